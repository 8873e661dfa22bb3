"""python -m train.eval.overlap_probe: the boxes cannot tell who is in front (50 on Controlled-B by construction),
the cache's overlap code can."""
from __future__ import annotations

import json

import pytest

from extract.worlds import hardworld
from train.eval.overlap_probe import main


@pytest.mark.slow
def test_boxes_read_chance_on_controlled_b_and_the_overlap_code_reads_the_front_object(tmp_path, capsys):
    world = tmp_path / "hard"
    hardworld.generate(world, 120, seed=2, workers=1)
    assert main(["--data", str(world), "--steps", "300", "--json-out", str(tmp_path / "probe.json")]) == 0
    out = capsys.readouterr().out
    assert "| source | reader | fit (n=" in out
    rows = {(r["source"], r["reader"]): r for r in json.loads((tmp_path / "probe.json").read_text())}
    assert rows[("boxes", "logistic regression")]["Controlled-B"] == 50.0
    assert rows[("boxes", "MLP (2 x 64)")]["Controlled-B"] == 50.0
    assert rows[("overlap", "logistic regression")]["Controlled-B"] >= 85.0


def test_a_version_2_world_is_refused_with_the_command_that_makes_a_hard_one(tmp_path, capsys):
    from extract.worlds import toyworld

    toyworld.generate(tmp_path / "v2", 20, seed=0, workers=1)
    assert main(["--data", str(tmp_path / "v2")]) != 0
    assert "--hard" in capsys.readouterr().err
