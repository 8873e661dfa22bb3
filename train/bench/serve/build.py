"""Sections 1 and 2: build time and memory per index kind, recall@10 against exact search, latency."""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from extract.common.cli import progress, say
from extract.common.memory import trim_heap

from train.bench.serve.data import cluster_world, clustered
from train.bench.serve.options import BenchmarkOptions, MIB, POINTS_PER_CLUSTER
from train.bench.serve.timing import clock, MemoryProbe, params_text, query_latency


def _slug(key: str) -> str:
    return key.replace(",", "_")


def measure_key(key: str, vectors: np.ndarray, queries: np.ndarray, exact: np.ndarray, opts: BenchmarkOptions,
                scratch: Path) -> dict:
    """Build ``key`` over ``vectors`` (timed, memory probed), tune it to the latency budget, measure recall@10 and
    single-query latency at the tuned parameters, write it to ``scratch`` (its size). Returns the record, with
    ``file``: the written index."""
    from serve import faiss_index as fi
    from serve.faiss_index import import_faiss

    faiss = import_faiss()
    n, d = vectors.shape
    m = re.search(r"IVF(\d+)", key)
    train = f", training on {min(n, fi.POINTS_PER_LIST * int(m.group(1))):,} vectors" if m else ""
    say(f"[{clock()}] N={n:,}: building {key}{train} ({faiss.omp_get_max_threads()} FAISS thread(s))")
    with MemoryProbe() as mem:
        started = time.perf_counter()
        with progress(total=n, desc=f"{key} add", unit="vec") as pbar:
            index = fi.build(vectors, key, seed=opts.seed, pbar=pbar)
        seconds = time.perf_counter() - started
    say(f"  built in {seconds:.1f} s; tuning to {opts.max_latency_ms} ms")
    tuned = fi.tune(index, key, vectors, queries, opts.max_latency_ms, say=say, exact=exact)
    say(recall_curve(tuned))
    _, found = index.search(np.ascontiguousarray(queries, dtype=np.float32), min(fi.RECALL_K, index.ntotal))
    recall = fi.recall_at_k(found, vectors, queries, exact)
    latency = query_latency(index, queries, opts.k)
    path = scratch / f"{n}-{_slug(key)}.index"
    faiss.write_index(index, str(path))
    record = {"key": key, "kind": fi.kind_of(key), "n": n, "d": d, "build_seconds": seconds,
              "added_bytes": mem.added, "peak_bytes": mem.peak, "index_bytes": path.stat().st_size, "disk_bytes": 0,
              "params": tuned["params"], "recall_at_10": recall, "tune_recall_at_10": tuned["recall_at_10"],
              "tune_ms_per_query": tuned["ms_per_query"], "ladder": tuned["ladder"], **latency, "file": str(path)}
    say(f"  {key}: recall@10 {recall:.3f}, p50 {latency['p50_ms']:.3f} ms, p99 {latency['p99_ms']:.3f} ms, "
        f"{record['index_bytes'] / MIB:,.1f} MiB")
    if record["kind"] == "ivf-pq" and opts.refine:
        record["refined"] = measure_refined(index, record, vectors, queries, exact, opts, scratch)
    del index, found
    trim_heap()
    return record


def recall_curve(tuned: dict) -> str:
    """The tuner's recall curve on one line, the chosen setting marked: ``  recall@10 by nprobe: 1 0.812 (0.05 ms),
    ..., 8 0.994 (0.36 ms) <- chosen, ...`` and the rule it was chosen by."""
    if not tuned["ladder"]:
        return "  exact index: nothing to tune"
    names = [k for k in tuned["ladder"][0] if k not in ("ms", "recall")]
    steps = []
    for step in tuned["ladder"]:
        setting = {k: step[k] for k in names}
        recall = "over budget" if step["recall"] is None else f"{step['recall']:.3f}"
        mark = " <- chosen" if setting == tuned["params"] else ""
        steps.append(f"{'/'.join(str(v) for v in setting.values())} {recall} ({step['ms']:.3f} ms){mark}")
    return f"  recall@10 by {'/'.join(names)}: " + ", ".join(steps) + f"; chosen: {tuned.get('rule', '')}"


def measure_refined(index, plain: dict, vectors: np.ndarray, queries: np.ndarray, exact: np.ndarray,
                    opts: BenchmarkOptions, scratch: Path) -> dict:
    """The ivf-pq index just measured, with its shortlist re-scored exactly (serve.faiss_index.Refined) from its
    vectors written as fp16 to a file and memory-mapped, as serve.index stores them: tuned (nprobe x k_factor),
    recall@10 and latency as the plain row. RAM is the PQ index's; the vectors are disk (``disk_bytes``)."""
    from serve import faiss_index as fi

    n, d = vectors.shape
    path = scratch / f"{n}-{_slug(plain['key'])}.refine.npy"
    say(f"  {plain['key']} + exact re-scoring: writing its {n:,} vectors as fp16 ({n * d * 2 / MIB:,.0f} MiB on disk)")
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, d))
    for a in range(0, n, 65_536):
        out[a:a + 65_536] = vectors[a:a + 65_536].astype(np.float16)
    out.flush()
    del out
    refined = fi.Refined(index, np.load(path, mmap_mode="r"))
    tuned = fi.tune(refined, plain["key"], vectors, queries, opts.max_latency_ms, say=say, exact=exact)
    say(recall_curve(tuned))
    _, found = refined.search(np.ascontiguousarray(queries, dtype=np.float32), min(fi.RECALL_K, n))
    recall = fi.recall_at_k(found, vectors, queries, exact)
    latency = query_latency(refined, queries, opts.k)
    record = {**plain, "kind": "ivf-pq + refine", "disk_bytes": path.stat().st_size, "params": tuned["params"],
              "recall_at_10": recall, "tune_recall_at_10": tuned["recall_at_10"],
              "tune_ms_per_query": tuned["ms_per_query"], "ladder": tuned["ladder"], **latency, "file": plain["file"],
              "refine_file": str(path)}
    say(f"  {plain['key']} + refine: recall@10 {recall:.3f}, p50 {latency['p50_ms']:.3f} ms, p99 "
        f"{latency['p99_ms']:.3f} ms ({params_text(tuned['params'])})")
    return record


def clusters_for(n: int, opts: BenchmarkOptions) -> int:
    return max(1, min(opts.clusters, n // POINTS_PER_CLUSTER))


def measure_size(n: int, d: int, opts: BenchmarkOptions, scratch: Path, kinds: list[str], with_auto: bool,
                 keep_vectors: bool):
    """Sections 1 and 2 at one N: ``({"kinds": {kind: record}, "auto": {...}, "records": {key: record}}, vectors,
    queries)``; the vectors are returned only with ``keep_vectors`` (the largest N, searched by sections 3-5)."""
    from serve import faiss_index as fi

    clusters = clusters_for(n, opts)
    world = cluster_world(d, clusters, opts.seed)
    say(f"[{clock()}] N={n:,}: drawing {n:,} x {d} vectors in {clusters:,} clusters and {opts.queries} held-out "
        "queries")
    vectors = clustered(world, n, opts.noise, opts.seed, stream=n)
    queries = clustered(world, opts.queries, opts.noise, opts.seed, stream=0xC0FFEE)
    exact = fi.exact_top(vectors, queries, fi.RECALL_K)
    records: dict[str, dict] = {}
    out: dict = {"n": n, "d": d, "clusters": clusters, "kinds": {}, "auto": None, "records": records}
    if with_auto:
        # serve.index._candidates for --kind auto: an exact search timed on these vectors, then auto_keys
        budget = fi.parse_memory(opts.max_memory)
        flat_ms = fi.flat_latency_ms(vectors, queries) if 4 * n * d <= budget and n >= fi.FLAT_THRESHOLD else None
        candidates = fi.auto_keys(n, d, budget, flat_ms=flat_ms, max_latency_ms=opts.max_latency_ms,
                                  refined=opts.refine)
        say(f"  auto candidates: {', '.join(candidates)}")
        best = None
        tried = []
        for key in candidates:  # serve.index.build_side's walk (PQ with --refine auto: re-scored)
            records[key] = records.get(key) or measure_key(key, vectors, queries, exact, opts, scratch)
            used = f"{key} + refine" if records[key].get("refined") else key
            records[used] = records[key].get("refined") or records[key]
            rec = records[used]
            recall = rec["tune_recall_at_10"]
            tried.append(used)
            if best is None or (recall or 1.0) > (records[best]["tune_recall_at_10"] or 1.0):
                best = used
            if recall is None or recall >= opts.min_recall:
                break
        out["auto"] = {"candidates": candidates, "tried": tried, "key": best, "kind": records[best]["kind"],
                       "flat_ms": flat_ms}
    for kind in kinds:
        try:
            key = (fi.pq_key_for(n, d, opts.pq_m) if kind == "ivf-pq" and opts.pq_m else
                   fi.key_for_kind(kind, n, d, fi.parse_memory(opts.max_memory), opts.refine))
        except ValueError as e:
            out["kinds"][kind] = {"kind": kind, "skipped": str(e)}
            continue
        records[key] = records.get(key) or measure_key(key, vectors, queries, exact, opts, scratch)
        out["kinds"][kind] = records[key]
        if records[key].get("refined"):
            records[f"{key} + refine"] = out["kinds"][f"{kind} + refine"] = records[key]["refined"]
    keep = records[out["auto"]["key"]] if keep_vectors and out["auto"] else {}
    for rec in records.values():
        rec.pop("refined", None)  # registered as a record of its own
        for name in ("file", "refine_file"):
            if rec.get(name) and rec[name] != keep.get(name):
                Path(rec[name]).unlink(missing_ok=True)
    if not keep_vectors:
        del vectors
        trim_heap()
        return out, None, queries
    return out, vectors, queries
