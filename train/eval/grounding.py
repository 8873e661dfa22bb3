"""``python -m train.eval.grounding``: can a frozen base find the object a phrase names, from box crops? At which crop
scale?

    python -m train.eval.grounding --data runs/demo/toyworld --base toy-negclip
    python -m train.eval.grounding --data runs/demo/toyworld --base toy-negclip --crop-scale 1,2,3,4

The grounded relation head (``adapters/heads/grounded.py``) scores "A left of B" by finding A and B among the
image's boxes first: each box is cropped, the backbone embeds the crop, and a phrase goes to the box whose crop
embedding is nearest its text embedding. Nothing it learns about predicates helps when that step fails, so this
measures it alone, untrained: for every object of the split's scenes (at most ``--n`` scenes of two or more objects),
its "colour shape" phrase against every box of its scene, by the base's cosine, for each crop scale (the square the
crop is centred on, this many times the box's longer side: ``python -m extract --crop-scale``). Accuracy is the share
of objects whose own box wins (chance: 1 / the scene's objects); errors are split into confusions with an object of
the same colour, of the same shape, or of neither.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from extract.common.cli import Parser, option, parse_options, progress, run_job
from extract.common.cli import build_parser as build_cli
from extract.common.config import positive_int

PROG = "python -m train.eval.grounding"


@dataclass
class GroundingOptions:
    data: str = option("runs/toy", help="toy-world folder")
    base: str = option("toy-negclip", help="backbone alias or open_clip model name")
    pretrained: str | None = option(None, help="its weights (default: the alias's)")
    crop_scale: Any = option("1,2,3,4", help="crop scales to compare, comma list of numbers >= 1")
    split: str = option("test", choices=["train", "val", "test"], help="toy-world split")
    n: int = option(300, type=positive_int, help="scenes of two or more objects to use, at most")
    device: str = option("cpu", help="torch device")

    def __post_init__(self):
        if isinstance(self.crop_scale, str):
            try:
                self.crop_scale = [float(v) for v in self.crop_scale.split(",") if v.strip()]
            except ValueError:
                raise ValueError(f"--crop-scale {self.crop_scale!r}: expected a comma list of numbers >= 1") from None
        self.crop_scale = [float(v) for v in self.crop_scale]
        if not self.crop_scale or min(self.crop_scale) < 1:
            raise ValueError("--crop-scale: give numbers >= 1 (1: the tight crop)")


@torch.no_grad()
def grounding(opts: GroundingOptions) -> dict[float, dict]:
    """{crop scale: {"accuracy", "objects", "errors": {"same colour", "same shape", "neither"}}} (module docstring)."""
    from PIL import Image

    from extract.components.regions import crop_regions
    from extract.data import toyworld
    from extract.models.backbone import load_backbone

    backbone = load_backbone(opts.base, opts.pretrained, device=opts.device)
    world = toyworld.load(opts.data)
    scenes = [s for s in world["scenes"] if s["split"] == opts.split and len(s["objects"]) >= 2][:opts.n]
    if not scenes:
        raise ValueError(f"{opts.data}: no {opts.split} scene with two or more objects")
    names = sorted({f"{o['colour']} {o['shape']}" for s in scenes for o in s["objects"]})
    text = dict(zip(names, F.normalize(backbone.encode_texts(names).embedding.float(), dim=-1)))
    out = {}
    for scale in opts.crop_scale:
        right, errors = 0, Counter()
        for scene in progress(scenes, desc=f"crop scale {scale:g}", unit="scene"):
            image = Image.open(f"{opts.data}/{scene['file_name']}").convert("RGB")
            objects = scene["objects"]
            crops = crop_regions(image, [o["box"] for o in objects], backbone.preprocess, scale=scale)
            emb = F.normalize(backbone.encode_images(crops.to(backbone.device)).embedding.float(), dim=-1)
            phrases = torch.stack([text[f"{o['colour']} {o['shape']}"] for o in objects]).to(emb.device)
            for k, j in enumerate((phrases @ emb.T).argmax(1).tolist()):
                if j == k:
                    right += 1
                else:
                    a, b = objects[k], objects[j]
                    errors["same colour" if a["colour"] == b["colour"] else
                           "same shape" if a["shape"] == b["shape"] else "neither"] += 1
        n = sum(len(s["objects"]) for s in scenes)
        out[scale] = {"accuracy": 100 * right / n, "objects": n,
                      "chance": 100 * float(np.mean([1 / len(s["objects"]) for s in scenes for _ in s["objects"]])),
                      "errors": {k: errors.get(k, 0) for k in ("same colour", "same shape", "neither")}}
    return out


def table(results: dict[float, dict]) -> str:
    lines = ["| crop scale | phrase finds its own box (%) | chance (%) | confused with: same colour | same shape | "
             "neither |", "|---|---|---|---|---|---|"]
    for scale, r in results.items():
        e = r["errors"]
        lines.append(f"| {scale:g} | {r['accuracy']:.1f} ({r['objects']} objects) | {r['chance']:.1f} | "
                     f"{e['same colour']} | {e['same shape']} | {e['neither']} |")
    return "\n".join(lines)


def build_parser() -> Parser:
    return build_cli(GroundingOptions, PROG, __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: GroundingOptions) -> None:
        print(table(grounding(opts)))

    return run_job(job, parse_options(GroundingOptions, build_parser(), argv))


if __name__ == "__main__":
    raise SystemExit(main())
