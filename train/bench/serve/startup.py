"""Section 5: start-up from disk, in fresh processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from extract.common.cli import say
from extract.common.memory import rss_bytes

from train.bench.serve.data import captions
from train.bench.serve.options import BenchmarkOptions, ROOT
from train.bench.serve.timing import clock


def _startup_child(spec_json: str) -> None:
    """Runs in a fresh process (section 5); prints one ``STARTUP {json}`` line."""
    started = time.perf_counter()
    spec = json.loads(spec_json)
    out: dict = {"mode": spec["mode"]}
    if spec["mode"] == "bare":
        import faiss

        from serve import layout
        out["import_s"] = time.perf_counter() - started
        t = time.perf_counter()
        index = layout.open_index(spec["index"], "image")
        out["open_s"] = time.perf_counter() - t
        q = np.load(spec["query"])
        faiss.omp_set_num_threads(1)
        t = time.perf_counter()
        index.search(q, spec["k"])
        out["first_query_s"] = time.perf_counter() - t
        t = time.perf_counter()
        index.search(q, spec["k"])
        out["second_query_s"] = time.perf_counter() - t
    else:
        import torch

        from adapters.load import load_scorer
        from extract.models.backbone import quiet_open_clip
        from serve.search import Searcher
        out["import_s"] = time.perf_counter() - started
        torch.set_num_threads(spec["torch_threads"])
        quiet_open_clip()
        t = time.perf_counter()
        scorer = load_scorer(spec["model"], spec["pretrained"])
        out["model_s"] = time.perf_counter() - t
        t = time.perf_counter()
        searcher = Searcher.open(spec["index"], scorer=scorer)
        out["open_s"] = time.perf_counter() - t
        t = time.perf_counter()
        hits = searcher.search_text(spec["text"], spec["k"])
        out["first_query_s"] = time.perf_counter() - t
        t = time.perf_counter()
        searcher.search_text(spec["text"], spec["k"])
        out["second_query_s"] = time.perf_counter() - t
        out["hits"] = len(hits)
    out["rss_bytes"] = rss_bytes()
    out["in_process_s"] = time.perf_counter() - started
    print("STARTUP " + json.dumps(out), flush=True)


def startup(index_dir: Path, query: np.ndarray, work: Path, opts: BenchmarkOptions) -> dict:
    """Section 5: each mode in a fresh ``python`` process (interpreter start included in ``process_s``)."""
    path = work / "startup-query.npy"
    np.save(path, np.ascontiguousarray(query[None], dtype=np.float32))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    code = "import sys; from train.bench.serve.startup import _startup_child; _startup_child(sys.argv[1])"
    out = {}
    for mode in ("bare", "searcher"):
        spec = {"mode": mode, "index": str(index_dir), "query": str(path), "k": opts.k, "model": opts.model,
                "pretrained": opts.pretrained, "text": captions(1, opts.seed)[0], "torch_threads": opts.torch_threads}
        say(f"[{clock()}] start-up in a fresh process: {mode}")
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=1800)
        elapsed = time.perf_counter() - t
        lines = [line for line in done.stdout.splitlines() if line.startswith("STARTUP ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"the start-up process ({mode}) failed with status {done.returncode}:\n"
                               f"{done.stderr[-3000:]}")
        result = json.loads(lines[-1][len("STARTUP "):])
        result["process_s"] = elapsed
        out[mode] = result
    return out
