"""Which scorer a ``--model`` names: a backbone alias or open_clip name with its weights, one of our pre-trained
checkpoints (it names its architecture and method), or an adapter checkpoint rebuilt from the file alone through the
method registry. Every job that takes ``--model`` asks here; the scorers themselves live below
(:mod:`adapters.scoring`, :mod:`adapters.adapter_scorer`)."""
from __future__ import annotations

import torch

from adapters.adapter_scorer import AdapterScorer
from adapters.scoring import BackboneScorer, Scorer


def is_adapter_path(model: str) -> bool:
    """True when ``--model`` names an adapter checkpoint file or a training run folder holding one."""
    import os

    return model.endswith(".safetensors") or os.path.isfile(os.path.join(model, "adapter.safetensors"))


def pretrained_checkpoint(model: str) -> tuple[str, str] | None:
    """(architecture, weights file) when ``--model`` names a ``python -m train.pretrain`` checkpoint (its
    ``model.safetensors``, or the run folder holding one): it says what it is in its JSON description, so no
    ``--pretrained`` is needed. None otherwise."""
    from pathlib import Path

    from extract.models.weights import checkpoint_sidecar

    path = Path(model)
    if path.is_dir():
        path = path / "model.safetensors"
    if path.suffix != ".safetensors" or not path.is_file():
        return None
    sidecar = checkpoint_sidecar(path)
    return (sidecar["model"], str(path)) if sidecar and sidecar.get("model") else None


def load_scorer(model: str, pretrained: str | None = None, *, device: str | torch.device = "cpu",
                precision: str = "fp32", annotations=None, detector: str | None = None,
                max_missing_boxes: float | None = None, use_annotations: bool = False) -> Scorer:
    """The scorer for ``--model``: a backbone alias / open_clip name, with ``pretrained`` a tag, a checkpoint
    path or 'none'; a pre-trained checkpoint of ours (``RUN/model.safetensors`` or the run folder: it names its
    architecture); or an adapter checkpoint (``RUN/adapter.safetensors`` or the run folder), rebuilt from the
    file alone through the method registry (``pretrained`` then relocates its base weights). Boxes (see
    :mod:`adapters.adapter_scorer`): an adapter trained on detected boxes detects with the detector its run folder
    carries; ``annotations`` (a file or folder :func:`extract.data.boxes.read_boxes` reads, or a dict keyed by image
    id, int or str) give the boxes of adapters trained on ground-truth boxes, and of any adapter with
    ``use_annotations=True`` (the user's ``--annotations``: it replaces the trained box source); ``detector`` (YOLO
    weights) replaces it too; ``max_missing_boxes`` the share of a collection's images annotations may leave out.
    Bare backbones read no boxes."""
    ours = pretrained_checkpoint(model) if pretrained is None else None
    if ours is not None:
        model, pretrained = ours
    elif is_adapter_path(model):
        return AdapterScorer.from_checkpoint(model, device=device, pretrained=pretrained, annotations=annotations,
                                             detector=detector, max_missing_boxes=max_missing_boxes,
                                             use_annotations=use_annotations)
    from extract.models.backbone import load_backbone

    backbone = load_backbone(model, pretrained, device=device, precision=precision)
    label = model if pretrained is None else f"{model}:{pretrained}"
    # A pre-trained checkpoint (python -m train.pretrain) names its method; a method that scores with more than
    # the global embeddings (FILIP's late interaction) provides its scorer through the PRETRAIN registry.
    from extract.models.weights import checkpoint_sidecar

    sidecar = checkpoint_sidecar(backbone.weights.path) if backbone.weights.kind == "file" else None
    if sidecar is not None:
        from adapters.registry import PRETRAIN

        method = PRETRAIN.get(sidecar["method"]) if sidecar.get("method") in PRETRAIN else None
        if hasattr(method, "scorer"):
            return method.scorer(backbone, name=label)
    return BackboneScorer(backbone, name=label)
