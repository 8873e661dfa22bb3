"""Adapter checkpoints: safetensors files that describe themselves, and the training state for exact resumption.

Two kinds of file, one format (safetensors tensors + a JSON description in the safetensors header under
``"plugvlm"``; nothing is ever unpickled):

- **adapter** (``RUN/adapter.safetensors``, kind ``"adapter"``): the head's state dict (``head.<name>``) and
  the description evaluation and serving need to rebuild the model from the file alone: ``method``,
  ``config``, ``embed_dim``, ``base`` (backbone alias, pretrained tag / path and the weights' SHA-256),
  ``extraction`` (the cache's settings, fingerprint and resolved extraction arguments, so the live pipeline
  computes the very arrays the head was trained on), ``args``, ``epoch`` / ``step``, ``metrics`` and what
  ``fit_inference`` fitted. A ``.json`` copy of the description is written next to it for people.
- **training state** (``RUN/checkpoints/last.safetensors``, kind ``"train_state"``): the same plus the
  optimizer's tensors (``optimizer.<param index>.<key>``), the RNG states (``rng.<name>``), and in the JSON
  the optimizer's param groups, the scheduler and gradient-scaler states and the position in the data
  order, so ``--resume`` continues exactly where the run stopped. Other trained modules (the backbone of an
  ``--unfreeze`` fine-tune) are stored under their own prefix (``backbone.<name>``).
- **detector** (a run trained on detected boxes, ``--boxes yolo``): ``RUN/detector.pt``, a copy of the detector
  weights that found its training boxes, written by :func:`save_detector`; the adapter's description names it under
  ``"detector"`` (file, SHA-256, where it was copied from) and :func:`run_detector` gives it back, checked.
- **fine-tuned backbone** (``--unfreeze``): ``RUN/backbone.safetensors``, the open_clip model's plain state
  dict (``open_clip.load_checkpoint`` reads it), written by :func:`save_backbone_weights`; the adapter's
  description names it under ``"backbone"`` (file, SHA-256, text context length).

Files are written to a temporary name and renamed, so a crash never leaves a half-written checkpoint where
the last good one was. Every file carries the digest of its tensors (``extract.common.tensorfile``), checked when it
is read: a damaged copy, or a file holding NaN / infinite weights, is refused with its name.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from adapters.heads.base import AdapterHead
from adapters.registry import ADAPTERS
from extract.common.files import atomic_write_text
from extract.common.tensorfile import load_tensors, save_tensors

FORMAT = "plugvlm-adapter"
VERSION = 1


class CheckpointError(ValueError):
    """A file that is not a (compatible) plugvlm adapter checkpoint; the message says what it is instead."""


# --------------------------------------------------------------------------------------------- raw format
def save_atomic(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """safetensors file written under a temporary name and renamed into place: a reader (or a run killed
    mid-write) never sees half a file. The header carries the tensors' digest, the file the umask's
    permissions (:func:`extract.common.tensorfile.save_tensors`); :func:`read_tensors` reads it back verified."""
    return save_tensors(path, tensors, metadata)


def read_tensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a file :func:`save_atomic` wrote (e.g. a per-rank RNG file), verified against its digest
    (:func:`extract.common.tensorfile.load_tensors`: a damaged file or non-finite weights raise, naming the file)."""
    return load_tensors(path, device)[0]


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write ``tensors`` + ``meta`` (JSON-serialisable) atomically; returns the path."""
    header = {"format": FORMAT, "version": str(VERSION),
              "plugvlm": json.dumps(meta, sort_keys=True, default=_json_default)}
    return save_atomic(tensors, path, header)


def _json_default(obj):
    if isinstance(obj, (Path, torch.device, torch.dtype)):
        return str(obj)
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"not JSON-serialisable in a checkpoint description: {type(obj).__name__}")


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON description of a checkpoint, without loading its tensors. Raises CheckpointError on any file
    that is not one of ours (another safetensors file, a .pt, a newer format version)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"adapter checkpoint {path} not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for non-safetensors files
        raise CheckpointError(f"{path} is not a safetensors file ({type(e).__name__}: {e}); adapter checkpoints "
                              "are written by python -m train.adapter") from None
    if header.get("format") != FORMAT:
        raise CheckpointError(f"{path} is a safetensors file but not a plugvlm adapter checkpoint (no "
                              f"format={FORMAT!r} in its header); backbone weights go to --pretrained, not --model")
    if int(header.get("version", 0)) > VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {header['version']}; this plugvlm reads up to "
                              f"{VERSION}: update plugvlm")
    return json.loads(header["plugvlm"])


def is_checkpoint(path: str | os.PathLike) -> bool:
    try:
        read_meta(path)
        return True
    except (CheckpointError, FileNotFoundError):
        return False


def read(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, description) of a checkpoint; the tensors are verified against the digest saved with them
    (a damaged file or non-finite weights raise :class:`extract.common.tensorfile.TensorFileError` naming the file)."""
    meta = read_meta(path)
    return read_tensors(path, device), meta


def _sub(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


# --------------------------------------------------------------------------------------------- the head
def describe_head(head: AdapterHead) -> dict:
    return {"method": head.name, "config": head.config_dict(), "embed_dim": head.embed_dim}


def build_head(meta: dict) -> AdapterHead:
    """The (untrained) head a description names; an unregistered method lists the registered ones."""
    try:
        cls = ADAPTERS.get(meta["method"])
    except KeyError as e:
        raise CheckpointError(f"checkpoint names {e.args[0]}") from None
    return cls.from_config(meta.get("config"), int(meta["embed_dim"]))


def load_head_state(head: AdapterHead, tensors: dict[str, torch.Tensor], source: str) -> None:
    state = _sub(tensors, "head.")
    own = head.state_dict()
    wrong = [f"{k} {tuple(v.shape)} (this version: {tuple(own[k].shape)})" for k, v in state.items()
             if k in own and v.shape != own[k].shape]
    if wrong:  # a head written by another version of the method: its weights cannot be read into this one
        raise CheckpointError(f"{source}: head weights do not fit {head.name} as this version of plugvlm builds it "
                              f"({', '.join(wrong[:3])}): train the adapter again with this version")
    result = head.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(f"{source}: head weights do not fit {head.name} with this config "
                              f"(missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]})")


def save_adapter(path: str | os.PathLike, head: AdapterHead, meta: dict) -> Path:
    """The inference checkpoint: head weights + description (module docstring). ``meta`` adds to
    :func:`describe_head`'s fields. Also writes ``<path>.json`` with the description."""
    meta = {"kind": "adapter", **meta, **describe_head(head)}
    tensors = {f"head.{k}": v for k, v in head.state_dict().items()}
    out = write(path, tensors, meta)
    atomic_write_text(Path(str(out) + ".json"), json.dumps(meta, indent=2, sort_keys=True, default=_json_default) + "\n")
    return out


def load_adapter(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[AdapterHead, dict]:
    """Rebuild a head from a checkpoint alone (adapter or training state): (head in eval mode, description)."""
    tensors, meta = read(path)
    head = build_head(meta)
    load_head_state(head, tensors, str(path))
    return head.to(device).eval(), meta


# --------------------------------------------------------------------------------------------- fine-tuned backbone
def save_backbone_weights(path: str | os.PathLike, model: torch.nn.Module) -> dict:
    """Write an open_clip model's state dict as plain safetensors (open_clip's key names, no wrapper), atomically.
    Returns ``{"file": name, "weights_sha256": ...}`` for the adapter's description."""
    from extract.models.weights import file_sha256

    path = save_atomic(model.state_dict(), path, {"format": "pt"})
    return {"file": path.name, "weights_sha256": file_sha256(path)}


# --------------------------------------------------------------------------------------------- the detector
def save_detector(run_dir: str | os.PathLike, extraction: dict) -> dict:
    """Copy the detector that found a run's training boxes into its folder (``RUN/detector.pt``, or ``.yaml`` for a
    local model config), so that a copied run folder scores anywhere, as the fine-tuned backbone does. Returns
    ``{"detector": {"file", "sha256", "trained_from"}}`` for the adapter's description, or {} when the boxes came
    from no detector file (ground truth, random boxes, a model config ultralytics ships). ``extraction``: the
    adapter's ``extraction`` description (the training cache's settings name the detector and its digest)."""
    import shutil

    from extract.models.weights import file_sha256

    boxes = (extraction.get("settings") or {}).get("boxes") or {}
    weights = (boxes.get("detector") or {}).get("weights") or {}
    source = weights.get("file") or weights.get("config")
    if boxes.get("source") != "yolo" or not source or not Path(source).is_file():
        return {}
    source = Path(source)
    out = Path(run_dir) / f"detector{source.suffix.lower()}"
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.copyfile(source, tmp)
    digest = file_sha256(tmp)
    if weights.get("sha256") and digest != weights["sha256"]:
        tmp.unlink()
        raise CheckpointError(f"the detector {source} changed after the training cache was extracted with it (SHA-256 "
                              f"{weights['sha256'][:16]}... then, {digest[:16]}... now): put the original back, or "
                              "train again (the cache is rebuilt for the new detector)")
    os.replace(tmp, out)
    return {"detector": {"file": out.name, "sha256": digest, "trained_from": str(source)}}


def run_detector(path: str | os.PathLike, meta: dict) -> str | None:
    """The run folder's copy of the detector the adapter at ``path`` was trained with (:func:`save_detector`),
    checked against the digest its description records (a missing or altered copy is refused, saying what to do);
    None for a checkpoint that carries none (a shipped model config, or written before detectors travelled with their
    runs: it names the detector where it lay, and a ``.pt`` no longer there is refused, saying what to pass)."""
    from extract.models.weights import file_sha256

    entry = meta.get("detector")
    if not entry:
        named = ((meta.get("extraction") or {}).get("args") or {}).get("detector")
        if named and str(named).lower().endswith(".pt") and not Path(named).is_file():  # not ultralytics' to fetch
            raise FileNotFoundError(f"{path} names its detector where it lay when it was trained, {named}, which is "
                                    "not there (runs written before detectors travelled in their run folder): pass "
                                    "--detector PATH (detector=PATH) with those weights, or train it again")
        return None
    copy = Path(path).parent / entry["file"]
    if not copy.is_file():
        raise FileNotFoundError(f"{path} was trained on boxes from the detector {entry.get('trained_from')}, which "
                                f"travels in its run folder as {entry['file']}, missing there: copy the run folder "
                                "whole, or pass --detector PATH (detector=PATH) to score with those weights")
    digest = file_sha256(copy)
    if digest != entry["sha256"]:
        raise CheckpointError(f"{copy} has SHA-256 {digest[:16]}..., but {path} was trained with a detector of SHA-256 "
                              f"{entry['sha256'][:16]}...: restore the run folder's {entry['file']}, or pass "
                              "--detector PATH (detector=PATH) to score with other weights on purpose")
    return str(copy)


# --------------------------------------------------------------------------------------------- training state
def save_training_state(path: str | os.PathLike, head: AdapterHead, optimizer: torch.optim.Optimizer,
                        scheduler, scaler, meta: dict, modules: dict[str, torch.nn.Module] | None = None) -> Path:
    """Everything ``--resume`` needs (module docstring). ``scheduler`` / ``scaler`` may be None; ``modules``:
    other trained modules by prefix (e.g. ``{"backbone": open_clip_model}``), restored by the same prefix."""
    tensors = {f"head.{k}": v for k, v in head.state_dict().items()}
    for prefix, module in (modules or {}).items():
        if prefix in ("head", "optimizer", "rng"):
            raise ValueError(f"module prefix {prefix!r} is taken by the checkpoint format")
        tensors.update({f"{prefix}.{k}": v for k, v in module.state_dict().items()})
    opt = optimizer.state_dict()
    opt_scalars: dict[str, dict] = {}
    for index, state in opt["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value
            else:
                opt_scalars.setdefault(str(index), {})[key] = value
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for k, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{k}"] = s
    state = {"param_groups": opt["param_groups"], "optimizer_scalars": opt_scalars,
             "scheduler": _plain(scheduler.state_dict()) if scheduler is not None else None,
             "scaler": _plain(scaler.state_dict()) if scaler is not None else None}
    return write(path, tensors, {"kind": "train_state", **meta, **describe_head(head), "state": state,
                                 "modules": sorted(modules or {})})


def _plain(state: dict) -> dict:
    # LambdaLR keeps [None] for plain-function lambdas; every value left is a number, list or None.
    return {k: v for k, v in state.items() if not callable(v)}


def load_training_state(path: str | os.PathLike, head: AdapterHead, optimizer: torch.optim.Optimizer,
                        scheduler, scaler, modules: dict[str, torch.nn.Module] | None = None) -> dict:
    """Restore head, optimizer, scheduler, scaler and RNG states (and ``modules`` by prefix, as saved) in
    place; returns the description."""
    tensors, meta = read(path)
    if meta.get("kind") != "train_state":
        raise CheckpointError(f"{path} is an inference checkpoint ({meta.get('kind')}); --resume needs "
                              "RUN/checkpoints/last.safetensors")
    load_head_state(head, tensors, str(path))
    saved = set(meta.get("modules", []))
    for prefix, module in (modules or {}).items():
        if prefix not in saved:
            raise CheckpointError(f"{path} holds no {prefix!r} weights (saved modules: {sorted(saved) or 'none'}); "
                                  "it was written by a run of another mode")
        result = module.load_state_dict(_sub(tensors, prefix + "."), strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise CheckpointError(f"{path}: {prefix} weights do not fit this model (missing "
                                  f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]})")
    state = meta["state"]
    opt_state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            opt_state.setdefault(int(index), {})[name] = value
    for index, scalars in state["optimizer_scalars"].items():
        opt_state.setdefault(int(index), {}).update(scalars)
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in state["param_groups"]]  # JSON lists
    optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    return meta
