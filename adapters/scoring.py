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
    ``direction`` "t2i" or "i2t" (see :class:`adapters.base.AdapterHead`).
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

    def text_input_keys(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """The token ids each text becomes, after truncation to the context (see :class:`Scorer`)."""
        return token_keys(self.backbone, texts)

    def first_stage_image(self, image_reps: Reps, direction: str = "t2i") -> torch.Tensor:
        """The serving first stage: the normalised global embeddings, whose inner product is ``score``."""
        return image_reps["embed"]

    def first_stage_text(self, text_reps: Reps, direction: str = "t2i") -> torch.Tensor:
        return text_reps["embed"]

    def ensemble(self, text_reps: Reps, groups: torch.Tensor) -> Reps:
        """groups [T] int: group of each text (0..G-1) -> one normalised mean embedding per group [G, D]."""
        emb = text_reps["embed"]
        n = int(groups.max()) + 1 if len(groups) else 0
        total = torch.zeros(n, emb.shape[1], dtype=emb.dtype, device=emb.device).index_add_(0, groups.to(emb.device), emb)
        return {"embed": torch.nn.functional.normalize(total, dim=-1)}


def is_adapter_path(model: str) -> bool:
    """True when ``--model`` names an adapter checkpoint file or a training run folder holding one."""
    import os

    return model.endswith(".safetensors") or os.path.isfile(os.path.join(model, "adapter.safetensors"))


def pretrained_checkpoint(model: str) -> tuple[str, str] | None:
    """(architecture, weights file) when ``--model`` names a ``python -m train.pretrain`` checkpoint (its
    ``model.safetensors``, or the run folder holding one): it says what it is in its JSON description, so no
    ``--pretrained`` is needed. None otherwise."""
    from pathlib import Path

    from extract.weights import checkpoint_sidecar

    path = Path(model)
    if path.is_dir():
        path = path / "model.safetensors"
    if path.suffix != ".safetensors" or not path.is_file():
        return None
    sidecar = checkpoint_sidecar(path)
    return (sidecar["model"], str(path)) if sidecar and sidecar.get("model") else None


def load_scorer(model: str, pretrained: str | None = None, *, device: str | torch.device = "cpu",
                precision: str = "fp32", annotations=None, detector: str | None = None) -> Scorer:
    """The scorer for ``--model``: a backbone alias / open_clip name, with ``pretrained`` a tag, a checkpoint
    path or 'none'; a pre-trained checkpoint of ours (``RUN/model.safetensors`` or the run folder: it names its
    architecture); or an adapter checkpoint (``RUN/adapter.safetensors`` or the run folder), rebuilt from the
    file alone through the method registry (``pretrained`` then relocates its base weights). ``annotations`` /
    ``detector``: boxes for adapters trained on ground-truth boxes (see :mod:`adapters.adapter_scorer`);
    ignored by bare backbones."""
    ours = pretrained_checkpoint(model) if pretrained is None else None
    if ours is not None:
        model, pretrained = ours
    elif is_adapter_path(model):
        from adapters.adapter_scorer import AdapterScorer

        return AdapterScorer.from_checkpoint(model, device=device, pretrained=pretrained, annotations=annotations,
                                             detector=detector)
    from extract.backbone import load_backbone

    backbone = load_backbone(model, pretrained, device=device, precision=precision)
    label = model if pretrained is None else f"{model}:{pretrained}"
    # A pre-trained checkpoint (python -m train.pretrain) names its method; a method that scores with more than
    # the global embeddings (FILIP's late interaction) provides its scorer through the PRETRAIN registry.
    from extract.weights import checkpoint_sidecar

    sidecar = checkpoint_sidecar(backbone.weights.path) if backbone.weights.kind == "file" else None
    if sidecar is not None:
        from adapters.registry import PRETRAIN

        method = PRETRAIN.get(sidecar["method"]) if sidecar.get("method") in PRETRAIN else None
        if hasattr(method, "scorer"):
            return method.scorer(backbone, name=label)
    return BackboneScorer(backbone, name=label)
