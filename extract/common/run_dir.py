"""Run folders: where a training job writes, chosen when the user names none, and never another run's.

``python -m train.adapter --method comalign`` writes ``runs/tiny-comalign``; ``--base ViT-B-32`` makes it
``runs/ViT-B-32-comalign``. A run folder holds ``config.json`` (the resolved options). :func:`claim` creates the
folder, refusing one that cannot be written, and lets a run write into a folder that is new, empty, or holds a run
with the same settings (rerunning a command; settings that do not change the result -- device, workers, verbosity,
resume -- do not count); it refuses, naming the differences and the fix, a folder holding a run with other
settings: a run never silently overwrites another.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

# options that change where or how fast a run goes, not what it computes
NEUTRAL = frozenset({"device", "workers", "quiet", "verbose", "resume", "out", "config", "stop_after_steps",
                     "eval_batch_size", "extract_batch_size", "keep_checkpoints", "log_every_n_steps",
                     "tensorboard", "dist_url", "save_every", "save_every_n_steps", "save_frequency",
                     "eval_every_n_epochs", "max_bad_steps", "compile", "compile_backend", "compile_mode", "fused_adamw",
                     "jobs"})


def default_out(*parts: str) -> Path:
    """``runs/<part1>-<part2>...`` with each part made safe for a folder name (``ViT-B-32``, ``comalign``)."""
    name = "-".join(re.sub(r"[^A-Za-z0-9._-]+", "_", str(p)).strip("_") for p in parts if p)
    return Path("runs") / name


def ensure_writable(out: Path) -> None:
    """Create the run folder ``out`` (parents included) and write and remove a file in it; raise ValueError naming
    ``--out`` when either fails (a path through a file, no permission, a read-only disk), so an unusable --out
    stops a run before extraction or training rather than at its first write, minutes later."""
    import tempfile

    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: pass a folder for the run")
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"--out {out} cannot be used as the run folder ({e.strerror or type(e).__name__}"
                         + (f": {e.filename}" if e.filename and str(e.filename) != str(out) else "")
                         + "): pass a folder you can write to") from None


def claim(out: Path, config: dict, *, resume: bool = False, neutral: Iterable[str] = NEUTRAL) -> None:
    """Raise ValueError when ``out`` cannot be created or written (:func:`ensure_writable`: it exists afterwards) or
    holds a run (its ``config.json``) whose settings differ from ``config`` in anything but ``neutral`` keys, unless
    ``resume`` (continuing a run checks its own settings)."""
    ensure_writable(out)
    path = Path(out) / "config.json"
    if resume or not path.is_file():
        return
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # not one of ours, or cut: the run rewrites it
    ignore = set(neutral)
    ours = json.loads(json.dumps(config, default=str))  # the form config.json stores
    diff = [f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} now" for k in sorted(set(ours) | set(theirs))
            if k not in ignore and theirs.get(k) != ours.get(k)]
    if diff:
        raise ValueError(f"{out} holds another run ({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}): pass "
                         "--out NEW_FOLDER for this one, or --resume to continue that one")
