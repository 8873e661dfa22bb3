"""Retrieval ranks and recalls of a whole score matrix held in memory, for library code that selects
inference-time parameters on a held-out split (ComAlign's fusion weights, PowerCLIP's beta).

Same protocol as the evaluation suite (``train/retrieval.py``, which streams chunked score matrices and is
tested against this): several captions per image; image -> text counts an image as found at its best own
caption; ties count against the model, so a constant scorer gets R@1 = 0, never 100.

    rank(t) = 1 + #{images j != img(t) : S[j, t] >= S[img(t), t]}
    rank(i) = 1 + #{captions t not of i : S[i, t] >= max_{t' of i} S[i, t']}
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

KS = (1, 5, 10)


def text_to_image_ranks(scores: Tensor, caption_image: Tensor) -> Tensor:
    """scores [I, T], caption_image [T] long -> rank of each caption's image among all images [T] (1 = best)."""
    cols = torch.arange(scores.shape[1], device=scores.device)
    pos = scores[caption_image, cols]
    return (scores >= pos[None, :]).sum(0)  # counts the positive itself once


def image_to_text_ranks(scores: Tensor, caption_image: Tensor) -> Tensor:
    """scores [I, T] -> rank of each image's best own caption among all captions [I]; 0 for an image
    without captions (callers drop those)."""
    n_images = scores.shape[0]
    cols = torch.arange(scores.shape[1], device=scores.device)
    pos = scores[caption_image, cols].float()
    best = torch.full((n_images,), -torch.inf, device=scores.device).scatter_reduce(0, caption_image, pos, "amax")
    # own captions reaching the best are not "others"
    own_at_best = torch.zeros(n_images, dtype=torch.long, device=scores.device).index_add_(
        0, caption_image, (pos >= best[caption_image]).long())
    reach = (scores.float() >= best[:, None]).sum(1)
    has = torch.isfinite(best)
    return torch.where(has, reach - own_at_best + 1, torch.zeros_like(reach))


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
