"""Random entity boxes: the control for ComAlign's detector boxes (``python -m extract --boxes random``).

ComAlign (paper sec. III-A) crops entity boxes from a detector and relation boxes from the union of each pair.
Part of a gain measured with those components may come from merely having more crops of the image to embed,
not from where they are; boxes drawn without looking at the image separate the two. :class:`RandomBoxes` has the
detector interface the extraction uses (``detect(images) -> list[Detections]``, ``settings()``), so the same
pipeline, cache and live extraction serve it.

Distribution, per image of W x H px (pixel boxes, xyxy, end-exclusive, as :mod:`extract.components.regions`): ``count``
boxes, each with centre ``cx ~ U[0, W)``, ``cy ~ U[0, H)`` and size ``w ~ U[min_side * W, W]``,
``h ~ U[min_side * H, H]`` (drawn in this order, ``count`` values each), then clipped to the image: the PowerCLIP-R
recipe (uniform centres, heights and widths; PowerCLIP sec. 3.2) in pixels instead of patch cells, with a floor
on the side so that no crop is a sliver. Every box scores 1 (no confidence; :func:`extract.components.regions.relation_boxes`
then ranks pairs in pair order, as for ground-truth boxes).

The draws are seeded by ``seed`` and the image's own pixels (SHA-256 of mode, size and bytes), not by its
position in a batch: an image gets the same boxes in the training cache and when an adapter scores it later.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from extract.components.detectors import Detections


class RandomBoxes:
    """``count`` random boxes per image (module docstring), as :class:`extract.components.detectors.Detections`.

    count: boxes per image (>= 1; the extraction passes ``--max-entities``); seed: >= 0; min_side: smallest box
    side as a fraction of the image side, in (0, 1].
    """

    def __init__(self, count: int = 10, seed: int = 0, min_side: float = 0.1):
        if count < 1 or seed < 0 or not 0.0 < min_side <= 1.0:
            raise ValueError(f"RandomBoxes: need count >= 1, seed >= 0, 0 < min_side <= 1; got {count}, {seed}, "
                             f"{min_side}")
        self.count, self.seed, self.min_side = int(count), int(seed), float(min_side)

    def _rng(self, image) -> np.random.Generator:
        h = hashlib.sha256(f"{image.mode}:{image.size}".encode())
        h.update(image.tobytes())
        return np.random.default_rng(np.random.SeedSequence([self.seed, int.from_bytes(h.digest()[:8], "little")]))

    def boxes(self, image) -> np.ndarray:
        """float32 [count, 4] boxes (xyxy px, inside the image) for one PIL image."""
        w, h = image.size
        rng = self._rng(image)
        cx, cy = rng.uniform(0.0, w, self.count), rng.uniform(0.0, h, self.count)
        bw = rng.uniform(self.min_side * w, w, self.count)
        bh = rng.uniform(self.min_side * h, h, self.count)
        b = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], axis=1)
        return np.clip(b, 0.0, [w, h, w, h]).astype(np.float32)

    def detect(self, images: Sequence) -> list[Detections]:
        """One :class:`Detections` of ``count`` boxes per PIL image, all scoring 1, class 0 ("random")."""
        return [Detections(self.boxes(im), np.ones(self.count, np.float32), np.zeros(self.count, np.int64),
                           ["random"] * self.count) for im in images]

    def settings(self) -> dict:
        """What determines the boxes, for cache fingerprints."""
        return {"kind": "random", "count": self.count, "seed": self.seed, "min_side": self.min_side}
