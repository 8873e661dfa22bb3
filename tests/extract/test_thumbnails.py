"""Each box's own pixels, small (extract/components/thumbnails.py)."""
from __future__ import annotations

import numpy as np
from PIL import Image

from extract.components.thumbnails import SIDE, thumbnails


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (40, 60, 3), dtype=np.uint8)


def test_a_thumbnail_is_the_boxs_own_pixels_resized_and_empty_slots_are_zero():
    raw = _image()
    raw[10:20, 30:50] = (200, 10, 10)  # a red box: its thumbnail is red throughout, nothing of its neighbours
    out = thumbnails(raw, np.asarray([[30, 10, 50, 20], [0, 0, 60, 40]], np.float32), 4)
    assert out.shape == (4, SIDE, SIDE, 3) and out.dtype == np.uint8
    assert (out[0] == (200, 10, 10)).all()
    whole = np.asarray(Image.fromarray(raw).resize((SIDE, SIDE), Image.BILINEAR))
    np.testing.assert_array_equal(out[1], whole)
    assert not out[2:].any()


def test_boxes_past_the_edge_or_thinner_than_a_pixel_are_clipped_to_at_least_one_pixel():
    raw = _image(1)
    out = thumbnails(raw, np.asarray([[-5, -5, 3, 3], [59.6, 39.2, 70, 50], [10.2, 10.2, 10.4, 10.4]]), 3)
    np.testing.assert_array_equal(out[0], np.asarray(Image.fromarray(raw[:3, :3]).resize((SIDE, SIDE),
                                                                                        Image.BILINEAR)))
    assert (out[1] == raw[39, 59]).all() and (out[2] == raw[10, 10]).all()


def test_a_function_of_the_image_and_its_boxes_alone():
    raw, boxes = _image(2), np.asarray([[4, 5, 30, 33], [20, 1, 58, 39]], np.float32)
    one = thumbnails(raw, boxes, 2)
    thumbnails(_image(3), boxes[::-1], 5)
    np.testing.assert_array_equal(thumbnails(raw.copy(), boxes[:1].copy(), 3)[0], one[0])
    np.testing.assert_array_equal(thumbnails(np.concatenate([raw, raw[..., :1]], -1), boxes, 2), one)  # RGBA-like
