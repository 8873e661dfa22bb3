"""Contrastive losses that work on one rank or many (open_clip's ``ClipLoss`` pattern, any tensor).

With ``world_size > 1`` every rank holds a local batch; features are all-gathered so each local item is
contrasted against the global batch. Two modes, as in open_clip:

- ``local_loss=True, gather_with_grad=True`` (the default here): each rank scores its own rows against
  everything; the gather passes gradients back to the rank that owns the features. The mean of the ranks'
  losses, and DDP's mean of their gradients, equal one process's loss and gradients on the global batch.
- ``local_loss=False``: every rank computes the whole [B, B] loss; without ``gather_with_grad`` only its
  own slice carries gradients (open_clip's cheaper default, whose DDP gradient is 1/world_size of the
  single-process one).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous. ``torch.distributed.nn.all_gather``'s
    backward hands the gradient slices to a collective (alltoall on gloo) that reads them as if they were
    contiguous; a strided gradient (e.g. from an einsum over the gathered tensor) then comes back scrambled --
    the loss is right and the gradient silently wrong (found by the two-process test of train.pretrain.engine)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def gather(x: Tensor, rank: int = 0, world_size: int = 1, *, with_grad: bool = True,
           keep_local_grad: bool = True) -> Tensor:
    """All-gather ``x`` [b, ...] from every rank into [world_size * b, ...] (rank order).

    Every rank must pass the same shape. ``with_grad``: gradients reach the owning rank
    (``torch.distributed.nn.all_gather``); otherwise the gather is detached and, with ``keep_local_grad``,
    this rank's own slice is put back so its gradient still flows.
    """
    if world_size <= 1:
        return x
    if with_grad:
        # Imported as a name of its own: a bare ``import torch.distributed.nn`` here would make ``torch`` a
        # local of this function and break the branch below (UnboundLocalError).
        from torch.distributed import nn as dist_nn  # the autograd-aware all_gather

        return _ContiguousGrad.apply(torch.cat(dist_nn.all_gather(x.contiguous()), dim=0))
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.detach().contiguous())
    if keep_local_grad:
        parts[rank] = x
    return torch.cat(parts, dim=0)


def gather_any(x: Tensor, rank: int = 0, world_size: int = 1, *, with_grad: bool = True) -> Tensor:
    """:func:`gather` for features and masks alike: floating tensors with their gradient (``with_grad``), others
    (bool masks, ids) as plain data."""
    if x.is_floating_point():
        return gather(x, rank, world_size, with_grad=with_grad)
    return gather(x, rank, world_size, with_grad=False, keep_local_grad=False)


def extra_columns_loss(i2t: Tensor, extra: Tensor, extra_valid: Tensor, rank: int = 0, world_size: int = 1) -> Tensor:
    """Image->text cross-entropy whose softmax holds, beside the global batch's texts (``i2t`` [b, B]: the local
    images' logits, the positives at this rank's rows), extra texts such as hard negatives (``extra`` [b, X],
    ``extra_valid`` [X]; an invalid column takes no part): NegCLIP's loss term (Yuksekgonul et al. 2023, §4)."""
    logits = torch.cat([i2t, extra.masked_fill(~extra_valid.bool()[None, :], float("-inf"))], dim=1).float()
    return F.cross_entropy(logits, local_rows(len(i2t), rank, world_size, i2t.device))


def local_rows(n_local: int, rank: int, world_size: int, device) -> Tensor:
    """Indices of this rank's items inside the gathered batch."""
    return torch.arange(n_local, device=device) + n_local * rank


def clip_loss(image_features: Tensor, text_features: Tensor, logit_scale: Tensor | float, *,
              rank: int = 0, world_size: int = 1, local_loss: bool = True, gather_with_grad: bool = True,
              logit_bias: Tensor | float | None = None) -> Tensor:
    """Symmetric InfoNCE (CLIP): mean of image->text and text->image cross-entropy, positives on the
    diagonal of the global batch. Features [b, D] (normalised by the caller); logit_scale is the
    multiplier itself (exp of the learnt log-scale), not its log."""
    all_img = gather(image_features, rank, world_size, with_grad=gather_with_grad)
    all_txt = gather(text_features, rank, world_size, with_grad=gather_with_grad)
    bias = 0.0 if logit_bias is None else logit_bias
    if world_size > 1 and local_loss:
        logits_i = logit_scale * image_features @ all_txt.T + bias  # [b, B]
        logits_t = logit_scale * text_features @ all_img.T + bias
        labels = local_rows(len(image_features), rank, world_size, image_features.device)
    else:
        logits_i = logit_scale * all_img @ all_txt.T + bias
        logits_t = logits_i.T
        labels = torch.arange(len(all_img), device=all_img.device)
    return 0.5 * (F.cross_entropy(logits_i.float(), labels) + F.cross_entropy(logits_t.float(), labels))


def triplet_rows(scores: Tensor, positives: Tensor, margin: float, *, hardest: bool = True,
                 semihard: bool = False) -> Tensor:
    """Row-wise triplet margin loss (PowerCLIP eq. 9): for each row r with positive column positives[r],
    ``relu(margin - s[r, pos] + s[r, neg])`` over the negatives, the hardest one (default, VSE++) or summed;
    mean over rows. scores [R, C]. ``semihard`` (with ``hardest``): the hardest negative among those scoring
    below the positive (FaceNet's semi-hard negatives), so a "negative" that outscores its positive -- often a
    second true match where captions fit several images -- is not pushed away; a row whose negatives all
    outscore the positive takes its easiest one (as FaceNet's reference loss does)."""
    rows = torch.arange(len(scores), device=scores.device)
    pos = scores[rows, positives]
    neg_mask = torch.ones_like(scores, dtype=torch.bool)
    neg_mask[rows, positives] = False
    hinge = (margin - pos[:, None] + scores).clamp_min(0)
    if hardest:
        worst = scores.masked_fill(~neg_mask, float("-inf")).amax(dim=1)
        if semihard:
            below = neg_mask & (scores < pos[:, None])
            easiest = scores.masked_fill(~neg_mask, float("inf")).amin(dim=1)
            worst = torch.where(below.any(dim=1), scores.masked_fill(~below, float("-inf")).amax(dim=1), easiest)
        per_row = (margin - pos + worst).clamp_min(0)
        per_row = torch.where(torch.isfinite(worst), per_row, torch.zeros_like(per_row))  # a 1-item batch
    else:
        per_row = (hinge * neg_mask).sum(dim=1)
    return per_row.mean()
