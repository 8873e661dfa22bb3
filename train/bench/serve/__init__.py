"""``python -m train.bench.serve``: what serving costs, measured in one run on synthetic embeddings -- index build
time and memory, recall@10 against exact search, query latency of the bare FAISS call and of our search path
(with and without compositional re-ranking), throughput under concurrent callers, and start-up from disk.

Data. ``N`` unit vectors of the model's width (512 for ViT-B-32) clustered like real embeddings: ``--clusters``
Gaussian centres on the unit sphere (fewer for small N: at least 32 points per cluster on average, else a
query's top 10 would be mostly unrelated points, which no collection of real images has) with lognormal cluster
sizes, each point its centre plus isotropic noise of norm ``--noise`` (nearest neighbours at cosine ~0.77),
normalised and rounded to fp16 as a feature cache stores them. The ``--queries`` queries are drawn the same way
(held out: none is in the index).

1. Build, per index kind (``--kinds``: flat, hnsw, ivf-flat, ivf-pq) and for what ``auto`` picks (serve.index's
   own candidates and fallback below ``--min-recall``), at every ``--sizes`` N: seconds, resident memory the
   index keeps (RSS after minus before) and the peak while building (``/proc/self/status`` VmHWM, reset before
   each build), and the file's size. Built with :mod:`serve.faiss_index`'s ``key_for_kind`` / ``auto_keys`` /
   ``build`` on FAISS's default OpenMP threads, as ``python -m serve.index`` builds.
2. recall@10 against exact search on the same queries at the parameter ``tune`` picks for ``--max-latency-ms``
   (serve.faiss_index's tie-tolerant ``recall_at_k``), with single-query latency p50 / p99 (FAISS on one thread).
3. At the largest N, query latency one query at a time (FAISS on one thread, torch on ``--torch-threads``) of
   (a) the bare ``index.search``, (b) ``Searcher.search_reps`` with a pre-encoded query (our path excluding query
   encoding) and ``Searcher.search_text`` (including it), on an index directory holding the ``auto`` index,
   written as serve.index writes one and opened with ``Searcher.open`` (memory-mapped as serve.layout maps large
   files); (c) re-ranking ``--rerank`` candidates with a ComAlign head at the model's shapes (E entity and R
   relation components per item, extract's defaults; 1-4 valid entities and their pairs as relations, the toy
   world's counts) for ``--rerank-rows`` synthetic items: from the head representations stored in the index
   (serve.stage2, as ``serve.index`` stores them by default) and, for comparison, encoded per query from the
   feature cache (Searcher's ``_gather`` -> ``encode_arrays``), then ``directed_score``. A ComAlign first stage is 2 x the width (global +
   base), so it has its own index directory over that cache: what re-ranking adds does not depend on N (only
   ``--rerank`` cache rows are read per query), the first stage does. The paths run query by query in rotating
   order, so load from other processes falls on all alike.
4. Queries per second with ``--callers`` threads sharing one index / Searcher (FAISS releases the GIL).
5. Start-up from disk of the ``auto`` index at the largest N, in fresh processes: serve.layout's ``open_index``
   + first search, and ``Searcher.open`` (+ the model) + first ``search_text``. The page cache is not dropped
   (the files were just written): a cold disk adds its read time.

The text tower has random weights (``--pretrained none``; pretrained weights cost the same to run), so
``search_text`` searches with a vector unrelated to the clusters. Targets (2 cores, 1M vectors) are printed
next to the figures as met / MISSED. Everything is written under ``--work`` (default: a temporary folder,
deleted after); ``--out`` saves the results as JSON.

The parts, one module each: options and targets (options), the machine, memory and timing (timing), synthetic
data (data), sections 1-2 (build), the index directories (dirs), sections 3-4 (search), section 5 (startup), the
run and its report (job).
"""
from __future__ import annotations

__all__ = ["build_parser", "main"]


def __getattr__(name: str):
    """The command's ``main`` and ``build_parser``, imported on first use (PEP 562)."""
    if name == "main":
        from train.bench.serve.job import main

        return main
    if name == "build_parser":
        from train.bench.serve.options import build_parser

        return build_parser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
