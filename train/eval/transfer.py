"""``python -m train.eval.transfer``: what carries over between the toy worlds. Bases and heads trained on one world
(version 2, hard, 3D) scored on every world named.

    python -m train.eval.transfer --world v2=runs/toy --world hard=H --world 3d=E \\
        --model toy-negclip --model toy-clip-hard --model toy-clip-3d \\
        --model runs/toy-negclip-grounded --model runs/H-grounded --model runs/E-grounded --out runs/transfer

Each world is one ``python -m train.eval --data WORLD --tasks zeroshot,compositional`` with every model (test
split, no bootstrap: one figure per cell), its report under ``OUT/NAME``. The table keeps, per world, the figures
that tell recognition from binding: zero-shot on the objects' crops, swap-obj and replace-rel (chance 50), and the
world's controlled four-way tests, caption and image choice (chance 25): the version-2 world's one test
(left / right / above / below), the hard and 3D worlds' Controlled-A (on / under / left / right) and -B (in front
of / behind / left / right). A cell a model was trained for (its run's ``--data`` is that world) is in bold; the
other cells are transfer. A world's vocabulary is its own: the 3D world's colours and shapes (CLEVR's) are words
the 2D worlds' text towers never saw, so there a base's zero-shot is near chance by construction, and a head's
figures say what its relation code brings with objects it cannot name.

Boxes: ``--boxes own`` (default) scores each adapter as it was trained: a head trained on a detector's boxes with
that run's detector (a detector trained on another world is part of what carries over, or not), one trained on
ground-truth boxes with the scored world's. ``--boxes true`` gives every adapter the scored world's ground-truth
boxes: the head alone.

Writes ``transfer.md``, ``transfer.json`` and ``transfer.png`` (one heat map per figure: models x worlds).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from extract.common.cli import Parser, option, parse_options, run_job, say
from extract.common.cli import build_parser as build_cli
from extract.common.config import positive_int

PROG = "python -m train.eval.transfer"

# (row label, train.eval metric, chance): a world shows the rows its report has
ROWS = (
    ("zero-shot top-1", "zero-shot top-1", None),
    ("swap-obj", "toyworld swap-obj", 50),
    ("replace-rel", "toyworld replace-rel", 50),
    ("four-way: caption", "toyworld-controlled all text", 25),
    ("four-way: image", "toyworld-controlled all image", 25),
    ("Controlled-A: caption", "toyworld-controlled-A all text", 25),
    ("Controlled-A: image", "toyworld-controlled-A all image", 25),
    ("Controlled-B: caption", "toyworld-controlled-B all text", 25),
    ("Controlled-B: image", "toyworld-controlled-B all image", 25),
)


@dataclass
class TransferOptions:
    world: list = option(default_factory=list, action="append", metavar="NAME=DIR",
                         help="a toy world to score on, named (python -m extract.worlds.toyworld; repeat: v2=runs/toy "
                              "hard=H 3d=E)")
    model: list = option(default_factory=list, action="append", metavar="MODEL",
                         help="a base alias / checkpoint or an adapter run, as train.eval takes it (repeat)")
    boxes: str = option("own", choices=("own", "true"),
                        help="own: each adapter's own box source (its run's detector, or the scored world's "
                             "ground truth for a head trained on it); true: every world's ground-truth boxes")
    split: str = option("test", help="toy world split to score")
    out: str = option("runs/transfer", help="report folder: transfer.{md,json,png} and one train.eval report "
                                            "per world")
    batch_size: int = option(128, type=positive_int, help="images / captions encoded at once")
    device: str | None = option(None, help="torch device (default: cuda when available, else cpu)")

    def __post_init__(self):
        self.worlds = {}
        for spec in self.world:
            name, sep, path = str(spec).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--world {spec!r}: give NAME=DIR, e.g. --world 3d=runs/world3d")
            if name in self.worlds:
                raise ValueError(f"--world {name} is named twice")
            self.worlds[name] = path


def trained_on(model: str, worlds: dict[str, str]) -> str | None:
    """The name of the world ``model`` was trained on, when it is an adapter run whose ``--data`` is one of
    ``worlds`` (its checkpoint's metadata says); None otherwise (a base, or a run on other data)."""
    from adapters.checkpoint import is_checkpoint, read_meta

    path = Path(model)
    path = path / "adapter.safetensors" if path.is_dir() else path
    if not path.is_file() or not is_checkpoint(path):
        return None
    data = (read_meta(path).get("args") or {}).get("data")
    if not data:
        return None
    for name, world in worlds.items():
        if Path(world).resolve() == Path(data).resolve():
            return name
    return None


def score(opts: TransferOptions) -> dict:
    """``{"worlds", "models", "trained_on", "cells": {world: {model: {row: figure}}}, "boxes"}``; each world's
    train.eval report is written under ``opts.out/NAME``."""
    from extract.worlds.shared import is_toyworld
    from train.eval.evaluate import EvaluateOptions, evaluate

    if not opts.worlds or not opts.model:
        raise ValueError("give at least one --world NAME=DIR and one --model (python -m train.eval.transfer --help)")
    for name, world in opts.worlds.items():  # every world checked before a model loads
        if not is_toyworld(world):
            raise ValueError(f"--world {name}={world}: not a toy world folder (make one with python -m "
                             "extract.worlds.toyworld --out DIR --n 400 --seed 1 [--hard | --world 3d])")
    cells: dict[str, dict] = {}
    labels: list[str] = []
    boxes: dict[str, dict] = {}
    for name, world in opts.worlds.items():
        say(f"scoring {len(opts.model)} model(s) on {name} ({world})")
        report = evaluate(EvaluateOptions(
            model=list(opts.model), data=world, split=opts.split, tasks="zeroshot,compositional", text_only=False,
            bootstrap=0, out=str(Path(opts.out) / name), batch_size=opts.batch_size, device=opts.device,
            annotations=world if opts.boxes == "true" else None))
        labels = list(report["results"])  # one per model, in order (train.eval keeps names unique)
        metrics = report["table"]["metrics"]
        cells[name] = {label: {row: metrics[label][key]["mean"] for row, key, _ in ROWS if key in metrics[label]}
                       for label in labels}
        boxes[name] = {label: report["results"][label].get("boxes") for label in labels}
    return {"worlds": dict(opts.worlds), "models": labels, "boxes": boxes, "split": opts.split,
            "trained_on": {label: trained_on(m, opts.worlds) for label, m in zip(labels, opts.model)},
            "cells": cells}


def table(result: dict) -> str:
    """The Markdown table: one row per (world, figure), one column per model; a model's own world in bold."""
    models = result["models"]
    head = [m + (f" (trained on {result['trained_on'][m]})" if result["trained_on"].get(m) else "") for m in models]
    lines = ["| scored on | figure (chance) | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(models)]
    for world, per_model in result["cells"].items():
        for row, _, chance in ROWS:
            if not any(row in per_model[m] for m in models):
                continue
            cells = []
            for m in models:
                v = per_model[m].get(row)
                text = "–" if v is None else f"{v:.1f}"
                cells.append(f"**{text}**" if v is not None and result["trained_on"].get(m) == world else text)
            label = row + (f" ({chance})" if chance else "")
            lines.append(f"| {world} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def heatmaps(result: dict, path: Path) -> Path | None:
    """One panel per figure: models (rows) x worlds (columns), the figure written in each cell."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        print("note: matplotlib is not installed (pip install 'plugvlm[train]'); no PNG written")
        return None
    worlds, models = list(result["cells"]), result["models"]
    rows = [r for r in ROWS if any(r[0] in result["cells"][w][m] for w in worlds for m in models)]
    ncols = min(3, len(rows))
    nrows = -(-len(rows) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * (2.6 + 0.8 * len(worlds)), nrows * (1.0 + 0.4 * len(models))),
                             squeeze=False)
    for ax in axes.flat[len(rows):]:
        ax.axis("off")
    for k, (ax, (row, _, chance)) in enumerate(zip(axes.flat, rows)):
        grid = np.array([[result["cells"][w][m].get(row, np.nan) for w in worlds] for m in models], float)
        ax.imshow(grid, vmin=chance or 0, vmax=100, cmap="viridis", aspect="auto")
        for i in range(len(models)):
            for j in range(len(worlds)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=8,
                            color="white" if grid[i, j] < 70 else "black")
        ax.set_xticks(range(len(worlds)), worlds)
        ax.set_yticks(range(len(models)), models if k % ncols == 0 else [""] * len(models), fontsize=8)
        ax.set_title(row + (f"\n(chance {chance})" if chance else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> Parser:
    return build_cli(TransferOptions, PROG, "Score bases and heads trained on one toy world on every world named: "
                                           "what carries over.")


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: TransferOptions) -> None:
        result = score(opts)
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        text = table(result)
        note = (f"\n\n{opts.split} split; boxes: "
                + ("each adapter's own source" if opts.boxes == "own" else "every world's ground truth")
                + "; bold: the world the model was trained on.\n")
        (out / "transfer.md").write_text(text + note)
        (out / "transfer.json").write_text(json.dumps(result, indent=1) + "\n")
        png = heatmaps(result, out / "transfer.png")
        print(text + note)
        say("reports: " + ", ".join(str(p) for p in (out / "transfer.md", out / "transfer.json", png) if p))

    return run_job(job, parse_options(TransferOptions, build_parser(), argv))


if __name__ == "__main__":
    raise SystemExit(main())
