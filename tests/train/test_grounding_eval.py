"""python -m train.eval.grounding: a phrase against its scene's box crops, per crop scale."""
from __future__ import annotations

import pytest

from extract.data import toyworld
from train.eval.grounding import GroundingOptions, grounding, main


def test_the_shipped_base_finds_each_object_from_a_canvas_crop(tmp_path, capsys):
    toyworld.generate(tmp_path / "world", n=60, seed=2, workers=1)
    results = grounding(GroundingOptions(data=str(tmp_path / "world"), base="toy-negclip", crop_scale="1,3",
                                         split="train", n=20))
    assert set(results) == {1.0, 3.0}
    for r in results.values():
        errors = sum(r["errors"].values())
        assert r["objects"] >= 40 and errors == round(r["objects"] * (1 - r["accuracy"] / 100))
        assert 25 <= r["chance"] <= 50  # two to four objects a scene
    assert results[3.0]["accuracy"] >= 95  # objects the size the base was trained on (extract/models/backbones.json)
    assert main(["--data", str(tmp_path / "world"), "--crop-scale", "3", "--split", "train", "--n", "5"]) == 0
    assert "| 3 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="numbers >= 1"):
        GroundingOptions(crop_scale="0.5")
