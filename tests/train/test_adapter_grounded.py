"""The grounded relation head end to end on toy worlds: what it learns comes from the captions, not from the words."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from extract.worlds import toyworld
from train.adapter.engine import main
from train.eval.evaluate import EvaluateOptions, evaluate

#: the four directions said with each other's words: "above" now means left of, ... (converse pairs stay converse, so
#: the hard-negative generator's converse list still holds)
SWAPPED = "left of=above,right of=below,above=to the left of,below=to the right of"
RELATION_ROWS = ("toyworld swap-obj", "toyworld replace-rel", "toyworld-controlled all text")


def _train(root, name: str, phrases: str | None) -> dict:
    world = root / name
    toyworld.generate(world, n=600, seed=3, workers=1, phrases=phrases)
    out = root / f"run-{name}"
    assert main(["--method", "grounded", "--base", "toy-negclip", "--data", str(world), "--out", str(out),
                 "--cache-dir", str(root / "cache"), "--workers", "0", "--epochs", "12", "--batch-size", "64",
                 "--eval-every", "0", "--no-final-eval"]) == 0
    # the adapter's own rows on the test split, from its file: what train.adapter's final table holds for it, without
    # the frozen base's column and the text-only floor it adds (neither is compared here)
    report = evaluate(EvaluateOptions(model=[str(out / "adapter.safetensors")], data=str(world), split="test",
                                      tasks="compositional", text_only=False, out=str(out / "eval")))
    return json.loads(Path(report["reports"][0]).read_text())["table"]["metrics"]["toy-negclip + grounded"]


@pytest.mark.slow
def test_renamed_predicates_are_learned_as_well(tmp_path):
    """The same world, its predicates said with each other's words in every caption and negative: the head, whose
    predicates are whatever the captions make of them, reads who is where as well as with the usual words, which
    read 100 on all three rows of this world (world seeds 3 and 4). A bar of 95 on the renamed world is that
    comparison within the noise of ~60 test images and 30 controlled sets: the usual words cannot read above 100.
    (This test trained the plain world beside it until that run cost 40 s of the suite; the renamed one is the harder
    of the two, as the base's own cosine, which knows the usual words, pulls the other way.) On this small world the
    renamed one needs the longer training (12 epochs: at 8 its controlled caption choice read ~89)."""
    renamed = _train(tmp_path, "renamed", SWAPPED)
    for row in RELATION_ROWS:
        assert renamed[row]["mean"] >= 95, (row, renamed[row]["mean"])
