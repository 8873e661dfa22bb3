"""Sections 3 and 4: query latency of the bare FAISS call against our search path (with and without
re-ranking), and throughput under concurrent callers."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from extract.common.cli import say

from train.bench.serve.data import captions
from train.bench.serve.options import BenchmarkOptions, ints
from train.bench.serve.timing import clock, interleaved, percentiles, throughput, wrap_ratio


def search_sections(backbone_index: Path, rerank_index: Path, backbone_scorer, rerank_scorer, queries: np.ndarray,
                    text_arrays: dict, opts: BenchmarkOptions) -> dict:
    """Section 3 (latency of each path, rotated query by query) and section 4 (throughput), plus a check that the
    re-ranked hits are the ComAlign head's own order of the first stage's candidates."""
    import torch

    from adapters.scoring import take_reps
    from serve.faiss_index import single_thread
    from serve.search import Searcher, encode_arrays

    say(f"[{clock()}] opening both index directories with Searcher.open")
    t = time.perf_counter()
    plain = Searcher.open(backbone_index, scorer=backbone_scorer)
    open_seconds = time.perf_counter() - t
    reranking = Searcher.open(rerank_index, scorer=rerank_scorer)
    encoding = Searcher.open(rerank_index, scorer=rerank_scorer)  # the same index, re-ranking without its store
    stored = reranking._sides["image"].stage2 is not None
    encoding._sides["image"].stage2 = None
    q = np.ascontiguousarray(queries, dtype=np.float32)
    count = len(q)
    texts = captions(count, opts.seed)
    reps = [{"embed": torch.from_numpy(q[i:i + 1].copy())} for i in range(count)]
    rerank_reps = encode_arrays(rerank_scorer, text_arrays, "text")
    rerank_rows = [take_reps(rerank_reps, [i]) for i in range(count)]
    index, rerank_faiss = plain._sides["image"].index, reranking._sides["image"].index
    rerank_vectors = np.ascontiguousarray(
        rerank_scorer.first_stage_text(rerank_reps, "t2i").float().cpu().numpy(), dtype=np.float32)
    k, K = opts.k, opts.rerank
    paths = [
        ("bare", lambda i: index.search(q[i:i + 1], k)),
        ("search_reps", lambda i: plain.search_reps(reps[i], "t2i", k)),
        ("search_text", lambda i: plain.search_text(texts[i], k)),
        ("encode", lambda i: backbone_scorer.encode_texts([texts[i]])),
        ("rerank_bare", lambda i: rerank_faiss.search(rerank_vectors[i:i + 1], k)),
        ("rerank_plain", lambda i: reranking.search_reps(rerank_rows[i], "t2i", k)),
        ("rerank_reps", lambda i: reranking.search_reps(rerank_rows[i], "t2i", k, K)),
        ("rerank_encoded", lambda i: encoding.search_reps(rerank_rows[i], "t2i", k, K)),
        ("rerank_text", lambda i: reranking.search_text(texts[i], k, K)),
    ]
    with single_thread():
        with torch.no_grad():
            slow = ("search_text", "encode", "rerank_encoded", "rerank_text")
            say(f"[{clock()}] timing {len(paths)} paths x {count} queries, one query at a time: the search paths "
                "warmed on each query, then the fastest of 3 interleaved rounds; the encoding paths once each")
            times = interleaved([p for p in paths if p[0] not in slow], count)
            times.update(interleaved([p for p in paths if p[0] in slow], count, rounds=1, warm=False))
            check = rerank_check(reranking, rerank_rows[0], k, K)
            say(f"[{clock()}] throughput with {opts.callers} concurrent callers, {opts.concurrency_seconds:g} s "
                "each")
            concurrency = {}
            for name, fn in (("bare", paths[0][1]), ("search_reps", paths[1][1]), ("rerank_reps", paths[6][1])):
                concurrency[name] = [throughput(fn, count, c, opts.concurrency_seconds)
                                     for c in ints(opts.callers)]
    latency = {name: percentiles(t) for name, t in times.items()}
    ratio, believable = wrap_ratio(times["search_reps"], times["bare"])
    rerank_ratio, rerank_believable = wrap_ratio(times["rerank_plain"], times["rerank_bare"])
    added = np.asarray(times["rerank_reps"]) - np.asarray(times["rerank_plain"])
    return {"latency": latency, "paired": {"search_reps_over_bare_median": ratio,
                                           "rerank_plain_over_bare_median": rerank_ratio,
                                           "reliable": bool(believable and rerank_believable),
                                           "rerank_added_median_ms": float(np.median(added) * 1000)},
            "concurrency": concurrency, "rerank_check": check, "open_in_process_seconds": open_seconds,
            "backbone_index": _describe_side(plain), "rerank_index": _describe_side(reranking),
            "torch_threads": opts.torch_threads, "k": k, "rerank": K, "stage2_stored": stored,
            "encoded_check": rerank_check(encoding, rerank_rows[0], k, K)}


def _describe_side(searcher) -> dict:
    from serve import layout

    entry = searcher.manifest["indexes"]["image"]
    return {"path": str(searcher.index_dir), "key": entry["key"], "kind": entry["kind"], "params": entry["params"],
            "ntotal": entry["ntotal"], "dim": searcher.manifest["model"]["first_stage_dim"],
            "recall_at_10": entry["recall_at_10"], "scorer": searcher.scorer.name, "bytes": entry["bytes"],
            "mmap": bool(entry["ondisk"] or entry["bytes"] > layout.MMAP_ABOVE_BYTES)}


def rerank_check(searcher, reps, k: int, K: int) -> dict:
    """The re-ranked hits against the head's own scores computed here: the first stage's top K (Searcher, no
    re-ranking), their cached arrays encoded and scored by ``directed_score``, ordered best first."""
    from serve.search import cache_keys, directed_score, encode_arrays

    candidates = searcher.search_reps(reps, "t2i", K)
    rows = np.array([h.row for h in candidates], dtype=np.int64)
    cache = searcher.caches[0]
    cache_rows = searcher._sides["image"].column("cache_row").astype(np.int64)[rows]
    arrays = {key: cache.gather(key, cache_rows) for key in cache_keys(searcher.scorer, "image")}
    scores = directed_score(searcher.scorer, encode_arrays(searcher.scorer, arrays, "image"), reps, "t2i")[:, 0]
    scores = scores.float().cpu().numpy().astype(np.float64)
    order = np.lexsort((np.arange(len(rows)), -scores))[:k]  # best first, ties by first-stage rank
    hits = searcher.search_reps(reps, "t2i", k, K)
    got = np.array([h.row for h in hits], dtype=np.int64)
    carried = np.array([h.rerank_score for h in hits], dtype=np.float64)
    by_row = dict(zip(rows.tolist(), scores.tolist()))
    own = np.array([by_row.get(int(r), np.nan) for r in got])
    # each hit carries its own score, and the hits' scores are the best k in order (ties may swap rows)
    diff = float(max(np.max(np.abs(carried - own)), np.max(np.abs(carried - scores[order])))) if len(got) else 0.0
    ok = bool(len(got) == min(k, len(rows)) and np.isfinite(diff) and diff < 1e-4)
    return {"ok": ok, "rows": got.tolist(), "expected": rows[order].tolist(),
            "same_rows": bool(np.array_equal(got, rows[order])), "max_abs_score_diff": diff}
