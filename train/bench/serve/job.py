"""The run in order and its report: what ``python -m train.bench.serve`` prints."""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Sequence


from extract.common.cli import check_options, run_job, say
from extract.common.memory import frozen_heap, trim_heap
from serve.faiss_index import MEASURE_K
from serve.layout import MMAP_ABOVE_BYTES

from train.bench.serve.build import clusters_for, measure_size
from train.bench.serve.dirs import backbone_dir, comalign_dir, comalign_scorer
from train.bench.serve.options import AUTO, BenchmarkOptions, build_parser, ints, LOAD_WARNING, MIB, parse_args, POINTS_PER_CLUSTER, TARGET_P50_MS, TARGET_PATH_RATIO, TARGET_RECALL, TARGET_REFINED_P50_MS, TARGET_RERANK_MS, TARGET_STARTUP_S
from train.bench.serve.search import search_sections
from train.bench.serve.startup import startup
from train.bench.serve.timing import clock, clock_seconds, machine, params_text, startclock


def run(opts: BenchmarkOptions) -> dict:
    """Measure everything (module docstring); returns the results (what ``--out`` writes) with ``markdown``."""
    check_options(opts, build_parser())
    startclock()
    import torch

    from adapters.load import load_scorer
    from extract.models.backbone import quiet_open_clip

    from serve.faiss_index import import_faiss

    faiss = import_faiss()
    faiss_before, torch_before = faiss.omp_get_max_threads(), torch.get_num_threads()
    torch.set_num_threads(opts.torch_threads)
    # after torch's: where torch and FAISS share one OpenMP runtime, torch's setting would become FAISS's too
    faiss.omp_set_num_threads(opts.build_threads or faiss_before)
    context = machine()
    sizes, kinds = ints(opts.sizes), [k for k in opts.kinds.split(",") if k != AUTO]
    auto_everywhere = AUTO in opts.kinds.split(",")
    largest = max(sizes)
    quiet_open_clip()
    say(f"[{clock()}] loading {opts.model} (pretrained {opts.pretrained}) for its text tower and width")
    backbone_scorer = load_scorer(opts.model, opts.pretrained)
    d = int(backbone_scorer.backbone.embed_dim)
    context.update(model=opts.model, pretrained=opts.pretrained, dim=d, torch_threads=opts.torch_threads)
    world_settings = {"source": "train.bench.serve", "clusters": clusters_for(largest, opts), "noise": opts.noise,
                      "seed": opts.seed, "dim": d, "n": largest}
    print(context_lines(context, opts), flush=True)

    temporary = opts.work is None
    work = Path(opts.work or tempfile.mkdtemp(prefix="plugvlm-serve-benchmark-")).absolute()
    scratch = work / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    results: dict = {"context": context, "options": dataclasses.asdict(opts), "sizes": [], "work": str(work)}
    try:
        search_input = None
        for n in sizes:
            is_largest = n == largest and search_input is None
            here = ([k for k in opts.largest_kinds.split(",") if k != AUTO] if n == largest and opts.largest_kinds
                    is not None else kinds)
            with frozen_heap():  # the trim before each of its measurements walks only what this size made
                size, vectors, queries = measure_size(n, d, opts, scratch, here, auto_everywhere or is_largest,
                                                      keep_vectors=is_largest)
            results["sizes"].append(size)
            if is_largest:
                record = size["records"][size["auto"]["key"]]
                backbone_index = backbone_dir(work / "index-backbone", record, size["auto"], vectors, backbone_scorer,
                                              opts, work / "cache", world_settings)
                rerank_scorer = comalign_scorer(backbone_scorer.backbone, opts)
                rerank_index, text_arrays = comalign_dir(work / "index-comalign", rerank_scorer, vectors, queries, opts,
                                                         work / "cache", world_settings)
                search_input = (backbone_index, rerank_index, rerank_scorer, queries, text_arrays)
                del vectors
                trim_heap()
        backbone_index, rerank_index, rerank_scorer, queries, text_arrays = search_input
        results["search"] = search_sections(backbone_index, rerank_index, backbone_scorer, rerank_scorer, queries,
                                            text_arrays, opts)
        results["startup"] = startup(backbone_index, queries[0], work, opts)
    finally:
        faiss.omp_set_num_threads(faiss_before)
        torch.set_num_threads(torch_before)
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    for size in results["sizes"]:  # the written files are gone or moved
        for rec in size["records"].values():
            rec.pop("file", None)
            rec.pop("refine_file", None)
    results["targets"] = targets(results)
    results["markdown"] = report(results, opts)
    results["seconds"] = clock_seconds()
    return results


def context_lines(context: dict, opts: BenchmarkOptions) -> str:
    v = context["versions"]
    load = context["load_average"]
    lines = ["# train.bench.serve", "",
             f"machine: {context['cpus']} CPUs ({context['cpu'] or 'unknown'}), load average "
             + (" / ".join(f"{x:.2f}" for x in load) + " (1 / 5 / 15 min)" if load else "unknown")
             + f"; faiss {v['faiss']}, torch {v['torch']}, numpy {v['numpy']}, open_clip {v['open_clip']}",
             f"threads: builds and tuning on {context['faiss_build_threads']} FAISS OpenMP thread(s)"
             + ("" if opts.build_threads else " (FAISS's default)") + f"; queries: FAISS 1 thread; torch "
             f"{opts.torch_threads} thread(s) throughout",
             f"memory: {context['memory']}",
             f"data: min({opts.clusters:,}, N/{POINTS_PER_CLUSTER}) Gaussian clusters (lognormal sizes) of unit "
             f"vectors, d={context['dim']} "
             f"({opts.model}'s width), noise norm {opts.noise:g}, fp16-rounded; {opts.queries} held-out queries; "
             f"text tower {opts.model} with pretrained={opts.pretrained}"]
    if load and load[0] > LOAD_WARNING:
        lines.append(f"warning: load average {load[0]:.2f} > {LOAD_WARNING}: other processes compete for the "
                     f"{context['cpus']} cores, timings are unreliable")
    return "\n".join(lines)


def _mib(b) -> str:
    return "n/a" if b is None else f"{b / MIB:,.1f}"


def _ms(x) -> str:
    return "n/a" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def _rows(size: dict) -> list[tuple[str, dict]]:
    out = [(kind, rec) for kind, rec in size["kinds"].items()]
    if size["auto"]:
        a = size["auto"]
        picked = size["records"][a["key"]]
        same = next((kind for kind, rec in size["kinds"].items() if rec is picked or (
            rec.get("key") == picked.get("key") and rec.get("kind") == picked.get("kind"))), None)
        out.append((f"auto -> {a['kind']}" + (f" (= {same} row)" if same else ""), size["records"][a["key"]]))
    return out


def targets(results: dict) -> list[dict]:
    out = []
    size = max(results["sizes"], key=lambda s: s["n"])
    cpus = results["context"]["cpus"]
    where = f"N={size['n']:,}, {cpus} CPUs"
    flat_ivf = size["kinds"].get("ivf-flat")
    for label, rec in _rows(size):
        if rec.get("skipped") or rec["kind"] == "flat":
            continue
        if rec["kind"] == "ivf-pq + refine":
            ram, budget = rec["index_bytes"] / rec["n"], None
            if flat_ivf and not flat_ivf.get("skipped"):
                budget = flat_ivf["index_bytes"] / flat_ivf["n"] / 4
            met = (rec["recall_at_10"] >= TARGET_RECALL and rec["p50_ms"] <= TARGET_REFINED_P50_MS
                   and (budget is None or ram <= budget))
            out.append({"target": f"PQ with exact re-scoring ({label}): recall@10 >= {TARGET_RECALL} at p50 <= "
                                  f"{TARGET_REFINED_P50_MS:g} ms, RAM per vector <= 1/4 of IVF-Flat's ({where})",
                        "measured": f"recall@10 {rec['recall_at_10']:.3f} at p50 {rec['p50_ms']:.3f} ms "
                                    f"({params_text(rec['params'])}); {ram:.0f} B of RAM per vector"
                                    + (f" vs IVF-Flat's {4 * budget:.0f} B" if budget else " (IVF-Flat not measured)")
                                    + f", plus {rec['disk_bytes'] / rec['n']:.0f} B on disk, memory-mapped",
                        "met": bool(met)})
            continue
        met = rec["recall_at_10"] >= TARGET_RECALL and rec["p50_ms"] <= TARGET_P50_MS
        out.append({"target": f"ANN {label}: recall@10 >= {TARGET_RECALL} at p50 <= {TARGET_P50_MS:g} ms ({where})",
                    "measured": f"recall@10 {rec['recall_at_10']:.3f} at p50 {rec['p50_ms']:.3f} ms "
                                f"({params_text(rec['params'])})", "met": bool(met)})
    s = results["search"]
    lat = s["latency"]
    ratio = s["paired"]["search_reps_over_bare_median"]
    reliable = s["paired"].get("reliable", True)
    out.append({"target": f"our search path <= {TARGET_PATH_RATIO}x the bare FAISS call it wraps (median of "
                          "per-query ratios, excluding encoding)",
                "measured": f"{ratio:.2f}x (p50 {lat['search_reps']['p50_ms']:.3f} vs {lat['bare']['p50_ms']:.3f} ms)"
                            + ("" if reliable else "; a path cannot be faster than the call it wraps: the two were "
                                                   "not measured alike, so this run's timings are a measurement "
                                                   "fault, not a result"),
                "met": bool(ratio <= TARGET_PATH_RATIO) if reliable else None})
    added = lat["rerank_reps"]["p50_ms"] - lat["rerank_plain"]["p50_ms"]
    out.append({"target": f"re-ranking {s['rerank']} candidates adds <= {TARGET_RERANK_MS:g} ms (p50)",
                "measured": f"+{added:.1f} ms ({lat['rerank_reps']['p50_ms']:.1f} vs "
                            f"{lat['rerank_plain']['p50_ms']:.1f}"
                            f" ms; median of paired differences {s['paired']['rerank_added_median_ms']:.1f} ms)",
                "met": bool(added <= TARGET_RERANK_MS)})
    st = results["startup"]["searcher"]
    total = st["open_s"] + st["first_query_s"]
    out.append({"target": f"start-up (Searcher.open + first query, fresh process) <= {TARGET_STARTUP_S:g} s",
                "measured": f"{total:.2f} s (open {st['open_s']:.2f} + first query {st['first_query_s']:.2f}; model "
                            f"load {st['model_s']:.2f} and imports {st['import_s']:.2f} before it)",
                "met": bool(total <= TARGET_STARTUP_S)})
    return out


PATH_LABELS = {
    "bare": "(a) bare FAISS index.search",
    "search_reps": "(b) Searcher.search_reps, query pre-encoded (excl. encoding)",
    "search_text": "(b) Searcher.search_text (incl. encoding)",
    "encode": "    query encoding alone (scorer.encode_texts)",
    "rerank_bare": "    bare FAISS index.search",
    "rerank_plain": "    Searcher.search_reps, no re-ranking",
    "rerank_reps": "(c) Searcher.search_reps, re-ranking {K} ({stage2})",
    "rerank_encoded": "    Searcher.search_reps, re-ranking {K}, candidates encoded from the cache per query",
    "rerank_text": "(c) Searcher.search_text, re-ranking {K} (incl. encoding: spaCy + text tower on caption + "
                   "components)",
}


def report(results: dict, opts: BenchmarkOptions) -> str:
    """The Markdown tables (each section once), then the targets."""
    threads = results["context"]["faiss_build_threads"]
    lines = ["", f"## 1. Index build ({threads} FAISS thread{'s' if threads > 1 else ''})", "",
             "| N | kind | FAISS key | build s | RSS added MiB | peak RSS added MiB | index file MiB (RAM when "
             "loaded) | RAM B / vector | more on disk MiB (memory-mapped) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for size in results["sizes"]:
        for label, rec in _rows(size):
            if rec.get("skipped"):
                lines.append(f"| {size['n']:,} | {label} | skipped: {rec['skipped']} | | | | | | |")
                continue
            lines.append(f"| {size['n']:,} | {label} | {rec['key']} | {rec['build_seconds']:.1f} | "
                         f"{_mib(rec['added_bytes'])} | {_mib(rec['peak_bytes'])} | {_mib(rec['index_bytes'])} | "
                         f"{rec['index_bytes'] / rec['n']:,.0f} | {_mib(rec.get('disk_bytes') or 0)} |")
    lines.append("")
    for size in results["sizes"]:
        a = size["auto"]
        if a:
            timed = "" if a["flat_ms"] is None else (f" (an exact search timed at {a['flat_ms']:.2f} ms against the "
                                                     f"{opts.max_latency_ms:g} ms budget)")
            lines.append(f"auto at N={size['n']:,}: candidates {', '.join(a['candidates'])}{timed}; built "
                         f"{', '.join(a['tried'])}; picked {a['key']}.")
    lines += ["", f"## 2. Recall@10 against exact search ({opts.queries} held-out queries), tuned to "
                  f"{opts.max_latency_ms:g} ms", "",
              f"| N | kind | tuned params | recall@10 | tune ms/query (k={MEASURE_K}, mean) | p50 ms (k={opts.k}) | "
              f"p99 ms (k={opts.k}) |", "|---:|---|---|---:|---:|---:|---:|"]
    for size in results["sizes"]:
        for label, rec in _rows(size):
            if rec.get("skipped"):
                continue
            lines.append(f"| {size['n']:,} | {label} | {params_text(rec['params'])} | {rec['recall_at_10']:.3f} | "
                         f"{_ms(rec['tune_ms_per_query'])} | {_ms(rec['p50_ms'])} | {_ms(rec['p99_ms'])} |")
    s = results["search"]
    b, r = s["backbone_index"], s["rerank_index"]
    lat = s["latency"]
    lines += ["", f"## 3. Query latency, one query at a time (FAISS 1 thread, torch {s['torch_threads']}; k={s['k']})",
              "",
              f"Index A: {b['ntotal']:,} x {b['dim']} {b['key']} ({params_text(b['params'])}), the auto pick, "
              f"{'memory-mapped from' if b['mmap'] else 'read into memory from'} its index directory (serve.layout "
              f"maps files over {_mib(MMAP_ABOVE_BYTES)} MiB); model {b['scorer']} (bare backbone, no second stage).",
              f"Index B: {r['ntotal']:,} x {r['dim']} {r['key']} ({params_text(r['params'])}): ComAlign first stage "
              f"(global "
              f"+ base, 2 x {b['dim']}) of a {r['ntotal']:,}-item ComAlign cache; model {r['scorer']}. Re-ranking "
              f"reads {s['rerank']} rows per query whatever N is.", "",
              "| index | path | p50 ms | p99 ms | mean ms | p50 / bare p50 |", "|---|---|---:|---:|---:|---:|"]
    for name, label in PATH_LABELS.items():
        base = lat["bare" if not name.startswith("rerank") else "rerank_bare"]["p50_ms"]
        x = lat.get(name)
        which = "A" if not name.startswith("rerank") else "B"
        if x is None:  # a path this run's results do not have (an older JSON)
            continue
        label = label.format(K=s["rerank"], stage2="stored representations" if s.get("stage2_stored") else
                             "encoded from the cache: nothing stored")
        lines.append(f"| {which} | {label} | {_ms(x['p50_ms'])} | {_ms(x['p99_ms'])} | "
                     f"{_ms(x['mean_ms'])} | {x['p50_ms'] / base:.2f}x |")
    added = lat["rerank_reps"]["p50_ms"] - lat["rerank_plain"]["p50_ms"]
    reliable = s["paired"].get("reliable", True)
    lines += ["", ("" if reliable else "UNRELIABLE: a search path timed faster than the bare FAISS call it wraps, "
                   "which it cannot be; the timings of this run are a measurement fault. ")
              + f"Ratios: search path / bare FAISS {lat['search_reps']['p50_ms'] / lat['bare']['p50_ms']:.2f}x (p50; "
                  f"median of per-query ratios {s['paired']['search_reps_over_bare_median']:.2f}x); encoding adds "
                  f"{lat['search_text']['p50_ms'] - lat['search_reps']['p50_ms']:.1f} ms; re-ranking {s['rerank']} "
                  f"adds {added:.1f} ms (p50; median of per-query differences "
                  f"{s['paired']['rerank_added_median_ms']:.1f} ms).",
              f"Re-ranking check (query 0): hits {'equal' if s['rerank_check']['ok'] else 'DIFFER FROM'} the ComAlign "
              f"head's own order of the first stage's {s['rerank']} candidates (max score difference "
              f"{s['rerank_check']['max_abs_score_diff']:.2e})"
              + (f"; encoded from the cache: {'equal' if s['encoded_check']['ok'] else 'DIFFER'} (max difference "
                 f"{s['encoded_check']['max_abs_score_diff']:.2e})." if "encoded_check" in s else "."),
              "", f"## 4. Throughput (queries per second; threads sharing one index / Searcher, "
                  f"{opts.concurrency_seconds:g} s each)", ""]
    callers = ints(opts.callers)
    lines += ["| path | " + " | ".join(f"{c} caller{'s' if c > 1 else ''}" for c in callers) + " |",
              "|---|" + "---:|" * len(callers)]
    for name, label in (("bare", f"A: bare FAISS index.search (k={s['k']})"),
                        ("search_reps", f"A: Searcher.search_reps (k={s['k']})"),
                        ("rerank_reps", f"B: Searcher.search_reps, re-ranking {s['rerank']}")):
        lines.append(f"| {label} | " + " | ".join(f"{m['qps']:,.1f}" for m in s["concurrency"][name]) + " |")
    st = results["startup"]
    lines += ["", "## 5. Start-up of index A from disk (fresh process; page cache not dropped: the files were just "
                  "written, a cold disk adds its reads)", "",
              "| process | imports s | model s | open s | first query s | second query s | process total s | RSS MiB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, label in (("bare", "serve.layout.open_index + index.search"),
                        ("searcher", "load_scorer + Searcher.open + search_text")):
        x = st[mode]
        lines.append(f"| {label} | {x['import_s']:.2f} | {x.get('model_s', 0.0):.2f} | {x['open_s']:.2f} | "
                     f"{x['first_query_s']:.3f} | {x['second_query_s']:.3f} | {x['process_s']:.2f} | "
                     f"{_mib(x['rss_bytes'])} |")
    lines += ["", "## Targets (2 cores, 1M vectors)", "", "| target | measured | |", "|---|---|---|"]
    for t in results["targets"]:
        verdict = "UNRELIABLE" if t["met"] is None else ("met" if t["met"] else "MISSED")
        lines.append(f"| {t['target']} | {t['measured']} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: BenchmarkOptions) -> None:
        results = run(opts)
        print(results["markdown"], end="", flush=True)
        say(f"done in {results['seconds'] / 60:.1f} min")
        if opts.out:
            path = Path(opts.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=2, default=str) + "\n")
            say(f"results: {path}")

    return run_job(job, parse_args(argv))
