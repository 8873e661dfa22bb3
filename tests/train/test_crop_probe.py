"""python -m train.eval.crop_probe: shape and colour probes of a base's crop features, fitted on the train split and
scored on seen and held-out combinations apart."""
from __future__ import annotations

import json

import pytest

from train.eval import crop_probe as cp

HOLDOUT = "red circle,blue square"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from extract.worlds import hardworld

    out = tmp_path_factory.mktemp("crop-probe") / "hard"
    hardworld.generate(out, 80, seed=6, holdout=HOLDOUT, workers=1)  # 4 val / test objects held out
    return out


@pytest.mark.slow
def test_a_base_trained_on_the_world_keeps_shape_apart_from_colour_and_a_random_one_ties_them(world, tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert cp.main(["--data", str(world), "--model", "toy-clip-hard", "--model", "tiny", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    n = result["objects"]
    assert n["train"] > 200 and n["seen"] > 20 and n["held out"] > 0
    assert result["chance"] == {"shape": pytest.approx(100 / 6), "colour": pytest.approx(100 / 8)}
    seen, random = result["models"]["toy-clip-hard"], result["models"]["tiny"]
    assert seen["shape"]["seen"] > 80 and seen["colour"]["seen"] > 90  # its own world's objects, partly hidden too
    # random features read a seen combination's shape as well (a flat drawing's outline is easy), but they file a
    # held-out object under the shape its colour came with; the trained base does not (measured 100 against 0)
    assert seen["shape"]["held out"] >= 60 and random["shape"]["held out"] <= 40
    # the second shape probe fits only colours shown with every shape: never the held-out ones' (red, blue), so it
    # cannot learn that red is evidence against a circle; the trained base reads held-out shapes there too
    complete = result["complete colours"]
    assert complete and "red" not in complete and "blue" not in complete
    assert seen["shape, complete colours"]["held out"] >= 60
    printed = capsys.readouterr().out
    assert (f"| toy-clip-hard | {seen['shape']['seen']:.1f} / {seen['shape']['held out']:.1f} | "
            f"{seen['shape, complete colours']['seen']:.1f} / {seen['shape, complete colours']['held out']:.1f} |") \
        in printed
    assert f"scored on {n['seen']} val / test objects of seen combinations and {n['held out']} of held-out" in printed


def test_the_train_split_fits_and_only_val_and_test_objects_are_scored(world):
    train, test = cp.objects(world, 10_000, 10_000)
    held = {("red", "circle"), ("blue", "square")}
    assert {s["split"] for s, _ in train} == {"train"} and "train" not in {s["split"] for s, _ in test}
    assert not [o for _, o in train if (o["colour"], o["shape"]) in held]  # the probe never fits a held-out one


def test_a_world_without_held_out_combinations_says_what_to_make(tmp_path, capsys):
    from extract.worlds import hardworld

    hardworld.generate(tmp_path / "w", 20, seed=1, workers=1)
    assert cp.main(["--data", str(tmp_path / "w"), "--model", "tiny"]) == 2
    assert "--holdout" in capsys.readouterr().err
    assert cp.main(["--model", "tiny"]) == 2
    assert "--data WORLD is required" in capsys.readouterr().err


def test_the_complete_colours_are_those_shown_with_every_shape():
    def obj(colour, shape):
        return {}, {"colour": colour, "shape": shape}

    train = [obj("red", "cube"), obj("blue", "cube"), obj("red", "sphere"), obj("blue", "cube"), obj("gray", "cube")]
    assert cp.complete_colours(train, ["cube", "sphere"]) == ["red"]
    assert cp.complete_colours(train, ["cube"]) == ["red", "blue", "gray"]
