"""ComAlign (Abdollah et al. 2024, §III): contextualise entity, relation and global
components of each modality with a small transformer, then align them component type by component type.

Inputs (cached by ``python -m extract``, §III-A/B): per image the frozen backbone's embeddings of up to E entity
crops and R relation crops (union boxes of entity pairs) plus the whole image; per caption the embeddings of up
to E spaCy entities (noun with its adjectives, and the bare noun), R relation triplets, and the whole caption.
Every component embedding is the backbone's normalised global embedding of that crop / phrase.

Architecture (§III-B, eq. 1): per modality an encoder over the sequence [entities; relations; global] with
sinusoidal positional encoding (Vaswani et al. 2017, §IV-A "as described in [29]"); padded components are
masked out of attention and out of every similarity. Our encoder is a pre-LN transformer whose output enters
through a zero-initialised projection added to the input component (``residual=True``): an untrained head is
exactly the identity, so training starts from the base model's own component similarities instead of from a
random map that would first have to re-learn CLIP's alignment from 80k pairs. ``residual=False`` gives the
plain transformer output.

Similarities (eq. 2-5), all on L2-normalised outputs:
  FGM(X, Y) = (1/|X|) sum_{x in X} max_{y in Y} <x, y>  over valid items (FILIP's token-wise max-mean);
  entity:   s^E_I2T(i, j) = FGM(V^E_i, T^E_j),  s^E_T2I(i, j) = FGM(T^E_j, V^E_i)   (eq. 3; relations eq. 4 alike)
  global:   s^G(i, j) = <v^G_i, t^G_j>                                              (eq. 5)
A set with no valid item contributes 0 (no evidence either way) instead of a max over nothing.

Loss (eq. 6-9): for every component type c in {E, R, G} a contrastive cross-entropy over the batch, image->text
with s^c_I2T (eq. 6) and text->image with s^c_T2I (eq. 7), softmax with a learnt temperature (eq. 8);
L = (L_I2T + L_T2I) / 2 with L_dir = sum_c w_c L^c_dir (eq. 9; the weights w_c are the paper's loss-term
ablation, Table III, and its "coefficient of the coarse-grained loss", Fig. 7). An anchor whose own or
positive component set is empty carries no evidence for that type and is left out of that term's mean.

Inference (eq. 10-11): S_T2I = a_E s^E_T2I + a_R s^R_T2I + a_G s^G + a_B <base_i, base_j>;
S_I2T = b_E s^E_I2T + b_R s^R_I2T + b_G s^G + b_B <base_i, base_j> + b_F (s^E_T2I + s^R_T2I), where base is the
frozen backbone's global embedding and the last term adds text->image fine-grained evidence to image->text
scores (§III-D: a caption does not describe everything in its image). The weights are buffers, fitted on the
validation split by :meth:`ComAlign.fit_inference` (the paper tunes them on held-out data, Appendix A, on a measure
it does not name; ours, :func:`adapters.eval.fit.fit_objective`: mean R@1/5/10, and for image->text also the mAP of
each image's own captions) and saved with the checkpoint.

``relation_geometry`` (ours, off by default): the paper's relation components are union-box crops embedded by the
frozen backbone, which carry no left/right (a CLIP embedding of the union crop is the same for "A left of B" and
"B left of A" up to what the backbone sees); this option adds the pair's box geometry and its entities in a
canonical left-to-right order (:class:`RelationGeometry`), zero-initialised.

``train`` (the paper's ablations, §IV-E trains "only the image transformer"): ``image`` / ``text`` builds and
trains only that side's encoder; the other side passes its frozen components through unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.heads.base import AdapterHead, Reps
from adapters.losses.contrastive import gather, local_rows
from adapters.eval.fit import fit_objective
from adapters.registry import ADAPTERS

TERMS = ("entity", "relation", "global")
T2I_WEIGHTS = ("entity", "relation", "global", "base")             # eq. 10
I2T_WEIGHTS = ("entity", "relation", "global", "base", "t2i_fine")  # eq. 11
FUSION_GRID = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
MAX_LOGIT_SCALE = 100.0  # CLIP's clamp on exp(logit_scale)


@dataclass
class ComAlignConfig:
    layers: int = field(default=2, metadata={"help": "transformer layers per modality (paper: 2; Table VI)"})
    heads: int = field(default=8, metadata={"help": "attention heads (must divide the embedding width)"})
    mlp_ratio: float = field(default=4.0, metadata={"help": "MLP hidden width / embedding width"})
    dropout: float = field(default=0.1, metadata={"help": "dropout in attention and MLP"})
    train: str = field(default="both", metadata={"help": "which encoders exist and train: image, text or both "
                                                         "(the other side passes its components through)"})
    residual: bool = field(default=True, metadata={"help": "output = component + zero-initialised transformer "
                                                           "branch (identity at init); off: plain transformer"})
    entity_weight: float = field(default=1.0, metadata={"help": "entity term of the loss (0 removes it from loss "
                                                                "and inference, Table III)"})
    relation_weight: float = field(default=1.0, metadata={"help": "relation term of the loss"})
    global_weight: float = field(default=1.0, metadata={"help": "global (coarse-grained) term of the loss"})
    relation_geometry: bool = field(default=False, metadata={
        "help": "give each image relation component the pair's box geometry and the ordered identities of its two "
                "entities (learned, zero-initialised; off: the paper's union-crop embedding alone)"})
    logit_scale_init: float = field(default=1 / 0.07, metadata={"help": "initial softmax scale 1/tau (CLIP's init)"})
    learn_logit_scale: bool = field(default=True, metadata={"help": "learn the scale (clamped at 100, as CLIP)"})

    def __post_init__(self):
        if self.train not in ("image", "text", "both"):
            raise ValueError(f"comalign: train must be image, text or both, got {self.train!r}")
        if self.layers < 1:
            raise ValueError("comalign: layers must be >= 1")
        if min(self.entity_weight, self.relation_weight, self.global_weight) < 0 or \
                self.entity_weight + self.relation_weight + self.global_weight <= 0:
            raise ValueError("comalign: loss weights must be >= 0 and not all 0")


def sinusoidal_positions(length: int, dim: int, device=None, dtype=torch.float32) -> Tensor:
    """[length, dim] positional encoding of Vaswani et al. 2017 §3.5: sin on even, cos on odd channels."""
    pos = torch.arange(length, device=device, dtype=torch.float64)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float64) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, dim, device=device, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return pe.to(dtype)


class _Block(nn.Module):
    """Pre-LN transformer block (fused QKV, scaled-dot-product attention with a key padding mask)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float):
        super().__init__()
        if dim % heads:
            raise ValueError(f"comalign: heads ({heads}) must divide the embedding width ({dim}); pass --heads")
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, key_valid: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=key_valid[:, None, None, :],
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.mlp(self.ln2(x))


class ComponentEncoder(nn.Module):
    """ComAlign's per-modality encoder (eq. 1): components [B, S, D] (normalised, S = E + R + 1, padding
    anywhere) with validity [B, S] -> contextualised, L2-normalised components [B, S, D]."""

    def __init__(self, dim: int, cfg: ComAlignConfig):
        super().__init__()
        self.dim, self.residual = dim, cfg.residual
        self.blocks = nn.ModuleList(_Block(dim, cfg.heads, cfg.mlp_ratio, cfg.dropout) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, dim)
        if cfg.residual:  # identity at init (module docstring)
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        # Unit-norm components have entries ~1/sqrt(D); scaling by sqrt(D) puts them on the scale of the
        # positional code (Vaswani et al. §3.4 scale embeddings by sqrt(d_model) for the same reason).
        h = x * math.sqrt(self.dim) + sinusoidal_positions(x.shape[1], self.dim, x.device, x.dtype)
        for block in self.blocks:
            h = block(h, valid)
        y = self.out(self.ln(h))
        return F.normalize(x + y if self.residual else y, dim=-1)


GEOMETRY_FEATURES = 11


def pair_geometry(boxes: Tensor, pairs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The relation components' geometry, in a canonical order (``relation_geometry``).

    boxes [B, E, 4] entity boxes (xyxy px), pairs [B, R, 2] entity indices of each relation slot -> (features
    [B, R, 11], first [B, R], second [B, R]): the two entities ordered left to right by box centre (top to bottom
    on a tie), then each box in the coordinates of the pair's union box (x0, y0, x1, y1 in [0, 1]), the centre
    offset second - first in union units (dx, dy) and log(area first / area second). The order makes "the red
    circle left of the blue square" one image component whatever order detection listed the boxes in; the union
    frame makes the features independent of the image's size."""
    idx = pairs.long().clamp_min(0)
    a = torch.gather(boxes, 1, idx[..., :1].expand(-1, -1, 4))
    b = torch.gather(boxes, 1, idx[..., 1:].expand(-1, -1, 4))
    ca, cb = (a[..., :2] + a[..., 2:]) / 2, (b[..., :2] + b[..., 2:]) / 2
    swap = (cb[..., 0] < ca[..., 0]) | ((cb[..., 0] == ca[..., 0]) & (cb[..., 1] < ca[..., 1]))
    first = torch.where(swap, idx[..., 1], idx[..., 0])
    second = torch.where(swap, idx[..., 0], idx[..., 1])
    a, b = torch.where(swap[..., None], b, a), torch.where(swap[..., None], a, b)
    lo, hi = torch.minimum(a[..., :2], b[..., :2]), torch.maximum(a[..., 2:], b[..., 2:])
    size = (hi - lo).clamp_min(1e-6)
    rel = lambda box: torch.cat([(box[..., :2] - lo) / size, (box[..., 2:] - lo) / size], -1)  # noqa: E731
    area = lambda box: ((box[..., 2:] - box[..., :2]).clamp_min(1e-6)).prod(-1)  # noqa: E731
    offset = ((b[..., :2] + b[..., 2:]) - (a[..., :2] + a[..., 2:])) / 2 / size
    feats = torch.cat([rel(a), rel(b), offset, torch.log(area(a) / area(b))[..., None]], -1)
    return feats, first, second


class RelationGeometry(nn.Module):
    """Adds to each image relation component a learned embedding of its geometry and of its ordered entities'
    crops: ``rel + G(features) + W_1 e_first + W_2 e_second`` (:func:`pair_geometry`). Without the ordered
    identities the geometry could say "one box is left of the other" but not which; every projection starts at
    zero, so an untrained head is the paper's form."""

    def __init__(self, dim: int):
        super().__init__()
        self.geometry = nn.Sequential(nn.Linear(GEOMETRY_FEATURES, dim), nn.GELU(), nn.Linear(dim, dim))
        self.first, self.second = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        for layer in (self.geometry[-1], self.first, self.second):
            nn.init.zeros_(layer.weight)
        nn.init.zeros_(self.geometry[-1].bias)

    def forward(self, rel: Tensor, entities: Tensor, boxes: Tensor, pairs: Tensor) -> Tensor:
        feats, first, second = pair_geometry(boxes.float(), pairs)
        ent = F.normalize(entities.float(), dim=-1)
        pick = lambda k: torch.gather(ent, 1, k[..., None].expand(-1, -1, ent.shape[-1]))  # noqa: E731
        return F.normalize(rel.float(), dim=-1) + self.geometry(feats) + self.first(pick(first)) + \
            self.second(pick(second))


def fgm_pair(x: Tensor, x_valid: Tensor, y: Tensor, y_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Fine-grained matching both ways between every x-set and every y-set (eq. 2-4).

    x [I, E, D], x_valid [I, E], y [J, F, D], y_valid [J, F] -> (xy [I, J], yx [I, J]) with
    xy[i, j] = FGM(x_i, y_j) = mean over valid x of the max over valid y of <x, y>, and yx[i, j] = FGM(y_j, x_i).
    Padding never enters a max or a mean; a max over an empty set and a mean over an empty set are 0.
    """
    i, e, d = x.shape
    j, f, _ = y.shape
    sims = (x.reshape(i * e, d) @ y.reshape(j * f, d).T).view(i, e, j, f)  # one GEMM for all pairs
    x_valid, y_valid = x_valid.bool(), y_valid.bool()
    # One masked copy serves both directions: a pair with an invalid side is never a max candidate, and the
    # rows of invalid items drop out of the means below. max (not amax) back-propagates through its indices,
    # which on the [I, E, J, F] tensor is much cheaper than amax's tie-splitting comparison.
    pair_ok = x_valid[:, :, None, None] & y_valid[None, None]
    masked = sims.masked_fill(~pair_ok, torch.finfo(sims.dtype).min)
    best_y = masked.max(3).values * y_valid.any(1)[None, None, :]        # [I, E, J]; no valid y: 0, not -big
    xy = (best_y * x_valid[:, :, None]).sum(1) / x_valid.sum(1).clamp_min(1)[:, None]
    best_x = masked.max(1).values * x_valid.any(1)[:, None, None]        # [I, J, F]; no valid x: 0
    yx = (best_x * y_valid[None]).sum(2) / y_valid.sum(1).clamp_min(1)[None, :]
    return xy, yx


@ADAPTERS.register("comalign")
class ComAlign(AdapterHead):
    """ComAlign head (module docstring). Reps: ``entity [B, E, D]`` + ``entity_valid``, ``relation [B, R, D]`` +
    ``relation_valid``, ``global [B, D]``, ``base [B, D]`` (the frozen global embedding), all normalised."""

    Config = ComAlignConfig
    components = ("entities", "relations")
    extract_options: dict = {}
    image_keys = ("image_embed", "ventity_embed", "ventity_valid", "vrelation_embed", "vrelation_valid",
                  "ventity_boxes", "vrelation_pairs")
    text_keys = ("text_embed", "entity_embed", "entity_valid", "relation_embed", "relation_valid")
    directional = True

    def __init__(self, config: ComAlignConfig, embed_dim: int):
        super().__init__(config, embed_dim)
        self.image_encoder = ComponentEncoder(embed_dim, config) if config.train in ("image", "both") else None
        self.text_encoder = ComponentEncoder(embed_dim, config) if config.train in ("text", "both") else None
        self.logit_scale = nn.Parameter(torch.tensor(math.log(config.logit_scale_init)),
                                        requires_grad=config.learn_logit_scale)
        self.relation_geometry = RelationGeometry(embed_dim) if config.relation_geometry else None
        # Fusion weights (eq. 10-11): a term left out of the loss is left out of inference too (Table III).
        enabled = self.enabled_terms()
        self.register_buffer("fusion_t2i", torch.tensor([float(enabled[k]) for k in T2I_WEIGHTS]))
        self.register_buffer("fusion_i2t", torch.tensor([float(enabled[k]) for k in I2T_WEIGHTS]))

    def enabled_terms(self) -> dict[str, bool]:
        """Which inference terms may carry weight: those whose similarity is trained, plus the base model's."""
        w = self.loss_weights()
        return {"entity": w["entity"] > 0, "relation": w["relation"] > 0, "global": w["global"] > 0, "base": True,
                "t2i_fine": w["entity"] > 0 or w["relation"] > 0}

    def loss_weights(self) -> dict[str, float]:
        c = self.config
        return {"entity": c.entity_weight, "relation": c.relation_weight, "global": c.global_weight}

    # -- encoders --------------------------------------------------------------------------------------
    def _encode(self, encoder, glob: Tensor, ent: Tensor, ent_valid: Tensor, rel: Tensor, rel_valid: Tensor) -> Reps:
        glob = F.normalize(glob.float(), dim=-1)
        e, r = ent.shape[1], rel.shape[1]
        x = torch.cat([ent, rel, glob[:, None]], dim=1)
        valid = torch.cat([ent_valid.bool(), rel_valid.bool(), torch.ones_like(ent_valid[:, :1], dtype=torch.bool)], 1)
        # padded slots are zeros in the cache; normalising them keeps zeros (F.normalize has an eps)
        x = F.normalize(x, dim=-1)
        y = encoder(x, valid) if encoder is not None else x
        return {"entity": y[:, :e], "entity_valid": valid[:, :e], "relation": y[:, e:e + r],
                "relation_valid": valid[:, e:e + r], "global": y[:, -1], "base": glob}

    def encode_image(self, batch: dict[str, Tensor]) -> Reps:
        rel = batch["vrelation_embed"]
        if self.relation_geometry is not None:
            rel = self.relation_geometry(rel, batch["ventity_embed"], batch["ventity_boxes"], batch["vrelation_pairs"])
        return self._encode(self.image_encoder, batch["image_embed"], batch["ventity_embed"], batch["ventity_valid"],
                            rel, batch["vrelation_valid"])

    def encode_text(self, batch: dict[str, Tensor]) -> Reps:
        return self._encode(self.text_encoder, batch["text_embed"], batch["entity_embed"], batch["entity_valid"],
                            batch["relation_embed"], batch["relation_valid"])

    # -- similarities ----------------------------------------------------------------------------------
    def similarities(self, image_reps: Reps, text_reps: Reps) -> dict[str, Tensor]:
        """Every [I, T] similarity of eq. 3-5 plus the base dot product."""
        out = {}
        for term in ("entity", "relation"):
            out[f"{term}_i2t"], out[f"{term}_t2i"] = fgm_pair(image_reps[term], image_reps[f"{term}_valid"],
                                                              text_reps[term], text_reps[f"{term}_valid"])
        out["global"] = image_reps["global"] @ text_reps["global"].T
        out["base"] = image_reps["base"] @ text_reps["base"].T
        return out

    @staticmethod
    def fuse(sims: dict[str, Tensor], weights: Tensor, direction: str) -> Tensor:
        """Eq. 10 (``t2i``, weights over T2I_WEIGHTS) or eq. 11 (``i2t``, weights over I2T_WEIGHTS)."""
        w = weights.tolist()
        if direction == "t2i":
            return w[0] * sims["entity_t2i"] + w[1] * sims["relation_t2i"] + w[2] * sims["global"] + w[3] * sims["base"]
        if direction == "i2t":
            return (w[0] * sims["entity_i2t"] + w[1] * sims["relation_i2t"] + w[2] * sims["global"]
                    + w[3] * sims["base"] + w[4] * (sims["entity_t2i"] + sims["relation_t2i"]))
        raise ValueError(f"direction must be 't2i' or 'i2t', got {direction!r}")

    def score_directed(self, image_reps: Reps, text_reps: Reps, direction: str, chunk_elements: int = 1 << 25) -> Tensor:
        """Eq. 10 / 11 scores [I, T]. Images are taken in chunks so the [I, E, T, E] component similarities stay
        under ``chunk_elements`` floats."""
        weights = self.fusion_t2i if direction == "t2i" else self.fusion_i2t
        n_img, n_txt = len(image_reps["global"]), len(text_reps["global"])
        per_image = max(1, n_txt * max(image_reps["entity"].shape[1] * text_reps["entity"].shape[1],
                                       image_reps["relation"].shape[1] * text_reps["relation"].shape[1], 1))
        step = max(1, chunk_elements // per_image)
        parts = [self.fuse(self.similarities({k: v[a:a + step] for k, v in image_reps.items()}, text_reps), weights,
                           direction) for a in range(0, n_img, step)]
        return torch.cat(parts) if parts else torch.zeros(0, n_txt, device=text_reps["global"].device)

    def _first_stage(self, reps: Reps, direction: str) -> Tensor:
        """[B, 2D] = [sqrt(w_global) global, sqrt(w_base) base] with the fusion weights of ``direction``: the inner
        product of an image's and a text's vectors is exactly the global + base part of eq. 10 (t2i) or 11 (i2t);
        the fine-grained terms (FGM over entities and relations) are added by the re-ranking stage. Both parts
        are unit vectors, so every item has the same norm and an index that normalises would rank alike. With
        both weights 0 (a fusion of fine terms only) the base cosine stands in."""
        if direction not in ("t2i", "i2t"):
            raise ValueError(f"direction must be 't2i' or 'i2t', got {direction!r}")
        names = T2I_WEIGHTS if direction == "t2i" else I2T_WEIGHTS
        weights = dict(zip(names, (self.fusion_t2i if direction == "t2i" else self.fusion_i2t).tolist()))
        wg, wb = max(weights["global"], 0.0), max(weights["base"], 0.0)
        if wg == 0.0 and wb == 0.0:
            wb = 1.0
        return torch.cat([wg ** 0.5 * reps["global"].float(), wb ** 0.5 * reps["base"].float()], dim=-1)

    def first_stage_image(self, image_reps: Reps, direction: str = "t2i") -> Tensor:
        return self._first_stage(image_reps, direction)

    def first_stage_text(self, text_reps: Reps, direction: str = "t2i") -> Tensor:
        return self._first_stage(text_reps, direction)

    def score(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        """Direction-free score: the mean of eq. 10 and eq. 11 (used where no direction applies, e.g. zero-shot)."""
        return 0.5 * (self.score_directed(image_reps, text_reps, "t2i") + self.score_directed(image_reps, text_reps, "i2t"))

    def logits(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        return self.logit_scale.clamp(max=math.log(MAX_LOGIT_SCALE)).exp() * self.score(image_reps, text_reps)

    # -- training --------------------------------------------------------------------------------------
    def loss(self, image_reps: Reps, text_reps: Reps, *, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
        """Eq. 6-9 on the global batch. Each rank scores its own images against every text and its own texts
        against every image (gathered with gradients); per-term sums are divided by the global count of
        anchors with evidence, so DDP's mean of the ranks' gradients is exactly the one-process gradient."""
        scale = self.logit_scale.clamp(max=math.log(MAX_LOGIT_SCALE)).exp()
        b = len(image_reps["global"])
        all_img = {k: gather(v, rank, world_size) for k, v in image_reps.items()}
        all_txt = {k: gather(v, rank, world_size) for k, v in text_reps.items()}
        labels = local_rows(b, rank, world_size, image_reps["global"].device)
        total = image_reps["global"].new_zeros(())
        parts = {}
        for term, weight in self.loss_weights().items():
            if weight == 0:
                continue
            if term == "global":
                i2t = image_reps["global"] @ all_txt["global"].T       # [b, B]: local images vs all texts
                t2i = text_reps["global"] @ all_img["global"].T        # [b, B]: local texts vs all images
                ok_i = ok_t = torch.ones(b, dtype=torch.bool, device=i2t.device)
            else:
                if world_size == 1:  # local = global: one [B, E, B, E] similarity tensor serves both directions
                    i2t, t2i_cols = fgm_pair(image_reps[term], image_reps[f"{term}_valid"], text_reps[term],
                                             text_reps[f"{term}_valid"])
                else:
                    i2t, _ = fgm_pair(image_reps[term], image_reps[f"{term}_valid"], all_txt[term],
                                      all_txt[f"{term}_valid"])
                    _, t2i_cols = fgm_pair(all_img[term], all_img[f"{term}_valid"], text_reps[term],
                                           text_reps[f"{term}_valid"])
                t2i = t2i_cols.T                                       # [b, B]: row = local text
                has_img = image_reps[f"{term}_valid"].any(1)
                has_txt = text_reps[f"{term}_valid"].any(1)
                ok_i = ok_t = has_img & has_txt                        # anchor and positive both have evidence
            term_loss = 0.5 * (self._ce(scale * i2t, labels, ok_i, world_size)
                               + self._ce(scale * t2i, labels, ok_t, world_size))
            total = total + weight * term_loss
            parts[term] = term_loss.detach()
        return {"loss": total, **parts, "logit_scale": scale.detach()}

    @staticmethod
    def _ce(logits: Tensor, labels: Tensor, keep: Tensor, world_size: int) -> Tensor:
        """Sum of the kept rows' cross-entropies over the global number of kept rows (times world_size so the
        mean over ranks, which DDP takes of the gradients, is the global mean)."""
        count = keep.sum().to(torch.float32)
        if world_size > 1:
            count = count.clone()
            dist.all_reduce(count)
        ce = F.cross_entropy(logits.float(), labels, reduction="none")
        return (ce * keep).sum() / count.clamp_min(1) * world_size

    # -- inference fit (eq. 10-11) ---------------------------------------------------------------------
    @torch.no_grad()
    def fit_inference(self, image_reps: Reps, text_reps: Reps, caption_image: Tensor, max_images: int = 1000,
                      sweeps: int = 2, seed: int = 0) -> dict[str, float]:
        """Fit the fusion weights of eq. 10 and 11 on a held-out split: coordinate ascent over FUSION_GRID on
        :func:`fit_objective` of each direction (at most ``max_images`` images, with all their captions, drawn
        with ``seed``). A weight of a term left out of the loss stays 0. Starts from the current weights and
        keeps a change only when it strictly improves, so a flat objective leaves them as they are."""
        caption_image = caption_image.to(image_reps["global"].device).long()
        n_images = len(image_reps["global"])
        if n_images > max_images:
            keep = torch.randperm(n_images, generator=torch.Generator().manual_seed(seed))[:max_images].sort().values
            new_row = torch.full((n_images,), -1, dtype=torch.long)
            new_row[keep] = torch.arange(len(keep))
            cap_keep = (new_row[caption_image.cpu()] >= 0).nonzero().squeeze(1)
            image_reps = {k: v[keep.to(v.device)] for k, v in image_reps.items()}
            text_reps = {k: v[cap_keep.to(v.device)] for k, v in text_reps.items()}
            caption_image = new_row[caption_image.cpu()[cap_keep]].to(caption_image.device)
        sims = self.similarities(image_reps, text_reps)
        out = {}
        for direction, buf, names in (("t2i", self.fusion_t2i, T2I_WEIGHTS), ("i2t", self.fusion_i2t, I2T_WEIGHTS)):
            w = buf.clone()
            enabled = self.enabled_terms()
            free = [k for k, n in enumerate(names) if enabled[n]]  # disabled terms stay 0
            before = best = fit_objective(self.fuse(sims, w, direction), caption_image, direction)
            for _ in range(sweeps):
                changed = False
                for k in free:
                    for value in FUSION_GRID:
                        trial = w.clone()
                        trial[k] = value
                        if not trial.any():
                            continue
                        got = fit_objective(self.fuse(sims, trial, direction), caption_image, direction)
                        if got > best:
                            best, w, changed = got, trial, True
                if not changed:
                    break
            buf.copy_(w)
            out.update({f"{direction}_{n}": float(v) for n, v in zip(names, w)})
            out[f"{direction}_objective_before"], out[f"{direction}_objective_after"] = before, best
        return out
