"""CLIP-PGS (Pei et al. 2025, papers/clip-pgs.txt §3.2): CLIP with patches masked by *Patch Generation-to-
Selection* instead of FLIP's uniform drop, so the masked patches are the redundant ones and object outlines stay.

Per image, before the image transformer (the steps of §3.2, "Gradual Process with Dynamic Masking Ratios" (i)-(iv)):

1. Generation: seed patches are drawn with FLIP's random masking at 5% (``--pgs-seed-ratio``).
2. Similarity (§3.2 "Optimal Transport Normalization"): ``S = alpha S_x + (1 - alpha) S_I``, the cosine
   similarities of the patches' features (the patch-embedding layer's output, what exists before the
   transformer runs) and of their raw pixels; alpha grows with the epoch (``--pgs-alpha linear``:
   alpha = epoch / epochs): pixels guide the early, untrained epochs, features the later ones.
3. OTN: ``S' = S + Sinkhorn(S)``. Sinkhorn runs in log space on ``exp(S / eps)`` (a positive kernel, as
   Cuturi 2013) for ``--pgs-sinkhorn-iters`` row/column normalisations and yields a doubly stochastic matrix;
   we multiply it by N so its entries average 1, the scale of S -- the paper writes the sum without a scale,
   but a doubly stochastic N x N matrix has entries ~1/N (1/196 at ViT-B/16) and would change nothing.
   A patch's candidate score is its S' to the most similar seed.
4. Edge detection (§3.2 "Edge Detection"): a Sobel edge map of the whole image (grey levels), averaged per
   patch and divided by the image's largest patch value; patches at or above ``--pgs-edge-threshold`` are
   protected: "if a patch is initially marked for removal but exhibits high edge scores, it is retained".
5. Selection with bounds (§3.2 (iv)): the unprotected patches whose score reaches ``--pgs-sim-threshold``
   are the candidates; their count, clipped to [min_ratio N, max_ratio N], is how many patches the image
   loses; patches are ranked (unprotected by decreasing score, then protected by increasing edge strength)
   and the first ones masked, so the lower bound is met by masking the least essential patches and the upper
   bound is never exceeded. ``--pgs-min-ratio 0.3 --pgs-max-ratio 0.5`` is CLIP-PGS_0.3 (the default),
   ``0.5 0.5`` is CLIP-PGS_0.5 (a fixed ratio, as FLIP's).

The paper gives no values for the thresholds, eps or the iteration count; ours are flags with the defaults
above. Images of one batch may keep different numbers of patches: rows are padded to the most an image may keep
(``--pgs-min-ratio``'s count, so the step never waits to learn the batch's largest) and the padding is hidden
from attention (it changes no output). All of this is a few batched tensor ops on [B, N, N] -- N^2 d flops per image
against the ViT's ~N d^2 L -- which is how the paper keeps the overhead over FLIP under 3%.
"""
from __future__ import annotations

import argparse
import functools
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.objectives.base import StepContext, batch_random, runs_ahead
from adapters.objectives.towers import encode_image, encode_text, keep_count, normalize, patch_embed
from adapters.objectives.clip import CLIPObjective
from adapters.registry import PRETRAIN

_SOBEL_X = ((-1.0, 0.0, 1.0), (-2.0, 0.0, 2.0), (-1.0, 0.0, 1.0))


def sobel_patch_edges(images: Tensor, grid: tuple[int, int], patch: tuple[int, int]) -> Tensor:
    """Edge strength per patch [B, N] in [0, 1]: Sobel gradient magnitude of the grey image (mean of the
    channels, border replicated), averaged over each patch's pixels, divided by the image's largest patch value."""
    gray = images.float().mean(dim=1, keepdim=True)
    kx = torch.tensor(_SOBEL_X, dtype=gray.dtype).to(gray.device, non_blocking=True)  # a blocking copy would wait
    # replicate the border: the image's edge is not an object's (zero padding would outline every image)
    g = F.conv2d(F.pad(gray, (1, 1, 1, 1), mode="replicate"), torch.stack([kx, kx.T])[:, None])
    mag = g.pow(2).sum(dim=1, keepdim=True).sqrt()
    (rows, cols), (ph, pw) = grid, patch
    e = F.avg_pool2d(mag[..., :rows * ph, :cols * pw], (ph, pw)).flatten(1)
    return e / e.amax(dim=1, keepdim=True).clamp_min(1e-12)


def pixel_patches(images: Tensor, patch: tuple[int, int]) -> Tensor:
    """Raw pixels of each patch [B, N, 3 * ph * pw] in the ViT's row-major patch order, each patch's values
    channel-major as ``F.unfold`` orders them (a remainder of rows or columns is dropped, as there).

    A reshape, not ``F.unfold``: the patches do not overlap, so one strided copy gathers them. On CUDA
    ``F.unfold`` launches an im2col kernel per image: 12 ms of the selection's 17 at batch 256 on an H200,
    against 0.7-0.9 ms for each cosine matrix (train/pretrain/README, Speed)."""
    (ph, pw), (b, c, h, w) = patch, images.shape
    rows, cols = h // ph, w // pw
    x = images[..., :rows * ph, :cols * pw].float().reshape(b, c, rows, ph, cols, pw)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, rows * cols, c * ph * pw)


def sinkhorn(s: Tensor, eps: float, iters: int) -> Tensor:
    """Doubly stochastic matrix from similarities s [..., N, N]: alternately normalise the rows and columns of
    exp(s / eps), in log space (no overflow for small eps). Columns sum to 1 exactly after the last iteration,
    rows within the iteration's tolerance."""
    log_k = s / eps
    for _ in range(iters):
        log_k = log_k - torch.logsumexp(log_k, dim=-1, keepdim=True)
        log_k = log_k - torch.logsumexp(log_k, dim=-2, keepdim=True)
    return log_k.exp()


def cosine_matrix(x: Tensor) -> Tensor:
    x = F.normalize(x.float(), dim=-1)
    return x @ x.transpose(-1, -2)


class PGSConfig:
    """The CLIP-PGS settings (see the module docstring)."""

    def __init__(self, min_ratio: float = 0.3, max_ratio: float = 0.5, seed_ratio: float = 0.05,
                 edge_threshold: float = 0.5, sim_threshold: float = 1.0, alpha: str | float = "linear",
                 sinkhorn_eps: float = 0.05, sinkhorn_iters: int = 3):
        if not 0.0 <= min_ratio <= max_ratio < 1.0:
            raise ValueError(f"need 0 <= --pgs-min-ratio <= --pgs-max-ratio < 1, got {min_ratio}, {max_ratio}")
        if not 0.0 < seed_ratio < 1.0:
            raise ValueError(f"--pgs-seed-ratio must lie in (0, 1), got {seed_ratio}")
        if alpha != "linear" and not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"--pgs-alpha must be 'linear' or a number in [0, 1], got {alpha}")
        self.min_ratio, self.max_ratio, self.seed_ratio = min_ratio, max_ratio, seed_ratio
        self.edge_threshold, self.sim_threshold = edge_threshold, sim_threshold
        self.alpha = alpha if alpha == "linear" else float(alpha)
        self.sinkhorn_eps, self.sinkhorn_iters = sinkhorn_eps, sinkhorn_iters

    def as_dict(self) -> dict:
        return dict(vars(self))

    def alpha_at(self, progress: float) -> float:
        """Weight of the feature similarity: grows from 0 to 1 over training with ``linear``."""
        return min(1.0, max(0.0, progress)) if self.alpha == "linear" else self.alpha


def pgs_order(images: Tensor, features: Tensor, seed_noise: Tensor, cfg: PGSConfig, alpha: float | Tensor,
              grid: tuple[int, int], patch: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Steps (1)-(5) of the module docstring: (order [B, N] long, the patches to keep first; n_masked [B] long).
    Tensor work only, shapes fixed by the inputs: what ``--compile`` compiles (:func:`compiled_order`)."""
    b, n = seed_noise.shape
    with torch.no_grad(), torch.autocast(device_type=images.device.type, enabled=False):
        n_seed = max(1, int(round(cfg.seed_ratio * n)))
        seeds = seed_noise.argsort(dim=1)[:, :n_seed]  # (1) FLIP-style random seeds
        s = alpha * cosine_matrix(features) + (1.0 - alpha) * cosine_matrix(pixel_patches(images, patch))  # (2)
        s2 = s + n * sinkhorn(s, cfg.sinkhorn_eps, cfg.sinkhorn_iters)  # (3) OTN, rescaled (module docstring)
        score = torch.gather(s2, 1, seeds[..., None].expand(-1, -1, n)).amax(dim=1)  # [B, N] best seed
        edges = sobel_patch_edges(images, grid, patch)  # (4)
        protected = edges >= cfg.edge_threshold
        lo, hi = bounds(n, cfg)
        candidates = (score >= cfg.sim_threshold) & ~protected
        n_masked = candidates.sum(dim=1).clamp(lo, hi)  # (5) the ratio bounds
        # rank to mask: unprotected by decreasing score, then protected by increasing edge strength
        big = 4.0 + 2.0 * n  # above any -score (S' <= 1 + n)
        rank_key = torch.where(protected, big + edges, -score)
        return rank_key.argsort(dim=1, descending=True), n_masked


def bounds(n: int, cfg: PGSConfig) -> tuple[int, int]:
    """(fewest, most) patches an image of ``n`` loses: the ratio bounds as counts."""
    return n - keep_count(n, cfg.min_ratio), n - keep_count(n, cfg.max_ratio)


@functools.cache
def compiled_order(backend: str, mode: str):
    """:func:`pgs_order` through ``torch.compile`` (one per backend and mode, shared by every objective: an
    objective holds only the names, so it still pickles to the data workers). ``alpha`` must come as a tensor, or
    each epoch's new value would be a new graph."""
    return torch.compile(pgs_order, backend=backend, mode=None if mode == "default" else mode)


def pgs_select(images: Tensor, features: Tensor, seed_noise: Tensor, cfg: PGSConfig, alpha: float,
               grid: tuple[int, int], patch: tuple[int, int], pad_to_bound: bool = False, order_fn=pgs_order
               ) -> tuple[Tensor, Tensor | None, Tensor]:
    """Choose the patches that enter the transformer.

    images [B, 3, H, W]; features [B, N, d] the patch features (no gradient needed); seed_noise U[0,1) [B, N]
    (the seeds are the patches with the smallest noise). Returns (keep [B, K] long; key_padding [B, K] bool, True
    past an image's own count, or None when every image keeps K; n_masked [B] long). K is the batch's largest
    count, or with ``pad_to_bound`` the most an image may keep: then nothing is read back to the host.
    ``order_fn``: :func:`pgs_order` or its compiled form.
    """
    n = seed_noise.shape[1]
    if order_fn is not pgs_order:
        # a value, not a constant of the graph; copied without waiting for the device
        alpha = torch.tensor(float(alpha)).to(images.device, non_blocking=True)
    order, n_masked = order_fn(images, features, seed_noise, cfg, alpha, grid, patch)
    lo, hi = bounds(n, cfg)
    n_keep = n - n_masked
    if lo == hi:  # one ratio (CLIP-PGS_0.5): every image keeps the same count, nothing to hide
        return order[:, :n - lo], None, n_masked
    # Padded to the batch's largest count, which the host must read from the device, or to the most an image
    # may keep (the lower bound's count), which it knows: the choice of pad_to_bound (see CLIPPGSObjective)
    k = n - lo if pad_to_bound else int(n_keep.max())
    keep = order[:, :k]
    padding = torch.arange(k, device=keep.device)[None, :] >= n_keep[:, None]
    if not pad_to_bound and not bool(padding.any()):
        padding = None
    return keep, padding, n_masked


@PRETRAIN.register("clip-pgs")
class CLIPPGSObjective(CLIPObjective):
    """CLIP on PGS-selected patches (CLIP-PGS §3.2)."""

    chooses_patches: ClassVar[bool] = True

    def __init__(self, cfg: PGSConfig = PGSConfig()):
        self.cfg = cfg
        self.compiled: tuple[str, str] | None = None  # (backend, mode) of the selection, set by compile()

    def compile(self, backend: str, mode: str) -> None:
        """The selection's tensor work (:func:`pgs_order`: two cosine matrices, Sinkhorn, Sobel, the ranking)
        compiled: on the H200 its eager kernels were most of CLIP-PGS's overhead over FLIP (README, Speed)."""
        self.compiled = (backend, mode)

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        d = PGSConfig()
        g = parser.add_argument_group("clip-pgs")
        g.add_argument("--pgs-min-ratio", type=float, default=d.min_ratio,
                       help="clip-pgs: lower bound of the masking ratio (0.3: CLIP-PGS_0.3; 0.5 with max 0.5: CLIP-PGS_0.5)")
        g.add_argument("--pgs-max-ratio", type=float, default=d.max_ratio, help="clip-pgs: upper bound (FLIP's 0.5)")
        g.add_argument("--pgs-seed-ratio", type=float, default=d.seed_ratio, help="clip-pgs: random seed patches")
        g.add_argument("--pgs-edge-threshold", type=float, default=d.edge_threshold,
                       help="clip-pgs: patches with Sobel strength >= this fraction of the image's strongest are kept")
        g.add_argument("--pgs-sim-threshold", type=float, default=d.sim_threshold,
                       help="clip-pgs: S' score from which an unprotected patch is a mask candidate")
        g.add_argument("--pgs-alpha", default="linear",
                       help="clip-pgs: weight of feature vs pixel similarity: 'linear' (epoch / epochs) or a number")
        g.add_argument("--pgs-sinkhorn-eps", type=float, default=d.sinkhorn_eps, help="clip-pgs: Sinkhorn temperature")
        g.add_argument("--pgs-sinkhorn-iters", type=int, default=d.sinkhorn_iters, help="clip-pgs: Sinkhorn iterations")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CLIPPGSObjective":
        return cls(PGSConfig(min_ratio=args.pgs_min_ratio, max_ratio=args.pgs_max_ratio, seed_ratio=args.pgs_seed_ratio,
                             edge_threshold=args.pgs_edge_threshold, sim_threshold=args.pgs_sim_threshold,
                             alpha=args.pgs_alpha, sinkhorn_eps=args.pgs_sinkhorn_eps,
                             sinkhorn_iters=args.pgs_sinkhorn_iters))

    def config(self) -> dict:
        return self.cfg.as_dict()

    def features(self, model: nn.Module, batch: dict[str, Tensor], ctx: StepContext):
        images = batch["image"]
        visual = model.visual
        embedded = patch_embed(model, images)
        n = embedded.shape[1]
        noise = batch_random(ctx, "pgs-seeds", len(images), n, device=images.device)
        # On CUDA the host queues the step ahead of the device, and reading the batch's largest kept count would
        # stop it until the selection is done; padding to the bound costs tokens only in a batch where no image
        # keeps that many, which grows rarer with the batch (one image with few mask candidates is enough). On a
        # CPU nothing runs ahead, so the batch's largest.
        keep, padding, n_masked = pgs_select(images, embedded.detach(), noise, self.cfg, self.cfg.alpha_at(ctx.progress),
                                             tuple(visual.grid_size), tuple(visual.patch_size),
                                             pad_to_bound=runs_ahead(images.device),
                                             order_fn=compiled_order(*self.compiled) if self.compiled else pgs_order)
        image = encode_image(model, embedded=embedded, keep=keep, key_padding=padding)
        text = encode_text(model, batch["text"])
        return {"image_features": normalize(image.pooled), "text_features": normalize(text.pooled),
                "logit_scale": model.logit_scale.exp(), "mask_ratio": n_masked.float() / n}

    def loss(self, features, ctx: StepContext):
        out = super().loss(features, ctx)
        out["mask_ratio"] = features["mask_ratio"].mean().detach()
        return out
