"""The demo's 3D world (``python -m train.demo --full``): the grounded head on path-traced scenes.

The hard world's scenes are drawings: depth is drawing order, support is two boxes touching. This stage renders a
3D world (``extract/worlds/world3d.py``: CLEVR's objects on a floor, a perspective camera with a jittered viewpoint,
sun and shadows, matte and metal, objects resting on objects; Mitsuba 3, the ``render3d`` extra), trains the grounded
head on it on :data:`BASE_3D` (fine-tuned on such scenes and shipped: ``extract/models/bases``) with the world's own
boxes and the head's defaults, and scores the frozen base, the text-only floor and the head on the world's
Controlled-A / -B analogues and its test split (``train.demo_hard.hard_controlled``: the same table as the hard
world's).

It runs with ``--full`` only: rendering :data:`WORLD3D_N` scenes and their controlled images and training the head
took 13 minutes on two cores with nothing else running, on a day they ran 1.7x slower than usual (the rendering 7
of them, the head 4.4), past the demo's 7 minutes.
Detected boxes need the world's detector first (minutes more): ``python -m train.adapter --method grounded --base
toy-clip-3d-mixed --data W --boxes yolo`` (train/adapter/README, "The 3D world").
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

from train.demo_hard import hard_controlled, train_head

WORLD3D_N = 1000  # scenes: 50 sets per controlled test (one per 20 scenes), 800 training scenes
BASE_3D = "toy-clip-3d-mixed"  # the base of the 3D world's best model (train/adapter/README, "The 3D world")


def world3d(out: Path, n: int, seed: int, holdout: Sequence[str] = (), say=print) -> Path:
    """The demo's 3D world under ``out / "world3d"``: reused when there with the same scenes, seed, held-out
    combinations and generator version, else rendered again (the same bytes for any worker count)."""
    from extract.worlds import world3d_layout

    folder = out / "world3d"
    held = sorted(f"{c} {s}" for c, s in world3d_layout.parse_holdout3d(holdout))
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        meta = {}
    if (meta.get("world"), meta.get("n"), meta.get("seed"), meta.get("version"), sorted(meta.get("holdout", []))) == (
            "3d", n, seed, world3d_layout.VERSION, held):
        say(f"  3D world: {folder} ({n} scenes, seed {seed}; reused)")
        return folder
    shutil.rmtree(folder, ignore_errors=True)  # the demo's own folder: another size or seed makes way
    workers = max(1, min(4, os.cpu_count() or 1))
    say(f"  3D world: rendering {n} scenes and the controlled images into {folder} ({workers} processes)")
    world3d_layout.generate(folder, n, seed, holdout=",".join(held), workers=workers)
    return folder


def stage(out: Path, n: int, seed: int, *, holdout: Sequence[str] = (), epochs: int | None = None,
          batch_size: int | None = None, workers: int | None = None, device: str | None = None,
          say=print) -> dict:
    """Render (or reuse) the 3D world, train the head on :data:`BASE_3D` with its own boxes, and score the frozen
    base, the floor and the head: ``train.demo_hard.hard_controlled``'s dict plus ``head`` (its checkpoint, steps and
    seconds) and ``n``."""
    world = world3d(out, n, seed, holdout, say=say)
    head = train_head(world, out / "3d", base=BASE_3D, seed=seed, epochs=epochs, batch_size=batch_size,
                      workers=workers, device=device)
    result = hard_controlled(world, out / "world3d-eval", [(BASE_3D, None), (head["adapter"], None)], seed=seed,
                             device=device)
    result["head"] = {"checkpoint": head["adapter"], "steps": head["steps"], "seconds": head["seconds"]}
    result["n"] = n
    return result
