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
    ``ensemble(text_reps, groups)`` (optional): merge the texts of each group (prompt templates of one class)
    into one representation per group, in group order; without it, zero-shot averages scores over templates.
    """

    name: str
    preprocess: Callable
    device: torch.device

    def encode_images(self, images: torch.Tensor) -> Reps: ...

    def encode_texts(self, texts: Sequence[str]) -> Reps: ...

    def score(self, image_reps: Reps, text_reps: Reps) -> torch.Tensor: ...


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


class BackboneScorer:
    """A frozen backbone as a scorer: cosine similarity of the normalised global embeddings (CLIP).

    Zero-shot prompt ensembles follow CLIP: mean of the normalised template embeddings, normalised again.
    """

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

    def ensemble(self, text_reps: Reps, groups: torch.Tensor) -> Reps:
        """groups [T] int: group of each text (0..G-1) -> one normalised mean embedding per group [G, D]."""
        emb = text_reps["embed"]
        n = int(groups.max()) + 1 if len(groups) else 0
        total = torch.zeros(n, emb.shape[1], dtype=emb.dtype, device=emb.device).index_add_(0, groups.to(emb.device), emb)
        return {"embed": torch.nn.functional.normalize(total, dim=-1)}


def load_scorer(model: str, pretrained: str | None = None, *, device: str | torch.device = "cpu",
                precision: str = "fp32") -> Scorer:
    """The scorer for ``--model``: a backbone alias / open_clip name, with ``pretrained`` a tag, a checkpoint
    path or 'none'. Adapter checkpoints join here through the method registry (they describe themselves)."""
    from extract.backbone import load_backbone

    backbone = load_backbone(model, pretrained, device=device, precision=precision)
    label = model if pretrained is None else f"{model}:{pretrained}"
    return BackboneScorer(backbone, name=label)
