"""Who owns the overlap (extract/components/overlap.py): the front object, from the pixels, for any drawing order."""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from extract.components.overlap import FEATURES, RULES, _hull, _hull_mask, ownership

RED, BLUE = (230, 25, 25), (40, 90, 255)


def _star(box):
    """A five-pointed star, point up, filling ``box`` (the toy world's shape of most concavity)."""
    cx, cy, r = (box[0] + box[2] - 1) / 2, (box[1] + box[3] - 1) / 2, (box[2] - box[0] - 1) / 2
    return [(cx + (r if k % 2 == 0 else 0.45 * r) * np.sin(np.pi * k / 5),
             cy - (r if k % 2 == 0 else 0.45 * r) * np.cos(np.pi * k / 5)) for k in range(10)]


def _image(shapes, background=(40, 40, 40), size=64):
    image = Image.new("RGB", (size, size), background)
    pen = ImageDraw.Draw(image)
    for kind, box, colour in shapes:  # in drawing order: later ones in front
        xy = [box[0], box[1], box[2] - 1, box[3] - 1]
        if kind == "star":
            pen.polygon(_star(box), fill=colour)
        elif kind == "triangle":
            pen.polygon([((box[0] + box[2] - 1) / 2, box[1]), (box[0], box[3] - 1), (box[2] - 1, box[3] - 1)],
                        fill=colour)
        else:
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


def test_each_rule_reads_a_difference_whose_sign_names_the_front_object():
    """RULES, which the grounded head's explanations and the probe read: each a column mirrored between (b, c) and
    (c, b) (a difference, not one object's share), never saying the object behind is in front, and together naming
    the front object of every drawing, circles and squares in either order."""
    assert [r.name for r in RULES] == ["seen", "extent", "bite", "mirror"] and len({r.column for r in RULES}) == 4
    a, b = [10, 10, 34, 34], [22, 20, 46, 44]
    for kinds in (("square", "square"), ("circle", "square"), ("square", "circle"), ("circle", "circle")):
        for front in (0, 1):
            order = [(kinds[0], a, RED), (kinds[1], b, BLUE)]
            f = ownership(_image(order if front else order[::-1]), np.asarray([a, b], np.float32), 2)
            back = 1 - front
            for rule in RULES:
                np.testing.assert_allclose(rule.difference(f[front, back]), -rule.difference(f[back, front]))
                assert rule.difference(f[front, back]) >= 0, (kinds, front, rule.name)
            assert sum(np.sign(r.difference(f[front, back])) for r in RULES) > 0, (kinds, front)


def test_the_object_in_front_shows_its_whole_mirror_symmetric_shape_and_the_one_behind_does_not():
    """mirror / flip (columns 12-17): the IoU of each object's pixels with their mirror image, left-right / up-down.
    Stars and triangles, whose hulls take in their neighbour's colour in front or behind, and boxes as a detector
    gives them (the one behind hugging what shows of it): the one in front is left-right symmetric, the one behind is
    not, whichever is drawn last (where the colour seen in the overlap, the extent and the bite, the three rules
    before it, name the wrong one or none in 11 of these 16 readings)."""
    mirror = next(r for r in RULES if r.name == "mirror")
    for kinds in (("star", "star"), ("star", "triangle"), ("triangle", "star"), ("triangle", "triangle")):
        for front in (0, 1):
            a, b = [8, 12, 36, 40], [20, 14, 48, 42]
            order = [(kinds[0], a, RED), (kinds[1], b, BLUE)]
            raw = _image(order if front else order[::-1])
            # the detector's box of the one behind: around what shows of it
            colour = np.asarray(RED if front == 1 else BLUE)
            ys, xs = np.nonzero((raw == colour).all(-1))
            boxes = [list(a), list(b)]
            boxes[1 - front] = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
            f = ownership(raw, np.asarray(boxes, np.float32), 2)
            back = 1 - front
            assert f[front, back, 12] > 0.9 and mirror.difference(f[front, back]) > 0.2, (kinds, front, f[front, back])
            np.testing.assert_allclose(mirror.difference(f[back, front]), -mirror.difference(f[front, back]))
            assert f[front, back, 12] == f[back, front, 13] and f[front, back, 15] == f[back, front, 16]


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
