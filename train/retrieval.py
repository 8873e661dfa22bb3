"""Image–text retrieval metrics with several captions per image (the COCO / Flickr 5-caption protocol).

Text -> image: each caption has exactly one correct image. Image -> text: an image is retrieved correctly
at rank r when its best-scoring own caption is at rank r (any of its captions counts, as in CLIP and
CLIP_benchmark). Ties count against the model: an incorrect item scoring *equal* to the correct one ranks
ahead of it, so a constant scorer gets R@1 = 0, not 100. Non-finite scores are the worst score (they rank
last; an all-NaN model gets R@1 = 0) and are counted: both rules are ``adapters.ranking``'s, shared by every
metric and the serving engine.

rank(t)  = 1 + #{images j != img(t) : S[j, t] >= S[img(t), t]}
rank(i)  = 1 + #{captions t not of i : S[i, t] >= max_{t' of i} S[i, t']}

The score matrix S [I, T] comes from ``score_fn(text_rows) -> [I, len(rows)]`` in chunks of captions. When
the whole matrix fits ``max_bytes`` it is computed once and both directions are read from it; otherwise two
streaming passes bound memory to one chunk (:func:`retrieval_metrics` tests the two against each other and
against a per-query reference).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from adapters.ranking import KS, best_own_caption, positive_ranks, rank_safe, small_split_warning


def _summary(ranks: torch.Tensor, ks: Sequence[int]) -> dict:
    r = ranks.double()
    out = {f"R@{k}": float((r <= k).double().mean() * 100) for k in ks}
    out.update(mean_rank=float(r.mean()), median_rank=float(r.median()), n=int(len(r)))
    return out


def ranks_from_scores(score_fn: Callable[[slice], torch.Tensor], n_images: int, caption_image: torch.Tensor,
                      chunk: int = 256, max_bytes: int = 1 << 30,
                      counts: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(text->image ranks [T], image->text ranks [I]; images without captions get rank 0 and are dropped
    by :func:`retrieval_metrics`). caption_image [T] long: the image row of every caption.

    Non-finite scores rank last (``adapters.ranking.rank_safe``); when ``counts`` is given,
    ``counts["nonfinite_scores"]`` receives how many of the I x T scores were non-finite."""
    caption_image = torch.as_tensor(caption_image, dtype=torch.long)
    n_texts = len(caption_image)
    if n_texts == 0 or n_images == 0:
        raise ValueError("retrieval needs at least one image and one caption")
    if int(caption_image.min()) < 0 or int(caption_image.max()) >= n_images:
        raise ValueError("caption_image holds image rows outside [0, n_images)")
    # Small chunks keep each [I, chunk] block in cache for the comparisons that follow its computation:
    # 256 captions make the counting ~5x faster than 4096 on a 2-core machine, at the same matmul cost.
    chunks = [slice(a, min(a + chunk, n_texts)) for a in range(0, n_texts, chunk)]
    whole = n_images * n_texts * 4 <= max_bytes
    stored = [] if whole else None

    # pass 1: text->image ranks and each caption's own score (the positive), read from the same matrix
    t2i = torch.empty(n_texts, dtype=torch.long)
    positive = torch.empty(n_texts, dtype=torch.float32)
    n_bad = 0
    for sl in chunks:
        s = score_fn(sl).float().cpu()  # [I, c]
        own = caption_image[sl]
        t2i[sl], bad = positive_ranks(s, own, dim=0)
        n_bad += bad
        positive[sl] = s[own, torch.arange(s.shape[1])]
        if stored is not None:
            stored.append(s)
    if counts is not None:
        counts["nonfinite_scores"] = n_bad
    positive, _ = rank_safe(positive)

    # best own-caption score per image, and how many own captions reach it (they are not "others")
    best, own_at_best, has_caption = best_own_caption(positive, caption_image, n_images)

    # pass 2 (or a read of the stored matrix): how many captions of any image reach each image's best
    reach = torch.zeros(n_images, dtype=torch.long)
    for k, sl in enumerate(chunks):
        s, _ = rank_safe(stored[k] if stored is not None else score_fn(sl).float().cpu())
        reach += (s >= best[:, None]).sum(1)
    i2t = torch.where(has_caption, reach - own_at_best + 1, torch.zeros_like(reach))
    return t2i, i2t


def retrieval_metrics(score_fn: Callable[[slice], torch.Tensor], n_images: int, caption_image,
                      ks: Sequence[int] = KS, chunk: int = 256, max_bytes: int = 1 << 30) -> dict:
    """R@k (percent), mean and median rank in both directions. See the module docstring for the protocol.

    Returns {"text_to_image": {...}, "image_to_text": {...}, "images_without_captions": n,
    "nonfinite_scores": how many of the I x T scores were NaN / inf (ranked last), "n_scores": I x T}, and
    "warning" (a one-line message) when the split has too few images for R@k to mean anything
    (``adapters.ranking.small_split_warning``).
    """
    counts: dict = {}
    t2i, i2t = ranks_from_scores(score_fn, n_images, caption_image, chunk, max_bytes, counts)
    kept = i2t > 0
    out = {"text_to_image": _summary(t2i, ks), "image_to_text": _summary(i2t[kept], ks),
           "images_without_captions": int((~kept).sum()), "nonfinite_scores": counts["nonfinite_scores"],
           "n_scores": n_images * len(t2i)}
    warning = small_split_warning(n_images, ks, what="images", metric="text->image R@")
    if warning:
        out["warning"] = warning
    return out


def feature_score_fn(image_emb: torch.Tensor, text_emb: torch.Tensor) -> Callable[[slice], torch.Tensor]:
    """score_fn for dot-product models: S[:, rows] = image_emb @ text_emb[rows].T, one matmul per chunk."""
    image_emb, text_emb = image_emb.float(), text_emb.float()
    return lambda rows: image_emb @ text_emb[rows].T

