"""Region geometry: every vectorised path against a brute-force reference, the preprocess map against open_clip's
own transform, and crops / annotations against the toy world."""
import json
import math

import numpy as np
import pytest
import torch
from open_clip.transform import image_transform
from PIL import Image, ImageDraw

from extract.worlds import toyworld
from extract.components.regions import (
    boxes_to_grid_masks, crop_regions, grid_boxes_to_masks, gt_boxes, image_to_grid_transform, masks_to_grid,
    pool_regions, preprocess_geometry, random_grid_boxes, relation_boxes,
)

TOL = 1e-6  # the module's tolerance on covered fractions

# (original (W, H), input (W, H), resize_mode): square and non-square images and inputs, every mode
GEOMETRIES = [
    ((64, 64), (64, 64), "shortest"),
    ((100, 60), (64, 64), "shortest"),
    ((37, 83), (32, 32), "shortest"),
    ((97, 31), (48, 64), "shortest"),
    ((90, 50), (64, 64), "longest"),
    ((41, 77), (64, 40), "longest"),
    ((90, 50), (64, 48), "squash"),
]


def _pil_transform(input_size, mode):
    """open_clip's eval preprocess with identity normalisation, so tensor values are pixel values / 255."""
    w, h = input_size
    return image_transform((h, w), is_train=False, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), resize_mode=mode)


# --------------------------------------------------------------------------------------------- relation boxes
def _relation_reference(boxes, scores, top_n):
    cands = []
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            union = [min(boxes[i][0], boxes[j][0]), min(boxes[i][1], boxes[j][1]),
                     max(boxes[i][2], boxes[j][2]), max(boxes[i][3], boxes[j][3])]
            cands.append((-scores[i] * scores[j], len(cands), union, (i, j)))
    cands.sort(key=lambda c: (c[0], c[1]))
    cands = cands if top_n is None else cands[:top_n]
    return ([c[2] for c in cands], [-c[0] for c in cands], [c[3] for c in cands])


@pytest.mark.parametrize("seed", range(12))
def test_relation_boxes_match_double_loop(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(0, 9))
    xy = rng.uniform(0, 100, (m, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(1, 40, (m, 2))], axis=1)
    scores = rng.choice([0.25, 0.5, 1.0], m)  # few values: many exact ties
    for top_n in (None, 1, 5, 10, 100):
        union, score, pairs = relation_boxes(boxes, scores, top_n)
        ref_union, ref_score, ref_pairs = _relation_reference(boxes.tolist(), scores.tolist(), top_n)
        r = len(ref_union)
        assert union.shape == (r, 4) and score.shape == (r,) and pairs.shape == (r, 2)
        np.testing.assert_array_equal(union.reshape(-1, 4), np.asarray(ref_union).reshape(-1, 4))
        np.testing.assert_array_equal(score, np.asarray(ref_score).reshape(-1))
        np.testing.assert_array_equal(pairs, np.asarray(ref_pairs, dtype=np.int64).reshape(-1, 2))


def test_relation_boxes_ties_keep_pair_order_and_empty_shapes():
    boxes = np.array([[0, 0, 1, 1], [5, 5, 6, 6], [2, 8, 3, 9], [9, 0, 10, 1]], dtype=float)
    _, score, pairs = relation_boxes(boxes, np.ones(4), top_n=4)
    assert pairs.tolist() == [[0, 1], [0, 2], [0, 3], [1, 2]] and score.tolist() == [1.0] * 4
    union, _, pairs = relation_boxes(boxes, [0.9, 0.1, 0.8, 0.7], top_n=2)
    assert pairs.tolist() == [[0, 2], [0, 3]] and union.tolist() == [[0, 0, 3, 9], [0, 0, 10, 1]]
    for m in (0, 1):
        union, score, pairs = relation_boxes(np.zeros((m, 4)), np.ones(m))
        assert union.shape == (0, 4) and score.shape == (0,) and pairs.shape == (0, 2) and pairs.dtype == np.int64
    with pytest.raises(ValueError):
        relation_boxes(boxes, np.ones(3))


# --------------------------------------------------------------------------------------------- random grid boxes
def test_random_boxes_follow_the_documented_draws():
    grid, m = (7, 5), 300
    boxes, masks = random_grid_boxes(grid, m, np.random.default_rng(3))
    rng = np.random.default_rng(3)  # the documented draw order, replayed one box at a time
    cy, cx, h, w = rng.uniform(0, 7, m), rng.uniform(0, 5, m), rng.integers(1, 8, m), rng.integers(1, 6, m)
    for k in range(m):
        r0, c0 = math.floor(cy[k] - h[k] / 2 + 0.5), math.floor(cx[k] - w[k] / 2 + 0.5)
        ref = [max(r0, 0), max(c0, 0), min(r0 + h[k], 7), min(c0 + w[k], 5)]
        assert boxes[k].tolist() == ref
        cells = np.zeros(grid, dtype=bool)
        cells[ref[0]:ref[2], ref[1]:ref[3]] = True
        np.testing.assert_array_equal(masks[k], cells)


@pytest.mark.parametrize("grid", [(1, 1), (1, 6), (4, 5), (14, 14)])
def test_random_boxes_reproducible_in_grid_nonempty(grid):
    rows, cols = grid
    a, ma = random_grid_boxes(grid, 500, np.random.default_rng(0))
    b, mb = random_grid_boxes(grid, 500, np.random.default_rng(0))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ma, mb)
    assert a.dtype == np.int64 and ma.shape == (500, rows, cols) and ma.dtype == bool
    assert (a[:, 0] >= 0).all() and (a[:, 1] >= 0).all() and (a[:, 2] <= rows).all() and (a[:, 3] <= cols).all()
    assert (a[:, 2] > a[:, 0]).all() and (a[:, 3] > a[:, 1]).all() and ma.any(axis=(1, 2)).all()
    np.testing.assert_array_equal(ma, grid_boxes_to_masks(a, grid))
    if rows * cols > 1:
        c, _ = random_grid_boxes(grid, 500, np.random.default_rng(1))
        assert not np.array_equal(a, c)
    empty, empty_masks = random_grid_boxes(grid, 0, np.random.default_rng(0))
    assert empty.shape == (0, 4) and empty_masks.shape == (0, rows, cols)


def test_random_boxes_centres_are_uniform():
    """A box that touches no border was not clipped, so its size is the drawn one and, the centre being uniform,
    every position that keeps a box of that size off the border is equally likely. Coverage of all boxes must
    be symmetric under flips (no drift towards a corner)."""
    grid, m = (6, 7), 100000
    boxes, masks = random_grid_boxes(grid, m, np.random.default_rng(7))
    heights, widths = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    interior = (boxes[:, 0] > 0) & (boxes[:, 1] > 0) & (boxes[:, 2] < 6) & (boxes[:, 3] < 7)
    for h, w in ((1, 1), (2, 3)):
        group = boxes[interior & (heights == h) & (widths == w)]
        counts = np.zeros((5 - h, 6 - w))  # top-left cell in 1 .. rows - h - 1, 1 .. cols - w - 1
        np.add.at(counts, (group[:, 0] - 1, group[:, 1] - 1), 1)
        expected = len(group) / counts.size
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert expected > 30 and chi2 < 45, (h, w, chi2)  # 99.9% quantile of chi-square with <= 19 dof: 43.8
    coverage = masks.mean(axis=0)
    assert np.abs(coverage - coverage[::-1, :]).max() < 0.01 and np.abs(coverage - coverage[:, ::-1]).max() < 0.01
    assert set(heights.tolist()) == set(range(1, 7)) and set(widths.tolist()) == set(range(1, 8))


# --------------------------------------------------------------------------------------------- preprocess map
#: open_clip's resize and crop stages (torchvision's and its own); what follows them (RGB conversion, named
#: MaybeConvertMode from open_clip 3.3 and a plain function before, ToTensor, Normalize) moves no pixel
GEOMETRIC_STAGES = ("Resize", "CenterCrop", "ResizeKeepRatio", "CenterCropOrPad")
@pytest.mark.parametrize("image_size,input_size,mode", GEOMETRIES)
def test_transform_matches_open_clip_resize_and_crop(image_size, input_size, mode):
    """Exact: the resize stage's output size, and which resized pixel lands at input (0, 0) (read from a ramp)."""
    stages = []
    for stage in _pil_transform(input_size, mode).transforms:
        if type(stage).__name__ not in GEOMETRIC_STAGES:  # the colour / tensor conversions that follow
            break
        stages.append(stage)
    t = image_to_grid_transform(image_size, input_size, mode)
    resized = stages[0](Image.new("RGB", image_size))
    rw, rh = resized.size
    assert (rw / image_size[0], rh / image_size[1]) == t.scale
    # ramp image: R = x + 1, G = y + 1 (0 is the padding colour)
    ramp = np.zeros((rh, rw, 3), dtype=np.uint8)
    ramp[..., 0] = np.arange(rw)[None, :] + 1
    ramp[..., 1] = np.arange(rh)[:, None] + 1
    out = Image.fromarray(ramp)
    for stage in stages[1:]:
        out = stage(out)
    out = np.asarray(out)
    # input pixel (i, j) holds resized pixel (i + oy, j + ox), or padding (0) where that is outside the image
    ox, oy = int(t.offset[0]), int(t.offset[1])
    cols = np.arange(input_size[0]) + ox
    rows = np.arange(input_size[1]) + oy
    inside = ((rows >= 0) & (rows < rh))[:, None] & ((cols >= 0) & (cols < rw))[None, :]
    np.testing.assert_array_equal(out[..., 0], np.where(inside, cols[None, :] + 1, 0))
    np.testing.assert_array_equal(out[..., 1], np.where(inside, rows[:, None] + 1, 0))


@pytest.mark.parametrize("image_size,input_size,mode", GEOMETRIES)
def test_mapped_box_is_where_the_preprocess_draws_it(image_size, input_size, mode):
    """End to end through open_clip's full (bicubic) preprocess: a white box's mapped edges are within 1 px."""
    w, h = image_size
    box = [0.3 * w, 0.25 * h, 0.7 * w, 0.8 * h]
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    image = Image.new("RGB", image_size)
    ImageDraw.Draw(image).rectangle([x0, y0, x1 - 1, y1 - 1], fill=(255, 255, 255))
    white = _pil_transform(input_size, mode)(image)[0].numpy() > 0.5
    ys, xs = np.nonzero(white)
    mapped = image_to_grid_transform(image_size, input_size, mode).clipped_boxes([[x0, y0, x1, y1]])[0]
    drawn = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
    assert np.abs(np.asarray(drawn) - mapped).max() <= 1.0, (drawn, mapped)


def test_preprocess_geometry_of_the_tiny_backbone():
    from extract.models.backbone import load_backbone

    bb = load_backbone("tiny")
    assert preprocess_geometry(bb) == ((64, 64), "shortest")
    assert bb.grid == (8, 8)


# --------------------------------------------------------------------------------------------- boxes -> grid
def _cell_in_original(t, r, c, cw, ch):
    """Cell (r, c)'s rectangle in original px (the inverse of input = original * scale - offset)."""
    (sx, sy), (ox, oy) = t.scale, t.offset
    return ((c * cw + ox) / sx, (r * ch + oy) / sy, ((c + 1) * cw + ox) / sx, ((r + 1) * ch + oy) / sy)


def _overlap(a, b):
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def _threshold_with_rescue(fraction, min_fraction):
    mask = fraction >= min_fraction - TOL
    if not mask.any() and fraction.max() > 0:
        best = fraction.max()
        for r, c in np.ndindex(*fraction.shape):  # first best cell in row-major order
            if fraction[r, c] >= best - TOL:
                mask[r, c] = True
                break
    return mask


def _boxes_reference(boxes, image_size, input_size, grid, min_fraction, mode):
    t = image_to_grid_transform(image_size, input_size, mode)
    (rows, cols), (tw, th), (w, h) = grid, input_size, image_size
    cw, ch = tw // cols, th // rows
    out = np.zeros((len(boxes), rows, cols), dtype=bool)
    for m, box in enumerate(boxes):
        fraction = np.zeros(grid)
        for r in range(rows):
            for c in range(cols):
                cell = _cell_in_original(t, r, c, cw, ch)
                visible = _overlap(box, (0, 0, w, h))
                inside = _overlap((max(box[0], 0), max(box[1], 0), min(box[2], w), min(box[3], h)), cell)
                fraction[r, c] = inside / _overlap(cell, cell) if visible else 0.0
        out[m] = _threshold_with_rescue(fraction, min_fraction)
    return out


@pytest.mark.parametrize("image_size,input_size,mode", GEOMETRIES)
@pytest.mark.parametrize("grid", [(8, 8), (4, 2)])
def test_boxes_to_grid_masks_match_per_cell_reference(image_size, input_size, mode, grid):
    if input_size[0] < grid[1] or input_size[1] < grid[0]:
        pytest.skip("grid larger than input")
    rng = np.random.default_rng(sum(image_size) + grid[0])
    w, h = image_size
    xy = rng.uniform([-0.2 * w, -0.2 * h], [w, h], (40, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(0.2, [0.6 * w, 0.6 * h], (40, 2))], axis=1)
    integer = np.floor(boxes)  # integer edges often fall exactly on cell edges / midlines
    boxes = np.concatenate([boxes, integer, [[0, 0, w, h], [1, 1, 1.5, 1.5]]])
    for min_fraction in (0.5, 0.25, 0.9):
        got = boxes_to_grid_masks(boxes, image_size, input_size, grid, min_fraction, resize_mode=mode)
        ref = _boxes_reference(boxes.tolist(), image_size, input_size, grid, min_fraction, mode)
        assert got.shape == (len(boxes), *grid) and got.dtype == bool
        np.testing.assert_array_equal(got, ref)


def test_tiny_boxes_get_one_cell_and_boxes_outside_the_crop_none():
    # 100 x 60 image -> shortest side to 64: resized 106 x 64, crop offset x = 21 resized px (= 19.8 px here)
    image_size, input_size, grid = (100, 60), (64, 64), (8, 8)
    t = image_to_grid_transform(image_size, input_size)
    assert t.offset == (21.0, 0.0) and t.scale == (1.06, 64 / 60)
    boxes = np.array([
        [50.0, 30.0, 50.5, 30.5],  # tiny, well inside one cell
        [0.0, 0.0, 15.0, 60.0],  # entirely in the left margin that the centre crop drops
        [85.0, 10.0, 100.0, 20.0],  # entirely in the right margin
        [10.0, 10.0, 10.0, 20.0],  # zero width
        [5.0, 5.0, 25.0, 7.0],  # mostly cropped: the visible sliver is under half a cell -> its best cell only
    ])
    masks = boxes_to_grid_masks(boxes, image_size, input_size, grid)
    assert masks.sum(axis=(1, 2)).tolist() == [1, 0, 0, 0, 1]
    # input x = 50 * 1.06 - 21 = 32.0 -> column 4; y = 32.0 -> row 4
    assert masks[0, 4, 4]
    # the sliver: x in [0, 5.5) input px, y in [5.33, 7.47): best cell = column 0, row 0
    assert masks[4, 0, 0]
    # a tiny box on the corner of four cells: all four equally covered, the first in row-major order wins
    corner = boxes_to_grid_masks([[7.5, 7.5, 8.5, 8.5]], (64, 64), (64, 64), grid)
    assert np.argwhere(corner[0]).tolist() == [[0, 0]]
    assert boxes_to_grid_masks(np.zeros((0, 4)), image_size, input_size, grid).shape == (0, 8, 8)


def test_longest_mode_padding_is_not_covered():
    # 128 x 64 image -> longest side to 64: 64 x 32 resized, padded by 16 px above and below
    t = image_to_grid_transform((128, 64), (64, 64), "longest")
    assert t.scale == (0.5, 0.5) and t.offset == (0.0, -16.0)
    masks = boxes_to_grid_masks([[0, -50, 128, 200]], (128, 64), (64, 64), (8, 8), resize_mode="longest")
    assert masks[0].any(axis=1).tolist() == [False, False, True, True, True, True, False, False]


# --------------------------------------------------------------------------------------------- masks -> grid
def _masks_reference(masks, image_size, input_size, grid, min_fraction, mode):
    t = image_to_grid_transform(image_size, input_size, mode)
    (rows, cols), (tw, th) = grid, input_size
    cw, ch = tw // cols, th // rows
    out = np.zeros((len(masks), rows, cols), dtype=bool)
    for m, mask in enumerate(masks):
        pixels = [(x, y, x + 1, y + 1) for y, x in zip(*np.nonzero(mask))]
        fraction = np.zeros(grid)
        for r in range(rows):
            for c in range(cols):
                cell = _cell_in_original(t, r, c, cw, ch)
                fraction[r, c] = sum(_overlap(p, cell) for p in pixels) / _overlap(cell, cell)
        out[m] = _threshold_with_rescue(fraction, min_fraction)
    return out


@pytest.mark.parametrize("image_size,input_size,mode", [
    ((20, 14), (16, 16), "shortest"), ((13, 9), (8, 8), "shortest"), ((9, 15), (12, 8), "shortest"),
    ((18, 10), (16, 16), "longest"), ((11, 17), (16, 8), "squash"), ((16, 16), (16, 16), "shortest"),
])
def test_masks_to_grid_match_per_pixel_reference(image_size, input_size, mode):
    w, h = image_size
    rng = np.random.default_rng(w * h)
    blobs = rng.random((6, h, w)) < rng.uniform(0.05, 0.6, (6, 1, 1))
    single = np.zeros((3, h, w), dtype=bool)
    single[0, h // 2, w // 2] = True  # one pixel: must still get a cell
    single[1, 0, 0] = True  # a corner pixel: outside the crop under "shortest" with a non-square image
    masks = np.concatenate([blobs, single])  # single[2] stays empty
    for grid in ((4, 4), (2, 4)):
        for min_fraction in (0.5, 0.2):
            got = masks_to_grid(masks, image_size, input_size, grid, min_fraction, resize_mode=mode)
            ref = _masks_reference(masks, image_size, input_size, grid, min_fraction, mode)
            np.testing.assert_array_equal(got, ref)
            assert got[6].sum() == 1 and not got[8].any()


@pytest.mark.parametrize("image_size,input_size,mode", GEOMETRIES)
def test_box_masks_agree_with_boxes(image_size, input_size, mode):
    """A pixel mask filling an integer box covers exactly the box, so both paths give the same cells."""
    w, h = image_size
    rng = np.random.default_rng(w + 3 * h)
    x0, y0 = rng.integers(0, [w - 1, h - 1], (30, 2)).T
    x1, y1 = rng.integers(x0 + 1, w + 1), rng.integers(y0 + 1, h + 1)
    boxes = np.stack([x0, y0, x1, y1], axis=1)
    masks = np.zeros((30, h, w), dtype=bool)
    for k, (a, b, c, d) in enumerate(boxes):
        masks[k, b:d, a:c] = True
    np.testing.assert_array_equal(masks_to_grid(masks, image_size, input_size, (8, 8), resize_mode=mode),
                                  boxes_to_grid_masks(boxes, image_size, input_size, (8, 8), resize_mode=mode))
    with pytest.raises(ValueError):
        masks_to_grid(masks[:, :, :-1], image_size, input_size, (8, 8), resize_mode=mode)


# --------------------------------------------------------------------------------------------- pooling
def test_pool_regions_match_loop_and_mask_empty_regions():
    gen = torch.Generator().manual_seed(0)
    b, rows, cols, d, m = 3, 4, 5, 8, 6
    patches = torch.randn(b, rows * cols, d, generator=gen)
    masks = torch.rand(b, m, rows, cols, generator=gen) < 0.3
    masks[0, 2] = False  # an empty region
    masks[1, 5] = False  # padding
    masks[2, 0] = True  # the whole grid
    emb, valid = pool_regions(patches, masks)
    assert emb.shape == (b, m, d) and valid.shape == (b, m) and torch.isfinite(emb).all()
    for i in range(b):
        for k in range(m):
            cells = masks[i, k].flatten().nonzero().flatten()
            assert bool(valid[i, k]) == (len(cells) > 0)
            if len(cells):
                mean = patches[i, cells].mean(0)
                torch.testing.assert_close(emb[i, k], mean / mean.norm())
            else:
                assert (emb[i, k] == 0).all()
    assert not valid[0, 2] and not valid[1, 5]
    # unbatched, and one set of (numpy) masks shared by a batch
    e1, v1 = pool_regions(patches[1], masks[1])
    torch.testing.assert_close(e1, emb[1])
    assert torch.equal(v1, valid[1])
    shared, vs = pool_regions(patches, masks[2].numpy())
    assert shared.shape == (b, m, d) and vs.shape == (b, m)
    torch.testing.assert_close(shared[2], emb[2])
    with pytest.raises(ValueError):
        pool_regions(patches, masks[..., :-1])


def test_pool_regions_on_real_backbone_patches():
    from extract.models.backbone import load_backbone

    bb = load_backbone("tiny")
    feats = bb.encode_images(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)))
    _, masks = random_grid_boxes(bb.grid, 10, np.random.default_rng(0))
    emb, valid = pool_regions(feats.patches, masks)
    assert emb.shape == (2, 10, bb.embed_dim) and valid.all()
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(2, 10))


# --------------------------------------------------------------------------------------------- crops and annotations
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("toyworld")
    toyworld.generate(out, 5, 0, workers=1)
    return out, toyworld.load(out)["scenes"]


def test_gt_boxes_of_a_toy_scene(world):
    _, scenes = world
    for scene in scenes:
        boxes, labels = gt_boxes(scene)
        assert boxes.dtype == np.float64 and boxes.shape == (len(scene["objects"]), 4)
        assert boxes.tolist() == [o["box"] for o in scene["objects"]]
        assert labels == [f"{o['size']} {o['colour']} {o['shape']}" for o in scene["objects"]]


def test_gt_boxes_of_a_visual_genome_entry():
    entry = json.loads('{"image_id": 1, "objects": ['
                       '{"object_id": 7, "x": 10, "y": 20, "w": 30, "h": 40, "names": ["man", "person"]},'
                       '{"object_id": 8, "x": 0, "y": 5, "w": 3, "h": 2, "name": "hat"}]}')
    boxes, labels = gt_boxes(entry)
    assert boxes.tolist() == [[10, 20, 40, 60], [0, 5, 3, 7]] and labels == ["man", "hat"]
    boxes, labels = gt_boxes({"objects": []})
    assert boxes.shape == (0, 4) and labels == []


def test_crop_regions_cut_out_the_objects(world):
    root, scenes = world
    transform = _pil_transform((64, 64), "shortest")
    checked = 0
    for scene in scenes:
        image = Image.open(root / scene["file_name"])
        boxes, _ = gt_boxes(scene)
        crops = crop_regions(image, boxes, transform)
        assert crops.shape == (len(boxes), 3, 64, 64)
        for crop, obj in zip(crops, scene["objects"]):
            colour = torch.tensor(toyworld.COLOURS[obj["colour"]]) / 255
            # every shape covers the middle of its box; squares fill it
            centre = crop[:, 28:36, 28:36].reshape(3, -1)
            torch.testing.assert_close(centre, colour[:, None].expand_as(centre), atol=2 / 255, rtol=0)
            if obj["shape"] == "square":
                torch.testing.assert_close(crop[:, 4:-4, 4:-4].mean((1, 2)), colour, atol=2 / 255, rtol=0)
            checked += 1
    assert checked > 0
    empty = crop_regions(image, np.zeros((0, 4)), transform)
    assert empty.shape == (0, 3, 64, 64)


def test_crop_regions_pad_keeps_a_wide_relation_box_whole():
    image = Image.new("RGB", (90, 40))
    pen = ImageDraw.Draw(image)
    pen.rectangle([0, 5, 19, 24], fill=(255, 0, 0))  # red square at the left end
    pen.rectangle([70, 10, 89, 29], fill=(0, 0, 255))  # blue square at the right end
    boxes = np.array([[0, 5, 20, 25], [70, 10, 90, 30]], dtype=float)
    union, _, _ = relation_boxes(boxes, [0.9, 0.8])
    transform = _pil_transform((32, 32), "shortest")
    padded = crop_regions(image, union, transform, fit="pad")[0]
    assert padded.shape == (3, 32, 32)
    assert (padded[0] > 0.9).any() and (padded[2] > 0.9).any()  # both objects survive
    assert (padded[:, :5] == 0).all() and (padded[:, -5:] == 0).all()  # black bars above and below
    literal = crop_regions(image, union, transform, fit="none")[0]
    assert (literal < 0.1).all()  # the centre crop keeps only the empty middle third
    # boxes are clipped to the image and never empty
    edge = crop_regions(image, [[-10, -10, 0.2, 0.2], [85, 35, 500, 500], [200, 200, 300, 300]], transform)
    assert edge.shape == (3, 3, 32, 32)
    torch.testing.assert_close(edge[0, :, 16, 16], torch.zeros(3))  # pixel (0, 0) is background
    torch.testing.assert_close(crop_regions(image, [[-10, 5, 0.2, 5.5]], transform)[0, :, 16, 16],
                               torch.tensor([1.0, 0.0, 0.0]))  # pixel (0, 5) is red
    with pytest.raises(ValueError):
        crop_regions(image, union, transform, fit="squash")



def test_gt_boxes_reads_the_box_readers_entries_and_no_entry_is_an_error(tmp_path):
    """The entries of extract.data.boxes (its own tests read every format). An image without an entry used to get
    ``{"objects": []}`` here (annotation_for), so a box file of other images gave a whole collection no boxes in
    silence; it is an error naming the file and the image now."""
    from extract.data.boxes import MissingBoxes, read_boxes

    vg = [{"image_id": 7, "url": "https://x/VG_100K/7.jpg",
           "objects": [{"x": 1, "y": 2, "w": 3, "h": 4, "names": ["cat"]}]},
          {"id": 8, "file_name": "imgs/8.png", "objects": []}]
    path = tmp_path / "objects.json"
    path.write_text(json.dumps(vg))
    found = read_boxes(path)
    boxes, labels = gt_boxes(found.entry("data/7.jpg"))  # CSV ids are paths: matched by base name
    np.testing.assert_array_equal(boxes, [[1, 2, 4, 6]])
    assert labels == ["cat"]
    assert gt_boxes(found.entry(8))[0].shape == (0, 4)  # an entry without objects: zero boxes, no error
    with pytest.raises(MissingBoxes, match="objects.json .* holds no boxes for image 'unknown'"):
        found.entry("unknown")


def test_pair_rows_list_pairs_as_relation_boxes_does():
    import numpy as np

    from extract.components.regions import pair_rows, relation_boxes

    boxes = np.array([[0, 0, 4, 4], [5, 5, 9, 9], [10, 0, 14, 4], [0, 10, 4, 14]], float)
    _, _, pairs = relation_boxes(boxes, np.ones(4), top_n=5)
    assert pair_rows(4, 5).tolist() == pairs.tolist()
    assert pair_rows(2, 3).tolist() == [[0, 1], [0, 1], [0, 1]] and pair_rows(1, 2).tolist() == [[0, 0], [0, 0]]


def test_crop_scale_puts_the_object_on_a_canvas_it_fills_a_third_of():
    image = Image.new("RGB", (64, 64))
    image.paste((200, 10, 10), (20, 20, 30, 30))  # a 10 x 10 red square
    seen = []
    crop_regions(image, [[20, 20, 30, 30]], lambda im: seen.append(im) or torch.zeros(3, 4, 4), scale=3.0)
    canvas = np.asarray(seen[0])
    assert canvas.shape == (30, 30, 3)
    red = np.argwhere(canvas[..., 0] == 200)
    assert red.min(0).tolist() == [10, 10] and red.max(0).tolist() == [19, 19]  # centred, the rest black
    assert (canvas[..., 0] > 0).sum() == 100
    with pytest.raises(ValueError, match="scale must be >= 1"):
        crop_regions(image, [[20, 20, 30, 30]], lambda im: torch.zeros(3, 4, 4), scale=0.5)
