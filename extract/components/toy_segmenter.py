"""The toy world's oracle segmenter: ``python -m extract --regions sam2 --segmenter toy`` caches every object's
exact mask where SAM2 would cache its automatic masks, so PowerCLIP-S (``train.pretrain --method powerclip --masks
sam2 --regions-cache ...``) trains with true object regions -- the masks a perfect SAM2 would approach.

    python -m extract --data runs/toy --out runs/toy-masks --base tiny --pretrained none \\
        --components regions --regions sam2 --segmenter toy --num-regions 10

Why it is exact from the pixels alone: the toy world draws solid shapes on a black background without
anti-aliasing, and its layout keeps every two boxes at least ``GAP`` x the image side apart
(``extract.data.toyworld``: 3 px at 64 px). An object is therefore one 8-connected component of non-background
pixels, and two objects never share one. The masks go through the same code as SAM2's (``masks_to_grid`` onto the
backbone's patch grid, ``region_masks`` / ``region_valid`` in the cache, ``regions.source = "sam2"`` in its
settings); only ``regions.segmenter`` says ``toy-oracle``. On other images it returns the non-black blobs, which
is rarely what anyone wants: it is for the toy world.
"""
from __future__ import annotations

import numpy as np

from extract.components.detectors import Masks
from extract.data.toyworld import BACKGROUND

NAME = "toy"  # the --segmenter value that selects it
VERSION = 1  # bump when the masks it returns change (cache fingerprints hold it)


def connected_components(foreground: np.ndarray) -> tuple[np.ndarray, int]:
    """8-connected components of a bool [H, W] image: (labels int32 [H, W], 0 = background, 1..n; n).
    Labels are numbered in raster order of each component's first pixel. Min-label propagation over the
    3x3 neighbourhood until nothing changes (at most a component's pixel diameter of passes, a few dozen on the
    toy world's 64-px images), then the surviving labels renumbered."""
    fg = np.asarray(foreground, dtype=bool)
    h, w = fg.shape
    big = np.iinfo(np.int32).max
    labels = np.where(fg, np.arange(h * w, dtype=np.int32).reshape(h, w), big)
    while True:
        padded = np.pad(labels, 1, constant_values=big)
        smallest = labels
        for dy in (0, 1, 2):
            for dx in (0, 1, 2):
                smallest = np.minimum(smallest, padded[dy:dy + h, dx:dx + w])
        smallest = np.where(fg, smallest, big)
        if np.array_equal(smallest, labels):
            break
        labels = smallest
    roots = np.unique(labels[fg])  # each component's smallest raster index: ascending = raster order
    out = np.zeros((h, w), dtype=np.int32)
    out[fg] = np.searchsorted(roots, labels[fg]) + 1
    return out, len(roots)


class ToySegmenter:
    """``generate(image) -> Masks``: one mask per object (8-connected non-background component), largest first
    (ties in raster order), score 1. ``max_masks`` caps the count as SAM2's generator does."""

    def __init__(self, max_masks: int | None = None):
        self.max_masks = max_masks

    def generate(self, image) -> Masks:
        rgb = np.asarray(image.convert("RGB"))
        labels, n = connected_components((rgb != np.array(BACKGROUND, dtype=rgb.dtype)).any(-1))
        masks = labels[None] == np.arange(1, n + 1, dtype=np.int32)[:, None, None]
        areas = masks.reshape(n, -1).sum(1).astype(np.int64)
        order = np.argsort(-areas, kind="stable")[: self.max_masks]
        return Masks(masks[order], np.ones(len(order), np.float32), areas[order])

    def settings(self) -> dict:
        return {"segmenter": "toy-oracle", "version": VERSION, "max_masks": self.max_masks}
