"""Image–text retrieval metrics with several captions per image (the COCO / Flickr 5-caption protocol).

Text -> image: each caption has exactly one correct image. Image -> text: an image is retrieved correctly
at rank r when its best-scoring own caption is at rank r (any of its captions counts, as in CLIP and
CLIP_benchmark). Ties count against the model: an incorrect item scoring *equal* to the correct one ranks
ahead of it, so a constant scorer gets R@1 = 0, not 100. Non-finite scores are the worst score (they rank
last; an all-NaN model gets R@1 = 0) and are counted: both rules are ``adapters.eval.ranking``'s, shared by every
metric and the serving engine.

rank(t)  = 1 + #{images j != img(t) : S[j, t] >= S[img(t), t]}
rank(i)  = 1 + #{captions t not of i : S[i, t] >= max_{t' of i} S[i, t']}

The score matrix S [I, T] comes from ``score_fn(text_rows) -> [I, len(rows)]`` in chunks of captions. When
the whole matrix fits ``max_bytes`` it is computed once and both directions are read from it; otherwise two
streaming passes bound memory to one chunk (:func:`retrieval_metrics` tests the two against each other and
against a per-query reference).

Multi-positive retrieval (``adapters.eval.multipositive``: any-true R@k and mAP, for data whose captions can be true of
several images) runs inside the same passes when :func:`retrieval_queries` gets a ``truth``: no extra scoring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from adapters.eval.ranking import KS, best_own_caption, positive_ranks, rank_safe, small_split_warning
from adapters.eval.bootstrap import PerQuery
from adapters.eval.multipositive import MultiPositive, MultiPositivePasses
from adapters.scoring import cat_reps, num_items, take_reps
from extract.common.cli import warn_once


def _summary(ranks: torch.Tensor, ks: Sequence[int]) -> dict:
    r = ranks.double()
    out = {f"R@{k}": float((r <= k).double().mean() * 100) for k in ks}
    out.update(mean_rank=float(r.mean()), median_rank=float(r.median()), n=int(len(r)))
    return out


@dataclass
class RetrievalQueries:
    """Per-query results of one score matrix [I, T]: strict ranks ``t2i`` [T] and ``i2t`` [I] (0: an image without
    captions; a direction not computed holds None), ``nonfinite`` of ``n_scores`` scores read, and the
    multi-positive figures (``adapters.eval.multipositive.MultiPositive``) when a truth was given."""

    t2i: torch.Tensor | None
    i2t: torch.Tensor | None
    nonfinite: int
    n_scores: int
    multi: MultiPositive | None = None


def retrieval_queries(score_fn: Callable[[slice], torch.Tensor], n_images: int, caption_image: torch.Tensor,
                      chunk: int = 256, max_bytes: int = 1 << 30, truth=None,
                      directions: Sequence[str] = ("t2i", "i2t")) -> RetrievalQueries:
    """Every query's rank (module docstring) and, with ``truth`` (bool [I, T] or ``rows -> bool [I, len(rows)]``:
    caption t is true of image i), its multi-positive figures (``adapters.eval.multipositive``), from ``score_fn`` in
    chunks of captions. ``directions``: the ones to compute ("t2i", "i2t"); a directional scorer asks each of its
    two matrices for one. ``nonfinite`` counts the non-finite scores of the matrix (read once)."""
    caption_image = torch.as_tensor(caption_image, dtype=torch.long)
    n_texts = len(caption_image)
    if n_texts == 0 or n_images == 0:
        raise ValueError("retrieval needs at least one image and one caption")
    if int(caption_image.min()) < 0 or int(caption_image.max()) >= n_images:
        raise ValueError("caption_image holds image rows outside [0, n_images)")
    unknown = set(directions) - {"t2i", "i2t"}
    if unknown or not directions:
        raise ValueError(f"directions must be among 't2i', 'i2t'; got {list(directions)}")
    # Small chunks keep each [I, chunk] block in cache for the comparisons that follow its computation:
    # 256 captions make the counting ~5x faster than 4096 on a 2-core machine, at the same matmul cost.
    chunks = [slice(a, min(a + chunk, n_texts)) for a in range(0, n_texts, chunk)]
    multi = MultiPositivePasses(truth, n_images, caption_image, directions) if truth is not None else None
    want_i2t = "i2t" in directions
    whole = n_images * n_texts * 4 <= max_bytes
    stored = [] if (whole and want_i2t) else None

    # pass 1: text->image ranks and each caption's own score (the positive), read from the same matrix
    t2i = torch.empty(n_texts, dtype=torch.long) if "t2i" in directions else None
    positive = torch.empty(n_texts, dtype=torch.float32)
    n_bad = 0
    for sl in chunks:
        raw = score_fn(sl).float().cpu()  # [I, c]
        s, bad = rank_safe(raw)
        n_bad += bad
        own = caption_image[sl]
        if t2i is not None:
            t2i[sl] = positive_ranks(s, own, dim=0)[0]
        positive[sl] = s[own, torch.arange(s.shape[1])]
        if multi is not None:
            multi.first_pass(s, sl)
        if stored is not None:
            stored.append(s)

    i2t = None
    if want_i2t:
        # best own-caption score per image, and how many own captions reach it (they are not "others")
        best, own_at_best, has_caption = best_own_caption(positive, caption_image, n_images)
        # pass 2 (or a read of the stored matrix): how many captions of any image reach each image's best
        reach = torch.zeros(n_images, dtype=torch.long)
        for k, sl in enumerate(chunks):
            s = stored[k] if stored is not None else rank_safe(score_fn(sl).float().cpu())[0]
            reach += (s >= best[:, None]).sum(1)
            if multi is not None:
                multi.second_pass(s)
        i2t = torch.where(has_caption, reach - own_at_best + 1, torch.zeros_like(reach))
    return RetrievalQueries(t2i, i2t, n_bad, n_images * n_texts, multi.result() if multi is not None else None)


def ranks_from_scores(score_fn: Callable[[slice], torch.Tensor], n_images: int, caption_image: torch.Tensor,
                      chunk: int = 256, max_bytes: int = 1 << 30,
                      counts: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(text->image ranks [T], image->text ranks [I]; images without captions get rank 0 and are dropped
    by :func:`retrieval_metrics`). caption_image [T] long: the image row of every caption.

    Non-finite scores rank last (``adapters.eval.ranking.rank_safe``); when ``counts`` is given,
    ``counts["nonfinite_scores"]`` receives how many of the I x T scores were non-finite."""
    q = retrieval_queries(score_fn, n_images, caption_image, chunk, max_bytes)
    if counts is not None:
        counts["nonfinite_scores"] = q.nonfinite
    return q.t2i, q.i2t


def summarise(q: RetrievalQueries, n_images: int, ks: Sequence[int] = KS) -> dict:
    """:func:`retrieval_metrics`' dict from per-query results (both directions computed)."""
    kept = q.i2t > 0
    out = {"text_to_image": _summary(q.t2i, ks), "image_to_text": _summary(q.i2t[kept], ks),
           "images_without_captions": int((~kept).sum()), "nonfinite_scores": q.nonfinite, "n_scores": q.n_scores}
    warning = small_split_warning(n_images, ks, what="images", metric="text->image R@")
    if warning:
        out["warning"] = warning
    return out


def retrieval_metrics(score_fn: Callable[[slice], torch.Tensor], n_images: int, caption_image,
                      ks: Sequence[int] = KS, chunk: int = 256, max_bytes: int = 1 << 30) -> dict:
    """R@k (percent), mean and median rank in both directions. See the module docstring for the protocol.

    Returns {"text_to_image": {...}, "image_to_text": {...}, "images_without_captions": n,
    "nonfinite_scores": how many of the I x T scores were NaN / inf (ranked last), "n_scores": I x T}, and
    "warning" (a one-line message) when the split has too few images for R@k to mean anything
    (``adapters.eval.ranking.small_split_warning``).
    """
    return summarise(retrieval_queries(score_fn, n_images, caption_image, chunk, max_bytes), n_images, ks)


def feature_score_fn(image_emb: torch.Tensor, text_emb: torch.Tensor) -> Callable[[slice], torch.Tensor]:
    """score_fn for dot-product models: S[:, rows] = image_emb @ text_emb[rows].T, one matmul per chunk."""
    image_emb, text_emb = image_emb.float(), text_emb.float()
    return lambda rows: image_emb @ text_emb[rows].T


# --------------------------------------------------------------------------------------------- a scorer's retrieval
def directed_scorer(scorer, direction: str):
    """score function (image_reps, text_reps) -> [I, T] for one direction ("t2i": texts rank images, "i2t":
    images rank texts); the plain ``score`` for scorers whose directions agree."""
    if scorer.directional:
        return lambda i, t: scorer.score_directed(i, t, direction)
    return scorer.score


def run_retrieval_cached(scorer, cache, batch_size: int = 1024, scenes: dict | None = None,
                         per_query: PerQuery | None = None) -> dict:
    """Retrieval from a feature cache (fp16 on disk, scored in fp32) instead of re-encoding the data.

    A bare backbone scores the cache's global embeddings: it must be the backbone that built the cache (same
    architecture, preprocessing and weights hash). An adapter scores its head's arrays (``image_keys`` /
    ``text_keys``) read from the cache: the cache must have been extracted with the adapter's own extraction
    settings (its checkpoint's ``extraction.settings``; the data aside), so it holds exactly the arrays live
    extraction would give the head, and the head's directions are ranked as in :func:`retrieval_from_reps`.
    A scorer that reads itself from a cache without being an adapter (``cache_keys`` / ``encode_arrays``: FILIP's
    late interaction on the cached patch and token embeddings) needs the backbone check of a bare backbone and a
    cache holding its arrays (``scorer.cache_components``). Other scorers are refused. Each scorer says which of
    these holds for it (``check_cache``; the refusals name the two sides). ``scenes`` (a toy world's, by image id) add multi-positive retrieval, as in ``train.eval.evaluate.run_retrieval``."""
    scorer.check_cache(cache)  # a ValueError naming both sides where this scorer cannot be read from this cache
    if scorer.second_stage:  # it reads its own representations there: an adapter's components, FILIP's patches / tokens
        return _retrieval_of_own_reps(scorer, cache, batch_size, scenes, per_query)
    # a bare backbone: its first stage is its exact score, the cached global embeddings
    image = torch.from_numpy(cache.gather("image_embed", np.arange(cache.num_images))).float()
    text = torch.from_numpy(cache.gather("text_embed", np.arange(cache.num_captions))).float()
    out = retrieval_from_reps(scorer, {"embed": image}, {"embed": text}, torch.from_numpy(cache.caption_image_index()),
                              truth=scene_truth(scenes, cache.image_ids(), cache.caption_ids()), per_query=per_query,
                              image_keys=cache.image_ids(), score=lambda i, t: i["embed"] @ t["embed"].T)
    out.update(images=cache.num_images, captions=cache.num_captions, skipped_images=0, cache=str(cache.path))
    return out


def _retrieval_of_own_reps(scorer, cache, batch_size: int, scenes: dict | None, per_query):
    """Retrieval of a scorer that reads its representations from the cache itself (``cache_keys`` /
    ``encode_arrays``: adapters, FILIP), every image against every caption."""
    image_reps = _cached_reps(scorer, cache, "image", cache.num_images, batch_size)
    text_reps = _cached_reps(scorer, cache, "text", cache.num_captions, batch_size)
    out = retrieval_from_reps(scorer, image_reps, text_reps, torch.from_numpy(cache.caption_image_index()),
                              truth=scene_truth(scenes, cache.image_ids(), cache.caption_ids()), per_query=per_query,
                              image_keys=cache.image_ids())
    out.update(images=cache.num_images, captions=cache.num_captions, skipped_images=0, cache=str(cache.path))
    return out


def _cached_reps(scorer, cache, side: str, n: int, batch_size: int):
    """An adapter's (or FILIP's) representations of every cache row of ``side`` ("image" / "text"), in batches."""
    return cat_reps([scorer.encode_arrays({k: cache.gather(k, np.arange(a, min(a + batch_size, n)))
                                           for k in scorer.cache_keys(side)}, side) for a in range(0, n, batch_size)])


def scene_truth(scenes: dict | None, image_ids, caption_ids):
    """The toy-world truth of the evaluated images and captions (``adapters.eval.multipositive.toyworld_truth``); None
    without scenes, or (said once) when the ids are not the toy world's."""
    if not scenes:
        return None
    from adapters.eval.multipositive import toyworld_truth

    try:
        return toyworld_truth(scenes, [str(i) for i in image_ids], [str(c) for c in caption_ids])
    except ValueError as e:
        warn_once(f"note: no multi-positive retrieval: {e}")
        return None


def retrieval_from_reps(scorer, image_reps, text_reps, caption_image: torch.Tensor, truth=None,
                        per_query: PerQuery | None = None, image_keys=None, score=None) -> dict:
    """retrieval_metrics on encoded images and captions; a directional scorer ranks each direction with its own
    score matrix (text->image ranks from "t2i" scores, image->text ranks from "i2t"; ``nonfinite_scores`` and
    ``n_scores`` then add up both matrices).

    ``truth`` (a ``adapters.eval.multipositive.ToyTruth``) adds ``multi_positive`` (:func:`multi_positive_report`),
    computed in the same passes. ``per_query`` receives every query's values (:func:`retrieval_per_query`), the
    images keyed by ``image_keys`` (default: their rows). ``score``: the (image reps, text reps) -> [I, T]
    function of a non-directional scorer (default ``scorer.score``)."""
    n_images = num_items(image_reps)
    matrix = truth.matrix if truth is not None else None

    def queries(fn, directions) -> RetrievalQueries:
        return retrieval_queries(lambda rows: fn(image_reps, take_reps(text_reps, rows)), n_images, caption_image,
                                 truth=matrix, directions=directions)

    if not scorer.directional:
        q = queries(score or scorer.score, ("t2i", "i2t"))
    else:
        from adapters.eval.multipositive import MultiPositive

        a, b = queries(directed_scorer(scorer, "t2i"), ("t2i",)), queries(directed_scorer(scorer, "i2t"), ("i2t",))
        multi = None
        if truth is not None:
            multi = MultiPositive(a.multi.t2i_first, a.multi.t2i_ap, a.multi.t2i_true,
                                  b.multi.i2t_first, b.multi.i2t_ap, b.multi.i2t_true)
        q = RetrievalQueries(a.t2i, b.i2t, a.nonfinite + b.nonfinite, a.n_scores + b.n_scores, multi)
    out = summarise(q, n_images)
    if truth is not None:
        out["multi_positive"] = multi_positive_report(q, truth)
    if per_query is not None:
        retrieval_per_query(per_query, q, torch.as_tensor(caption_image), truth,
                            list(image_keys) if image_keys is not None else list(range(n_images)))
    return out


def multi_positive_report(q: RetrievalQueries, truth) -> dict:
    """The ``multi_positive`` section of a retrieval result (``adapters.eval.multipositive``): ``text_to_image`` and
    ``image_to_text`` (any-true R@1/5/10, mAP, n, true_per_query; T2I also its strict R@1 for comparison), and the
    same per caption group (``text_to_image_by``: caption kind, object count of the caption's own image, one-object
    captions by that count) and per image group (``image_to_text_by``: object count)."""
    from adapters.eval.multipositive import summary

    m = q.multi
    t2i = lambda keep=None: summary(m.t2i_first, m.t2i_ap, m.t2i_true, keep, strict=q.t2i)  # noqa: E731
    i2t = lambda keep=None: summary(m.i2t_first, m.i2t_ap, m.i2t_true, keep)  # noqa: E731
    return {"text_to_image": t2i(), "image_to_text": i2t(),
            "text_to_image_by": {name: t2i(torch.from_numpy(mask)) for name, mask in truth.caption_groups().items()},
            "image_to_text_by": {name: i2t(torch.from_numpy(mask)) for name, mask in truth.image_groups().items()},
            "rule": "a caption is true of an image when extract.worlds.toyworld.satisfies(scene, struct) holds"}


def hits(ranks: torch.Tensor, k: int, counted: torch.Tensor | None = None) -> np.ndarray:
    hit = (ranks <= k).double().numpy()
    return hit if counted is None else np.where(counted.numpy(), hit, np.nan)


def retrieval_per_query(per_query: PerQuery, q: RetrievalQueries, caption_image: torch.Tensor, truth,
                        image_keys: list) -> None:
    """Every retrieval row of ``train.eval.evaluate.headline`` as per-query values (family "retrieval captions": one value per
    caption, unit = its image; "retrieval images": one per image), for ``adapters.eval.bootstrap``."""
    per_query.add_family("retrieval captions", [image_keys[int(i)] for i in caption_image])
    per_query.add_family("retrieval images", image_keys)
    has_caption = q.i2t > 0
    for k in (1, 5, 10):
        per_query.add(f"retrieval T2I R@{k}", "retrieval captions", hits(q.t2i, k))
        per_query.add(f"retrieval I2T R@{k}", "retrieval images", hits(q.i2t, k, has_caption))
    if truth is None:
        return
    m = q.multi
    has_true = m.i2t_true > 0
    for k in (1, 5, 10):
        per_query.add(f"retrieval T2I any-true R@{k}", "retrieval captions", hits(m.t2i_first, k))
    per_query.add("retrieval T2I mAP", "retrieval captions", m.t2i_ap.numpy())
    per_query.add("retrieval I2T any-true R@1", "retrieval images", hits(m.i2t_first, 1, has_true))
    per_query.add("retrieval I2T mAP", "retrieval images", m.i2t_ap.numpy())
    for name, mask in truth.caption_groups().items():
        if mask.any():
            for metric, values in group_rows(name, hits(m.t2i_first, 1), m.t2i_ap.numpy()):
                per_query.add(metric, "retrieval captions", np.where(mask, values, np.nan))


def group_rows(group: str, any_true_r1, ap) -> list[tuple[str, object]]:
    """The table rows of one caption group: any-true R@1 and mAP for a caption kind, mAP for the object-count
    groups (the one figure that weighs every true image, where the count changes how many there are)."""
    rows = [(f"T2I mAP [{group}]", ap)]
    if "object images" not in group:
        rows.insert(0, (f"T2I any-true R@1 [{group}]", any_true_r1))
    return rows
