"""A weights file read into an open_clip model: checked, strict, never unpickling what a user hands us; and the model
built for it without drawing the random weights the file replaces.

Formats: safetensors (a file plugvlm wrote is checked against the digest of its tensors), ``torch.load(weights_only=
True)``, TorchScript archives (OpenAI's ``.pt``, read with ``torch.jit.load``, whose restricted unpickler builds only
TorchScript types), big_vision's numpy weights through open_clip. Third-party layouts are converted and position
embeddings resized as open_clip does. Every failure is a :class:`WeightsFileError` (a ValueError) naming the file.
"""
from __future__ import annotations

import contextlib
import json
import pickle
import re
import threading
from pathlib import Path

import torch
from torch import nn


def _is_torchscript(path: Path) -> bool:
    """OpenAI's original CLIP .pt files are TorchScript archives (a zip with code/ and constants.pkl)."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/constants.pkl") or "/code/" in n for n in z.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):  # an end record but a damaged directory: torch.load says so
        return False


class WeightsFileError(ValueError):
    """A weights file (``--pretrained``) plugvlm cannot use; the message names the file and what to do."""


class PickledObjectsError(WeightsFileError):
    """A weights file that is a pickle holding Python objects besides tensors: plugvlm will not unpickle it.
    The message names what torch refused and how to convert the file to safetensors."""


class UnreadableWeightsError(WeightsFileError):
    """A weights file torch cannot read at all: cut short (an interrupted download or copy), damaged, or not a
    checkpoint (another kind of file under a .pt name)."""


class ArchitectureMismatchError(WeightsFileError):
    """A readable weights file whose tensors do not fit the model built for it (another architecture, or another
    size of the same one); the message names a few missing, unexpected and differently shaped tensors."""


def _torch_said(error: Exception) -> str:
    """The gist of a torch.load error: the weights-only unpickler's own reason without torch's boilerplate around
    it, else the first sentence."""
    text = str(error)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. Please use|\n\s*\n|$)", text, re.S)
    return " ".join((found.group(1) if found else text.split(". ")[0] if text else type(error).__name__).split())


def _pickled_objects_message(path: Path, error: Exception) -> str:
    import zipfile

    refused = _torch_said(error)
    what = ("a PyTorch file (torch.save) that holds Python objects besides tensors" if zipfile.is_zipfile(path)
            else "a plain pickle file, not a PyTorch tensor file")
    out = path.with_suffix(".safetensors")
    return (
        f"{path} is {what} (torch's tensors-only loader refused it: {refused}). plugvlm will not unpickle it: "
        "unpickling can run arbitrary code from the file. Convert it "
        "once, on a machine where you trust the file, to a safetensors state dict plugvlm loads (these 3 lines of "
        "Python, pasted as they are):\n"
        "import torch; from safetensors.torch import save_file\n"
        f"ckpt = torch.load({json.dumps(str(path))}, map_location=\"cpu\", weights_only=False)\n"
        "sd = ckpt.get(\"state_dict\", ckpt); save_file({k.removeprefix(\"module.\"): v.detach().clone().contiguous() "
        f"for k, v in sd.items() if isinstance(v, torch.Tensor)}}, {json.dumps(str(out))})\n"
        f"then pass --pretrained {out}")


def _unreadable(path: Path, error: Exception | str) -> UnreadableWeightsError:
    said = error if isinstance(error, str) else f"torch.load: {type(error).__name__}: {_torch_said(error)}"
    return UnreadableWeightsError(f"{path} is not a readable PyTorch file (cut short or not a checkpoint; {said}): "
                                  "re-copy or re-download it")


def _refuses_objects(path: Path, error: Exception) -> bool:
    """Whether torch's weights-only unpickler refused ``path`` for holding objects (or for being a plain pickle of
    protocol 4+, whose FRAME opcode it does not take) rather than because the file is cut or is not a pickle:
    junk bytes trip the same unpickler ("Unsupported operand", a stray opcode) and must not get conversion advice."""
    text = str(error)
    if isinstance(error, RuntimeError) and "weights_only" not in text and "WeightsUnpickler" not in text:
        return False
    if re.search(r"Unsupported (global|class)|not an allowed global|Can only build", text):
        return True
    with open(path, "rb") as f:  # a pickle starts with PROTO (0x80) and its protocol number
        head = f.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5 and "Unsupported operand" in text


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file (safetensors, verified when plugvlm wrote it; a torch.save file read with
    ``weights_only=True``; a TorchScript archive), as a state dict without DDP's ``module.`` prefix.

    Everything torch raises for a file it cannot parse becomes one error naming the file: a cut zip archive
    (RuntimeError from PytorchStreamReader), a cut or foreign byte stream taken for a legacy pickle (EOFError,
    and whatever the unpickler trips over first: KeyError, IndexError, struct.error, UnicodeDecodeError, ...).
    Raises :class:`PickledObjectsError`, :class:`UnreadableWeightsError`, or TensorFileError (safetensors)."""
    import warnings

    if path.suffix == ".safetensors":  # open_clip's own test for the format
        from extract.common.tensorfile import load_tensors

        checkpoint = load_tensors(path)[0]  # TensorFileError (a ValueError naming the file) when unusable
    elif _is_torchscript(path):
        try:
            state_dict = torch.jit.load(str(path), map_location="cpu").state_dict()
        except Exception as e:  # a damaged archive; jit's restricted unpickler builds TorchScript types only
            raise _unreadable(path, e) from None
        # TorchScript archives also carry buffers that are not parameters of the eager model
        # (input_resolution / context_length / vocab_size in OpenAI's files, the causal attn_mask).
        return {k: v for k, v in state_dict.items() if k not in ("input_resolution", "context_length", "vocab_size")}
    else:
        try:
            with warnings.catch_warnings():  # "Detected pickle protocol 4": about files we refuse anyway
                warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
                checkpoint = torch.load(str(path), map_location="cpu", weights_only=True)
        except (OSError, MemoryError):
            raise
        except Exception as e:
            if isinstance(e, (pickle.UnpicklingError, RuntimeError)) and _refuses_objects(path, e):
                raise PickledObjectsError(_pickled_objects_message(path, e)) from None
            raise _unreadable(path, e) from None
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict):
        checkpoint = checkpoint["state_dict"]  # a training checkpoint: {"epoch", "state_dict", ...}
    if not isinstance(checkpoint, dict) or not any(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        what = f"a {type(checkpoint).__name__}" + (" without tensors" if isinstance(checkpoint, (dict, list)) else "")
        raise _unreadable(path, f"it holds {what}, not a state dict of tensors")
    return {(k[len("module."):] if isinstance(k, str) and k.startswith("module.") else k): v
            for k, v in checkpoint.items()}


def _fit_state_dict(model: nn.Module, state_dict: dict) -> dict:
    """``state_dict`` in ``model``'s layout, as ``open_clip.load_checkpoint`` massages it: third-party layouts
    converted, the old text-tower naming, a scalar or 1-d logit scale / bias, position embeddings resized."""
    from open_clip.factory import convert_state_dict
    from open_clip.model import convert_to_custom_text_state_dict, resize_pos_embed, resize_text_pos_embed

    state_dict = convert_state_dict(model, state_dict)
    if "positional_embedding" in state_dict and not hasattr(model, "positional_embedding"):
        state_dict = convert_to_custom_text_state_dict(state_dict)
    for key in ("logit_scale", "logit_bias"):
        ours = getattr(model, key, None)
        if key in state_dict and isinstance(ours, torch.Tensor) and ours.ndim != state_dict[key].ndim:
            state_dict[key] = state_dict[key].reshape(ours.shape)
    siglip = getattr(model, "logit_bias", None) is not None
    if siglip and "logit_bias" not in state_dict and "logit_scale" in state_dict:  # a CLIP file for a SigLIP model
        state_dict["logit_bias"] = torch.zeros_like(state_dict["logit_scale"])
    state_dict.pop("text.transformer.embeddings.position_ids", None)  # gone from transformers >= 4.31 models
    resize_pos_embed(state_dict, model)
    resize_text_pos_embed(state_dict, model)
    return state_dict


def _mismatch(path: Path, expected: dict, state_dict: dict, architecture: str) -> str | None:
    """What keeps ``state_dict`` from loading strictly where ``expected`` (a model's state dict) is wanted, naming a
    few tensors of each kind; None when it fits."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shapes = [f"{k} {tuple(v.shape)} in the file, {tuple(expected[k].shape)} in the model"
              for k, v in state_dict.items() if k in expected and isinstance(v, torch.Tensor)
              and tuple(v.shape) != tuple(expected[k].shape)]

    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")

    parts = ([f"{len(missing)} of the model's tensors missing ({few(missing)})"] if missing else []) \
        + ([f"{len(unexpected)} unexpected ({few(unexpected)})"] if unexpected else []) \
        + ([f"{len(shapes)} of another shape ({few(shapes)})"] if shapes else [])
    if not parts:
        return None
    return (f"{path} does not fit architecture {architecture}: {'; '.join(parts)}. Are these another model's "
            "weights? Pass the architecture they were saved from")


def load_weights_file(model: nn.Module, path: str | Path, architecture: str | None = None) -> None:
    """Load a weights file into an open_clip ``model`` (strict) without unpickling arbitrary objects.

    safetensors, torch.load(weights_only=True), or TorchScript archives (OpenAI's .pt) read with torch.jit.load,
    whose restricted unpickler builds only TorchScript types, never arbitrary Python objects; third-party layouts
    are converted and position embeddings resized as open_clip does. A safetensors file plugvlm wrote is checked
    against the digest of its tensors (:func:`extract.common.tensorfile.load_tensors`). ``architecture`` names the model
    in messages. Every failure is a ValueError naming the file (one ``error:`` line from a job):
    :class:`extract.common.tensorfile.TensorFileError` for a damaged safetensors file or non-finite weights,
    :class:`PickledObjectsError` for a pickle holding other objects (with how to convert it),
    :class:`UnreadableWeightsError` for a file torch cannot read (cut short, not a checkpoint), and
    :class:`ArchitectureMismatchError` when the weights do not fit ``model``.
    """
    import open_clip

    path = Path(path)
    if path.suffix in (".npz", ".npy"):  # big_vision (SigLIP) numpy weights: open_clip's own converter
        open_clip.load_checkpoint(model, str(path), strict=True)
        return
    state_dict = _read_state_dict(path)
    try:
        state_dict = _fit_state_dict(model, state_dict)
    except (RuntimeError, KeyError, ValueError, IndexError) as e:  # resizing met shapes of another model
        raise ArchitectureMismatchError(f"{path} does not fit architecture {architecture or type(model).__name__}: "
                                        f"{type(e).__name__}: {e}") from None
    # TorchScript archives (OpenAI's) also save the causal attn_mask, a buffer the eager model rebuilds
    expected = model.state_dict()
    state_dict = {k: v for k, v in state_dict.items() if k in expected or not k.endswith("attn_mask")}
    problem = _mismatch(path, expected, state_dict, architecture or type(model).__name__)
    if problem is not None:
        raise ArchitectureMismatchError(problem)
    model.load_state_dict(state_dict, strict=True)


# --------------------------------------------------------------------------------------------- building for a file
#: torch.nn.init's initialisers: what a module's constructor draws its random weights with
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
_skip = threading.local()
_installed_lock = threading.Lock()
_installed = {"count": 0, "originals": {}}


def _skipping(real):
    def initialiser(tensor, *args, **kwargs):
        return tensor if getattr(_skip, "on", False) else real(tensor, *args, **kwargs)

    return initialiser


@contextlib.contextmanager
def weights_come_later():
    """Modules built in this thread inside the block skip ``torch.nn.init``'s random draws: their parameters are
    allocated, not drawn, because a weights file loaded strictly right after replaces every one of them
    (:func:`load_weights_file` refuses a file that leaves any out). Random init is most of building a model: ViT-B/32
    in 0.94 s with it, 0.11 s without, on two CPU threads here. Other threads keep drawing (the initialisers are
    wrapped while any block is open and check a thread-local flag), and tensors drawn directly (``torch.randn``) are
    drawn as before."""
    import torch.nn.init as init

    with _installed_lock:
        if _installed["count"] == 0:
            _installed["originals"] = {name: getattr(init, name) for name in _INITIALISERS if hasattr(init, name)}
            for name, real in _installed["originals"].items():
                setattr(init, name, _skipping(real))
        _installed["count"] += 1
    _skip.on = True
    try:
        yield
    finally:
        _skip.on = False
        with _installed_lock:
            _installed["count"] -= 1
            if _installed["count"] == 0:
                for name, real in _installed["originals"].items():
                    setattr(init, name, real)
