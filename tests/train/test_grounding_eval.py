"""python -m train.eval.grounding: a phrase against its scene's box crops, per crop scale and way of writing it."""
from __future__ import annotations

import pytest

from extract.worlds import toyworld
from train.eval.grounding import GroundingOptions, grounding, main


def test_the_shipped_base_finds_each_object_from_a_canvas_crop(tmp_path, capsys):
    toyworld.generate(tmp_path / "world", n=60, seed=2, workers=1, holdout="red circle,blue square",
                      splits=(0.5, 0.1, 0.4))
    results = grounding(GroundingOptions(data=str(tmp_path / "world"), base="toy-negclip", crop_scale="1,3",
                                         split="train", n=20))
    assert set(results) == {(1.0, "{}"), (1.0, "a {}"), (3.0, "{}"), (3.0, "a {}")}
    for r in results.values():
        errors = sum(r["errors"].values())
        assert r["objects"] >= 40 and errors == round(r["objects"] * (1 - r["accuracy"] / 100))
        assert 25 <= r["chance"] <= 50  # two to four objects a scene
        assert r["held_out_objects"] == 0 and r["held_out"] is None  # the train split never shows them
    assert results[3.0, "{}"]["accuracy"] >= 95  # objects the size the base was trained on (extract/models/backbones.json)
    assert main(["--data", str(tmp_path / "world"), "--crop-scale", "3", "--split", "train", "--n", "5"]) == 0
    assert main(["--data", str(tmp_path / "world"), "--crop-scale", "3", "--split", "test", "--phrase-prompt",
                 "a {}"]) == 0
    said = capsys.readouterr().out
    assert said.count('| 3 | "{}" |') == 1 and said.count('| 3 | "a {}" |') == 2
    held = said.split('| 3 | "a {}" |')[-1].split("|")[1]  # the combinations held out of train, in its test split
    assert "object" in held and "–" not in held, said
    with pytest.raises(ValueError, match="numbers >= 1"):
        GroundingOptions(crop_scale="0.5")
    with pytest.raises(ValueError, match="once"):
        GroundingOptions(phrase_prompt="a colour shape")
