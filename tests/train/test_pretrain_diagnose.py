"""train/pretrain/diagnose.py: region statistics counted exactly on a hand-made grid, and the command on a tiny world
(object masks isolate every object, random boxes do not; CLIP-PGS's selection measured against the objects)."""
from __future__ import annotations

import json

import numpy as np

from extract.worlds import toyworld
from train.pretrain.diagnose import region_stats


def cells(*indices: int, n: int = 9) -> np.ndarray:
    out = np.zeros(n, bool)
    out[list(indices)] = True
    return out


def test_region_stats_count_whole_isolating_and_background_regions_and_terms():
    objects = np.stack([cells(0, 1), cells(7, 8)])  # a 3 x 3 grid: one object top left, one bottom right
    regions = np.stack([cells(0, 1, 2), cells(4), cells(1, 7, 8)])  # isolates A; background; holds B but cuts A
    s = region_stats(objects, regions)
    assert (s["regions"], s["terms"], s["objects"]) == (3, 7, 2)
    assert (s["region_holds_object"], s["region_isolates_object"], s["region_background_only"]) == (2, 1, 1)
    # the 7 unions: {r0} and {r0,r1} isolate A; {r1} holds nothing; {r2} and {r1,r2} hold B with a cell of A;
    # {r0,r2} and {r0,r1,r2} hold both: 2 terms isolate an object, and only A is ever isolated
    assert (s["term_isolates_object"], s["object_isolated_by_a_term"]) == (2, 1)


def test_batch_mates_count_attribute_swaps_and_moved_objects_in_the_batch():
    from train.pretrain.diagnose import batch_mates_section

    def scene(text, objects, split="train", kind="relation"):
        struct = {"objects": [{"colour": c, "shape": sh} for c, sh in objects], "relations": []}
        return {"split": split, "captions": [{"kind": kind, "text": text, "struct": struct}]}

    scenes = [scene("a red circle left of a blue square", [("red", "circle"), ("blue", "square")]),
              scene("a blue circle left of a red square", [("blue", "circle"), ("red", "square")]),  # A's swap
              scene("a red circle above a blue square", [("blue", "square"), ("red", "circle")]),  # A, moved
              scene("a red circle", [("red", "circle")], kind="one-object"),  # one object: not counted
              scene("a blue circle left of a red square", [("blue", "circle"), ("red", "square")], split="val")]
    # every batch is the 4 train scenes: A has a swap (B) and a move (C), B a swap (A, C) only, C both (B; A)
    out = batch_mates_section(scenes, batch_size=64, batches=5, seed=0)
    assert list(out) == ["relation"] and out["relation"]["captions"] == 15
    assert out["relation"]["attribute swap in the batch %"] == 100
    assert abs(out["relation"]["same objects, another relation or order %"] - 200 / 3) < 1e-9
    assert batch_mates_section(scenes[:1], 64, 5, 0) == {}


def test_diagnose_on_a_tiny_world(tmp_path, capsys):
    from train.pretrain.diagnose import main

    world = tmp_path / "toy"
    toyworld.generate(world, 30, seed=1, workers=1)
    assert main(["--data", str(world), "--n", "12", "--json", str(tmp_path / "d.json")]) == 0
    report = json.loads((tmp_path / "d.json").read_text())
    oracle, boxes = report["regions"]["powerclip-S (object masks)"], report["regions"]["powerclip-R (random boxes)"]
    assert oracle["regions isolating one object %"] == 100 and oracle["objects some term isolates %"] == 100
    assert boxes["regions isolating one object %"] < 100 and boxes["regions per image"] == 10
    kept = report["selection"]["clip-pgs 0.5, alpha 0 (pixels: the first epoch)"]
    assert 0 <= kept["background cells kept %"] <= 100 and 0 <= kept["object cells kept %"] <= 100
    assert any(len(t["leaves"]) > 1 for t in report["trees"])  # relation captions have several phrases
    mates = report["batch_mates"]
    assert set(mates) <= {"relation", "long"} and all(0 <= v <= 100 for row in mates.values() for k, v in row.items()
                                                       if k.endswith("%"))
    out = capsys.readouterr().out
    assert "1. regions" in out and ("6. batch mates" in out) == bool(mates)


def test_hard_negatives_are_scored_by_the_cosine_and_by_the_powerset_similarity(tmp_path):
    """Section 5: each item is a two-way choice by either score, so swapping an item's positive and negative turns
    every answer around (no ties on random weights); the items are the world's test hard negatives by type."""
    import dataclasses

    import numpy as np

    from extract.models.backbone import load_backbone
    from train.eval.datasets import read_toyworld
    from train.pretrain.diagnose import DiagnoseOptions, diagnose, score_items

    world = tmp_path / "toy"
    toyworld.generate(world, 30, seed=1, workers=1)
    report = diagnose(DiagnoseOptions(data=str(world), n=4, score=["none"], n_items=3))
    row = report["scores"]["none"]
    items = read_toyworld(world, "test").items
    assert set(row) == {it.subtype for it in items} and all(r["items"] <= 3 for r in row.values())
    ways = {"global cosine %", "powerset S %", "cosine, CLIP-PGS 0.5 tokens %", "cosine, FLIP 0.5 tokens %"}
    assert all(set(r) == ways | {"items"} and all(0 <= r[k] <= 100 for k in ways) for r in row.values())
    backbone = load_backbone("tiny", "none", device="cpu")
    some = items[:6]
    right = score_items(backbone, some)
    back = score_items(backbone, [dataclasses.replace(it, texts=it.texts[::-1]) for it in some])
    assert {f"{k} %" for k in right} == ways and all(r.shape == (6,) for r in right.values())
    assert all(np.array_equal(right[k], ~back[k]) for k in right)


def test_the_training_views_are_the_tokens_pgs_and_flip_keep():
    """image_views: on a ViT the PGS and FLIP views differ from the whole image (half the tokens enter) and from each
    other; on the ResNet tower, which has no tokens to drop, only the whole image is scored."""
    import torch

    from extract.models.backbone import load_backbone
    from train.pretrain.diagnose import image_views

    images = torch.randn(3, 3, 64, 64)
    views = image_views(load_backbone("tiny", "none", device="cpu").model, images)
    assert list(views) == ["global cosine", "cosine, CLIP-PGS 0.5 tokens", "cosine, FLIP 0.5 tokens"]
    whole, pgs, flip = views.values()
    assert torch.allclose(whole.norm(dim=-1), torch.ones(3)) and not torch.allclose(whole, pgs, atol=1e-3)
    assert not torch.allclose(pgs, flip, atol=1e-3)
    rn = load_backbone("tiny-rn", "none", device="cpu")
    assert list(image_views(rn.model, torch.randn(2, 3, 128, 128))) == ["global cosine"]
