"""Ranks and recalls of score matrices: the one place that decides how scores become ranks.

Every metric of the project (retrieval in ``adapters/eval/retrieval.py``, zero-shot top-k, compositional items,
the linear probe's accuracies, ComAlign / PowerCLIP fitting inference params on a held-out split here, and
the serving engine) ranks through :func:`rank_safe` / :func:`positive_ranks`, so two rules hold everywhere:

- Ties count against the model: an incorrect candidate scoring *equal* to the correct one ranks ahead of
  it, so a constant scorer gets R@1 = 0, never 100.
- A non-finite score (NaN, +inf, -inf) is the worst possible score (-inf). With the ties rule a non-finite
  positive ranks last (every candidate is ``>=`` it), and a non-finite negative never beats a finite
  positive. Without this, ``NaN >= x`` is False for every x, so an all-NaN model would rank every positive
  first and report R@1 = 100. Callers count the replaced values (the second result of :func:`rank_safe`)
  and report them.

Retrieval protocol (several captions per image; image -> text counts an image as found at its best own
caption), for a whole score matrix held in memory (``adapters/eval/retrieval.py`` streams chunked matrices and is
tested against this)::

    rank(t) = 1 + #{images j != img(t) : S[j, t] >= S[img(t), t]}
    rank(i) = 1 + #{captions t not of i : S[i, t] >= max_{t' of i} S[i, t']}
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

KS = (1, 5, 10)
WORST = float("-inf")  # what every non-finite score becomes
# Fewer images than this many times the largest k, and a random scorer already reaches R@k_max >= 10%
# in expectation (chance R@k = k / n): the recalls cannot tell a model from noise (see small_split_warning).
MIN_CANDIDATES_PER_K = 10


def rank_safe(scores: Tensor) -> tuple[Tensor, int]:
    """(scores with every non-finite value replaced by -inf, how many values were non-finite).

    Same shape and dtype; finite values are unchanged. When every value is finite the input itself is
    returned (no copy). Integer tensors are always finite and returned as they are."""
    if not scores.is_floating_point():
        return scores, 0
    # Fast path, one read-only reduction: NaN and inf propagate through a sum (inf - inf = NaN), so a finite
    # sum proves every value finite. A sum that overflows from finite values falls through to the exact count.
    if bool(torch.isfinite(scores.sum())):
        return scores, 0
    finite = torch.isfinite(scores)
    n_bad = scores.numel() - int(finite.sum())
    if n_bad == 0:
        return scores, 0
    return torch.where(finite, scores, torch.full((), WORST, dtype=scores.dtype, device=scores.device)), n_bad


def positive_ranks(scores: Tensor, positive: Tensor, dim: int = -1) -> tuple[Tensor, int]:
    """(rank of the positive of every query, number of non-finite scores), through :func:`rank_safe`.

    ``scores`` [Q, C] with candidates along ``dim`` = -1 / 1 (or [C, Q] with ``dim`` = 0); ``positive`` [Q]
    long: the index of each query's correct candidate along ``dim``. Returns ranks [Q] long, 1 = best:
    ``1 + #{other candidates scoring >= the positive}`` (ties against the model; a non-finite positive
    ranks last, C)."""
    safe, n_bad = rank_safe(scores)
    dim = dim % safe.ndim
    pos = safe.gather(dim, positive.to(safe.device).long().unsqueeze(dim))
    return (safe >= pos).sum(dim), n_bad  # counts the positive itself once


def best_own_caption(positive: Tensor, caption_image: Tensor, n_images: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per image: (best own-caption score [I], how many own captions reach it [I] long, has a caption [I] bool).

    ``positive`` [T]: each caption's rank-safe score with its own image; ``caption_image`` [T] long. An image
    whose own scores are all non-finite has best -inf (its captions rank last) and still counts as having
    captions; an image without captions has best -inf and ``has`` False."""
    positive = positive.float()
    best = torch.full((n_images,), WORST, device=positive.device).scatter_reduce(
        0, caption_image, positive, reduce="amax")
    own_at_best = torch.zeros(n_images, dtype=torch.long, device=positive.device).index_add_(
        0, caption_image, (positive >= best[caption_image]).long())  # own captions at the best are not "others"
    has = torch.bincount(caption_image, minlength=n_images) > 0
    return best, own_at_best, has


def text_to_image_ranks(scores: Tensor, caption_image: Tensor) -> Tensor:
    """scores [I, T], caption_image [T] long -> rank of each caption's image among all images [T] (1 = best)."""
    return positive_ranks(scores, caption_image.to(scores.device), dim=0)[0]


def image_to_text_ranks(scores: Tensor, caption_image: Tensor) -> Tensor:
    """scores [I, T] -> rank of each image's best own caption among all captions [I]; 0 for an image
    without captions (callers drop those)."""
    safe, _ = rank_safe(scores.float())
    caption_image = caption_image.to(safe.device).long()
    pos = safe[caption_image, torch.arange(safe.shape[1], device=safe.device)]
    best, own_at_best, has = best_own_caption(pos, caption_image, safe.shape[0])
    reach = (safe >= best[:, None]).sum(1)
    return torch.where(has, reach - own_at_best + 1, torch.zeros_like(reach))


def small_split_warning(n_candidates: int, ks: Sequence[int] = KS, *, what: str = "images", metric: str = "R@",
                        min_per_k: int = MIN_CANDIDATES_PER_K) -> str | None:
    """A one-line warning when ``n_candidates`` are too few for R@k (top-k) to mean anything, else None.

    ``what`` names the candidates and ``metric`` prefixes k in the message ("R@" -> "R@1/5/10", "top" ->
    "top5"). Two rules, for the ks of ``ks``:

    - ``n_candidates <= k``: no rank can exceed the number of candidates, so R@k = 100 for *any* scorer,
      by construction (a held-out split of one image reports R@1 = 100 in both directions).
    - ``n_candidates < min_per_k * max(ks)``: a random scorer gets R@k = k / n_candidates in expectation;
      below ``10 * k`` candidates (100 images for R@10) chance alone exceeds 10 points and each image query
      moves R@1 by more than a point, so the numbers neither separate a model from noise nor compare with
      published ones. ``min_per_k=0`` keeps only the first rule (zero-shot: chance is 1 / classes however
      many images there are).
    """
    if not ks:
        return None
    k = max(ks)
    trivial = sorted(j for j in ks if j >= n_candidates)
    noun = what[:-1] if n_candidates == 1 and what.endswith("s") else what
    if trivial:
        return (f"only {n_candidates} {noun}: {metric}{'/'.join(map(str, trivial))} "
                f"{'is' if len(trivial) == 1 else 'are'} 100% for any scorer by construction (no rank exceeds the "
                "number of candidates): no evidence about the model")
    if n_candidates < min_per_k * k:
        return (f"only {n_candidates} {what}: a random scorer already gets {metric}{k} = "
                f"{100 * k / n_candidates:.0f}% (chance is k / {n_candidates}); use at least {min_per_k * k} "
                f"{what} for numbers that mean something")
    return None


def mean_recall(scores: Tensor, caption_image: Tensor, direction: str = "both",
                ks: Sequence[int] = KS) -> float:
    """Mean of R@k over ``ks`` (percent) for ``"t2i"``, ``"i2t"`` or the mean of both (``"both"``)."""
    caption_image = caption_image.to(scores.device).long()
    parts = []
    if direction in ("t2i", "both"):
        r = text_to_image_ranks(scores, caption_image)
        parts += [(r <= k).double().mean() for k in ks]
    if direction in ("i2t", "both"):
        r = image_to_text_ranks(scores, caption_image)
        r = r[r > 0]
        parts += [(r <= k).double().mean() for k in ks]
    if not parts:
        raise ValueError(f"direction must be 't2i', 'i2t' or 'both', got {direction!r}")
    return float(torch.stack(parts).mean() * 100)
