"""train.eval.heatmaps: the figures (mass share vs area share per object, specificity against the image's other
objects, bootstrap intervals over images), the brightness control, and the command's report and errors. That the
maps localise on a model where they should is asserted in tests/serve/test_serve_heatmap.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from extract.worlds import toyworld
from train.eval import heatmaps as heatmap_eval
from serve.heatmap import METHODS


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("heatmap-eval-world")
    toyworld.generate(root, n=6, seed=3, workers=1, splits=(0.0, 0.0, 1.0))
    return root


def test_box_figures_and_the_brightness_control():
    heat = np.zeros((10, 10), np.float32)
    heat[0:2, 0:2] = 1.0
    assert heatmap_eval.box_figures(heat, (0, 0, 2, 2), [(5, 5, 8, 8)]) == (1.0, 0.04, [True])
    assert heatmap_eval.box_figures(np.zeros((4, 4)), (0, 0, 2, 2), [])[0] == 0.0
    scores = [heatmap_eval.ObjectScore(0, "a", 0.5, 0.1, [True]), heatmap_eval.ObjectScore(1, "b", 0.05, 0.1, [False])]
    s = heatmap_eval.summarise(scores, 2, seed=0, resamples=200)
    assert s["localisation_rate"]["rate"] == 0.5 and s["specificity"]["n"] == 2 and s["box_accuracy"]["n"] == 0
    boxed = heatmap_eval.summarise([heatmap_eval.ObjectScore(0, "a", 0.5, 0.1, [], box_hit=k < 3) for k in range(4)],
                                   1, seed=0, resamples=50)
    assert boxed["box_accuracy"]["rate"] == 0.75 and boxed["box_accuracy"]["n"] == 4
    assert heatmap_eval.iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0 and heatmap_eval.iou(None, (0, 0, 1, 1)) == 0.0
    assert heatmap_eval.iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(1 / 3)
    assert s["mean_ratio"] == pytest.approx(2.75)


def test_heatmap_eval_command(world, tmp_path, capsys, monkeypatch):
    out = tmp_path / "eval"
    argv = ["--model", "tiny", "--pretrained", "none", "--data", str(world), "--images", "4", "--out", str(out)]
    assert heatmap_eval.main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "results.json").read_text())
    rows = {(r["model"], r["query"], r["method"]): r for r in report["rows"]}
    assert set(rows) == {("brightness", "-", "brightness")} | {("tiny", q, m) for q in heatmap_eval.QUERIES
                                                               for m in METHODS}
    assert all(r["objects"] > 0 for r in rows.values()) and "| tiny (none) | long | surgery |" in printed
    assert rows[("brightness", "-", "brightness")]["localisation_rate"]["rate"] > 0.5  # shapes on black
    monkeypatch.chdir(tmp_path)  # no runs/demo/base here
    assert heatmap_eval.main(["--data", str(world)]) == 2
    assert "python -m train.demo" in capsys.readouterr().err
    assert heatmap_eval.main(["--model", "tiny", "--data", str(tmp_path)]) == 2
    assert "not a toy-world folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        heatmap_eval.parse_args(["--methods", "gradcam"])
    assert "methods: expected a comma list from surgery, raw" in capsys.readouterr().err
