"""extract/components/toy_segmenter.py: the toy world's oracle masks, exact from the pixels, cached by python -m extract
--regions sam2 --segmenter toy in SAM2's format and read by PowerCLIP-S's data path."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from extract.components.regions import masks_to_grid, preprocess_geometry
from extract.components.toy_segmenter import ToySegmenter, check_world, connected_components, main
from extract.worlds import hardworld, toyworld


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("toyseg") / "world"
    toyworld.generate(root, 40, seed=3, workers=1)
    return root


def object_pixels(scene: dict, rgb: np.ndarray) -> list[np.ndarray]:
    """Each object's pixels: its box's non-background pixels (boxes never overlap; drawing is not anti-aliased)."""
    out = []
    for obj in scene["objects"]:
        x0, y0, x1, y1 = obj["box"]
        inside = np.zeros(rgb.shape[:2], bool)
        inside[y0:y1, x0:x1] = True
        out.append(inside & (rgb != 0).any(-1))
    return out


def test_connected_components_8_neighbours_in_raster_order():
    fg = np.array([[1, 0, 0, 1],
                   [0, 1, 0, 1],
                   [0, 0, 0, 0],
                   [1, 1, 0, 1]], bool)
    labels, n = connected_components(fg)
    assert n == 4  # the diagonal pair joins; the right column is one; two more below
    assert labels.tolist() == [[1, 0, 0, 2], [0, 1, 0, 2], [0, 0, 0, 0], [3, 3, 0, 4]]
    assert connected_components(np.zeros((3, 3), bool))[1] == 0
    # with classes, touching runs of two colours stay apart and one colour joins only itself
    classes = np.array([[0, 0, 1, 1]] * 2)
    labels, n = connected_components(np.ones((2, 4), bool), classes=classes)
    assert n == 2 and labels.tolist() == [[1, 1, 2, 2], [1, 1, 2, 2]]


def test_connected_components_equal_scipys_labelling():
    # the fast path (pointer jumping) against scipy's 8-connected labelling, per class, on random images whose long
    # snaking runs need many passes of plain propagation
    ndimage = pytest.importorskip("scipy.ndimage")
    rng = np.random.default_rng(0)
    for trial in range(20):
        fg = rng.random((24, 31)) < (0.3 + 0.03 * trial)
        classes = rng.integers(0, 1 + trial % 3, fg.shape)
        labels, n = connected_components(fg, classes=classes)
        reference, count = np.zeros(fg.shape, np.int64), 0
        for c in np.unique(classes):
            part, k = ndimage.label(fg & (classes == c), structure=np.ones((3, 3)))
            reference[part > 0] = part[part > 0] + count
            count += k
        assert n == count
        # the same partition, numbered in raster order of each component's first pixel
        pairs = set(zip(labels[fg].tolist(), reference[fg].tolist()))
        assert len(pairs) == n == len({a for a, _ in pairs}) == len({b for _, b in pairs})
        firsts = [int(np.flatnonzero((labels == k).ravel())[0]) for k in range(1, n + 1)]
        assert firsts == sorted(firsts)


def test_one_mask_per_object_equal_to_its_pixels(world):
    scenes = json.loads((world / "annotations.json").read_text())["scenes"]
    seg = ToySegmenter()
    for scene in scenes:
        image = Image.open(world / scene["file_name"])
        found = seg.generate(image)
        truth = object_pixels(scene, np.asarray(image.convert("RGB")))
        assert len(found) == len(truth) and (found.scores == 1).all()
        assert sorted(found.areas.tolist(), reverse=True) == found.areas.tolist()
        for pixels in truth:  # each object is exactly one mask
            assert sum(bool((m == pixels).all()) for m in found.masks) == 1
    assert len(ToySegmenter(max_masks=1).generate(Image.open(world / scenes[0]["file_name"]))) <= 1


@pytest.fixture(scope="module")
def hard_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("toyseg") / "hard"
    hardworld.generate(root, 30, seed=4, workers=1)
    return root


def test_hard_world_masks_are_visible_pixels_of_one_colour(hard_world):
    """On the hard world (textured backgrounds, overlaps) each mask is a run of one object colour, and each
    object's visible pixels are one mask, part of one mask it shares with a touching object of its colour, or
    split into masks that each lie within them; no background pixel enters a mask."""
    scenes = json.loads((hard_world / "annotations.json").read_text())["scenes"]
    seg, kinds = ToySegmenter(), {"exact": 0, "shared": 0, "split": 0}
    for scene in scenes:
        image = Image.open(hard_world / scene["file_name"])
        found = seg.generate(image).masks
        rgb = np.asarray(image.convert("RGB"))
        visible = hardworld.visible_masks(scene["objects"], scene["width"])
        drawn = np.any(visible, axis=0)
        assert not (found.any(0) & ~drawn).any()  # the background never
        for m in found:
            assert len({tuple(p) for p in rgb[m]}) == 1
        for obj, pixels in zip(scene["objects"], visible):
            holding = [m for m in found if (m & pixels).any()]
            assert holding and all((rgb[m] == toyworld.COLOURS[obj["colour"]]).all() for m in holding)
            if len(holding) > 1:
                kinds["split"] += 1
                assert all(not (m & ~pixels).any() for m in holding)
            elif np.array_equal(holding[0], pixels):
                kinds["exact"] += 1
            else:
                kinds["shared"] += 1
                assert not (pixels & ~holding[0]).any()
    assert kinds["exact"] > 0.85 * sum(kinds.values())
    assert check_world(hard_world) == {"objects": sum(kinds.values()), **kinds}


def test_check_command_counts_and_refuses_a_folder_without_a_world(hard_world, tmp_path, capsys):
    assert main(["--data", str(hard_world), "--limit", "5"]) == 0
    assert "objects: exact" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--data", str(tmp_path)])
    assert "python -m extract.worlds.toyworld" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("base, model_name", [("tiny", "plugvlm-tiny"), ("tiny-rn", "plugvlm-tiny-rn")])
def test_masks_cache_opens_in_powerclip_s_and_covers_each_object(world, tmp_path, base, model_name):
    """python -m extract --regions sam2 --segmenter toy -> a cache PowerCLIP-S trains from, whose masks on the patch
    grid are the objects' pixels mapped by the backbone's preprocessing, one per object: on a ViT's patch grid and
    on a ResNet's final 4x4 map."""
    from adapters.objectives.base import StepContext
    from adapters.objectives.powerclip import PowerCLIPObjective
    from extract.pipeline import build_cache
    from train.pretrain.trainer import create_model

    cache = build_cache(world, tmp_path / "masks", base=base, pretrained="none", components=["regions"],
                        regions="sam2", segmenter="toy", num_regions=6, workers=0)
    assert cache.settings["regions"]["source"] == "sam2"
    assert cache.settings["regions"]["segmenter"]["segmenter"] == "toy-oracle"
    model, _, _, tok = create_model(model_name, False, 0)
    obj = PowerCLIPObjective(masks="sam2", regions_cache=str(tmp_path / "masks"), num_masks=10)
    ids = cache.image_ids()
    obj.setup(model, {"image_ids": set(ids), "data": str(world)})
    scenes = {str(s["image_id"]): s for s in json.loads((world / "annotations.json").read_text())["scenes"]}
    from extract.models.backbone import image_grid, load_backbone

    grid = image_grid(model.visual)
    input_size, mode = preprocess_geometry(load_backbone(base, "none", device="cpu"))
    extras = obj.prepare(["a red circle"] * len(ids), ids, tok)
    for row, image_id in enumerate(ids):
        scene = scenes[image_id]
        rgb = np.asarray(Image.open(world / scene["file_name"]).convert("RGB"))
        cached = extras["cached_masks"][row][extras["cached_valid"][row]].numpy()
        truth = masks_to_grid(np.stack(object_pixels(scene, rgb)), (rgb.shape[1], rgb.shape[0]), input_size, grid,
                              resize_mode=mode).reshape(len(scene["objects"]), -1)
        assert len(cached) == len(scene["objects"])
        for cells in truth:
            assert cells.any() and any(np.array_equal(cells, m) for m in cached)
    batch = {"image": torch.zeros(len(ids), 3, *input_size), **extras}
    masks = obj.region_masks(model, batch, StepContext(global_batch=len(ids)))
    assert int(masks.any(-1).sum()) == sum(len(scenes[i]["objects"]) for i in ids)  # every object a region
