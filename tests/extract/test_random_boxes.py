"""extract.components.random_boxes: the random-box control for ComAlign (``--boxes random``): count, bounds, sizes, seeding
by the image's pixels, and the extraction path that caches their crops."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from extract.components.random_boxes import RandomBoxes


def _image(seed: int, size=(64, 48)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_boxes_lie_in_the_image_with_the_documented_distribution():
    boxes = RandomBoxes(count=4000, seed=3, min_side=0.25)
    im = _image(0, (80, 40))
    b = boxes.boxes(im)
    assert b.shape == (4000, 4) and b.dtype == np.float32
    assert (b[:, :2] >= 0).all() and (b[:, 2] <= 80).all() and (b[:, 3] <= 40).all()
    assert (b[:, 2] > b[:, 0]).all() and (b[:, 3] > b[:, 1]).all()
    # The unclipped draws, replayed from the documented order, give these boxes exactly after clipping.
    rng = boxes._rng(im)
    cx, cy = rng.uniform(0, 80, 4000), rng.uniform(0, 40, 4000)
    w, h = rng.uniform(20, 80, 4000), rng.uniform(10, 40, 4000)
    ref = np.clip(np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1), 0, [80, 40, 80, 40])
    np.testing.assert_allclose(b, ref, rtol=1e-6, atol=1e-4)
    centres = (b[:, :2] + b[:, 2:]) / 2  # clipping pulls centres inwards, never outside
    assert 0.4 < centres[:, 0].mean() / 80 < 0.6 and 0.4 < centres[:, 1].mean() / 40 < 0.6


def test_seeded_by_pixels_and_seed_not_by_batch_position():
    a, b = _image(1), _image(2)
    det = RandomBoxes(count=5, seed=0)
    first = det.detect([a, b])
    again = det.detect([b, a, a])
    np.testing.assert_array_equal(first[0].boxes, again[1].boxes)
    np.testing.assert_array_equal(first[1].boxes, again[0].boxes)
    assert not np.array_equal(first[0].boxes, first[1].boxes)
    assert not np.array_equal(first[0].boxes, RandomBoxes(count=5, seed=1).detect([a])[0].boxes)
    d = first[0]
    assert len(d) == 5 and (d.scores == 1).all() and d.classes.tolist() == [0] * 5 and d.names == ["random"] * 5
    assert RandomBoxes(count=5, seed=0).settings() == det.settings() != RandomBoxes(count=6).settings()
    with pytest.raises(ValueError):
        RandomBoxes(count=0)


def test_boxes_random_is_an_extraction_box_source(tmp_path):
    from extract.pipeline import build_cache
    from extract.worlds.toyworld import generate

    generate(tmp_path / "toy", 12, 0, workers=1)
    cache = build_cache(tmp_path / "toy", tmp_path / "cache", base="tiny", components=["entities", "relations"],
                        boxes="random", max_entities=3, max_relations=2, region_seed=5, workers=0)
    assert cache.settings["boxes"] == {"source": "random",
                                       "detector": {"kind": "random", "count": 3, "seed": 5, "min_side": 0.1},
                                       "crop_scale": 3.0}  # the tiny base's own (extract/models/backbones.json)
    rows = np.arange(len(cache.image_ids()))
    assert cache.gather("ventity_valid", rows).all() and cache.gather("vrelation_valid", rows).all()
    pairs = cache.gather("vrelation_pairs", rows)
    assert pairs[0].tolist() == [[0, 1], [0, 2]]  # equal scores: pair order (extract.components.regions.relation_boxes)
    boxes = cache.gather("ventity_boxes", rows)
    image = Image.open(tmp_path / "toy" / "images" / "000000.png").convert("RGB")
    ids = cache.image_ids()
    row = ids.index("0") if "0" in ids else next(k for k, i in enumerate(ids) if i.endswith("000000.png"))
    np.testing.assert_allclose(boxes[row], RandomBoxes(count=3, seed=5).boxes(image), atol=1e-5)
