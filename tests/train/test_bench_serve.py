"""train.bench.serve: one tiny run end to end (the random tiny backbone, 1,200 and 2,000 vectors, 20 queries), checked
for what it prints and writes, and for measuring the paths users run: the index directories it writes open with
Searcher.open, and its re-ranked hits are the ComAlign head's own order of the exact first stage's candidates.
Nothing here asserts a timing beyond "positive"."""
from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

SECTIONS = ("## 1. Index build", "## 2. Recall@10", "## 3. Query latency", "## 4. Throughput", "## 5. Start-up",
            "## Targets")
# ivf-pq is left out: OPQ training takes tens of seconds even on a collection this small (test_serve_faiss_index.py
# covers building it); every other kind, auto and all five sections are covered.
ARGV = ["--sizes", "1200,2000", "--queries", "20", "--model", "tiny", "--kinds", "flat,hnsw,ivf-flat,auto",
        "--rerank-rows", "600", "--rerank", "50", "--callers", "1,4", "--concurrency-seconds", "0.1"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """The run: its printed output, its JSON and its work folder (kept: --work)."""
    from train.bench.serve import main

    root = tmp_path_factory.mktemp("serve-benchmark")
    out, work = root / "results.json", root / "work"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = main([*ARGV, "--work", str(work), "--out", str(out)])
    return SimpleNamespace(status=status, text=buffer.getvalue(), data=json.loads(out.read_text()), work=work)


@pytest.mark.slow
def test_the_run_prints_each_section_once_after_the_machine(bench):
    assert bench.status == 0
    text = bench.text
    assert text.index("machine: ") < text.index(SECTIONS[0])
    for header in SECTIONS:
        assert text.count(header) == 1, header
    positions = [text.index(h) for h in SECTIONS]
    assert positions == sorted(positions)
    assert "| 1,200 | flat |" in text and "| 2,000 | auto -> flat (= flat row) |" in text
    assert " met |" in text or " MISSED |" in text
    # the tuner's recall curve, the chosen setting marked, for each tuned index (IVF: nprobe, HNSW: efSearch)
    for curve in ("recall@10 by nprobe: ", "recall@10 by efSearch: "):
        line = next(line for line in text.splitlines() if curve in line)
        assert line.count("<- chosen") == 1 and "chosen: the cheapest setting within 0.005" in line, line


@pytest.mark.slow
def test_json_has_every_section_with_sane_figures(bench):
    data = bench.data
    assert set(data) >= {"context", "options", "sizes", "search", "startup", "targets", "markdown", "seconds"}
    assert data["context"]["cpus"] >= 1 and data["context"]["dim"] == 64  # the tiny model's width
    assert [s["n"] for s in data["sizes"]] == [1200, 2000]
    for size in data["sizes"]:
        assert set(size["kinds"]) == {"flat", "hnsw", "ivf-flat"}
        assert size["auto"]["key"] in size["records"]
        for kind, rec in size["kinds"].items():
            assert 0.0 <= rec["recall_at_10"] <= 1.0
            assert rec["build_seconds"] >= 0 and rec["index_bytes"] > 0
            assert 0 < rec["p50_ms"] <= rec["p99_ms"]
            assert rec["n"] == size["n"] and "file" not in rec
        assert size["kinds"]["flat"]["recall_at_10"] == 1.0  # exact search against exact search
        assert size["kinds"]["flat"]["params"] == {} and size["kinds"]["hnsw"]["params"]["efSearch"] >= 16
    search = data["search"]
    assert set(search["latency"]) == {"bare", "search_reps", "search_text", "encode", "rerank_bare", "rerank_plain",
                                      "rerank_reps", "rerank_encoded", "rerank_text"}
    assert search["stage2_stored"] and search["encoded_check"]["ok"], search["encoded_check"]
    for figures in search["latency"].values():
        assert 0 < figures["p50_ms"] <= figures["p99_ms"] and figures["count"] == 20
    assert search["backbone_index"]["ntotal"] == 2000 and search["backbone_index"]["dim"] == 64
    assert search["rerank_index"]["ntotal"] == 600 and search["rerank_index"]["dim"] == 128  # global + base
    assert search["rerank"] == 50 and search["k"] == 10
    for name in ("bare", "search_reps", "rerank_reps"):
        assert [m["callers"] for m in search["concurrency"][name]] == [1, 4]
        assert all(m["qps"] > 0 and m["queries"] >= 1 for m in search["concurrency"][name])
    assert search["rerank_check"]["ok"], search["rerank_check"]
    for mode in ("bare", "searcher"):
        st = data["startup"][mode]
        assert st["open_s"] > 0 and st["first_query_s"] > 0 and st["process_s"] > 0 and st["in_process_s"] > 0
    assert data["startup"]["searcher"]["hits"] == 10
    assert len(data["targets"]) >= 4 and all(t["met"] in (True, False, None) for t in data["targets"])
    for t in data["targets"]:  # None: the run says its timings are a measurement fault, and why
        assert t["met"] is not None or "measurement fault" in t["measured"]
    paired = search["paired"]
    assert paired["reliable"] == (paired["search_reps_over_bare_median"] >= 0.97
                                  and paired["rerank_plain_over_bare_median"] >= 0.97)


def test_paths_are_warmed_then_timed_in_interleaved_rounds_and_a_faster_wrapper_is_a_fault(monkeypatch):
    from train.bench.serve import timing as benchmark

    calls = []
    clock = iter(np.arange(0.0, 1e6, 1.0))  # every reading one second later: each call "takes" one second
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: next(clock))
    paths = [(name, lambda i, name=name: calls.append((name, i))) for name in ("a", "b", "c")]
    times = benchmark.interleaved(paths, 2, rounds=2)
    # per query: each path once untimed, then 2 rounds in an order rotated by query and round
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("a", 0), ("b", 0), ("c", 0), ("b", 0), ("c", 0), ("a", 0),
                     ("a", 1), ("b", 1), ("c", 1), ("b", 1), ("c", 1), ("a", 1), ("c", 1), ("a", 1), ("b", 1)]
    assert all(np.array_equal(t, [1.0, 1.0]) for t in times.values())  # the fastest round of each
    assert benchmark.wrap_ratio(np.array([2.0, 3.0]), np.array([1.0, 1.0])) == (2.5, True)
    assert benchmark.wrap_ratio(np.array([8.6]), np.array([18.3]))[1] is False  # the path cannot beat its call


@pytest.mark.slow
def test_its_index_directories_open_and_search_as_users_search_them(bench):
    """The backbone directory: Searcher.open with the model, first-stage hits equal the bare FAISS search; the
    ComAlign directory: the re-ranked hits are the head's own scores of the exact top K, best first."""
    from adapters.load import load_scorer
    from extract.models.backbone import load_backbone
    from train.bench.serve.data import component_arrays, component_counts
    from train.bench.serve.dirs import comalign_scorer
    from train.bench.serve.options import BenchmarkOptions
    from serve.search import Searcher, cache_keys, encode_arrays

    plain = Searcher.open(bench.work / "index-backbone", scorer=load_scorer("tiny", "none"))
    assert plain.num_images == 2000 and not plain.has_second_stage
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 64)).astype(np.float32)
    q /= np.linalg.norm(q)
    hits = plain.search_reps({"embed": torch.from_numpy(q)}, "t2i", k=10)
    scores, ids = plain._sides["image"].index.search(q, 10)
    assert [h.row for h in hits] == ids[0].tolist()
    assert np.allclose([h.score for h in hits], scores[0], atol=1e-6)

    scorer = comalign_scorer(load_backbone("tiny", "none"), BenchmarkOptions(model="tiny"))
    rerank = Searcher.open(bench.work / "index-comalign", scorer=scorer)  # same head weights: same fingerprint
    cache = rerank.caches[0]
    assert rerank.has_second_stage and rerank.num_images == cache.num_images == 600
    images = encode_arrays(scorer, {k: cache.gather(k, np.arange(600)) for k in cache_keys(scorer, "image")}, "image")
    entities, relations = component_counts()
    text = component_arrays(images["base"][:3].numpy() * 0.5 + q * 0.5, entities, relations,
                            np.random.default_rng(1), "text")
    queries = encode_arrays(scorer, text, "text")
    first = (scorer.first_stage_image(images, "t2i") @ scorer.first_stage_text(queries, "t2i").T).numpy()
    own = scorer.score_directed(images, queries, "t2i").numpy()
    for j in range(3):
        reps = {key: value[j:j + 1] for key, value in queries.items()}
        candidates = np.argsort(-first[:, j], kind="stable")[:50]
        best = candidates[np.argsort(-own[candidates, j], kind="stable")][:10]
        got = rerank.search_reps(reps, "t2i", k=10, rerank=50)
        assert [h.rank_after for h in got] == list(range(1, 11))
        assert np.allclose([h.rerank_score for h in got], own[best, j], atol=1e-5)
        assert [h.row for h in got] == best.tolist() or np.allclose(own[[h.row for h in got], j], own[best, j],
                                                                    atol=1e-5)


def test_bad_options_are_one_line_errors(capsys):
    from train.bench.serve import main

    for argv in (["--sizes", "0"], ["--kinds", "flat,lsh"], ["--callers", "two"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "usage:" not in err


def test_throughput_counts_a_query_from_every_caller_even_when_the_window_closes_first():
    """A thread that starts after the window has closed (a busy machine, the suite's 0.1 s window) still completes
    one query: a caller that never ran would read as 0 queries per second."""
    from train.bench.serve.timing import throughput

    seen = []
    figures = throughput(seen.append, count=3, callers=4, seconds=0.0)
    assert figures["callers"] == 4 and figures["queries"] == len(seen) == 4 and figures["qps"] > 0
    assert sorted(seen) == [0, 0, 1, 2]  # the shared counter, wrapped at count
