"""``python -m train.eval.crop_probe``: does a base's image side keep shape apart from colour? Probes of its frozen
features on a hard or 3D world's object crops, seen combinations against held-out ones.

    python -m train.eval.crop_probe --data W --model toy-clip-3d --model toy-negclip-3d

Zero-shot on a world's crops (``python -m train.eval --tasks zeroshot``) says how often a base names an object; when
it names held-out colour-shape combinations far worse than seen ones, the question is which side fails: the text
tower composing "a yellow cylinder", or the image features, which may file a yellow cylinder where the yellow cube
is. This answers the second. Each object is cropped as the grounded head and the zero-shot set see it
(``extract.worlds.hardworld.zero_shot_crop``: its box on a black square three times its side); logistic-regression
probes of its shape and of its colour are fitted on the frozen global embeddings of up to ``--n-train`` train-split
objects (the train split never shows a held-out combination) and scored on the val / test objects, seen
combinations and held-out ones apart. A base whose features keep shape apart from colour reads a held-out object's
shape as well as a seen one's; one that ties them reads it at or below chance (1 / the world's shapes).

A probe fitted on every train object learns the world's colour prior as well: a held-out colour never came with its
held-out shape, so "yellow" is evidence against "cylinder", and where the features' shape evidence is weak the prior
wins, below chance, whatever the features hold. So shape is probed a second time, fitted only on the objects of
colours the train split shows with every shape (no prior to learn): where this reads held-out shapes and the first
does not, the features do keep shape apart and what fails is reading it past the colour (issue 69's 3D bases).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from extract.common.cli import Parser, option, parse_options, progress, run_job
from extract.common.cli import build_parser as build_cli
from extract.common.config import positive_int

PROG = "python -m train.eval.crop_probe"


@dataclass
class CropProbeOptions:
    data: str | None = option(None, metavar="WORLD", help="a hard or 3D toy world (python -m extract.worlds.toyworld "
                                                        "--hard | --world 3d, with --holdout)")
    model: list = option(default_factory=list, action="append", metavar="MODEL",
                         help="a base alias or a pre-trained checkpoint, as train.eval takes it (repeat)")
    n_train: int = option(3000, type=positive_int, help="train-split objects the probes are fitted on")
    n_test: int = option(2000, type=positive_int, help="val / test objects the probes are scored on")
    device: str = option("cpu", help="torch device")
    json_out: str | None = option(None, help="also write the figures to this JSON file")


def objects(world: Path, n_train: int, n_test: int) -> tuple[list[tuple[dict, dict]], list[tuple[dict, dict]]]:
    """(scene, object) pairs: up to ``n_train`` of the train split, up to ``n_test`` of val and test."""
    scenes = json.loads((world / "annotations.json").read_text())["scenes"]
    pairs = [(s, o) for s in scenes for o in s["objects"]]
    return ([p for p in pairs if p[0]["split"] == "train"][:n_train],
            [p for p in pairs if p[0]["split"] != "train"][:n_test])


def crop_features(backbone, world: Path, pairs: list[tuple[dict, dict]], batch: int = 256) -> np.ndarray:
    """Each object's crop (``zero_shot_crop`` of its scene), encoded: the global image embeddings [n, D]."""
    from PIL import Image

    from extract.worlds.hardworld import zero_shot_crop

    images: dict[str, Image.Image] = {}
    out = []
    for a in range(0, len(pairs), batch):
        crops = []
        for scene, obj in pairs[a:a + batch]:
            if scene["file_name"] not in images:
                images[scene["file_name"]] = Image.open(world / scene["file_name"]).convert("RGB")
            crops.append(backbone.preprocess(zero_shot_crop(images[scene["file_name"]], obj["box"])))
        with torch.no_grad():
            out.append(backbone.encode_images(torch.stack(crops).to(backbone.device)).embedding.float().cpu())
    return torch.cat(out).numpy()


def fit_and_score(xtr: np.ndarray, ytr: list[str], xte: np.ndarray, yte: list[str], held: np.ndarray) -> dict:
    """``train.eval.shape_probe.probe`` (a logistic-regression probe fitted on (xtr, ytr); deterministic) scored on
    the test rows of seen combinations and on those of held-out ones, in % (None where there are none)."""
    from train.eval.shape_probe import probe

    labels = np.asarray(yte)
    return {name: probe(xtr, ytr, xte[rows], list(labels[rows])) if rows.any() else None
            for name, rows in (("seen", ~held), ("held out", held))}


def complete_colours(train: list[tuple[dict, dict]], shapes: Sequence[str]) -> list[str]:
    """The colours the train objects show with every one of ``shapes``, in first-seen order."""
    seen: dict[str, set] = {}
    for _, o in train:
        seen.setdefault(o["colour"], set()).add(o["shape"])
    return [c for c, got in seen.items() if got >= set(shapes)]


def load(model: str, device: str):
    """The backbone ``model`` names: an alias (or open_clip name), or a pre-training checkpoint."""
    from adapters.load import pretrained_checkpoint
    from extract.models.backbone import load_backbone

    found = pretrained_checkpoint(model)
    return load_backbone(*found, device=device) if found else load_backbone(model, device=device)


def crop_probe(opts: CropProbeOptions) -> dict:
    """``{"objects": {...counts}, "chance": {...}, "models": {model: {"shape": {...}, "colour": {...}}}}``."""
    from extract.worlds.shared import heldout_of, is_toyworld

    world = Path(str(opts.data))
    if not opts.data or not is_toyworld(world):
        raise ValueError("--data WORLD is required: a hard or 3D toy world with held-out combinations (python -m "
                         "extract.worlds.toyworld --out W --n 1000 --seed 5 --world 3d --holdout \"yellow cylinder\")")
    held_combos = heldout_of(world)
    train, test = objects(world, opts.n_train, opts.n_test)
    held = np.array([(o["colour"], o["shape"]) in held_combos for _, o in test])
    if not train or not held.any():
        raise ValueError(f"{world}: {len(train)} train objects, {int(held.sum())} val / test objects of a held-out "
                         "combination: the probe needs both (a larger world, or one generated with --holdout)")
    meta = json.loads((world / "annotations.json").read_text())["meta"]
    vocabulary = meta.get("vocabulary") or {"colours": list(meta["colours"]), "shapes": list(meta["shapes"])}
    result = {"world": str(world), "objects": {"train": len(train), "seen": int((~held).sum()), "held out": int(held.sum())},
              "chance": {"shape": 100.0 / len(vocabulary["shapes"]), "colour": 100.0 / len(vocabulary["colours"])},
              "models": {}}
    complete = complete_colours(train, vocabulary["shapes"])
    result["complete colours"] = complete
    rows = np.array([o["colour"] in complete for _, o in train])
    for model in progress(opts.model or ["tiny"], desc="probing", unit="model"):
        backbone = load(model, opts.device)
        xtr, xte = crop_features(backbone, world, train), crop_features(backbone, world, test)
        truth = {key: ([o[key] for _, o in train], [o[key] for _, o in test]) for key in ("shape", "colour")}
        row = {key: fit_and_score(xtr, truth[key][0], xte, truth[key][1], held) for key in ("shape", "colour")}
        row["shape, complete colours"] = (fit_and_score(xtr[rows], list(np.asarray(truth["shape"][0])[rows]), xte,
                                                        truth["shape"][1], held)
                                          if rows.any() else {"seen": None, "held out": None})
        result["models"][model] = row
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(result: dict) -> str:
    def cell(v):
        return "–" if v is None else f"{v:.1f}"

    n = result["objects"]
    lines = [f"| model | shape: seen / held out (chance {result['chance']['shape']:.1f}) | shape, fitted on the complete "
             f"colours: seen / held out | colour: seen / held out (chance {result['chance']['colour']:.1f}) |",
             "|---|---|---|---|"]
    for model, row in result["models"].items():
        shape, complete, colour = row["shape"], row["shape, complete colours"], row["colour"]
        lines.append(f"| {model} | {cell(shape['seen'])} / {cell(shape['held out'])} | {cell(complete['seen'])} / "
                     f"{cell(complete['held out'])} | {cell(colour['seen'])} / {cell(colour['held out'])} |")
    colours = ", ".join(result["complete colours"]) or "none"
    return "\n".join(lines) + (f"\n\nfitted on {n['train']} train objects (the complete colours, those shown with "
                               f"every shape: {colours}); scored on {n['seen']} val / test objects of seen "
                               f"combinations and {n['held out']} of held-out ones")


def build_parser() -> Parser:
    return build_cli(CropProbeOptions, PROG, __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: CropProbeOptions) -> None:
        print(table(crop_probe(opts)))

    return run_job(job, parse_options(CropProbeOptions, build_parser(), argv))


if __name__ == "__main__":
    raise SystemExit(main())
