"""serve.heatmap_render: the map blended over the image (the scene stays visible where the map is low), a
perceptual colour scale, panels that keep the image's aspect ratio, and outlines (never washes) as annotations."""
from __future__ import annotations

import numpy as np
from PIL import Image

from serve.heatmap import PhraseMap
from serve.heatmap_render import BAR, GAP, INFERNO, MAX_ALPHA, TITLE, TOP, blend, colormap, panel_size, render


def test_the_colour_scale_is_inferno_and_grows_lighter():
    assert np.array_equal(colormap(np.array([0.0, 1.0])), INFERNO[[0, -1]])
    lightness = colormap(np.linspace(0, 1, 101)) @ np.array([0.2126, 0.7152, 0.0722])
    assert (np.diff(lightness) > 0).all()  # reads right in grey too
    assert np.array_equal(colormap(np.array([np.nan, -1.0, 2.0])), INFERNO[[0, 0, -1]])


def test_blending_leaves_the_image_where_the_map_is_zero():
    image = np.random.default_rng(0).integers(0, 256, (4, 5, 3), dtype=np.uint8)
    heat = np.zeros((4, 5), np.float32)
    heat[1, 2] = 1.0
    out = blend(image, heat)
    keep = heat == 0
    assert np.array_equal(out[keep], image[keep])
    want = image[1, 2] * (1 - MAX_ALPHA) + INFERNO[-1] * MAX_ALPHA
    assert np.abs(out[1, 2].astype(float) - want).max() <= 0.5


def test_panels_keep_the_aspect_ratio():
    assert panel_size((64, 64)) == (256, 256)        # enlarged by 4, pixels kept square
    assert panel_size((100, 60)) == (200, 120)       # by the largest whole factor that fits
    assert panel_size((1000, 500)) == (256, 128)     # larger: scaled down, aspect kept


def test_render_shows_the_scene_a_scale_and_outlines_only():
    rng = np.random.default_rng(1)
    scene = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))  # 48 x 32: not square
    heat = np.zeros((32, 48), np.float32)
    heat[8:16, 24:40] = 1.0
    maps = [PhraseMap("a red circle", (0, 12), heat, box=(24, 8, 40, 16), box_kind="entity", box_score=0.7,
                      peak=0.4, low=-0.1),
            PhraseMap("a blue square", (17, 30), np.zeros_like(heat), peak=0.1, low=0.0),
            PhraseMap("a red circle", (35, 47), heat, peak=0.4, low=0.0)]
    picture, annotations = render(scene, maps)
    pw, ph = panel_size(scene.size)
    assert (pw, ph) == (240, 160) and picture.size[1] == TOP + TITLE + ph + BAR + GAP
    labels = [label for _, label in annotations]
    assert labels == ["a red circle", "a red circle: entity box, score 0.700", "a blue square", "a red circle (2)"]
    pixels = np.asarray(picture)
    big = np.asarray(scene.resize((pw, ph), Image.NEAREST))
    left = GAP + (max(pw, 180) - pw) // 2
    first = pixels[TOP + TITLE:TOP + TITLE + ph, left:left + pw]
    far = np.ones_like(heat, bool)
    far[7:17, 23:41] = False  # the hot cells and their neighbours (the map is interpolated between cells)
    cold = np.kron(far, np.ones((5, 5), bool))
    assert np.array_equal(first[cold], big[cold])  # where the phrase scores low the scene is untouched
    hot = np.kron(heat == 1, np.ones((5, 5), bool))
    assert np.abs(first[hot].astype(int) - big[hot]).mean() > 20  # where it scores high the map shows
    for mask, _ in annotations:  # outlines, a few pixels wide: nothing is washed over
        assert mask.shape == pixels.shape[:2] and set(np.unique(mask)) <= {0.0, 1.0} and mask.mean() < 0.02
    box = annotations[1][0]
    ys, xs = np.nonzero(box)
    assert (xs.min() - left, ys.min() - TOP - TITLE, xs.max() + 1 - left, ys.max() + 1 - TOP - TITLE) == \
        (24 * 5, 8 * 5, 40 * 5, 16 * 5)  # the box, scaled with its panel
    bar = pixels[TOP + TITLE + ph + 6 + 5, left:left + pw].astype(float)
    assert np.abs(bar[[0, -1]] - INFERNO[[0, -1]]).max() <= 1.0  # the scale runs low (left) to peak (right)


def test_an_overlap_region_is_hatched_in_the_panels_of_both_its_phrases_under_one_legend_entry():
    scene = Image.new("RGB", (64, 64))
    region, label = (26.0, 24.0, 38.0, 38.0), "overlap of red square and blue square: the red square's pixels"
    maps = [PhraseMap("a red square", (0, 12), np.zeros((64, 64), np.float32), overlaps=[(region, label)]),
            PhraseMap("a blue square", (29, 42), np.zeros((64, 64), np.float32), overlaps=[(region, label)]),
            PhraseMap("a green star", (47, 59), np.zeros((64, 64), np.float32))]
    picture, annotations = render(scene, maps)
    [hatch] = [mask for mask, name in annotations if name == label]  # one entry for the region in both panels
    pw, ph = panel_size(scene.size)
    cell = max(pw, 180)
    for k in range(3):
        left, top = GAP + k * (cell + GAP) + (cell - pw) // 2, TOP + TITLE
        inside = hatch[top + 24 * 4:top + 38 * 4, left + 26 * 4:left + 38 * 4]
        outside = hatch[top:top + ph, left:left + pw].sum() - inside.sum()
        if k < 2:  # outlined, and filled with thin diagonals: the picture shows between them
            assert inside[0].all() and inside[-1].all() and inside[:, 0].all() and inside[:, -1].all()
            assert 0.2 < inside[1:-1, 1:-1].mean() < 0.35 and outside == 0
        else:
            assert hatch[top:top + ph, left:left + pw].sum() == 0  # the third phrase is in no relation
    assert np.array_equal(np.asarray(picture)[TOP + TITLE:TOP + TITLE + ph, GAP:GAP + pw].max(), 0)  # nothing burnt in
