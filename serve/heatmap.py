"""Per-phrase heatmaps of a query on an image, from the frozen backbone under any scorer, and ComAlign's boxes.

For each noun phrase of the query ("a small red circle"; :mod:`extract.components.text`' spaCy parse) a map
[H, W] in [0, 1] at the image's original pixel size says where the backbone finds that phrase. Two training-free
maps (``METHODS``; the first is the default, chosen by ``python -m train.eval.heatmaps``'s measurement):

``raw``
    cosine of each projected patch token (``extract.models.backbone.ImageFeatures.patches``: ``ln_post(x_n) @ proj``,
    the map the global embedding is made with) with the phrase's text embedding. Known weakness on real CLIP
    weights: noisy and often inverted maps, because nothing in CLIP's loss trains the patch tokens (the "opposite
    visualization" Li et al. 2023 set out to fix). Measured here too: on the CLIP-pre-trained tiny base, raw maps
    put *less* mass on the named object than a uniform map for ~70% of objects.
``surgery``
    CLIP Surgery (Li et al. 2023, "CLIP Surgery for Better Explainability with Enhancement in Open-Vocabulary
    Tasks", arXiv:2304.05653). *Architecture surgery*: a second path through the last ``depth`` residual blocks
    whose attention is value-value (softmax(v v^T / sqrt(d)) v, with the block's own projections) instead of
    query-key, and which skips the FFN; it reads the original path's normalised tokens in each block and adds
    only its attention outputs to its own stream (the paper's "dual paths": the original path is left untouched,
    so the class token, hence the global embedding, is the model's own). Its patch tokens then go through the
    same ln_post / projection as the ordinary ones. *Feature surgery*: with P phrases, the score of phrase p at
    patch n is ``sum_d (x_nd t_pd w_p - mean_q x_nd t_qd w_q)``, i.e. the elementwise product of patch and text
    features minus the redundant feature common to all phrases, summed; w = softmax(2 <cls, t>) / its mean
    restrains obvious phrases. A query with one phrase has nothing to take the mean over; as the paper's
    single-prompt use, the embedding of the empty text stands for the redundant feature (``x . (t - t_empty)``).
    Depth: the reference implementation's last 6 blocks (of ViT-B's 12, ViT-L's 24); all blocks of a smaller
    tower (``min(6, layers)``: both of the 2-layer tiny, where 2 localises far better than 1, see the README).

Each grid map is min-max normalised over the patches (as Surgery's ``get_similarity_map``), then interpolated
bilinearly between patch centres and mapped back through the preprocess's resize and centre crop
(:func:`extract.components.regions.image_to_grid_transform`), so pixel (x, y) of the original image reads the grid where
the model saw it; pixels the crop cut away read 0 (the model never saw them). ``PhraseMap.peak`` keeps the
largest un-normalised score, since a min-max map always has a hot spot, even for a phrase that is not there.

Grounded relation scorers (a head with ``explain_score``, :mod:`adapters.heads.grounded`): :meth:`Heatmapper.explain`
gives the score's parts (base, entity and relation terms with their weights) and, for every relation of the query,
where its subject and its object were grounded (the box the soft grounding weighs most, and that weight), which
:meth:`Heatmapper.maps` puts on the subject's and the object's phrase, next to P(the relation holds); and what the
pixels say about that pair of boxes (:class:`OverlapEvidence`: where they overlap and which of the two owns the
overlap's pixels, the evidence the head reads for "in front of" / "behind"), whose region the maps of both phrases
carry.

ComAlign scorers (anything whose head scores entity / relation component sets with fine-grained matching, see
:mod:`adapters.heads.comalign`): :meth:`Heatmapper.explain` recomputes the text->image score of eq. 10 from
its parts -- for every text entity / relation component, the image component (a box: ground truth or
detector's, and relation boxes as their union) that wins its max in FGM, with that similarity; the mean of
those maxima per type is the fine-grained term -- and :meth:`Heatmapper.maps` puts on each phrase the box that
won its entity component (the phrase's noun with its adjectives, as ComAlign embeds it).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from extract.models.backbone import is_vit

if TYPE_CHECKING:
    from PIL import Image

#: heatmap methods; the first is the default, by ``python -m train.eval.heatmaps``'s measurement (README): on the
#: toy world's test split, the CLIP-pre-trained tiny base localises 84% of objects with surgery (3 seeds: 81-88%)
#: and 29% with raw (inverted); a FILIP-pre-trained one ~99% with either
METHODS = ("surgery", "raw")
#: CLIP Surgery's depth: the reference implementation's last 6 blocks, whatever the tower (all of a smaller one)
SURGERY_DEPTH = 6
#: temperature of feature surgery's class weights (softmax(t <cls, text>)), the reference's value
SURGERY_TEMPERATURE = 2.0
TEXT_SOURCES = ("phrase", "context")
#: phrase embeddings a Heatmapper remembers
CACHE_SIZE = 4096


# --------------------------------------------------------------------------------------------- outputs
@dataclass
class PhraseMap:
    """One phrase's heatmap on one image.

    phrase: the noun phrase as written in the query; span: its [start, end) character offsets in the query;
    heat: [H, W] float32 in [0, 1] at the image's original pixel size; box / box_kind / box_score (ComAlign
    scorers): the image component (x0, y0, x1, y1 in original px, end-exclusive) that won the max of this phrase's
    entity component in fine-grained matching, "entity" or "relation", and that similarity (a term of eq. 10's
    entity mean); None otherwise. method: "raw" or "surgery"; peak / low: the largest / smallest un-normalised
    score behind ``heat`` (cosine for raw; the surgery score), the scale heat 1 / 0 stand for; whole_caption: True
    when the query has no noun phrase and this one map is for the whole caption.
    """

    phrase: str
    span: tuple[int, int]
    heat: np.ndarray
    box: tuple[float, float, float, float] | None = None
    box_kind: str | None = None
    box_score: float | None = None
    method: str = ""
    peak: float = 0.0
    whole_caption: bool = False
    low: float = 0.0  # the smallest un-normalised score: heat 0 is ``low``, heat 1 is ``peak``
    #: grounded heads: (region, label) of each overlap of a relation this phrase is the subject or object of
    #: (:class:`OverlapEvidence`): where its box and the other's overlap, and whose pixels fill it
    overlaps: list = field(default_factory=list)

    @property
    def label(self) -> str:
        """The legend entry: the phrase, or "whole caption: ..." for the fallback map."""
        return f"whole caption: {self.phrase}" if self.whole_caption else self.phrase


@dataclass
class ComponentMatch:
    """One text component of a ComAlign query and the image component that wins its max in FGM (eq. 2-4).

    kind: "entity" | "relation" (| "subject" | "object" | "count": grounded heads); index: its slot among the caption's components of that kind; text: the component
    as embedded ("small red circle", "red circle to the left of blue square"); score: max over the image's valid
    components of that kind of <t, v> (0 when the image has none: eq. 3's empty-set convention); image_index /
    box: the winner's slot and box (original px), None when there is none.
    """

    kind: str
    index: int
    text: str
    score: float
    image_index: int | None = None
    box: tuple[float, float, float, float] | None = None


@dataclass
class OverlapEvidence:
    """What the pixels say about the two boxes one relation of a query was grounded in (grounded heads:
    ``adapters.heads.grounded.Grounded.overlap_evidence``, named by the query's parse).

    relation / subject / object: the triplet and its two phrases as parsed ("red circle in front of blue square",
    "red circle", "blue square"); subject_box / object_box: their boxes (x0, y0, x1, y1 px); region: the boxes'
    intersection, None where they do not overlap; same_box: both phrases grounded in one box; read: the overlap
    features hold evidence for the pair (the boxes share enough pixels); owner: "subject" / "object" (whose pixels
    fill the overlap: the one in front), None where the rules split or say nothing; votes / agree / differences:
    each rule's vote, how many side with the owner, each rule's signed difference (positive: the subject);
    holds / holds_without: the head's P(predicate holds) of this pair read with the evidence and without it.
    """

    relation: str
    subject: str
    object: str
    subject_box: tuple
    object_box: tuple
    region: tuple | None
    same_box: bool = False
    read: bool = False
    owner: str | None = None
    votes: dict = field(default_factory=dict)
    agree: int = 0
    differences: dict = field(default_factory=dict)
    holds: float | None = None
    holds_without: float | None = None

    @property
    def owner_phrase(self) -> str | None:
        """The phrase whose pixels fill the overlap (the one in front), or None."""
        return {"subject": self.subject, "object": self.object}.get(self.owner)

    @property
    def label(self) -> str:
        """The region's legend entry on the picture."""
        whose = f"the {self.owner_phrase}'s pixels" if self.owner_phrase else "whose pixels, unread"
        return f"overlap of {self.subject} and {self.object}: {whose}"

    def sentence(self) -> str:
        """The evidence in words: where the two boxes overlap and whose pixels fill the overlap, or that they do not
        overlap; and whether the head's P(holds) for the pair moves with it."""
        s, o = f"the {self.subject}", f"the {self.object}"
        if self.same_box:
            return f"{s} and {o} were grounded in one box {_px(self.subject_box)}: no pair to read an overlap of"
        if self.region is None:
            return f"{s}'s box {_px(self.subject_box)} and {o}'s box {_px(self.object_box)} do not overlap"
        text = f"{s}'s box and {o}'s box overlap at {_px(self.region)}; "
        if not self.read:
            text += "too few pixels to tell whose they are"
        elif self.owner_phrase is None:
            text += "its pixels do not say whose they are (the rules split: " + ", ".join(
                f"{k} {v:+d}" for k, v in self.votes.items()) + ")"
        else:
            text += (f"its pixels belong to the {self.owner_phrase} (in front: {self.agree} of {len(self.votes)} "
                     "rules)")
        if self.holds is not None and self.holds_without is not None:
            if abs(self.holds - self.holds_without) < 5e-4:
                text += f"; P(holds) of these two boxes {self.holds:.3f} with or without it"
            else:
                text += (f"; the head reads it: P(holds) of these two boxes {self.holds:.3f} with it, "
                         f"{self.holds_without:.3f} without")
        return text


def _px(box) -> str:
    return "(" + ", ".join(f"{v:.0f}" for v in box) + ")"


@dataclass
class ScoreExplanation:
    """ComAlign's text->image score (eq. 10) of one image and one query, rebuilt from its parts.

    components: every valid text entity / relation component with its winner; terms: ``entity`` / ``relation``
    (the mean of the components' scores of that kind: s^E_T2I, s^R_T2I; 0 without components), ``global``,
    ``base``; weights: the fusion weights of eq. 10 (``adapters.heads.comalign.T2I_WEIGHTS``); score:
    ``sum(weights[k] * terms[k])``, which is the head's own ``score_directed(..., "t2i")``. A grounded head's
    explanation has its own terms and weights, and ``overlaps``: each relation's :class:`OverlapEvidence`.
    """

    components: list[ComponentMatch]
    terms: dict[str, float]
    weights: dict[str, float]
    overlaps: list[OverlapEvidence] = field(default_factory=list)
    score: float = field(init=False)

    def __post_init__(self):
        self.score = float(sum(self.weights[k] * self.terms[k] for k in self.weights))


@dataclass(frozen=True)
class NounPhrase:
    """A noun phrase of a query: text as written, [start, end) span, the entity component it holds (the noun with
    its adjectives, no determiner: what ComAlign embeds), and its backbone token positions in the query."""

    text: str
    span: tuple[int, int]
    entity: str
    tokens: tuple[int, ...] = ()


# --------------------------------------------------------------------------------------------- phrases
def noun_phrases(text: str, extractor, tokenized=None) -> list[NounPhrase]:
    """The noun phrases of ``text`` in caption order, from one spaCy parse (``extractor``: a
    :class:`extract.components.text.TextComponentExtractor`; ``tokenized``: the backbone's tokenisation of
    ``[text]``, for token positions).

    Each entity of the parse that is not part of a longer one ("small red circle", not its bare noun "circle")
    grows into the noun-chunk leaf of the phrase tree that holds it, determiners included ("a small red circle").
    A phrase repeated word for word gives one phrase, at its first occurrence (the extractor keeps each entity
    text once, as ComAlign embeds it once).
    """
    comp = extractor.extract([text], tokenized)[0]
    ents = comp.entities
    outer = [e for e in ents
             if not any(o is not e and o.start <= e.start and e.end <= o.end and (o.end - o.start) > (e.end - e.start)
                        for o in ents)]
    out, seen = [], set()
    for e in outer:
        leaf = next((lf for lf in comp.tree.leaves if lf.start <= e.start and e.end <= lf.end), None)
        start, end, tokens = (leaf.start, leaf.end, leaf.tokens) if leaf is not None else (e.start, e.end, e.tokens)
        if (start, end) in seen:
            continue
        seen.add((start, end))
        out.append(NounPhrase(text[start:end], (start, end), e.text, tuple(tokens)))
    return sorted(out, key=lambda p: p.span)


# --------------------------------------------------------------------------------------------- the vision tower
def default_depth(layers: int) -> int:
    """Surgery depth for a tower of ``layers`` blocks (module docstring)."""
    return max(1, min(SURGERY_DEPTH, layers))


def _is_open_clip_attention(attn: nn.Module) -> bool:
    return not isinstance(attn, nn.MultiheadAttention) and hasattr(attn, "in_proj_weight") and hasattr(attn, "out_proj")


def _attention(block: nn.Module, h: torch.Tensor, value_value: bool) -> torch.Tensor:
    """The attention branch of one open_clip residual block on normalised tokens h [B, N, C], as the block adds it
    to the residual stream (after out_proj, and the block's ln_attn / ls_1 where it has them).

    value_value False: the block's own query-key attention (nn.MultiheadAttention in ResidualAttentionBlock, or
    open_clip's Attention with its qk-norm / scaled-cosine / head-scale / inner-norm options in
    CustomResidualAttentionBlock). True: CLIP Surgery's v-v attention with the same projections
    (softmax(v v^T * d^-1/2) v, Li et al. 2023, architecture surgery)."""
    attn = block.attn
    custom = _is_open_clip_attention(attn)
    if not custom and not getattr(attn, "_qkv_same_embed_dim", True):
        raise NotImplementedError("heatmaps need a fused q/k/v projection in the image tower's attention")
    b, n, c = h.shape
    heads = attn.num_heads
    qkv = F.linear(h, attn.in_proj_weight, attn.in_proj_bias)
    q, k, v = qkv.view(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    scale = (c // heads) ** -0.5
    if value_value:
        logits = (v * scale) @ v.transpose(-1, -2)
    elif custom and getattr(attn, "logit_scale", None) is not None:  # scaled cosine attention (Swin v2)
        logits = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
        logits = logits * torch.clamp(attn.logit_scale, max=attn.logit_scale_max).exp()
    else:
        if custom:
            q, k = attn.ln_q(q), attn.ln_k(k)
        logits = (q * scale) @ k.transpose(-1, -2)
    out = logits.softmax(dim=-1) @ v
    if custom and getattr(attn, "head_scale", None) is not None:
        out = out * attn.head_scale
    out = out.transpose(1, 2).reshape(b, n, c)
    if custom:
        out = attn.out_proj(attn.ln_inner(out))
        out = block.ln_attn(out) if hasattr(block, "ln_attn") else out
    else:
        out = attn.out_proj(out)
    return block.ls_1(out)


def vision_streams(visual: nn.Module, images: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our own forward through an open_clip VisionTransformer's modules (open_clip itself is not modified).

    images [B, 3, H, W] preprocessed -> (ordinary [B, 1 + N, C], surgery [B, 1 + N, C]): the residual stream at
    the tower's transformer output, class token first, and CLIP Surgery's parallel stream (module docstring) that
    forks off before the last ``depth`` blocks. The ordinary stream is exactly what the tower computes (eval mode:
    no patch dropout), which the tests check against ``model.visual``.
    """
    x = visual.conv1(images)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # [B, N, C], row-major patches
    cls = visual.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
    x = torch.cat([cls, x], dim=1) + visual.positional_embedding.to(x.dtype)
    x = visual.ln_pre(visual.patch_dropout(x))
    blocks = visual.transformer.resblocks
    if not 1 <= depth <= len(blocks):
        raise ValueError(f"surgery depth must be 1..{len(blocks)} for this tower, got {depth}")
    batch_first = getattr(visual.transformer, "batch_first", True)
    for block in blocks[:len(blocks) - depth]:
        x = block(x) if batch_first else block(x.transpose(0, 1)).transpose(0, 1)
    surgery = x
    for block in blocks[len(blocks) - depth:]:
        h = block.ln_1(x)  # both paths attend over the original path's tokens (the paper's dual paths)
        surgery = surgery + _attention(block, h, value_value=True)  # no FFN on the new path
        x = x + _attention(block, h, value_value=False)
        x = x + block.ls_2(block.mlp(block.ln_2(x)))
    return x, surgery


def pooled_embedding(visual: nn.Module, stream: torch.Tensor) -> torch.Tensor:
    """The tower's global embedding [B, D] (not normalised) from its transformer output stream [B, 1 + N, C]:
    its own pooling (class token, or CoCa's attentional pooler) and projection, as ``visual.forward`` ends."""
    pooled, _ = visual._pool(stream)
    return pooled @ visual.proj if visual.proj is not None else pooled


# --------------------------------------------------------------------------------------------- maps
def feature_surgery(patches: torch.Tensor, texts: torch.Tensor, cls: torch.Tensor,
                    redundant: torch.Tensor | None = None, temperature: float = SURGERY_TEMPERATURE) -> torch.Tensor:
    """CLIP Surgery's feature surgery (Li et al. 2023): scores [N, P] of patches [N, D] for texts [P, D] (all
    L2-normalised), with the image's global embedding cls [D].

    With ``redundant`` [D] (one text: the empty text's embedding): ``patches @ (texts - redundant).T``. Else
    ``sum_d (x_nd t_pd w_p - mean_q x_nd t_qd w_q)`` with w = softmax(temperature <cls, t>) / mean: the literal
    form builds the [N, P, D] products; it equals ``w_p <x_n, t_p> - mean_q w_q <x_n, t_q>``, computed here in
    [N, P] (the tests compare the two).
    """
    if redundant is not None:
        return patches @ (texts - redundant[None]).T
    prob = (temperature * (texts @ cls)).softmax(dim=0)
    w = prob / prob.mean()
    s = (patches @ texts.T) * w[None]
    return s - s.mean(dim=1, keepdim=True)


def minmax(scores: torch.Tensor) -> torch.Tensor:
    """scores [N, P] -> each column scaled to [0, 1] (a constant column becomes 0)."""
    lo, hi = scores.amin(dim=0, keepdim=True), scores.amax(dim=0, keepdim=True)
    return (scores - lo) / (hi - lo).clamp_min(1e-12)


def _axis_weights(n_pixels: int, scale: float, offset: float, cell: int, n_cells: int) -> np.ndarray:
    """[n_pixels, n_cells] linear-interpolation weights of each original pixel's centre between patch centres
    along one axis (input px = original px * scale - offset); rows of pixels outside the input are 0."""
    centre = (np.arange(n_pixels) + 0.5) * scale - offset  # input px
    g = np.clip(centre / cell - 0.5, 0.0, n_cells - 1.0)  # in cells, centres at integers; clamp at the edges
    i0 = np.minimum(np.floor(g).astype(np.int64), n_cells - 1)
    i1 = np.minimum(i0 + 1, n_cells - 1)
    frac = g - i0
    w = np.zeros((n_pixels, n_cells))
    rows = np.arange(n_pixels)
    np.add.at(w, (rows, i0), 1.0 - frac)
    np.add.at(w, (rows, i1), frac)
    seen = (centre >= 0) & (centre < cell * n_cells)
    w[~seen] = 0.0
    return w


def grid_to_pixels(grid_maps: np.ndarray, image_size: tuple[int, int], input_size: tuple[int, int],
                   resize_mode: str = "shortest") -> np.ndarray:
    """grid_maps [P, rows, cols] -> [P, H, W] float32 at the original image's size (``image_size`` = (W, H);
    ``input_size`` = the network input's (W, H); ``resize_mode`` the preprocess's): bilinear between patch centres,
    clamped at the grid's edge, 0 where the preprocess cropped the image away (module docstring)."""
    from extract.components.regions import image_to_grid_transform

    p, rows, cols = grid_maps.shape
    w, h = image_size
    t = image_to_grid_transform((w, h), input_size, resize_mode)
    cw, ch = input_size[0] // cols, input_size[1] // rows
    wx = _axis_weights(w, t.scale[0], t.offset[0], cw, cols)  # [W, cols]
    wy = _axis_weights(h, t.scale[1], t.offset[1], ch, rows)  # [H, rows]
    return np.einsum("hr,prc,wc->phw", wy, grid_maps.astype(np.float64), wx).astype(np.float32)


def box_outline(box: Sequence[float], size: tuple[int, int], width: int = 2) -> np.ndarray:
    """A [H, W] float mask (1 on the outline, 0 elsewhere) of a pixel box (x0, y0, x1, y1, end-exclusive) in an
    image of ``size`` = (W, H): how a box goes into gr.AnnotatedImage next to the heatmaps."""
    w, h = size
    x0, y0 = max(0, int(np.floor(box[0]))), max(0, int(np.floor(box[1])))
    x1, y1 = min(w, int(np.ceil(box[2]))), min(h, int(np.ceil(box[3])))
    mask = np.zeros((h, w), np.float32)
    if x1 <= x0 or y1 <= y0:
        return mask
    mask[y0:y1, x0:x1] = 1.0
    mask[y0 + width:y1 - width, x0 + width:x1 - width] = 0.0
    return mask


# --------------------------------------------------------------------------------------------- the mapper
class Heatmapper:
    """Per-phrase heatmaps for one scorer (anything :func:`adapters.load.load_scorer` returns: the frozen
    backbone under it makes the maps; a ComAlign head adds its boxes).

    ``device``: where the scorer's backbone runs (a mismatch is refused, naming both). ``surgery_depth``: blocks
    on CLIP Surgery's v-v path (default :func:`default_depth`). ``text``: how a phrase is embedded -- "phrase":
    encoded alone as a caption (default); "context": the mean of its token embeddings in the whole query.
    """

    def __init__(self, scorer, *, device: str | torch.device = "cpu", surgery_depth: int | None = None,
                 text: str = "phrase"):
        backbone = getattr(scorer, "backbone", None)
        if backbone is None or not hasattr(backbone, "encode_images") or not hasattr(backbone, "model"):
            raise ValueError(f"{type(scorer).__name__}: heatmaps need a scorer with a frozen open_clip backbone "
                             "(scorer.backbone)")
        wanted, where = torch.device(device), backbone.device
        if wanted.type != where.type or (wanted.index is not None and wanted.index != (where.index or 0)):
            raise ValueError(f"the scorer's backbone is on {backbone.device}, not {device}: pass device="
                             f"{str(backbone.device)!r}")
        if text not in TEXT_SOURCES:
            raise ValueError(f"text must be one of {TEXT_SOURCES}, got {text!r}")
        self.scorer, self.backbone, self.text = scorer, backbone, text
        self.visual = backbone.model.visual
        # CLIP Surgery's path runs through a ViT's transformer blocks; a ResNet tower has its raw map only (its
        # tokens: the attention pool's value path at each position of the last feature map, MaskCLIP §3.2)
        self.methods = METHODS if is_vit(self.visual) else ("raw",)
        self.depth = None
        if is_vit(self.visual):
            layers = len(self.visual.transformer.resblocks)
            self.depth = default_depth(layers) if surgery_depth is None else int(surgery_depth)
            if not 1 <= self.depth <= layers:
                raise ValueError(f"surgery depth must be 1..{layers} for {backbone.spec.model}, got {self.depth}")
        from extract.components.regions import preprocess_geometry

        self.input_size, self.resize_mode = preprocess_geometry(backbone)
        self._extractor = None
        self._empty: torch.Tensor | None = None
        self._phrase_cache: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    # -- phrases ------------------------------------------------------------------------------------
    @property
    def extractor(self):
        """The spaCy component extractor (loaded on first use), with caps high enough for any query."""
        if self._extractor is None:
            from extract.components.text import TextComponentExtractor

            self._extractor = TextComponentExtractor(max_entities=64, max_relations=0, max_leaves=64, max_nodes=1)
        return self._extractor

    def noun_phrases(self, text: str) -> list[NounPhrase]:
        """:func:`noun_phrases` of ``text`` with the backbone's token positions."""
        return noun_phrases(text, self.extractor, self.backbone.tokenize([text]))

    def phrases(self, text: str) -> list[tuple[str, tuple[int, int]]]:
        """The query's noun phrases as (text as written, (start, end) character offsets), in caption order."""
        return [(p.text, p.span) for p in self.noun_phrases(text)]

    # -- maps ---------------------------------------------------------------------------------------
    def maps(self, image, text: str, method: str | None = None, *, image_id: str | None = None) -> list[PhraseMap]:
        """One :class:`PhraseMap` per noun phrase of ``text`` (or one for the whole caption when it has none).

        image: a PIL image or an image file's path; method: one of :data:`METHODS` (default: the first);
        image_id: the image's id for a ComAlign adapter trained on ground-truth boxes (default: the path, or the
        PIL image's file name) -- the annotations the scorer was loaded with are looked up by it.
        """
        return self.explained_maps(image, text, method, image_id=image_id)[0]

    def explained_maps(self, image, text: str, method: str | None = None, *,
                       image_id: str | None = None) -> tuple[list[PhraseMap], ScoreExplanation | None]:
        """(:meth:`maps`, :meth:`explain`) from one pass: the boxes on the maps come from that explanation, so a
        caller showing both (the app) computes ComAlign's components once."""
        method = self.methods[0] if method is None else method
        by_method, explanation = self._maps(image, text, (method,), image_id, explain=True)
        return by_method[method], explanation

    def maps_by_method(self, image, text: str, methods: Sequence[str] | None = None, *, image_id: str | None = None,
                       explain: bool = True) -> dict[str, list[PhraseMap]]:
        """:meth:`maps` for several methods from one forward pass: method -> maps (same phrases, same order).
        ``explain`` False skips ComAlign's boxes (they crop and embed every image component). ``methods``: default
        every method this tower has (:attr:`methods`)."""
        return self._maps(image, text, self.methods if methods is None else methods, image_id, explain)[0]

    def _maps(self, image, text: str, methods: Sequence[str], image_id: str | None,
              explain: bool) -> tuple[dict[str, list[PhraseMap]], ScoreExplanation | None]:
        for method in methods:
            if method not in self.methods:
                why = (f" ({type(self.visual).__name__} image tower: CLIP Surgery needs a ViT)"
                       if method in METHODS else "")
                raise ValueError(f"unknown heatmap method {method!r}{why}; choose from {', '.join(self.methods)}")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the query is empty: type a caption to see its phrases' heatmaps")
        pil, image_id = self._load(image, image_id)
        phrases = self.noun_phrases(text)
        whole = not phrases
        if whole:
            phrases = [NounPhrase(text, (0, len(text)), "")]
        texts = self._text_embeddings(text, phrases, whole)
        feats = self.image_features(self.backbone.preprocess(pil)[None])
        explanation = self.explain(pil, text, image_id=image_id) if explain else None
        # the box each phrase won: its entity component's, or, in a relation, where its subject / object was grounded
        won = {m.text.lower(): m for kind in ("entity", "subject", "object") for m in
               (explanation.components if explanation else ()) if m.kind == kind and m.box is not None}
        # where a relation's two boxes overlap, on the maps of both its phrases
        regions: dict[str, list] = {}
        for ev in (explanation.overlaps if explanation else ()):
            if ev.region is not None:
                for name in dict.fromkeys((ev.subject.lower(), ev.object.lower())):
                    regions.setdefault(name, []).append((ev.region, ev.label))
        rows, cols = self.backbone.grid
        out = {}
        for method in methods:
            scores = self.scores(feats, texts, method)  # [N, P]
            grid = minmax(scores).T.reshape(len(phrases), rows, cols).cpu().numpy()
            heat = np.clip(grid_to_pixels(grid, pil.size, self.input_size, self.resize_mode), 0.0, 1.0)
            peaks, lows = scores.amax(dim=0).tolist(), scores.amin(dim=0).tolist()
            maps = []
            for k, p in enumerate(phrases):
                pm = PhraseMap(p.text, p.span, heat[k], method=method, peak=float(peaks[k]), whole_caption=whole,
                               low=float(lows[k]))
                m = won.get(p.entity.lower()) if not whole else None
                if m is not None and m.box is not None:
                    pm.box, pm.box_kind, pm.box_score = m.box, m.kind, m.score
                if not whole:
                    pm.overlaps = list(regions.get(p.entity.lower(), ()))
                maps.append(pm)
            out[method] = maps
        return out, explanation

    @torch.no_grad()
    def image_features(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """images [B, 3, H, W] preprocessed -> ``embedding`` [B, D] (normalised global), ``patches`` [B, N, D]
        (the ordinary projected patch tokens, = ``backbone.encode_images(images).patches``) and ``surgery``
        [B, N, D] (the v-v path's), in float32; N in the grid's row-major order."""
        bb = self.backbone
        images = images.to(device=bb.device, dtype=bb.dtype)
        if self.depth is None:  # no surgery path (a ResNet tower): the backbone's own tokens
            f = bb.encode_images(images)
            return {"embedding": f.embedding.float(), "patches": f.patches.float()}
        stream, surgery = vision_streams(self.visual, images, self.depth)
        # the backbone's own patch projection (ln_post + proj, or CoCa's pooler value path) for both streams
        return {"embedding": F.normalize(pooled_embedding(self.visual, stream).float(), dim=-1),
                "patches": bb._patch_tokens(stream).float(), "surgery": bb._patch_tokens(surgery).float()}

    @torch.no_grad()
    def scores(self, feats: dict[str, torch.Tensor], texts: torch.Tensor, method: str) -> torch.Tensor:
        """Un-normalised scores [N, P] of one image's N patches (``feats``: :meth:`image_features` of that one
        image) for P L2-normalised text embeddings [P, D] by ``method``, before min-max (``raw``: cosine;
        ``surgery``: :func:`feature_surgery`, with the empty text as the redundant feature when P = 1)."""
        if method == "raw":
            return F.normalize(feats["patches"][0], dim=-1) @ texts.T
        patches = F.normalize(feats["surgery"][0], dim=-1)
        redundant = self._empty_text() if len(texts) == 1 else None
        return feature_surgery(patches, texts, feats["embedding"][0], redundant)

    @torch.no_grad()
    def _text_embeddings(self, text: str, phrases: list[NounPhrase], whole: bool) -> torch.Tensor:
        """[P, D] L2-normalised embeddings of the phrases (class docstring, ``text``)."""
        bb = self.backbone
        if whole:
            return bb.encode_texts([text]).embedding.float()
        alone = self._phrase_embeddings([p.text for p in phrases])
        if self.text == "phrase":
            return alone
        tokens = bb.encode_texts([text]).tokens[0].float()
        rows = [F.normalize(tokens[list(p.tokens)].mean(0), dim=-1) if p.tokens else alone[k]
                for k, p in enumerate(phrases)]  # a phrase cut off by the context length: embedded alone
        return torch.stack(rows)

    def _phrase_embeddings(self, phrases: list[str]) -> torch.Tensor:
        """[P, D] normalised embeddings of phrases encoded alone, remembered (a served query is mapped on many
        hits; toy-world phrases repeat): at most CACHE_SIZE phrases, the oldest forgotten first."""
        with self._lock:  # a served page may map from several threads
            new = [p for p in dict.fromkeys(phrases) if p not in self._phrase_cache]
            if new:
                for p, e in zip(new, self.backbone.encode_texts(new).embedding.float()):
                    self._phrase_cache[p] = e
            found = torch.stack([self._phrase_cache[p] for p in phrases])
            while len(self._phrase_cache) > CACHE_SIZE:
                self._phrase_cache.pop(next(iter(self._phrase_cache)))
            return found

    def _empty_text(self) -> torch.Tensor:
        if self._empty is None:
            self._empty = self._phrase_embeddings([""])[0]
        return self._empty

    def _load(self, image, image_id: str | None):
        """(RGB PIL image, id): a path is decoded with extract.data.images' checks; a PIL image is converted to RGB."""
        if isinstance(image, (str, os.PathLike)):
            from extract.data.images import decode_image

            return decode_image(str(image)).image, image_id or str(image)
        if not hasattr(image, "convert") or not hasattr(image, "size"):
            raise ValueError(f"image must be a PIL image or a file path, got {type(image).__name__}")
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        return rgb, image_id or os.path.basename(getattr(image, "filename", "") or "") or "image"

    # -- ComAlign -----------------------------------------------------------------------------------
    def explains(self) -> bool:
        """True when the scorer's head can say which box each part of a query won -- ComAlign's fine-grained
        matching of entity / relation sets, or a head with ``explain_score`` (the grounded relation head: where the
        subject and the object of each relation were grounded) -- and its extractor gives the boxes: :meth:`explain`
        then returns its score's parts."""
        head, extractor = getattr(self.scorer, "head", None), getattr(self.scorer, "extractor", None)
        if head is not None and extractor is not None and hasattr(head, "explain_score"):
            return True
        if head is None or extractor is None or not hasattr(head, "similarities") or not hasattr(head, "fusion_t2i"):
            return False
        keys = set(getattr(head, "image_keys", ())) | set(getattr(head, "text_keys", ()))
        return {"ventity_embed", "vrelation_embed", "entity_embed", "relation_embed"} <= keys

    @torch.no_grad()
    def explain(self, image, text: str, *, image_id: str | None = None) -> ScoreExplanation | None:
        """ComAlign's text->image score of ``image`` for ``text`` (eq. 10) with, per text component, the image
        component that wins its max (:class:`ScoreExplanation`); None for scorers without such components."""
        if not self.explains():
            return None
        from adapters.heads.comalign import T2I_WEIGHTS

        scorer = self.scorer
        pil, image_id = self._load(image, image_id)
        arrays = scorer.extractor.image_arrays([pil], [image_id])
        image_reps = scorer.encode_arrays(arrays, "image")
        text_reps = scorer.encode_texts([text])
        comp = scorer.extractor.components.text.extract([text])[0]
        if hasattr(scorer.head, "explain_score"):
            return self._explain_grounded(scorer, comp, arrays, image_reps, text_reps)
        names = {"entity": [p.text for p in comp.entities[:scorer.extractor.args.max_entities]],
                 "relation": [r.text for r in comp.relations[:scorer.extractor.args.max_relations]]}
        matches, terms = [], {}
        for kind in ("entity", "relation"):
            t, t_valid = text_reps[kind][0], text_reps[f"{kind}_valid"][0].bool()
            v, v_valid = image_reps[kind][0], image_reps[f"{kind}_valid"][0].bool()
            slots = t_valid.nonzero().flatten().tolist()
            if len(slots) != len(names[kind]):
                raise RuntimeError(f"{len(slots)} valid text {kind} components but the parse gives "
                                   f"{len(names[kind])}: the scorer's extractor and its arrays disagree")
            sims = (t @ v.T).masked_fill(~v_valid[None], float("-inf"))  # padding never wins a max
            boxes = arrays[f"v{kind}_boxes"][0]
            found = []
            for slot, name in zip(slots, names[kind]):
                if bool(v_valid.any()):
                    j = int(sims[slot].argmax())
                    found.append(ComponentMatch(kind, slot, name, float(sims[slot, j]), j,
                                                tuple(float(c) for c in boxes[j])))
                else:  # an empty image set contributes 0 (eq. 3 with comalign's convention)
                    found.append(ComponentMatch(kind, slot, name, 0.0))
            matches += found
            terms[kind] = float(np.mean([m.score for m in found])) if found else 0.0
        terms["global"] = float(image_reps["global"][0] @ text_reps["global"][0])
        terms["base"] = float(image_reps["base"][0] @ text_reps["base"][0])
        weights = dict(zip(T2I_WEIGHTS, scorer.head.fusion_t2i.tolist()))
        return ScoreExplanation(matches, terms, weights)

    @staticmethod
    def _explain_grounded(scorer, comp, arrays, image_reps, text_reps) -> ScoreExplanation:
        """:meth:`explain` for a head with ``explain_score`` (adapters/heads/grounded.py): its parts, named by the
        query's parse (entity phrases; each relation's subject, object and the relation itself)."""
        parts = scorer.head.explain_score(image_reps, text_reps, arrays)
        args = scorer.extractor.args
        relations = comp.relations[:args.max_relations]
        entities = comp.entities[:args.max_entities]
        names = {"entity": [p.text for p in entities], "count": [f"{p.count} {p.text}" for p in entities],
                 "subject": [r.subject.text for r in relations], "object": [r.object.text for r in relations],
                 "relation": [r.text for r in relations]}
        boxes = arrays["ventity_boxes"][0]
        matches = [ComponentMatch(kind, slot, names[kind][slot], score, j,
                                  None if j is None else tuple(float(c) for c in boxes[j]))
                   for kind, slot, score, j in parts["components"]]
        overlaps = [OverlapEvidence(
            names["relation"][e["slot"]], names["subject"][e["slot"]], names["object"][e["slot"]], e["subject_box"],
            e["object_box"], e["region"], e["same_box"], e["read"], e["owner"], e["votes"], e["agree"],
            e["differences"], e["holds"], e["holds_without"]) for e in parts.get("overlaps", ())]
        return ScoreExplanation(matches, parts["terms"], parts["weights"], overlaps)

    # -- display ------------------------------------------------------------------------------------
    def overlay(self, image, maps: list[PhraseMap]) -> tuple[Image.Image, list[tuple[np.ndarray, str]]]:
        """(the RGB image, [(mask [H, W] float in [0, 1], label)]): what gr.AnnotatedImage takes. One heatmap per
        phrase, labelled with the phrase; a ComAlign box is one more mask, its outline, labelled with the phrase,
        the box's kind and its score; so is a relation's overlap region (once, though both its phrases carry it).
        Labels are made unique (gr.AnnotatedImage keys its legend by label)."""
        pil, _ = self._load(image, None)
        out, used, drawn = [], {}, set()

        def unique(label: str) -> str:
            used[label] = used.get(label, 0) + 1
            return label if used[label] == 1 else f"{label} ({used[label]})"

        for m in maps:
            if m.heat.shape != (pil.size[1], pil.size[0]):
                raise ValueError(f"map of {m.phrase!r} is {m.heat.shape}, the image is {pil.size[1]}x{pil.size[0]}: "
                                 "overlay the image the maps were made for")
            out.append((m.heat, unique(m.label)))
            if m.box is not None:
                out.append((box_outline(m.box, pil.size), unique(f"{m.phrase}: {m.box_kind} box, score "
                                                                 f"{m.box_score:.3f}")))
            for region, label in m.overlaps:
                if (tuple(region), label) not in drawn:
                    drawn.add((tuple(region), label))
                    out.append((box_outline(region, pil.size, width=1), unique(label)))
        return pil, out
