"""Who owns the overlap (extract/components/overlap.py): the front object, from the pixels, for any drawing order."""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from extract.components.overlap import FEATURES, _hull, _hull_mask, ownership

RED, BLUE = (230, 25, 25), (40, 90, 255)


def _image(shapes, background=(40, 40, 40), size=64):
    image = Image.new("RGB", (size, size), background)
    pen = ImageDraw.Draw(image)
    for kind, box, colour in shapes:  # in drawing order: later ones in front
        xy = [box[0], box[1], box[2] - 1, box[3] - 1]
        (pen.ellipse if kind == "circle" else pen.rectangle)(xy, fill=colour)
    return np.asarray(image)


def test_the_later_drawn_of_two_overlapping_objects_owns_the_overlap_in_every_rule():
    a, b = [10, 10, 34, 34], [22, 20, 46, 44]
    for kinds in (("square", "square"), ("circle", "square"), ("square", "circle"), ("circle", "circle")):
        back_first = _image([(kinds[0], a, RED), (kinds[1], b, BLUE)])   # b in front
        front_first = _image([(kinds[1], b, BLUE), (kinds[0], a, RED)])  # a in front
        for raw, front in ((back_first, 1), (front_first, 0)):
            f = ownership(raw, np.asarray([a, b], np.float32), 3)
            assert f.shape == (3, 3, FEATURES)
            back = 1 - front
            assert f[front, back, 0] == 1.0 and f[front, back, 3] > 0 and f[front, back, 9] > 0, (kinds, front)
            np.testing.assert_allclose(f[front, back, 3], -f[back, front, 3])  # each pair both ways, mirrored


def test_boxes_that_do_not_overlap_and_empty_slots_get_zeros():
    raw = _image([("square", [2, 2, 20, 20], RED), ("square", [30, 30, 50, 50], BLUE)])
    f = ownership(raw, np.asarray([[2, 2, 20, 20], [30, 30, 50, 50]], np.float32), 4)
    assert not f.any()


def test_a_function_of_the_image_and_its_boxes_alone():
    """The same image and boxes give the same bytes whatever else there is (another image, more slots)."""
    raw = _image([("circle", [10, 10, 34, 34], RED), ("square", [22, 20, 46, 44], BLUE)])
    boxes = np.asarray([[10, 10, 34, 34], [22, 20, 46, 44]], np.float32)
    one = ownership(raw, boxes, 2)
    ownership(_image([("square", [0, 0, 30, 30], BLUE)]), boxes[:1], 2)
    assert ownership(raw.copy(), boxes.copy(), 4)[:2, :2].tobytes() == one.tobytes()


def test_the_hull_from_row_ends_equals_the_hull_of_every_pixel():
    # the fast path takes each row's end pixels only; the reference, every pixel's four corners
    rng = np.random.default_rng(0)
    for trial in range(30):
        mask = rng.random((20, 26)) < 0.02 + 0.03 * (trial % 10)
        if trial % 7 == 0:
            mask[:] = False
        reference = mask.copy()
        ys, xs = np.nonzero(mask)
        if len(xs):
            corners = np.concatenate([np.stack([xs + dx, ys + dy], 1) for dx in (0, 1) for dy in (0, 1)])
            image = Image.new("L", (mask.shape[1], mask.shape[0]), 0)
            ImageDraw.Draw(image).polygon([(x - 0.5, y - 0.5) for x, y in _hull(corners)], fill=255)
            reference |= np.asarray(image) > 0
        assert np.array_equal(_hull_mask(mask), reference), trial
