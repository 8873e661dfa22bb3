"""``python -m train.eval.overlap_probe``: is "who is in front" in what the cache holds? Probes on a hard world.

    python -m train.eval.overlap_probe --data WORLD        # a hard world (python -m extract.worlds.toyworld --hard)

Before a head is asked to learn "in front of" from captions, this measures whether the signal is there at all, from
each source a head could read: fitted on the named in-front / behind pairs of the world's train scenes, scored on
those of its val / test scenes and on the overlapping images of its Controlled-B test (where the two images of a
set share their boxes):

- ``boxes``: the pair's geometry (``adapters.heads.grounded.pair_features``), the control: on Controlled-B the two
  images give the same features, so any probe reads 50;
- ``overlap``: the pixels' evidence of who owns the overlap (``extract.components.overlap``, the cache's
  ``ventity_overlap``): each of its three rules alone (the sign of a difference, no fit), a logistic regression and a
  small MLP (what the grounded head's pair code is), all with true boxes.

Each row: accuracy of telling the front object of an ordered pair (chance 50) on each set, its pairs' count in the
header (each pair both ways round).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from extract.common.cli import Parser, option, parse_options, run_job
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int, positive_int
from extract.components.overlap import RULES

PROG = "python -m train.eval.overlap_probe"


@dataclass
class OverlapProbeOptions:
    data: str | None = option(None, metavar="WORLD", help="a hard toy world (python -m extract.worlds.toyworld --hard)")
    seed: int = option(0, type=nonnegative_int, help="seed of the probes' initialisation")
    steps: int = option(1500, type=positive_int, help="full-batch Adam steps of each fitted probe")
    json_out: str | None = option(None, help="also write the figures to this JSON file")


def _pairs(world: Path, scenes: list[tuple[dict, int, int]]) -> dict[str, np.ndarray]:
    """Features of (front, back) and (back, front) for each (scene, front index, back index): ``overlap`` [2n, F],
    ``boxes`` [2n, 12], ``label`` [2n] (1: the first of the pair is in front)."""
    from PIL import Image

    from adapters.heads.grounded import box_features, pair_features
    from extract.components.overlap import ownership

    overlap, boxes, label = [], [], []
    for scene, front, back in scenes:
        raw = np.asarray(Image.open(world / scene["file_name"]).convert("RGB"))
        xyxy = np.asarray([o["box"] for o in scene["objects"]], np.float32)
        own = ownership(raw, xyxy, len(xyxy))
        size = torch.tensor([[scene["width"], scene["height"]]], dtype=torch.float32)
        geom = pair_features(box_features(torch.from_numpy(xyxy)[None], size))[0].numpy()
        for a, b, y in ((front, back, 1), (back, front, 0)):
            overlap.append(own[a, b]), boxes.append(geom[a, b]), label.append(y)
    return {"overlap": np.asarray(overlap, np.float32), "boxes": np.asarray(boxes, np.float32),
            "label": np.asarray(label, np.float32)}


def load(world: str | Path) -> tuple[dict, dict]:
    """(fit pairs from the scenes' named in-front / behind pairs, scored pairs from Controlled-B's overlapping
    images). ValueError naming the fix when ``world`` is not a hard world."""
    from extract.worlds import hardworld
    from extract.worlds.shared import CONTROLLED_FILES

    world = Path(world)
    if not hardworld.is_hard(world):
        raise ValueError(f"{world} is not a hard toy world: make one with python -m extract.worlds.toyworld --out DIR "
                         "--n 1000 --seed 5 --hard")
    named = {"train": [], "held-out": []}
    for scene in json.loads((world / "annotations.json").read_text())["scenes"]:
        pair = scene["named"]
        if pair["predicate"] in ("in front of", "behind"):
            front, back = ((pair["subject"], pair["object"]) if pair["predicate"] == "in front of"
                           else (pair["object"], pair["subject"]))
            named["train" if scene["split"] == "train" else "held-out"].append((scene, front, back))
    controlled = []
    for entry in json.loads((world / CONTROLLED_FILES["B"]).read_text())["sets"]:
        named_pair = [(o["colour"], o["shape"]) for o in entry["objects"]]
        for scene in entry["scenes"]:
            if scene["predicate"] in ("in front of", "behind"):  # of the named pair, the one drawn last is in front
                drawn = [k for k, o in enumerate(scene["objects"]) if (o["colour"], o["shape"]) in named_pair]
                controlled.append((scene, drawn[1], drawn[0]))
    return {"fit": _pairs(world, named["train"]), "held-out scenes": _pairs(world, named["held-out"]),
            "Controlled-B": _pairs(world, controlled)}


def _fit(x: torch.Tensor, y: torch.Tensor, hidden: int | None, seed: int, steps: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    width = x.shape[1]
    model = torch.nn.Linear(width, 1) if hidden is None else torch.nn.Sequential(
        torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x)[:, 0], y).backward()
        opt.step()
    return model


def probe(opts: OverlapProbeOptions) -> list[dict]:
    """Rows ``{"source", "reader", "<set>": accuracy %, "n <set>": pairs}`` for the sets of :func:`load`."""
    sets = load(opts.data)
    fit = sets["fit"]
    rows = []

    def row(source, reader, predict):
        out = {"source": source, "reader": reader}
        for name, d in sets.items():
            out[name] = 100.0 * float((predict(d) == (d["label"] > 0.5)).mean())
            out[f"n {name}"] = len(d["label"])
        rows.append(out)

    for rule in RULES:  # what each says is the overlap code's (extract.components.overlap.RULES)
        row("overlap", f"rule: {rule.label}", lambda d, r=rule: r.difference(d["overlap"]) > 0)
    for source in ("boxes", "overlap"):
        mean, std = fit[source].mean(0), fit[source].std(0) + 1e-6
        x = torch.from_numpy((fit[source] - mean) / std)
        for reader, hidden in (("logistic regression", None), ("MLP (2 x 64)", 64)):
            model = _fit(x, torch.from_numpy(fit["label"]), hidden, opts.seed, opts.steps)
            with torch.no_grad():
                row(source, reader, lambda d, m=model, s=source: (
                    m(torch.from_numpy((d[s] - mean) / std))[:, 0] > 0).numpy())
    return rows


def table(rows: list[dict]) -> str:
    sets = ("fit", "held-out scenes", "Controlled-B")
    lines = ["| source | reader | " + " | ".join(f"{s} (n={rows[0][f'n {s}']})" for s in sets) + " |",
             "|---|---|" + "---|" * len(sets)]
    lines += [f"| {r['source']} | {r['reader']} | " + " | ".join(f"{r[s]:.1f}" for s in sets) + " |" for r in rows]
    return "\n".join(lines)


def build_parser() -> Parser:
    return build_cli(OverlapProbeOptions, PROG, "Probe whether the cache's pair features tell which of two "
                                                "overlapping objects is in front (chance 50).")


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: OverlapProbeOptions) -> None:
        if not opts.data:
            raise ValueError("--data WORLD is required: a hard toy world (python -m extract.worlds.toyworld --out DIR "
                             "--n 1000 --seed 5 --hard)")
        rows = probe(opts)
        print("telling the front object of two overlapping ones, true boxes (chance 50):")
        print(table(rows))
        if opts.json_out:
            Path(opts.json_out).write_text(json.dumps(rows, indent=1) + "\n")

    return run_job(job, parse_options(OverlapProbeOptions, build_parser(), argv))


if __name__ == "__main__":
    raise SystemExit(main())
