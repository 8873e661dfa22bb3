"""R@k of the served results on the collection itself (every caption searching the images, every image the
captions), with the evaluation suite's protocol (``adapters.eval.retrieval``), for side-by-side tables with
``train.eval``."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from adapters.eval.ranking import KS, rank_safe
from adapters.scoring import cat_reps, take_reps
from serve.layout import IndexDirError

from serve.hits import Hits
from serve.search import encode_arrays, gather, Searcher
from serve.sides import open_caches, Side


def served_recall(searcher: Searcher, rerank: int | None = None, *, ks: Sequence[int] = KS, queries: str = "cache",
                  batch_size: int = 256) -> dict:
    """R@k (percent) of the served results on the indexed collection itself, both directions, with the
    evaluation suite's protocol (``adapters.eval.retrieval``): each caption searches the images (its own image is the
    answer), each image searches the captions (found at its best own caption); ties count against the model
    and non-finite scores rank last, read from the scores the hits carry (re-ranked ones with ``rerank``). A
    query asks for ``max(ks)`` hits, and for more while the last one ties its answer (duplicate captions tie
    exactly): an item tied beyond the window counts against it, as in evaluation.

    ``queries="cache"``: the queries' representations come from the feature cache (the arrays the collection
    was indexed with), so with a flat index and ``rerank`` covering the collection the figures equal
    ``train.eval --cache`` on that cache exactly; a bare backbone's first stage is its score, so there the
    first stage alone equals it. ``queries="live"``: every caption's text and image file is encoded as a user's
    query would be (``search_text`` / ``search_image``; fp32 where the cache holds fp16).

    Returns ``{"text_to_image": {"R@1": ..., "n": queries, "rerank": K as used}, "image_to_text": {...},
    "rerank": K as asked, "queries": ...}``; K as used is clamped to the side's collection (None: no second
    stage). Images without captions are no query, as in ``adapters.eval.retrieval``."""
    if queries not in ("cache", "live"):
        raise ValueError(f"queries must be 'cache' or 'live', got {queries!r}")
    if "text" not in searcher._sides:
        raise ValueError(f"index {searcher.index_dir} has no captions: served recall needs both sides")
    image, text = searcher._sides["image"], searcher._sides["text"]
    caches = searcher.caches
    if queries == "cache" and caches is None:  # a bare backbone keeps no cache open: open them now
        caches, problem = open_caches(searcher.index_dir, searcher.manifest)
        if caches is None:
            raise IndexDirError(problem)
    caption_image = text.column("image_row").astype(np.int64)
    own_captions: dict[int, set[int]] = {}
    for t, i in enumerate(caption_image):
        own_captions.setdefault(int(i), set()).add(t)
    used = {"t2i": None, "i2t": None}
    kmax = max(ks)

    def rank_of(search, own: set[int], n: int, direction: str) -> float:
        # The hits are a window of the ranking: while its last hit ties the query's own best one, items beyond it
        # may tie too, and ties count against the model (duplicate captions tie exactly), so the window grows.
        # With re-ranking the ranking ends at the K candidates.
        limit = n if rerank is None or not searcher.has_second_stage else min(n, max(rerank, kmax))
        k = min(kmax, limit)
        while True:
            hits = search(k)
            used[direction] = hits.rerank
            rank, open_end = _served_rank(hits, own)
            if not open_end or rank > kmax or len(hits) < k or k >= limit:
                return rank
            k = min(limit, 2 * k)

    def encoded(side: Side):
        rows, parts = side.column("cache_row").astype(np.int64), side.parts()
        return cat_reps([encode_arrays(searcher.scorer, gather(searcher.scorer, caches, side.name,
                                                                rows[a:a + batch_size], parts[a:a + batch_size]),
                                       side.name) for a in range(0, len(rows), batch_size)])

    t2i = []
    text_reps = encoded(text) if queries == "cache" else None
    texts = text.column("text")
    for t in range(text.n):
        search = ((lambda k, t=t: searcher.search_reps(take_reps(text_reps, [t]), "t2i", k, rerank))
                  if text_reps is not None else (lambda k, t=t: searcher.search_text(str(texts[t]), k, rerank)))
        t2i.append(rank_of(search, {int(caption_image[t])}, image.n, "t2i"))
    i2t = []
    image_reps = encoded(image) if queries == "cache" else None
    paths = image.column("path")
    for i in range(image.n):
        if i not in own_captions:
            continue  # as retrieval_metrics: an image without captions is not a query
        search = ((lambda k, i=i: searcher.search_reps(take_reps(image_reps, [i]), "i2t", k, rerank))
                  if image_reps is not None else (lambda k, i=i: searcher.search_image(str(paths[i]), k, rerank)))
        i2t.append(rank_of(search, own_captions[i], text.n, "i2t"))

    def summary(ranks, direction):
        r = np.asarray(ranks, dtype=np.float64)
        return {f"R@{j}": float((r <= j).mean() * 100) for j in ks} | {"n": len(r), "rerank": used[direction]}

    return {"text_to_image": summary(t2i, "t2i"), "image_to_text": summary(i2t, "i2t"), "rerank": rerank,
            "queries": queries}


def _served_rank(hits: Hits, own: set[int]) -> tuple[float, bool]:
    """(1 + the hits not in ``own`` scoring >= the best own hit, inf when no own hit was returned; whether the last
    hit scores >= that best own one, i.e. items after the window could still count)."""
    if not hits:
        return math.inf, False
    safe, _ = rank_safe(torch.tensor([h.final_score for h in hits], dtype=torch.float64))
    mine = torch.tensor([h.row in own for h in hits])
    if not bool(mine.any()):
        return math.inf, False
    best = safe[mine].max()
    return float(1 + int((safe[~mine] >= best).sum())), bool(safe[-1] >= best)


def recall_table(searcher: Searcher, reranks: Sequence[int] = (10, 50, 100), *, evaluation: dict | None = None,
                 ks: Sequence[int] = KS, queries: str = "cache") -> str:
    """A Markdown table of :func:`served_recall`: the first stage, re-ranked with each K of ``reranks`` (only for
    models with a second stage) and, given ``evaluation`` (the evaluation suite's retrieval result for the same
    model and data: ``adapters.eval.retrieval.run_retrieval_cached``), its figures, side by side."""
    rows = [("served, first stage", served_recall(searcher, None, ks=ks, queries=queries))]
    if searcher.has_second_stage:
        rows += [(f"served, re-ranked K={K}", served_recall(searcher, K, ks=ks, queries=queries)) for K in reranks]
    if evaluation is not None:
        rows.append(("train.eval", evaluation))
    heads = [f"{tag} R@{j}" for tag in ("T2I", "I2T") for j in ks]
    lines = ["| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for label, r in rows:
        values = [r[d][f"R@{j}"] for d in ("text_to_image", "image_to_text") for j in ks]
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines) + "\n"
