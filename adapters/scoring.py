"""How evaluation and serving ask a model for image–text scores, whatever the method.

Every model (a bare backbone, and later each adapter in the method registry) is a :class:`Scorer`:
it encodes a batch of images and a batch of texts into *representations* and scores every image against
every text. A representation is a dict of tensors whose first dimension indexes the items (one global
embedding for a bare backbone; components, masks and token states for adapters), so callers can cut,
concatenate and move them without knowing what is inside (:func:`cat_reps`, :func:`take_reps`).
Evaluation never re-implements a method's scoring (ComAlign fusion, SmartCLIP masked cosine, PowerCLIP
T2R/R2T): it only calls ``score``.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

Reps = dict[str, torch.Tensor]


@runtime_checkable
class Scorer(Protocol):
    """name: for reports; preprocess: PIL image -> [3, H, W] tensor; device: where reps live.

    encode_images([B, 3, H, W]) -> Reps with first dim B; encode_texts(list of B str) -> Reps with first dim B;
    score(image_reps (I items), text_reps (T items)) -> float tensor [I, T], higher = better match.
    Optional, for adapters (see :mod:`adapters.adapter_scorer`): ``encode_pil(pil_images, ids)`` when
    components are computed from the decoded image (crops, detections) and the image's id (ground-truth
    boxes); ``directional = True`` with ``score_directed(image_reps, text_reps, "t2i" | "i2t")`` when the two
    retrieval directions score differently (ComAlign eq. 10-11).
    ``first_stage_image(image_reps, direction)`` / ``first_stage_text(text_reps, direction)`` (for serving): one
    vector per item whose inner products find a query's candidates (stage 1), which ``score`` re-ranks (stage 2);
    ``direction`` "t2i" or "i2t" (see :class:`adapters.heads.base.AdapterHead`).
    ``ensemble(text_reps, groups)`` (optional): merge the texts of each group (prompt templates of one class)
    into one representation per group, in group order; without it, zero-shot averages scores over templates.
    ``text_input_keys(texts)`` (optional): one hashable per text, equal exactly when the model receives the same
    input (e.g. the same token ids after truncation to its context); evaluation encodes one text per key, so texts
    the model cannot tell apart score exactly alike (a tie) instead of differing by float rounding.
    """

    name: str
    preprocess: Callable
    device: torch.device

    def encode_images(self, images: torch.Tensor) -> Reps: ...

    def encode_texts(self, texts: Sequence[str]) -> Reps: ...

    def score(self, image_reps: Reps, text_reps: Reps) -> torch.Tensor: ...


class CacheReadable:
    """What serving's second stage and ``--cache`` evaluation ask of a scorer, with the answers of a scorer that
    has nothing beyond :class:`Scorer`: it scores alike in both directions, it re-ranks (its exact score may order
    the first stage's candidates differently), and it cannot be read from a feature cache. The scorers subclass it and
    override what they have, so callers ask the scorer instead of testing its type."""

    directional = False
    #: False where the first stage's inner product is the exact score (a bare backbone): nothing to re-rank
    second_stage = True
    #: False where an image is a set of components, not one vector a linear probe could read (adapters)
    has_global_embedding = True
    #: where the boxes of the images it scores come from (``{"source", "trained", "from"}``: an adapter's), None for a
    #: scorer that reads none
    boxes_used: dict | None = None

    def score_directed(self, image_reps: Reps, text_reps: Reps, direction: str) -> torch.Tensor:
        return self.score(image_reps, text_reps)

    @torch.no_grad()
    def encode_pil(self, images: Sequence, ids: Sequence | None = None, *, missing_boxes: str = "error") -> Reps:
        """Decoded images (PIL, any mode) -> representations: each converted to RGB and preprocessed as the model
        expects, then :meth:`encode_images`. ``ids`` (ints or strings) and ``missing_boxes`` are for scorers whose
        components need the image's id (an adapter's ground-truth boxes,
        ``adapters.adapter_scorer.AdapterScorer.encode_pil``); a bare backbone or a pre-trained model ignores them,
        so code that swaps an adapter for its base keeps its calls."""
        if not len(images):
            raise ValueError("encode_pil: no images given")
        return self.encode_images(torch.stack([self.preprocess(im.convert("RGB")) for im in images]))

    def encode_pil_bulk(self, images: Sequence, ids: Sequence | None = None, *, missing_boxes: str = "error") -> Reps:
        """:meth:`encode_pil` for a run's bulk images (an evaluation's, in batches fixed by its data and batch size):
        here the same; an adapter computes such a batch together instead of each image alone, as serving must
        (``adapters.adapter_scorer.AdapterScorer.encode_pil_bulk``)."""
        return self.encode_pil(images, ids, missing_boxes=missing_boxes)

    def encode_texts_bulk(self, texts: Sequence[str]) -> Reps:
        """``encode_texts`` for a run's bulk texts (:meth:`encode_pil_bulk`): here the same."""
        return self.encode_texts(texts)

    def box_coverage(self, collection: str):
        """A tally of the images of ``collection`` its ground-truth boxes cover (``extract.data.boxes.Coverage``), or
        None: a scorer that reads no boxes has none to count."""
        return None

    def text_input_keys(self, texts: Sequence[str]) -> list:
        """One hashable per text, equal exactly when the model receives the same input (see :class:`Scorer`); here
        each text is its own input."""
        return list(texts)

    def ensemble(self, text_reps: Reps, groups: torch.Tensor) -> Reps | None:
        """One representation per group of texts (the prompt templates of one class), or None: this scorer does
        not merge them, and zero-shot averages its scores over the templates instead."""
        return None

    def text_tower(self):
        """The frozen backbone whose text tower a text-only floor is fitted on (``train.eval.text_only``), or None
        for a scorer without one."""
        return None

    def check_cache(self, cache) -> None:
        """Whether retrieval may read this scorer's representations from feature cache ``cache`` (``train.eval
        --cache``): a ValueError naming the two sides when not. Here never: a scorer that knows no way to read
        itself from a cache is evaluated live."""
        raise ValueError(f"--cache is read by bare backbones, adapters and FILIP; {self.name} scores with its own "
                         "method: evaluate it without --cache")

    def cache_keys(self, side: str) -> tuple[str, ...]:
        """The feature-cache arrays it reads per item of ``side`` ("image" / "text")."""
        raise ValueError(f"{self.name}: no known way to read its representations from a feature cache")

    def encode_arrays(self, arrays: dict, side: str) -> Reps:
        """Representations of items of ``side`` from their cached arrays (one per :meth:`cache_keys`)."""
        raise ValueError(f"{self.name}: no known way to read its representations from a feature cache")


def check_cache_backbone(scorer, cache) -> None:
    """ValueError unless feature cache ``cache`` was built by ``scorer.backbone`` (its description, weights hashed)."""
    from extract.cache import settings_diff

    theirs, ours = cache.settings["backbone"], scorer.backbone.describe(hash_weights=True)
    if theirs != ours:
        raise ValueError(f"--cache {cache.path} was built by another backbone than {scorer.name}:\n  "
                         + "\n  ".join(settings_diff(theirs, ours)[:8]))


def cat_reps(parts: Sequence[Reps]) -> Reps:
    """Concatenate representations along the item dimension."""
    if not parts:
        return {}
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def take_reps(reps: Reps, index) -> Reps:
    """Items ``index`` (a slice, index tensor or list) of every tensor."""
    return {k: v[index] for k, v in reps.items()}


def num_items(reps: Reps) -> int:
    return len(next(iter(reps.values()))) if reps else 0


def token_keys(backbone, texts: Sequence[str]) -> list[tuple[int, ...]]:
    """The token ids of each text as ``backbone`` reads them (truncated to its context, padding dropped)."""
    tokens = backbone.tokenize(list(texts))
    return [tuple(row[mask].tolist()) for row, mask in zip(tokens.ids, tokens.attention_mask.bool())]


class BackboneScorer(CacheReadable):
    """A frozen backbone as a scorer: cosine similarity of the normalised global embeddings (CLIP).

    Zero-shot prompt ensembles follow CLIP: mean of the normalised template embeddings, normalised again. Its first
    stage is its exact score (no second stage); from a feature cache it reads the global embeddings as stored (fp16,
    unit norm before rounding: ``train.eval --cache`` scores the same).
    """

    second_stage = False

    def cache_keys(self, side: str) -> tuple[str, ...]:
        return ("image_embed",) if side == "image" else ("text_embed",)

    def encode_arrays(self, arrays: dict, side: str) -> Reps:
        import numpy as np

        return {"embed": torch.as_tensor(np.asarray(arrays[self.cache_keys(side)[0]])).float().to(self.device)}

    def __init__(self, backbone, name: str | None = None):
        self.backbone = backbone
        self.name = name or "backbone"
        self.preprocess = backbone.preprocess
        self.device = backbone.device

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> Reps:
        return {"embed": self.backbone.encode_images(images.to(self.device)).embedding.float()}

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str]) -> Reps:
        return {"embed": self.backbone.encode_texts(list(texts)).embedding.float()}

    def score(self, image_reps: Reps, text_reps: Reps) -> torch.Tensor:
        return image_reps["embed"] @ text_reps["embed"].T

    def text_input_keys(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """The token ids each text becomes, after truncation to the context (see :class:`Scorer`)."""
        return token_keys(self.backbone, texts)

    def first_stage_image(self, image_reps: Reps, direction: str = "t2i") -> torch.Tensor:
        """The serving first stage: the normalised global embeddings, whose inner product is ``score``."""
        return image_reps["embed"]

    def first_stage_text(self, text_reps: Reps, direction: str = "t2i") -> torch.Tensor:
        return text_reps["embed"]

    def text_tower(self):
        return self.backbone

    def check_cache(self, cache) -> None:
        """The cache's global embeddings must come from this very backbone (architecture, preprocessing, weights)."""
        check_cache_backbone(self, cache)

    def ensemble(self, text_reps: Reps, groups: torch.Tensor) -> Reps:
        """groups [T] int: group of each text (0..G-1) -> one normalised mean embedding per group [G, D]."""
        emb = text_reps["embed"]
        n = int(groups.max()) + 1 if len(groups) else 0
        total = torch.zeros(n, emb.shape[1], dtype=emb.dtype, device=emb.device).index_add_(0, groups.to(emb.device), emb)
        return {"embed": torch.nn.functional.normalize(total, dim=-1)}
