"""``python -m train.eval.grounding``: can a frozen base find the object a phrase names, from box crops? At which crop
scale, with the phrase written how?

    python -m train.eval.grounding --data runs/demo/toyworld --base toy-negclip
    python -m train.eval.grounding --data runs/demo/toyworld --base toy-negclip --crop-scale 1,2,3,4
    python -m train.eval.grounding --data W --base toy-clip-3d-mixed --crop-scale 3 --phrase-prompt "{},a {}"

The grounded relation head (``adapters/heads/grounded.py``) scores "A left of B" by finding A and B among the
image's boxes first: each box is cropped, the backbone embeds the crop, and a phrase goes to the box whose crop
embedding is nearest its text embedding. Nothing it learns about predicates helps when that step fails, so this
measures it alone, untrained: for every object of the split's scenes (at most ``--n`` scenes of two or more objects),
its "colour shape" phrase against every box of its scene, by the base's cosine, for each crop scale (the square the
crop is centred on, this many times the box's longer side: ``python -m extract --crop-scale``) and each way of writing
the phrase (``--phrase-prompt``, {} standing for it: "{}" as the parse gives it, "a {}" as a caption writes it;
``python -m extract --phrase-prompt``). Accuracy is the share of objects whose own box wins (chance: 1 / the scene's
objects), also over the objects of combinations the world held out of training; errors are split into confusions
with an object of the same colour, of the same shape, or of neither.
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
    phrase_prompt: Any = option("{},a {}", help="ways of writing the phrase to compare, comma list, {} standing for "
                                                "'colour shape' ('{}': as the parse gives it)")
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
        if isinstance(self.phrase_prompt, str):
            self.phrase_prompt = [v.strip() for v in self.phrase_prompt.split(",") if v.strip()]
        if not self.phrase_prompt or any(p.count("{}") != 1 for p in self.phrase_prompt):
            raise ValueError(f"--phrase-prompt {self.phrase_prompt!r}: each form writes the phrase's place as {{}} "
                             "once, e.g. '{},a {}'")


@torch.no_grad()
def grounding(opts: GroundingOptions) -> dict[tuple[float, str], dict]:
    """{(crop scale, phrase prompt): {"accuracy", "objects", "chance", "held_out" (accuracy over the held-out
    combinations' objects, None without any), "held_out_objects", "errors": {"same colour", "same shape",
    "neither"}}} (module docstring)."""
    from PIL import Image

    from extract.components.regions import crop_regions
    from extract.worlds import toyworld
    from extract.worlds.shared import heldout_of
    from extract.models.backbone import load_backbone

    backbone = load_backbone(opts.base, opts.pretrained, device=opts.device)
    world = toyworld.load(opts.data)
    scenes = [s for s in world["scenes"] if s["split"] == opts.split and len(s["objects"]) >= 2][:opts.n]
    if not scenes:
        raise ValueError(f"{opts.data}: no {opts.split} scene with two or more objects")
    held = heldout_of(opts.data)
    names = sorted({f"{o['colour']} {o['shape']}" for s in scenes for o in s["objects"]})
    # each phrase alone, as the cache embeds its phrases (encode_each): its value does not depend on the others
    text = {(prompt, name): e.float() for prompt in opts.phrase_prompt for name, e in
            zip(names, backbone.encode_each([prompt.replace("{}", name) for name in names]))}
    n = sum(len(s["objects"]) for s in scenes)
    chance = 100 * float(np.mean([1 / len(s["objects"]) for s in scenes for _ in s["objects"]]))
    out = {}
    for scale in opts.crop_scale:
        right, held_right, held_n, errors = Counter(), Counter(), 0, {p: Counter() for p in opts.phrase_prompt}
        for scene in progress(scenes, desc=f"crop scale {scale:g}", unit="scene"):
            image = Image.open(f"{opts.data}/{scene['file_name']}").convert("RGB")
            objects = scene["objects"]
            crops = crop_regions(image, [o["box"] for o in objects], backbone.preprocess, scale=scale)
            emb = F.normalize(backbone.encode_images(crops.to(backbone.device)).embedding.float(), dim=-1)
            is_held = [(o["colour"], o["shape"]) in held for o in objects]
            held_n += sum(is_held)
            for prompt in opts.phrase_prompt:
                phrases = torch.stack([text[prompt, f"{o['colour']} {o['shape']}"] for o in objects]).to(emb.device)
                for k, j in enumerate((phrases @ emb.T).argmax(1).tolist()):
                    if j == k:
                        right[prompt] += 1
                        held_right[prompt] += is_held[k]
                    else:
                        a, b = objects[k], objects[j]
                        errors[prompt]["same colour" if a["colour"] == b["colour"] else
                                       "same shape" if a["shape"] == b["shape"] else "neither"] += 1
        for prompt in opts.phrase_prompt:
            out[scale, prompt] = {
                "accuracy": 100 * right[prompt] / n, "objects": n, "chance": chance,
                "held_out": 100 * held_right[prompt] / held_n if held_n else None, "held_out_objects": held_n,
                "errors": {k: errors[prompt].get(k, 0) for k in ("same colour", "same shape", "neither")}}
    return out


def table(results: dict[tuple[float, str], dict]) -> str:
    lines = ["| crop scale | phrase written | phrase finds its own box (%) | held-out combinations (%) | chance (%) | "
             "confused with: same colour | same shape | neither |", "|---|---|---|---|---|---|---|---|"]
    for (scale, prompt), r in results.items():
        e = r["errors"]
        k = r["held_out_objects"]
        held = "–" if r["held_out"] is None else f"{r['held_out']:.1f} ({k} object{'s' * (k != 1)})"
        lines.append(f"| {scale:g} | \"{prompt}\" | {r['accuracy']:.1f} ({r['objects']} objects) | {held} | "
                     f"{r['chance']:.1f} | {e['same colour']} | {e['same shape']} | {e['neither']} |")
    return "\n".join(lines)


def build_parser() -> Parser:
    return build_cli(GroundingOptions, PROG, __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: GroundingOptions) -> None:
        print(table(grounding(opts)))

    return run_job(job, parse_options(GroundingOptions, build_parser(), argv))


if __name__ == "__main__":
    raise SystemExit(main())
