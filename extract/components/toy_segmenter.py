"""The toy worlds' oracle segmenter: ``python -m extract --regions sam2 --segmenter toy`` caches every object's
mask where SAM2 would cache its automatic masks, so PowerCLIP-S (``train.pretrain --method powerclip --masks
sam2 --regions-cache ...``, ``train.adapter --method powerclip --unfreeze --regions sam2 --segmenter toy``) trains
with true object regions -- the masks a perfect SAM2 would approach.

    python -m extract --data runs/toy --out runs/toy-masks --base tiny --pretrained none \\
        --components regions --regions sam2 --segmenter toy --num-regions 10

From the pixels alone: both toy worlds draw every object solid in one of the vocabulary's colours without
anti-aliasing (``extract.worlds.shared.COLOURS``, ``draw_shape``), and no background pixel holds one of them
(version 2: black; the hard world, ``extract.worlds.hardworld.background``: every channel <= 95, and every object
colour has a channel above that). A mask is therefore one 8-connected run of pixels of one object colour:

- version-2 world: exact (its layout keeps every two boxes ``GAP`` x the side apart, so each object is one run);
- hard world: each object's **visible** pixels (the part the objects drawn after it leave). On the 2,000-scene
  world of train/adapter/README 94.7 % of the objects are one mask exactly; 3.3 % share one with an object of their colour
  they touch or overlap (as SAM2 would often merge them too), and 2.0 %, hidden in two pieces, give a mask per
  piece (``python -m extract.components.toy_segmenter --data WORLD`` counts them).

The masks go through the same code as SAM2's (``masks_to_grid`` onto the backbone's patch grid, ``region_masks``
/ ``region_valid`` in the cache, ``regions.source = "sam2"`` in its settings); only ``regions.segmenter`` says
``toy-oracle``. On other images it returns the runs of those eight colours, which is rarely what anyone wants.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from extract.components.detectors import Masks
from extract.worlds.shared import COLOURS

NAME = "toy"  # the --segmenter value that selects it
VERSION = 2  # bump when the masks it returns change (cache fingerprints hold it); 2: runs of one object colour


def connected_components(foreground: np.ndarray, classes: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """8-connected components of a bool [H, W] image: (labels int32 [H, W], 0 = background, 1..n; n). With
    ``classes`` (int [H, W]), two neighbours join only when their classes are equal (one run per colour).
    Labels are numbered in raster order of each component's first pixel. Min-label propagation over the
    3x3 neighbourhood with pointer jumping until nothing changes, then the surviving labels renumbered.

    Each label is the raster index of a pixel of the same component, never above the pixel's own, so a pixel may
    take its label's label (the jump): chains halve at each jump, and a few passes replace the component's pixel
    diameter of them (tests/extract/test_toy_segmenter.py checks the result against scipy's labelling)."""
    fg = np.asarray(foreground, dtype=bool)
    h, w = fg.shape
    big = np.iinfo(np.int32).max
    labels = np.where(fg, np.arange(h * w, dtype=np.int32).reshape(h, w), big)
    if classes is not None:
        padded_classes = np.pad(np.asarray(classes), 1, constant_values=-1)
        same = [padded_classes[dy:dy + h, dx:dx + w] == classes for dy in (0, 1, 2) for dx in (0, 1, 2)]
    while True:
        padded = np.pad(labels, 1, constant_values=big)
        smallest = labels
        for k, (dy, dx) in enumerate((dy, dx) for dy in (0, 1, 2) for dx in (0, 1, 2)):
            shifted = padded[dy:dy + h, dx:dx + w]
            smallest = np.minimum(smallest, shifted if classes is None else np.where(same[k], shifted, big))
        smallest = np.where(fg, smallest, big)
        while True:  # pointer jumping: a pixel takes its label's label
            jumped = np.where(fg, smallest.ravel()[np.where(fg, smallest, 0)], big)
            if np.array_equal(jumped, smallest):
                break
            smallest = jumped
        if np.array_equal(smallest, labels):
            break
        labels = smallest
    roots = np.unique(labels[fg])  # each component's smallest raster index: ascending = raster order
    out = np.zeros((h, w), dtype=np.int32)
    out[fg] = np.searchsorted(roots, labels[fg]) + 1
    return out, len(roots)


class ToySegmenter:
    """``generate(image) -> Masks``: one mask per 8-connected run of one object colour, largest first (ties in
    raster order of each run's first pixel), score 1. ``max_masks`` caps the count as SAM2's generator does."""

    def __init__(self, max_masks: int | None = None):
        self.max_masks = max_masks

    def generate(self, image) -> Masks:
        rgb = np.asarray(image.convert("RGB"))
        palette = np.array(list(COLOURS.values()), dtype=rgb.dtype)
        hit = (rgb[:, :, None, :] == palette[None, None]).all(-1)  # [H, W, colours]
        labels, n = connected_components(hit.any(-1), classes=hit.argmax(-1))  # runs in raster order
        masks = labels[None] == np.arange(1, n + 1, dtype=np.int32)[:, None, None]
        areas = masks.reshape(n, -1).sum(1).astype(np.int64)
        order = np.argsort(-areas, kind="stable")[: self.max_masks]
        return Masks(masks[order], np.ones(len(order), np.float32), areas[order])

    def settings(self) -> dict:
        return {"segmenter": "toy-oracle", "version": VERSION, "max_masks": self.max_masks}


def check_world(world: str | Path, limit: int | None = None) -> dict[str, int]:
    """Each object of a toy world (either kind) against the masks: ``exact`` (one mask is its visible pixels),
    ``shared`` (one mask holds them and another object's: two of one colour touch), ``split`` (hidden in two or more
    pieces, a mask each), of ``objects``, over the first ``limit`` scenes."""
    from PIL import Image

    from extract.worlds.hardworld import visible_masks

    world = Path(world)
    scenes = json.loads((world / "annotations.json").read_text())["scenes"][:limit]
    seg, counts = ToySegmenter(), {"objects": 0, "exact": 0, "shared": 0, "split": 0}
    for scene in scenes:
        found = seg.generate(Image.open(world / scene["file_name"])).masks
        for visible in visible_masks(scene["objects"], scene["width"]):
            holding = [m for m in found if (m & visible).any()]
            counts["objects"] += 1
            if len(holding) > 1:
                counts["split"] += 1
            elif len(holding) == 1:
                counts["exact" if np.array_equal(holding[0], visible) else "shared"] += 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m extract.components.toy_segmenter --data WORLD``: how many objects the oracle masks exactly."""
    parser = argparse.ArgumentParser(prog="python -m extract.components.toy_segmenter",
                                     description="Count how many of a toy world's objects the oracle segmenter "
                                                 "masks exactly (visible pixels), shares with another object of "
                                                 "its colour, or splits.")
    parser.add_argument("--data", required=True, help="a toy-world folder (version 2 or --hard)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N scenes (default: all)")
    args = parser.parse_args(argv)
    if not (Path(args.data) / "annotations.json").is_file():
        parser.error(f"{args.data} holds no annotations.json: pass a folder python -m extract.worlds.toyworld wrote")
    c = check_world(args.data, args.limit)
    n = max(1, c["objects"])
    print(f"{c['objects']} objects: exact {c['exact']} ({100 * c['exact'] / n:.1f} %), shared with an object of "
          f"the same colour {c['shared']} ({100 * c['shared'] / n:.1f} %), split {c['split']} "
          f"({100 * c['split'] / n:.1f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
