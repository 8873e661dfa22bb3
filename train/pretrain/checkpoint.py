"""Pre-training checkpoints: open_clip's weights as safetensors, everything else as JSON, nothing pickled.

A checkpoint is a folder ``OUT/checkpoints/<name>/`` (``step_00001000`` every ``--save-every-n-steps``,
``epoch_0003`` at the end of each epoch):

- ``model.safetensors``: the model's ``state_dict`` exactly as open_clip names it, so
  ``open_clip.create_model_and_transforms(name, pretrained=".../model.safetensors")`` loads it (open_clip reads
  safetensors files itself) and so does ``extract.models.backbone.load_backbone(name, path)`` -- hence ``python -m
  extract``, ``train.adapter --base`` and ``train.eval --model``.
- ``model.json``: what the weights are (format ``plugvlm-pretrain``; the open_clip model name *and* its config
  dict, QuickGELU or not, the method and its settings, step / epoch / samples seen, the data, all arguments,
  library versions, evaluation results). ``extract.models.weights.checkpoint_sidecar`` reads it back.
- ``state.safetensors`` + ``state.json``: what ``--resume`` needs besides the weights -- the optimizer's
  tensors (AdamW moments and step counts, keyed by parameter name) and hyper-parameters, the gradient scaler,
  torch's RNG states, the step, epoch and position in the epoch, the bad-step counter and the data report.

Folders are written under a temporary name, fsynced and renamed (atomic on POSIX); ``checkpoints/latest``
names the newest and is replaced atomically after the rename. A kill -9 at any moment therefore leaves the
previous checkpoints intact and ``--resume latest`` never sees half a checkpoint; leftovers are removed by the
next run. ``checkpoints/best`` names the checkpoint whose per-epoch evaluation scored highest (mean retrieval
R@1); :func:`prune` keeps the newest ``--keep-checkpoints`` and never deletes those two. The final weights are
also written as ``OUT/model.safetensors`` + ``OUT/model.json``.

Both safetensors files carry the digest of their tensors (``extract.common.tensorfile``); :func:`load_checkpoint` and
``extract.models.backbone.load_backbone`` check it, so a damaged copy or NaN weights are refused naming the file.

``python -m train.pretrain.checkpoint RUN OUT`` writes a run's final model in fp16 (half the bytes; what
the project ships in ``extract/models/bases/``) with its ``model.json`` and the command that made it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from extract.common.files import atomic_write_text, fsync_path
from extract.common.cli import Parser, option, parse_options, run_job
from extract.common.cli import build_parser as build_cli
from extract.common.tensorfile import load_tensors, save_tensors
from extract.models.weights import SIDECAR_FORMAT

FORMAT_VERSION = 1
LATEST = "latest"
BEST = "best"
_CHECKPOINT_DIR = re.compile(r"^(step|epoch)_\d+$")


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as contiguous CPU tensors (what goes into model.safetensors)."""
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}


def write_model(folder: Path, model: torch.nn.Module, description: dict) -> Path:
    """``folder/model.safetensors`` + ``folder/model.json`` (fsynced; the caller makes the folder visible)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    save_tensors(path, model_tensors(model), metadata={"format": "pt", "plugvlm": SIDECAR_FORMAT})
    _write_json(folder / "model.json", {"format": SIDECAR_FORMAT, "format_version": FORMAT_VERSION, **description})
    return path


def save_final(out: Path, model: torch.nn.Module, description: dict) -> Path:
    """``OUT/model.safetensors`` + ``OUT/model.json``, each replaced atomically."""
    tmp = out / f".final.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_model(tmp, model, description)
    os.replace(tmp / "model.safetensors", out / "model.safetensors")
    os.replace(tmp / "model.json", out / "model.json")
    shutil.rmtree(tmp, ignore_errors=True)
    fsync_path(out)
    return out / "model.safetensors"


# --------------------------------------------------------------------------------------------- resume state
def optimizer_state(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, json) for an optimizer whose parameters, in ``param_groups`` order, are named ``names``."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{names[idx]}/{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(names[idx], {})[key] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars, "names": names}


def load_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor],
                         meta: dict) -> None:
    if meta["names"] != names:
        raise ValueError("the checkpoint's optimizer holds other parameters than this model (another architecture "
                         "or a changed parameter grouping); resume with the same --model, or start a new run")
    state: dict[int, dict[str, Any]] = {}
    index = {n: i for i, n in enumerate(names)}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, name, field = key.split("/", 2)
            state.setdefault(index[name], {})[field] = value
    for name, scalars in meta["scalars"].items():
        state.setdefault(index[name], {}).update(scalars)
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/cuda_{i}"] = s
    return out


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    if "rng/torch_cpu" in tensors:
        torch.set_rng_state(tensors["rng/torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng/cuda_")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def save_checkpoint(ckpt_dir: Path, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    param_names: list[str], scaler, state: dict, description: dict) -> Path:
    """Write checkpoint ``ckpt_dir/name`` atomically and point ``latest`` at it (module docstring)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / name
    tmp = ckpt_dir / f"{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_model(tmp, model, description)
    opt_tensors, opt_meta = optimizer_state(optimizer, param_names)
    tensors = {**opt_tensors, **rng_tensors()}
    save_tensors(tmp / "state.safetensors", tensors)
    _write_json(tmp / "state.json", {"format_version": FORMAT_VERSION, **state, "optimizer": opt_meta,
                                     "scaler": scaler.state_dict() if scaler is not None else None})
    fsync_path(tmp)
    if final.exists():  # the same step saved again (e.g. a resumed run): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(ckpt_dir)
    atomic_write_text(ckpt_dir / LATEST, name + "\n")
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    param_names: list[str], scaler) -> dict:
    """Restore weights (strict), optimizer, scaler and RNG from a checkpoint folder; returns state.json. Both
    safetensors files are checked against their digests first (a damaged or NaN-holding file raises
    :class:`extract.common.tensorfile.TensorFileError` naming it, before anything is restored)."""
    weights, _ = load_tensors(path / "model.safetensors")
    tensors, _ = load_tensors(path / "state.safetensors")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit this model (missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}); resume with the --model it was trained with")
    state = json.loads((path / "state.json").read_text())
    if optimizer is not None:
        load_optimizer_state(optimizer, param_names, tensors, state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    restore_rng(tensors)
    return state


def find_resume(out: Path, resume: str) -> Path | None:
    """``--resume latest``: the folder ``checkpoints/latest`` names (None when there is none yet); else a path
    to a checkpoint folder (or to a file inside one)."""
    if resume == "latest":
        pointer = out / "checkpoints" / LATEST
        if not pointer.is_file():
            return None
        path = out / "checkpoints" / pointer.read_text().strip()
        if not (path / "state.json").is_file():
            raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint; pass "
                                    "--resume PATH with an older one from " + str(out / "checkpoints"))
        return path
    path = Path(resume)
    if path.is_file():
        path = path.parent
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"--resume {resume}: no checkpoint there (expected a folder with model.safetensors, "
                                "state.safetensors and state.json, or 'latest')")
    return path


def clean_partial(ckpt_dir: Path) -> int:
    """Remove temporary folders a killed run left behind; returns how many."""
    removed = 0
    for tmp in ckpt_dir.glob("*.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        removed += 1
    return removed


def _position(folder: Path) -> int:
    """How far into training a checkpoint is (its step); -1 when its state.json cannot be read."""
    try:
        return int(json.loads((folder / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def prune(ckpt_dir: Path, keep: int, keep_also: Iterable[str | None] = ()) -> list[str]:
    """Delete all but the ``keep`` newest checkpoints, step and epoch ones alike (newest = furthest into
    training), never the one ``latest`` names nor those in ``keep_also`` (the best evaluated one); ``keep`` 0
    keeps all. Returns the removed names, oldest first."""
    if keep <= 0 or not ckpt_dir.is_dir():
        return []
    spared = {n for n in keep_also if n}
    for pointer in (LATEST, BEST):
        if (ckpt_dir / pointer).is_file():
            spared.add((ckpt_dir / pointer).read_text().strip())
    found = sorted((_position(p), p.name) for p in ckpt_dir.iterdir() if p.is_dir() and _CHECKPOINT_DIR.match(p.name))
    removed = [name for _, name in found[:-keep] if name not in spared]
    for name in removed:
        shutil.rmtree(ckpt_dir / name, ignore_errors=True)
    return removed


def mark_best(ckpt_dir: Path, name: str) -> None:
    """Point ``checkpoints/best`` at checkpoint ``name`` (atomically, as ``latest``)."""
    atomic_write_text(ckpt_dir / BEST, name + "\n")


# --------------------------------------------------------------------------------------------- shipping
@dataclass
class ExportOptions:
    run: str = option(positional=True, help="a pre-training run folder (its model.safetensors + model.json)")
    out: str = option(positional=True, help="folder for the fp16 model.safetensors + model.json")
    command: str | None = option(None, help="the command(s) that trained the run, recorded in model.json")


def export_half(run: Path, out: Path, command: str | None = None) -> Path:
    """``run``'s final weights with every floating tensor cast to fp16 (integer buffers as they are), and its
    ``model.json`` (plus ``dtype`` and ``command``), written to ``out``. Loading casts back to the model's dtype;
    the digest is the fp16 file's own, so a damaged copy is still refused."""
    tensors, _ = load_tensors(run / "model.safetensors")
    description = json.loads((run / "model.json").read_text())
    if description.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"{run / 'model.json'} is not a python -m train.pretrain model description")
    half = {k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}
    description.update(dtype="float16", command=command)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(out / "model.safetensors", half, metadata={"format": "pt", "plugvlm": SIDECAR_FORMAT})
    _write_json(out / "model.json", description)
    return out / "model.safetensors"


def build_parser() -> Parser:
    return build_cli(ExportOptions, "python -m train.pretrain.checkpoint", __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: ExportOptions) -> None:
        path = export_half(Path(opts.run), Path(opts.out), opts.command)
        print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB, fp16) + model.json")

    return run_job(job, parse_options(ExportOptions, build_parser(), argv))


if __name__ == "__main__":
    raise SystemExit(main())
