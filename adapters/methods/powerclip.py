"""PowerCLIP NLA head: powerset alignment of image regions and phrase-tree nodes on cached features.

PowerCLIP (PowerCLIP paper §3-4) pre-trains CLIP with an extra loss that aligns every subset of image regions
with every node of the caption's parse tree. This head brings that objective to a frozen backbone: light
projections over the cached patch tokens and token embeddings are trained with

    loss = CLIP(global image, global text) + lam * [triplet(S) + triplet(S^T)]       (§3.4 eq. 8, §4.4 eq. 16)

where S_ij = w_t2r * NLA-T1_ij + w_r2t * NLA-T2_ij approximates T2R / R2T (eq. 6-7) in time linear in the
number of regions (adapters/nla.py). Embeddings follow §3.2-3.3:

- region r_m = normalise(mean of the projected patch tokens inside region mask m) (eq. 2), masks from the
  cache (random boxes = PowerCLIP-R, ground-truth boxes, or SAM2 masks = PowerCLIP-S, on the patch grid);
- leaf = normalise(mean of the projected token embeddings of the leaf phrase) (eq. 4), node p_B = sum of its
  leaves (supplement eq. 18), trees from the cache (spaCy, extract/text_components.py).

Projections are residual (x + W x, W = 0 at init): the untrained head computes everything from the base
model's own patch / token / global embeddings.

Score (what evaluation ranks by), precisely:

    score(i, j) = <g_I^(i), g_T^(j)> + beta * S_ij / (M_i * mean node size_j)

the global cosine (g = normalised, projected global embeddings; the base CLIP score at init) plus beta
times the same S the triplet loss trains, on the loss's normalised scale (adapters.nla.pair_scale): S grows
with the number of valid regions M_i and with the leaf counts of the nodes, and dividing by them makes it a
mean of (soft-relu'd) region-leaf cosines, on the scale of the global cosine. beta = 1 (equal weight on two
unit-scale terms) until :meth:`fit_inference` picks it on a held-out split from ``beta_grid`` (0 included, so
the fitted head is never worse there than its global term alone); the fitted value is a buffer, saved with
the weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.base import AdapterHead, Reps
from adapters.layers import ResidualLinear
from adapters.ranking import mean_recall
from adapters.nla import (NLAConfig, PowerCLIPLoss, PowerCLIPLossConfig, combined_similarity, leaf_embeddings,
                          node_embeddings, region_embeddings)
from adapters.registry import ADAPTERS

#: elements of one [images x texts x M x K] block in :meth:`PowerCLIPHead.nla_scores` (~64 MiB of fp32)
_BLOCK_ELEMENTS = 1 << 24


@dataclass
class PowerCLIPHeadConfig:
    """Head + loss settings. Loss defaults are the paper's (PowerCLIP paper §5.1, supplement App. F: lam 0.1,
    softplus / tanh NLAs, tau 0.01, alpha 0.75); margin, weights and normalisation as in
    adapters.nla.PowerCLIPLossConfig (the margin is on the normalised scale of S). The logit scale starts at
    100, the value CLIP backbones end pre-training at, and is learnt, capped at 100 like open_clip's.
    """

    lam: float = field(default=0.1, metadata={"help": "weight of the NLA triplet loss (eq. 16)"})
    margin: float = field(default=0.2, metadata={"help": "triplet margin on the normalised S (eq. 9)"})
    w_t2r: float = field(default=0.5, metadata={"help": "weight of NLA-T1 (T2R) in S"})
    w_r2t: float = field(default=0.5, metadata={"help": "weight of NLA-T2 (R2T) in S"})
    hardest: bool = field(default=True, metadata={"help": "triplet on the hardest negative (else sum over all)"})
    normalize: bool = field(default=True, metadata={"help": "divide S by M_i x mean node size_j"})
    tau_t1: float = field(default=0.01, metadata={"help": "NLA-T1 temperature"})
    tau_t2: float = field(default=0.01, metadata={"help": "NLA-T2 temperature"})
    alpha: float = field(default=0.75, metadata={"help": "NLA-T2 interpolation between R2T's bounds"})
    chunk_size: int = field(default=64, metadata={"help": "images per block of the pair similarities"})
    logit_scale: float = field(default=100.0, metadata={"help": "initial CLIP inverse temperature (cap 100)"})
    learn_logit_scale: bool = field(default=True, metadata={"help": "learn the CLIP logit scale"})
    project_global: bool = field(default=True, metadata={
        "help": "residual projection of the global embeddings (identity at init)"})
    beta: float = field(default=1.0, metadata={"help": "score = global cosine + beta x normalised S (before fitting)"})
    fit_beta: bool = field(default=True, metadata={"help": "fit beta on the held-out split after training"})
    beta_grid: str = field(default="0,0.1,0.25,0.5,1,2,4", metadata={"help": "comma list of betas to try"})
    fit_max_images: int = field(default=2000, metadata={"help": "held-out images used to fit beta"})

    def betas(self) -> list[float]:
        try:
            return sorted(float(b) for b in str(self.beta_grid).split(",") if b.strip())
        except ValueError:
            raise ValueError(f"beta_grid must be a comma list of numbers, got {self.beta_grid!r}") from None


@ADAPTERS.register("powerclip")
class PowerCLIPHead(AdapterHead):
    """PowerCLIP's powerset alignment as an adapter head (see the module docstring).

    Inputs per image: ``image_embed [B, D]``, ``patch_tokens [B, N, D]``, ``region_masks [B, M, rows, cols]``
    (rows * cols = N), ``region_valid [B, M]``. Per caption: ``text_embed [B, D]``, ``token_embed [B, L, D]`` +
    ``token_mask [B, L]``, ``leaf_tokens [B, P, L']`` (L' may differ from L by padding), ``node_leaves
    [B, K, P]``, ``n_nodes [B]``.
    Reps (first dim = items, chunkable): image ``{"global": [I, D] unit, "regions": [I, M, D] unit,
    "region_mask": [I, M] bool}``; text ``{"global": [T, D] unit, "nodes": [T, K, D], "node_mask": [T, K]
    bool, "node_sizes": [T, K] float (leaves per node)}``.
    """

    Config: ClassVar[type] = PowerCLIPHeadConfig
    components: ClassVar[tuple[str, ...]] = ("patches", "tokens", "tree", "regions")
    image_keys: ClassVar[tuple[str, ...]] = ("image_embed", "patch_tokens", "region_masks", "region_valid")
    text_keys: ClassVar[tuple[str, ...]] = ("text_embed", "token_embed", "token_mask", "leaf_tokens",
                                            "node_leaves", "n_nodes")
    #: the cache's region defaults (random boxes, M = 10) are the paper's PowerCLIP-R setting (§5.1); pass
    #: ``--regions sam2`` (PowerCLIP-S) or ``gt`` to the extraction for the others.
    extract_options: ClassVar[dict] = {}

    def __init__(self, config: PowerCLIPHeadConfig, embed_dim: int):
        super().__init__(config, embed_dim)
        d = embed_dim
        self.patch_proj = ResidualLinear(d)
        self.token_proj = ResidualLinear(d)
        self.image_proj = ResidualLinear(d) if config.project_global else nn.Identity()
        self.text_proj = ResidualLinear(d) if config.project_global else nn.Identity()
        self.log_logit_scale = nn.Parameter(torch.tensor(math.log(config.logit_scale)),
                                            requires_grad=config.learn_logit_scale)
        self.register_buffer("beta", torch.tensor(float(config.beta)))

    @property
    def _dtype(self) -> torch.dtype:
        return self.patch_proj.linear.weight.dtype

    @property
    def loss_config(self) -> PowerCLIPLossConfig:
        c = self.config
        return PowerCLIPLossConfig(lam=c.lam, margin=c.margin, w_t2r=c.w_t2r, w_r2t=c.w_r2t, hardest=c.hardest,
                                   normalize=c.normalize, nla=NLAConfig(c.tau_t1, c.tau_t2, c.alpha),
                                   chunk_size=c.chunk_size)

    def logit_scale(self) -> Tensor:
        """exp of the learnt log-scale, capped at 100 (open_clip clamps the parameter after each optimiser
        step; a head cannot reach the optimiser, so the cap is applied in the forward pass with a
        straight-through gradient: starting at the cap, a plain clamp would pass no gradient and freeze it)."""
        ls = self.log_logit_scale
        return (ls + (ls.clamp(max=math.log(100.0)) - ls).detach()).exp()

    # -- encoders ----------------------------------------------------------------------------------------
    def encode_image(self, batch: dict[str, Tensor]) -> Reps:
        g = F.normalize(self.image_proj(batch["image_embed"].to(self._dtype)), dim=-1)
        patches = self.patch_proj(batch["patch_tokens"].to(self._dtype))
        masks = batch["region_masks"]
        b, m = masks.shape[:2]
        masks = masks.reshape(b, m, -1).to(torch.bool)
        if masks.shape[-1] != patches.shape[1]:
            raise ValueError(f"region masks cover {masks.shape[-1]} cells but there are {patches.shape[1]} patch "
                             "tokens: the masks were built for another backbone's patch grid")
        if "region_valid" in batch:
            masks = masks & batch["region_valid"].to(torch.bool)[:, :, None]
        regions, valid = region_embeddings(patches, masks)  # eq. 2; an empty mask is invalid
        return {"global": g, "regions": regions, "region_mask": valid}

    def encode_text(self, batch: dict[str, Tensor]) -> Reps:
        g = F.normalize(self.text_proj(batch["text_embed"].to(self._dtype)), dim=-1)
        tokens = self.token_proj(batch["token_embed"].to(self._dtype))
        token_mask = batch["token_mask"].to(torch.bool)
        length = tokens.shape[1]
        leaf_tokens = batch["leaf_tokens"].to(torch.bool)
        # leaf_tokens and token_embed are padded separately (per cache shard / batch): align them on L.
        if leaf_tokens.shape[-1] < length:
            leaf_tokens = F.pad(leaf_tokens, (0, length - leaf_tokens.shape[-1]))
        leaf_tokens = leaf_tokens[..., :length] & token_mask[:, None, :]
        leaves, leaf_valid = leaf_embeddings(tokens, leaf_tokens)  # eq. 4
        node_leaves = batch["node_leaves"].to(torch.bool) & leaf_valid[:, None, :]
        if "n_nodes" in batch:
            k = torch.arange(node_leaves.shape[1], device=node_leaves.device)
            node_leaves = node_leaves & (k[None, :] < batch["n_nodes"].to(k.device)[:, None])[:, :, None]
        nodes = node_embeddings(leaves, node_leaves)  # p_B = sum of leaves (supplement eq. 18)
        return {"global": g, "nodes": nodes, "node_mask": node_leaves.any(-1),
                "node_sizes": node_leaves.sum(-1).to(leaves.dtype)}

    # -- scores ------------------------------------------------------------------------------------------
    def nla_scores(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        """[I, T] normalised S = (w_t2r NLA-T1 + w_r2t NLA-T2) / (M_i * mean node size_j), in blocks of texts
        (images are chunked inside adapters.nla.pair_similarities), so memory stays bounded for any I, T."""
        cfg = self.loss_config
        regions, rmask = image_reps["regions"], image_reps["region_mask"]
        nodes, nmask, sizes = text_reps["nodes"], text_reps["node_mask"], text_reps["node_sizes"]
        per_text = max(1, cfg.chunk_size * regions.shape[1] * nodes.shape[1])
        step = max(1, _BLOCK_ELEMENTS // per_text)
        parts = [combined_similarity(regions, rmask, nodes[s:s + step], nmask[s:s + step], cfg, sizes[s:s + step])
                 for s in range(0, nodes.shape[0], step)]
        return torch.cat(parts, dim=1) if parts else regions.new_zeros(regions.shape[0], 0)

    def global_scores(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        return image_reps["global"].float() @ text_reps["global"].float().T

    def first_stage_image(self, image_reps: Reps, direction: str = "t2i") -> Tensor:
        """[I, D] the global term of the score (unit g_I); the NLA term is added by the re-ranking stage."""
        return image_reps["global"].float()

    def first_stage_text(self, text_reps: Reps, direction: str = "t2i") -> Tensor:
        """[T, D] unit g_T: ``<g_I, g_T>`` is the score's first term."""
        return text_reps["global"].float()

    def score(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        """[I, T] = global cosine + beta * normalised NLA similarity (module docstring)."""
        out = self.global_scores(image_reps, text_reps)
        beta = float(self.beta)
        if beta != 0.0:
            out = out + beta * self.nla_scores(image_reps, text_reps).to(out.dtype)
        return out

    # -- objective ---------------------------------------------------------------------------------------
    def loss(self, image_reps: Reps, text_reps: Reps, *, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
        """CLIP + lam x bidirectional triplet on S (eq. 16), over the global batch (gathered inside
        adapters.nla.PowerCLIPLoss when world_size > 1)."""
        loss_fn = PowerCLIPLoss(self.loss_config, rank=rank, world_size=world_size)
        out = loss_fn(image_reps["global"], text_reps["global"], self.logit_scale(), image_reps["regions"],
                      image_reps["region_mask"], text_reps["nodes"], text_reps["node_mask"], text_reps["node_sizes"])
        out["logit_scale"] = self.logit_scale().detach()
        return out

    @torch.no_grad()
    def fit_inference(self, image_reps: Reps, text_reps: Reps, caption_image: Tensor) -> dict[str, float]:
        """Pick beta from ``beta_grid`` maximising the mean of text->image and image->text R@1/5/10 on a
        held-out split (ties: the smaller beta). Uses the first ``fit_max_images`` images and their captions."""
        cfg = self.config
        grid = cfg.betas()
        if not cfg.fit_beta or not grid:
            return {}
        caption_image = torch.as_tensor(caption_image, dtype=torch.long)
        n_img = min(len(image_reps["global"]), cfg.fit_max_images)
        keep = (caption_image < n_img).nonzero().squeeze(1)
        if len(keep) == 0:
            return {}
        img = {k: v[:n_img] for k, v in image_reps.items()}
        dev = img["global"].device
        txt = {k: v[keep.to(v.device)] for k, v in text_reps.items()}
        owner = caption_image[keep].to(dev)
        glob = self.global_scores(img, txt)
        nla = self.nla_scores(img, txt).to(glob.dtype)
        results = {b: mean_recall(glob + b * nla, owner) for b in grid}
        best = max(results, key=lambda b: (results[b], -b))
        self.beta.fill_(best)
        return {"beta": best, "val_recall_mean": results[best],
                "val_recall_mean_global_only": mean_recall(glob, owner)}
