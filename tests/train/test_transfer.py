"""python -m train.eval.transfer: one train.eval per world, every model; the table keeps each world's own tests and
marks the world a run was trained on."""
from __future__ import annotations

import json

import pytest

from train.eval import transfer


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    from extract.worlds import hardworld
    from fixtures.toy import toy_root, trained_grounded

    root = toy_root(tmp_path_factory)
    run = trained_grounded(root)
    hard = tmp_path_factory.mktemp("transfer") / "hard"
    hardworld.generate(hard, 30, seed=3, workers=1)
    out = tmp_path_factory.mktemp("transfer-out")
    argv = ["--world", f"v2={root / 'world'}", "--world", f"hard={hard}", "--model", "toy-negclip",
            "--model", str(run), "--out", str(out), "--batch-size", "64"]
    assert transfer.main(argv) == 0
    return out, json.loads((out / "transfer.json").read_text()), (out / "transfer.md").read_text()


@pytest.mark.slow
def test_each_world_shows_its_own_tests_and_the_runs_world_is_marked(scored):
    out, result, text = scored
    base, head = result["models"]
    assert result["trained_on"] == {base: None, head: "v2"}
    v2, hard = result["cells"]["v2"], result["cells"]["hard"]
    assert {"swap-obj", "replace-rel", "four-way: caption", "four-way: image"} <= set(v2[head])
    assert not any(row.startswith("Controlled") for row in v2[head])  # the version-2 world has one controlled test
    assert {"Controlled-A: caption", "Controlled-B: image", "zero-shot top-1"} <= set(hard[head]) | set(hard[base])
    assert "four-way: caption" not in hard[head]
    swap = f"{v2[head]['swap-obj']:.1f}"
    assert f"| v2 | swap-obj (50) | {v2[base]['swap-obj']:.1f} | **{swap}** |" in text  # in-world: bold
    assert f"**{hard[head]['swap-obj']:.1f}**" not in text.split("| hard | swap-obj")[1].split("\n")[0]
    assert (out / "transfer.png").stat().st_size > 0


@pytest.mark.slow
def test_a_cell_is_what_train_eval_reports_for_that_model_on_that_world(scored):
    out, result, _ = scored
    head = result["models"][1]
    for world in ("v2", "hard"):
        report = json.loads((out / world / "results.json").read_text())
        assert report["config"]["data"] == result["worlds"][world]
        metrics = report["table"]["metrics"][head]
        assert result["cells"][world][head]["replace-rel"] == metrics["toyworld replace-rel"]["mean"]


@pytest.mark.parametrize("argv, says", [
    (["--world", "v2", "--model", "tiny"], "give NAME=DIR"),
    (["--world", "a=x", "--world", "a=y", "--model", "tiny"], "named twice"),
    (["--model", "tiny"], "at least one --world"),
])
def test_bad_worlds_are_one_line_errors(argv, says, capsys):
    try:
        status = transfer.main(argv)
    except SystemExit as e:  # the parser's own error line
        status = e.code
    assert status == 2
    assert says in capsys.readouterr().err


def test_a_folder_that_is_no_world_is_refused_before_a_model_loads(tmp_path, capsys):
    assert transfer.main(["--world", f"x={tmp_path}", "--model", "no-such-model", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "not a toy world folder" in err and "python -m extract.worlds.toyworld" in err
