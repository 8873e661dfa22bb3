"""PowerCLIP NLA head: powerset alignment of image regions and phrase-tree nodes on cached features.

PowerCLIP (PowerCLIP paper §3-4) pre-trains CLIP with an extra loss that aligns every subset of image regions
with every node of the caption's parse tree. This head brings that objective to a frozen backbone: light
trainable towers over the cached embeddings are trained with

    loss = CLIP(global image, global text) + lam * [triplet(S) + triplet(S^T)]       (§3.4 eq. 8, §4.4 eq. 16)

where S_ij = w_t2r * NLA-T1_ij + w_r2t * NLA-T2_ij approximates T2R / R2T (eq. 6-7) in time linear in the
number of regions (adapters/losses/nla.py). Embeddings follow §3.2-3.3:

- region r_m = normalise(mean of the tower's patch outputs inside region mask m) (eq. 2), masks from the cache
  (random boxes = PowerCLIP-R, ground-truth boxes, or SAM2 masks = PowerCLIP-S, on the patch grid);
- leaf = normalise(mean of the tower's token outputs over the leaf phrase) (eq. 4), node p_B = sum of its
  leaves (supplement eq. 18), trees from the cache (spaCy, extract/components/text.py).

**One tower per modality makes the global embedding and the regions / phrases** (``tower``). In the paper both
losses train one encoder, whose output is the global embedding as well as the patch / token embeddings the
regions and phrases pool (§3.1 "Architecture", §3.2 eq. 2: masks are applied to the embeddings of the entire
image), so the powerset loss shapes the embedding retrieval ranks by. On a frozen backbone the trainable part is
the head, so the head is built the same way: the cached global embedding and the cached patch (token)
embeddings -- which live in the same joint space, the global being the same final projection of the class
(end-of-text) token -- go through the same parameters:

- ``block`` (default): a pre-norm transformer block over [global; patches] (or [global; tokens]) before one
  residual projection ``x + W x``, the closest we get on cached features to training the encoder's last block
  (the backbone's own blocks cannot be unfrozen on the cache: it holds features after the final projection);
- ``shared``: that residual projection alone, applied to the global embedding and to every patch / token; the
  triplet term's gradient reaches W and so the global embedding;
- ``separate``: the first version of this head, kept to load its checkpoints and as the measured control:
  independent projections for the global and the local path, so the triplet term never reaches the global.

Every trainable output layer starts at zero, so an untrained head computes everything from the base model's
own embeddings (its score is the base CLIP score plus ``beta`` x S).

Measured on the demo's toy world (CLIP-pre-trained tiny base, 3 seeds, 95% bootstrap intervals; train/adapter/README, "The long run"):
``block`` lifts retrieval (T2I R@1 +2.7, I2T R@1 +10.8, relation captions +4.0 mAP) where ``shared`` and
``separate`` do not, which is why it is the default; but the same block trained with the CLIP term alone
(``lam = 0``) lifts it as much (+3.3, +13.3, +4.1), and the fitted ``beta`` is 0: the powerset term adds nothing
measurable on a frozen backbone. Its regions pool the backbone's patch tokens, which nothing in CLIP's loss
aligns with text (train.eval.heatmaps: raw patch-token maps of that base localise 29% of objects, below a
uniform map), so S has no aligned local evidence to work with; in the paper the same loss trains the encoder
that makes the patch tokens (``python -m train.pretrain --method powerclip``).

**Negatives of the triplet** (eq. 9): the paper's hardest negative (VSE++) is preceded by
``warmup_negatives_steps`` steps of ``warmup_negatives`` (sum over all negatives by default, VSE++'s own
warm-up). Started from an untrained local path, the hardest negative alone collapses S (every pair scored alike:
the loss sits at twice the margin); in data where a caption is true of several images of a batch (toy-world one-object captions, COCO's
generic captions) the hardest "negative" is often a true match that no margin can separate. ``semihard`` takes
the hardest negative that still scores below the positive instead. The step count is a buffer saved with the
weights, so a resumed run continues the same schedule.

Score (what evaluation ranks by), precisely:

    score(i, j) = <g_I^(i), g_T^(j)> + beta * S_ij / (M_i * mean node size_j)

the global cosine (g = normalised tower outputs of the global embeddings; the base CLIP score at init) plus beta
times the same S the triplet loss trains, on the loss's normalised scale (adapters.losses.nla.pair_scale): S grows
with the number of valid regions M_i and with the leaf counts of the nodes, and dividing by them makes it a
mean of (soft-relu'd) region-leaf cosines, on the scale of the global cosine. beta = 1 (equal weight on two
unit-scale terms) until :meth:`fit_inference` picks it on a held-out split from ``beta_grid`` by recall and the
mAP of each image's own captions (adapters.eval.fit; 0 included, so the fitted head is never worse there than its
global term alone); at ``lam = 0`` (nothing trains S) it is 0. The fitted value is a buffer, saved with the
weights. Serving's first stage is the global term (``first_stage_image`` / ``first_stage_text``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.heads.base import AdapterHead, Reps
from adapters.heads.layers import ResidualLinear
from adapters.eval.fit import fit_objective
from adapters.losses.nla import (NLAConfig, PowerCLIPLoss, PowerCLIPLossConfig, combined_similarity, leaf_embeddings,
                          node_embeddings, region_embeddings)
from adapters.registry import ADAPTERS

#: elements of one [images x texts x M x K] block in :meth:`PowerCLIPHead.nla_scores` (~64 MiB of fp32)
_BLOCK_ELEMENTS = 1 << 24
TOWERS = ("shared", "block", "separate")
NEGATIVES = ("hardest", "semihard", "sum")


def _used(mask: Tensor) -> int:
    """1 + the last slot (dim 1) of ``mask [B, S, ...]`` that any item uses; at least 1."""
    used = mask.reshape(mask.shape[0], mask.shape[1], -1).any(-1).any(0)
    return int(used.nonzero().max()) + 1 if bool(used.any()) else 1


@dataclass
class PowerCLIPHeadConfig:
    """Head + loss settings. Loss defaults are the paper's (PowerCLIP paper §5.1, supplement App. F: lam 0.1,
    softplus / tanh NLAs, tau 0.01, alpha 0.75, hardest negative); margin, weights and normalisation as in
    adapters.losses.nla.PowerCLIPLossConfig (the margin is on the normalised scale of S). The logit scale starts at
    100, the value CLIP backbones end pre-training at, and is learnt, capped at 100 like open_clip's.
    """

    tower: str = field(default="block", metadata={
        "choices": TOWERS, "help": "trainable part per modality: one residual projection shared by the global "
                                   "embedding and the patches / tokens (shared), a transformer block over [global; "
                                   "locals] before it (block), or independent global and local projections "
                                   "(separate: the first version)"})
    lam: float = field(default=0.1, metadata={"help": "weight of the NLA triplet loss (eq. 16)"})
    margin: float = field(default=0.2, metadata={"help": "triplet margin on the normalised S (eq. 9)"})
    w_t2r: float = field(default=0.5, metadata={"help": "weight of NLA-T1 (T2R) in S"})
    w_r2t: float = field(default=0.5, metadata={"help": "weight of NLA-T2 (R2T) in S"})
    negatives: str = field(default="hardest", metadata={
        "choices": NEGATIVES, "help": "triplet negatives after the warm-up: the hardest, the hardest below the "
                                      "positive (semihard), or the sum over all"})
    warmup_negatives: str = field(default="sum", metadata={
        "choices": NEGATIVES, "help": "triplet negatives during the first --warmup-negatives-steps training steps"})
    warmup_negatives_steps: int = field(default=100, metadata={
        "help": "training steps on --warmup-negatives before --negatives (0: none)"})
    normalize: bool = field(default=True, metadata={"help": "divide S by M_i x mean node size_j"})
    tau_t1: float = field(default=0.01, metadata={"help": "NLA-T1 temperature"})
    tau_t2: float = field(default=0.01, metadata={"help": "NLA-T2 temperature"})
    alpha: float = field(default=0.75, metadata={"help": "NLA-T2 interpolation between R2T's bounds"})
    chunk_size: int = field(default=64, metadata={"help": "images per block of the pair similarities"})
    logit_scale: float = field(default=100.0, metadata={"help": "initial CLIP inverse temperature (cap 100)"})
    learn_logit_scale: bool = field(default=True, metadata={"help": "learn the CLIP logit scale"})
    beta: float = field(default=1.0, metadata={"help": "score = global cosine + beta x normalised S (before fitting)"})
    fit_beta: bool = field(default=True, metadata={"help": "fit beta on the held-out split after training"})
    beta_grid: str = field(default="0,0.1,0.25,0.5,1,2,4", metadata={"help": "comma list of betas to try"})
    fit_max_images: int = field(default=2000, metadata={"help": "held-out images used to fit beta"})

    def __post_init__(self):
        for name, allowed in (("tower", TOWERS), ("negatives", NEGATIVES), ("warmup_negatives", NEGATIVES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"powerclip: {name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.warmup_negatives_steps < 0:
            raise ValueError(f"powerclip: warmup_negatives_steps must be >= 0, got {self.warmup_negatives_steps}")

    def betas(self) -> list[float]:
        try:
            return sorted(float(b) for b in str(self.beta_grid).split(",") if b.strip())
        except ValueError:
            raise ValueError(f"beta_grid must be a comma list of numbers, got {self.beta_grid!r}") from None


class ContextBlock(nn.Module):
    """Pre-norm transformer block over [global; locals] whose output layers start at zero (the identity at init).

    forward(glob [B, D], local [B, N, D], valid [B, N] bool | None) -> (glob [B, D], local [B, N, D]); invalid
    locals are never attended to (their own outputs are meaningless and must stay masked downstream).
    """

    def __init__(self, dim: int):
        super().__init__()
        self.ln_attn, self.ln_mlp = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, max(1, dim // 64), batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        for layer in (self.attn.out_proj, self.mlp[2]):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, glob: Tensor, local: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        x = torch.cat([glob[:, None, :], local], dim=1)
        pad = None
        if valid is not None:
            pad = ~torch.cat([torch.ones_like(valid[:, :1], dtype=torch.bool), valid.to(torch.bool)], dim=1)
        h = self.ln_attn(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        x = x + self.mlp(self.ln_mlp(x))
        return x[:, 0], x[:, 1:]


class Tower(nn.Module):
    """One modality's trainable part: (global [B, D], locals [B, N, D], valid [B, N]) -> the same shapes, the
    global and the locals through the same parameters (an optional :class:`ContextBlock`, then one
    :class:`ResidualLinear`), so a loss on the locals moves the global embedding too."""

    def __init__(self, dim: int, block: bool):
        super().__init__()
        self.block = ContextBlock(dim) if block else None
        self.proj = ResidualLinear(dim)

    def forward(self, glob: Tensor, local: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if self.block is not None:
            glob, local = self.block(glob, local, valid)
        return self.proj(glob), self.proj(local)


class _Separate(nn.Module):
    """The first version's towers: independent residual projections of the global and the local embeddings."""

    def __init__(self, dim: int):
        super().__init__()
        self.glob, self.local = ResidualLinear(dim), ResidualLinear(dim)

    def forward(self, glob: Tensor, local: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.glob(glob), self.local(local)


@ADAPTERS.register("powerclip")
class PowerCLIPHead(AdapterHead):
    """PowerCLIP's powerset alignment as an adapter head (see the module docstring).

    Inputs per image: ``image_embed [B, D]``, ``patch_tokens [B, N, D]``, ``region_masks [B, M, rows, cols]``
    (rows * cols = N), ``region_valid [B, M]``. Per caption: ``text_embed [B, D]``, ``token_embed [B, L, D]`` +
    ``token_mask [B, L]``, ``leaf_tokens [B, P, L']`` (L' may differ from L by padding), ``node_leaves
    [B, K, P]``, ``n_nodes [B]``.
    Reps (first dim = items, chunkable): image ``{"global": [I, D] unit, "regions": [I, M, D] unit,
    "region_mask": [I, M] bool}``; text ``{"global": [T, D] unit, "nodes": [T, K, D], "node_mask": [T, K]
    bool, "node_sizes": [T, K] float (leaves per node)}``. K is trimmed to the batch's largest tree.
    """

    Config: ClassVar[type] = PowerCLIPHeadConfig
    components: ClassVar[tuple[str, ...]] = ("patches", "tokens", "tree", "regions")
    image_keys: ClassVar[tuple[str, ...]] = ("image_embed", "patch_tokens", "region_masks", "region_valid")
    text_keys: ClassVar[tuple[str, ...]] = ("text_embed", "token_embed", "token_mask", "leaf_tokens",
                                            "node_leaves", "n_nodes")
    #: the cache's region defaults (random boxes, M = 10) are the paper's PowerCLIP-R setting (§5.1); pass
    #: ``--regions sam2`` (PowerCLIP-S) or ``gt`` to the extraction for the others.
    extract_options: ClassVar[dict] = {}
    #: ``--unfreeze``: the head *and* the backbone trained with the powerset loss, as in the paper, where eq. 16
    #: trains the encoder that makes the patch tokens the regions pool (§3.1, §3.4); on the cache it cannot reach them
    #: (module docstring). The backbone's patch / token states are computed with gradients, the region masks and
    #: phrase trees per batch from the data (train.adapter.live.DataArrays), the backbone at ``backbone_lr``.
    supports_unfreeze: ClassVar[bool] = True
    backbone_lr: ClassVar[float] = 1e-5

    def __init__(self, config: PowerCLIPHeadConfig, embed_dim: int):
        super().__init__(config, embed_dim)
        d = embed_dim
        if config.tower == "separate":
            self.image_tower, self.text_tower = _Separate(d), _Separate(d)
        else:
            self.image_tower, self.text_tower = Tower(d, config.tower == "block"), Tower(d, config.tower == "block")
        self.log_logit_scale = nn.Parameter(torch.tensor(math.log(config.logit_scale)),
                                            requires_grad=config.learn_logit_scale)
        self.register_buffer("beta", torch.tensor(float(config.beta)))
        #: training steps taken (loss evaluations with gradients in train mode): drives the negatives' warm-up
        self.register_buffer("triplet_step", torch.zeros((), dtype=torch.long))

    @classmethod
    def from_config(cls, config: dict | None, embed_dim: int) -> "PowerCLIPHead":
        """As :meth:`AdapterHead.from_config`; a configuration written by the first version of this head (it has
        ``hardest`` and ``project_global`` keys) is read as ``tower="separate"`` with its negatives, no warm-up."""
        config = dict(config or {})
        if "hardest" in config or "project_global" in config:
            if not config.pop("project_global", True):
                raise ValueError("powerclip: this checkpoint was trained by the first version of the head with "
                                 "project_global=False, which no longer exists; retrain it (python -m train.adapter "
                                 "--method powerclip)")
            config.setdefault("tower", "separate")
            config.setdefault("negatives", "hardest" if config.pop("hardest", True) else "sum")
            config.setdefault("warmup_negatives_steps", 0)
        return super().from_config(config, embed_dim)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The first version's weights: other names, and no step counter (it was trained without a warm-up).
        renames = {"image_proj.": "image_tower.glob.", "patch_proj.": "image_tower.local.",
                   "text_proj.": "text_tower.glob.", "token_proj.": "text_tower.local."}
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rest = key[len(prefix):]
            for old, new in renames.items():
                if self.config.tower == "separate" and rest.startswith(old):
                    state_dict[prefix + new + rest[len(old):]] = state_dict.pop(key)
        if self.config.tower == "separate" and prefix + "image_tower.glob.linear.weight" in state_dict:
            state_dict.setdefault(prefix + "triplet_step", torch.zeros((), dtype=torch.long))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def _dtype(self) -> torch.dtype:
        return self.log_logit_scale.dtype

    def in_warmup(self) -> bool:
        return int(self.triplet_step) < self.config.warmup_negatives_steps

    @property
    def loss_config(self) -> PowerCLIPLossConfig:
        """The loss settings of the current training step (the negatives follow the warm-up schedule)."""
        c = self.config
        negatives = c.warmup_negatives if self.in_warmup() else c.negatives
        return PowerCLIPLossConfig(lam=c.lam, margin=c.margin, w_t2r=c.w_t2r, w_r2t=c.w_r2t,
                                   hardest=negatives != "sum", semihard=negatives == "semihard",
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
        masks = batch["region_masks"]
        b, m = masks.shape[:2]
        masks = masks.reshape(b, m, -1).to(torch.bool)
        if masks.shape[-1] != batch["patch_tokens"].shape[1]:
            raise ValueError(f"region masks cover {masks.shape[-1]} cells but there are "
                             f"{batch['patch_tokens'].shape[1]} patch tokens: the masks were built for another "
                             "backbone's patch grid")
        g, patches = self.image_tower(batch["image_embed"].to(self._dtype), batch["patch_tokens"].to(self._dtype))
        if "region_valid" in batch:
            masks = masks & batch["region_valid"].to(torch.bool)[:, :, None]
        regions, valid = region_embeddings(patches, masks)  # eq. 2; an empty mask is invalid
        return {"global": F.normalize(g, dim=-1), "regions": regions, "region_mask": valid}

    def encode_text(self, batch: dict[str, Tensor]) -> Reps:
        token_mask = batch["token_mask"].to(torch.bool)
        g, tokens = self.text_tower(batch["text_embed"].to(self._dtype), batch["token_embed"].to(self._dtype),
                                    token_mask)
        length = tokens.shape[1]
        leaf_tokens = batch["leaf_tokens"].to(torch.bool)
        # leaf_tokens and token_embed are padded separately (per cache shard / batch): align them on L.
        if leaf_tokens.shape[-1] < length:
            leaf_tokens = F.pad(leaf_tokens, (0, length - leaf_tokens.shape[-1]))
        leaf_tokens = leaf_tokens[..., :length] & token_mask[:, None, :]
        node_leaves = batch["node_leaves"].to(torch.bool)
        if "n_nodes" in batch:
            k = torch.arange(node_leaves.shape[1], device=node_leaves.device)
            node_leaves = node_leaves & (k[None, :] < batch["n_nodes"].to(k.device)[:, None])[:, :, None]
        # The cache pads every tree to max_leaves (24 by default) and most captions are short: pool only the leaf
        # slots some caption of this batch uses (exact: padding never counts).
        p = _used(leaf_tokens.any(-1) | node_leaves.any(1))
        leaf_tokens, node_leaves = leaf_tokens[:, :p], node_leaves[:, :, :p]
        leaves, leaf_valid = leaf_embeddings(tokens, leaf_tokens)  # eq. 4
        node_leaves = node_leaves & leaf_valid[:, None, :]
        nodes = node_embeddings(leaves, node_leaves)  # p_B = sum of leaves (supplement eq. 18)
        return {"global": F.normalize(g, dim=-1), "nodes": nodes, "node_mask": node_leaves.any(-1),
                "node_sizes": node_leaves.sum(-1).to(leaves.dtype)}

    # -- scores ------------------------------------------------------------------------------------------
    @staticmethod
    def _nodes(text_reps: Reps) -> tuple[Tensor, Tensor, Tensor]:
        """(nodes, node_mask, node_sizes) without the node slots no text uses: reps keep the cache's padded K
        (47 by default) so that chunks concatenate, while the NLA's cost grows with K."""
        k = _used(text_reps["node_mask"])
        return text_reps["nodes"][:, :k], text_reps["node_mask"][:, :k], text_reps["node_sizes"][:, :k]

    def nla_scores(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        """[I, T] normalised S = (w_t2r NLA-T1 + w_r2t NLA-T2) / (M_i * mean node size_j), in blocks of texts
        (images are chunked inside adapters.losses.nla.pair_similarities), so memory stays bounded for any I, T."""
        cfg = self.loss_config
        regions, rmask = image_reps["regions"], image_reps["region_mask"]
        nodes, nmask, sizes = self._nodes(text_reps)
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

    def logits(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        """What ``--hard-negatives``' extra columns rank by: the learnt scale times the global cosine, CLIP's own
        logits. NegCLIP's negatives extend the CLIP term of eq. 16, so S is trained by the powerset term alone and
        ``lam = 0`` (the fine-tune's control) leaves it without gradient, with hard negatives too. Through
        :meth:`score` (+ beta x S, beta = 1 before fitting) they trained S at CLIP's logit scale (100), in the
        control as in the fine-tune, where the powerset term weighs lam = 0.1: the two could not differ."""
        return self.logit_scale() * self.global_scores(image_reps, text_reps)

    # -- objective ---------------------------------------------------------------------------------------
    def loss(self, image_reps: Reps, text_reps: Reps, *, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
        """CLIP + lam x bidirectional triplet on S (eq. 16), over the global batch (gathered inside
        adapters.losses.nla.PowerCLIPLoss when world_size > 1), with the current step's negatives (warm-up). A call
        with gradients in train mode counts as a training step."""
        loss_fn = PowerCLIPLoss(self.loss_config, rank=rank, world_size=world_size)
        nodes = self._nodes(text_reps) if world_size == 1 else (  # ranks gather nodes: equal shapes everywhere
            text_reps["nodes"], text_reps["node_mask"], text_reps["node_sizes"])
        out = loss_fn(image_reps["global"], text_reps["global"], self.logit_scale(), image_reps["regions"],
                      image_reps["region_mask"], *nodes)
        out["logit_scale"] = self.logit_scale().detach()
        if self.training and torch.is_grad_enabled():
            self.triplet_step += 1
        return out

    @torch.no_grad()
    def fit_inference(self, image_reps: Reps, text_reps: Reps, caption_image: Tensor) -> dict[str, float]:
        """Pick beta from ``beta_grid`` maximising :func:`adapters.eval.fit.fit_objective` over both directions
        (mean R@1/5/10, and the mAP of each image's own captions) on a held-out split (ties: the smaller beta).
        Uses the first ``fit_max_images`` images and their captions.

        At ``lam = 0`` beta is 0, not fitted: the head was trained by the CLIP term alone (the fine-tune's control),
        so S is nothing the loss shaped, and a control that weighs it is scored unlike the method it controls (on
        the hard world an untrained S weighed 0.1 cost 6-8 points of I2T mAP and add-obj; train/adapter/powerclip.md, "The
        control's fitted beta"). ``--beta B --no-fit-beta`` still weighs it when asked. Returns what was fitted: at
        ``lam = 0`` nothing (beta is set, and a log saying "fitted" would misreport the control)."""
        cfg = self.config
        grid = cfg.betas()
        if not cfg.fit_beta or not grid:
            return {}
        if cfg.lam == 0:
            self.beta.fill_(0.0)
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
        results = {b: fit_objective(glob + b * nla, owner, "both") for b in grid}
        best = max(results, key=lambda b: (results[b], -b))
        self.beta.fill_(best)
        global_only = results[0.0] if 0.0 in results else fit_objective(glob, owner, "both")  # glob + 0 * S == glob
        return {"beta": best, "val_objective": results[best], "val_objective_global_only": global_only}
