"""SmartCLIP head: a caption-conditioned binary mask over the embedding dimensions (SmartCLIP paper §5).

A caption usually names only some of the concepts in its image, so SmartCLIP aligns the caption with the
*part* of the image embedding its concepts occupy: a mask network reads the caption's token states and
chooses dimensions ``m(t) in {0, 1}^D``, and the image embedding is compared only on those
(SmartCLIP paper §3 eq. 1, §5 eq. 5-7):

    score(i, j) = cos(z_I^(i) * m(z_T^(j)), z_T^(j))

The text side is not masked: in the data-generating model the caption *is* the masked image latent
(``z_T := m * z_I``, §3), so the mask selects the image dimensions to match against the whole caption.

Mask network (§5 "Modular alignment through adaptive masking" and §6.1 "Implementation details"): one
transformer block over the text token states (padding masked in attention), attention pooling to the
embedding width, sigmoid, and a straight-through estimator [Bengio et al. 2013] to binarise:
``hard = (m >= 0.5) - m.detach() + m`` (value 0/1, gradient of the sigmoid).

Loss (eq. 9): ``lambda_align * (L_ctrI + L_ctrT) + lambda_sparsity * L_sparsity`` where L_ctrI is the
cross-entropy of each image over all texts, each text with its own mask (eq. 6), and L_ctrT that of each
text over all images under that text's mask (eq. 7) — the columns of the same score matrix — and
L_sparsity the L1 norm of the mask (eq. 8), taken as a mean over dimensions (see ``Config``).

Frozen mode (the default here): the mask network plus light residual projections of the cached global
embeddings train on cached features. ``--unfreeze`` (the official recipe) fine-tunes the whole backbone;
the training loop decides how to run it (class attributes below), this head only needs the same arrays
computed live, with gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.losses import contrastive
from adapters.heads.base import AdapterHead, Reps
from adapters.heads.layers import ResidualLinear
from adapters.registry import ADAPTERS


@dataclass
class SmartCLIPConfig:
    """SmartCLIP hyper-parameters. Defaults: the official code's settings where they exist (the official
    code: lambda_sparse 2, lambda_align 10, logit scale 100; SmartCLIP paper §6.1: one block).

    The sparsity term is the *mean* |m| over dimensions (eq. 8 writes the L1 norm; with the sum, lambda 2
    over 512 dimensions would outweigh the alignment term ~100x, and the weight would depend on the width).
    ``mask_init_logit``: the mask network's last layer starts with zero weights and this bias, so every
    caption's mask keeps every dimension (sigmoid(2) = 0.88 >= 0.5) and the untrained head scores exactly
    like the base model (with ``project``'s identity-initialised projections); training then moves the mask
    away from all-ones (a zero-initialised last layer still gets a gradient, so nothing is stuck).
    """

    lambda_align: float = field(default=10.0, metadata={"help": "weight of the modular contrastive loss (eq. 9)"})
    lambda_sparsity: float = field(default=2.0, metadata={"help": "weight of the mask sparsity mean |m| (eq. 8-9)"})
    logit_scale: float = field(default=100.0, metadata={"help": "fixed inverse temperature 1/tau of eq. 3"})
    heads: int = field(default=0, metadata={"help": "attention heads of the mask network (0: embed_dim // 64)"})
    mlp_ratio: float = field(default=4.0, metadata={"help": "MLP width of the mask block / embed_dim"})
    mask_init_logit: float = field(default=2.0, metadata={
        "help": "initial mask logit of every dimension (> 0: all kept, the untrained head scores like the base)"})
    project: bool = field(default=True, metadata={
        "help": "light residual projections of the global embeddings (identity at init)"})
    eps: float = field(default=1e-6, metadata={"help": "norm floor of the masked cosine"})


def _heads(dim: int, heads: int) -> int:
    h = heads or max(1, dim // 64)
    if dim % h:
        raise ValueError(f"embed_dim {dim} is not divisible by heads={h}")
    return h


class _Attention(nn.Module):
    """Multi-head attention with a key padding mask, on scaled_dot_product_attention (fused kernels on GPU)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, query: Tensor, x: Tensor, key_mask: Tensor) -> Tensor:
        """query [B, Q, D], x [B, L, D], key_mask [B, L] bool (True = real token) -> [B, Q, D]."""
        b, q_len, d = query.shape
        h = self.heads
        q = self.q(query).view(b, q_len, h, d // h).transpose(1, 2)
        k, v = self.kv(x).view(b, x.shape[1], 2, h, d // h).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        return self.out(o.transpose(1, 2).reshape(b, q_len, d))


class MaskNetwork(nn.Module):
    """Token states [B, L, D] + mask [B, L] -> mask logits [B, D] (SmartCLIP paper §6.1: one pre-norm
    transformer block, then attention pooling with one learnt query down to the embedding width)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, init_logit: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(round(dim * mlp_ratio))
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.norm_pool = nn.LayerNorm(dim)
        # 1-D like open_clip's class embedding, so the default param groups leave it out of weight decay
        self.pool_query = nn.Parameter(torch.randn(dim) * dim ** -0.5)
        self.pool = _Attention(dim, heads)
        self.to_logits = nn.Linear(dim, dim)
        # Zero weights + constant bias: every caption starts with the same all-keep mask (see Config).
        nn.init.zeros_(self.to_logits.weight)
        nn.init.constant_(self.to_logits.bias, init_logit)

    def forward(self, tokens: Tensor, token_mask: Tensor) -> Tensor:
        mask = token_mask.to(torch.bool)
        # A row without any real token (cannot come from the tokenizer, which always emits start/end of text)
        # would make the softmax 0/0; let it attend to position 0 instead of producing NaN.
        mask = mask | (~mask.any(-1, keepdim=True) & (torch.arange(mask.shape[1], device=mask.device) == 0))
        x = tokens
        h = self.norm1(x)
        x = x + self.attn(h, h, mask)
        x = x + self.mlp(self.norm2(x))
        pooled = self.pool(self.pool_query.to(x.dtype).expand(len(x), 1, -1), self.norm_pool(x), mask)
        return self.to_logits(pooled[:, 0])


def straight_through(probs: Tensor) -> Tensor:
    """Binarise at 0.5 in the forward pass, identity gradient in the backward pass (straight-through)."""
    return (probs >= 0.5).to(probs.dtype) - probs.detach() + probs


def masked_cosine(image: Tensor, text: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """cos(image_i * mask_j, text_j) for every (i, j): [I, T], without materialising [I, T, D].

    <z_I * m_j, z_T_j> = z_I @ (m_j * z_T_j) is one matmul; ||z_I * m_j||^2 = (z_I^2) @ (m_j^2)^T another.
    image [I, D], text [T, D], mask [T, D]; computed in fp32 at least (autocast off) so the scores are exact
    and identical under any training precision.
    """
    with torch.autocast(device_type=image.device.type, enabled=False):
        dtype = torch.promote_types(image.dtype, torch.float32)
        image, text, mask = image.to(dtype), text.to(dtype), mask.to(dtype)
        num = image @ (mask * text).T
        image_norm = ((image * image) @ (mask * mask).T).clamp_min(0).sqrt()
        text_norm = text.norm(dim=-1)
        return num / (image_norm.clamp_min(eps) * text_norm.clamp_min(eps)[None, :])


@ADAPTERS.register("smartclip")
class SmartCLIPHead(AdapterHead):
    """SmartCLIP on cached (frozen) features, or on live ones from a trainable backbone (``--unfreeze``).

    Inputs: ``image_embed [B, D]``; ``text_embed [B, D]``, ``token_embed [B, L, D]`` (joint-space token
    states) + ``token_mask [B, L]``. Any float dtype, with or without gradients (nothing is detached or
    modified in place), so a fine-tuned backbone can feed it directly.
    Reps: image ``{"embed": [I, D] unit}``; text ``{"embed": [T, D] unit, "mask": [T, D] in {0, 1}}``
    (the mask carries the straight-through gradient in training).
    """

    Config: ClassVar[type] = SmartCLIPConfig
    components: ClassVar[tuple[str, ...]] = ("tokens",)
    image_keys: ClassVar[tuple[str, ...]] = ("image_embed",)
    text_keys: ClassVar[tuple[str, ...]] = ("text_embed", "token_embed", "token_mask")
    text_from_tokens: ClassVar[bool] = True

    #: learning rate of the head (the official mask-network lr, SmartCLIP paper §6.1)
    head_lr: ClassVar[float] = 1e-3
    #: ``--unfreeze``: the official full fine-tune. The loop unfreezes the backbone, trains it at
    #: ``backbone_lr`` and the head at ``head_lr`` (two AdamW param groups), computes this head's keys live
    #: with gradients (global embeddings and joint-space token states, as extract.models.backbone defines them) and,
    #: with ``--context-length 248``, stretches the text positions first
    #: (extract.models.long_context.extend_backbone_context). Batch 1024, one caption per image per step (§6.1).
    supports_unfreeze: ClassVar[bool] = True
    backbone_lr: ClassVar[float] = 1e-6
    unfreeze_batch_size: ClassVar[int] = 1024
    long_context_length: ClassVar[int] = 248

    def __init__(self, config: SmartCLIPConfig, embed_dim: int):
        super().__init__(config, embed_dim)
        d = embed_dim
        self.mask_net = MaskNetwork(d, _heads(d, config.heads), config.mlp_ratio, config.mask_init_logit)
        self.image_proj = ResidualLinear(d) if config.project else nn.Identity()
        self.text_proj = ResidualLinear(d) if config.project else nn.Identity()

    @property
    def _dtype(self) -> torch.dtype:
        return self.mask_net.to_logits.weight.dtype

    # -- encoders ----------------------------------------------------------------------------------------
    def encode_image(self, batch: dict[str, Tensor]) -> Reps:
        z = self.image_proj(batch["image_embed"].to(self._dtype))
        return {"embed": F.normalize(z, dim=-1)}

    def mask_probs(self, batch: dict[str, Tensor]) -> Tensor:
        """sigmoid of the mask logits [B, D] (before binarisation), for analysis."""
        tokens = batch["token_embed"].to(self._dtype)
        return torch.sigmoid(self.mask_net(tokens, batch["token_mask"]))

    def encode_text(self, batch: dict[str, Tensor]) -> Reps:
        z = self.text_proj(batch["text_embed"].to(self._dtype))
        return {"embed": F.normalize(z, dim=-1), "mask": straight_through(self.mask_probs(batch))}

    # -- scores --------------------------------------------------------------------------------------------
    def score(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        """Exact [I, T] masked cosines cos(z_I^(i) * m_j, z_T^(j)) (eq. 5-7's sim)."""
        return masked_cosine(image_reps["embed"], text_reps["embed"], text_reps["mask"], self.config.eps)

    def logits(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        return self.config.logit_scale * self.score(image_reps, text_reps)

    def first_stage_image(self, image_reps: Reps, direction: str = "t2i") -> Tensor:
        """[I, D] vectors to index for inner-product search (unit z_I), either direction."""
        return image_reps["embed"]

    def first_stage_text(self, text_reps: Reps, direction: str = "t2i") -> Tensor:
        """[T, D] q_j = m_j * z_T^(j) (z_T unit) for an inner-product first stage, either direction.

        <z_I, q_j> = score(i, j) * ||z_I * m_j|| / ||z_I||: the exact score times the share of the image's
        norm on the text's dimensions (at most 1), so a text's candidate images are found by inner product
        (FAISS) and re-ranked with :meth:`score` on the top k.
        """
        return text_reps["mask"].to(text_reps["embed"].dtype) * text_reps["embed"]

    # -- objective -----------------------------------------------------------------------------------------
    def loss(self, image_reps: Reps, text_reps: Reps, *, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
        """eq. 9 on the global batch. On many ranks, features are gathered with gradients and each rank
        scores its own rows (images vs all texts) and columns (its texts' masks on all images); the mean of
        the ranks' losses (DDP's gradient average) equals one process's loss on the global batch."""
        cfg = self.config
        z_i, z_t, m = image_reps["embed"], text_reps["embed"], text_reps["mask"]
        g = lambda x: contrastive.gather(x, rank, world_size, with_grad=True)  # noqa: E731
        all_i, all_t, all_m = g(z_i), g(z_t), g(m)
        labels = contrastive.local_rows(len(z_i), rank, world_size, z_i.device)
        # rows (L_ctrI, eq. 6): my images against every text, each under its own mask
        rows = cfg.logit_scale * masked_cosine(z_i, all_t, all_m, cfg.eps)
        # columns (L_ctrT, eq. 7): my texts' masks applied to every image -> transpose to [b, B]
        cols = cfg.logit_scale * masked_cosine(all_i, z_t, m, cfg.eps).T
        ctr_i = F.cross_entropy(rows, labels)
        ctr_t = F.cross_entropy(cols, labels)
        sparsity = m.float().abs().mean()  # eq. 8 (the binary mask's value, the sigmoid's gradient)
        total = cfg.lambda_align * (ctr_i + ctr_t) + cfg.lambda_sparsity * sparsity
        # "sparsity" is also the share of dimensions kept (the mask is binary)
        return {"loss": total, "ctr_image": ctr_i.detach(), "ctr_text": ctr_t.detach(), "sparsity": sparsity.detach()}
