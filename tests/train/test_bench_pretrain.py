"""train/bench/pretrain.py runs end to end (a smoke run on the tiny model; the figures themselves are the
script's output, never asserted here) and train/pretrain/compare.py builds its side-by-side table."""
from __future__ import annotations

import json

import pytest
import torch

from extract.data import toyworld


def test_benchmark_times_every_configuration(tmp_path):
    from train.bench.pretrain import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["--model", "tiny", "--batch-size", "4", "--rounds", "1", "--steps", "1", "--warmup", "1",
                     "--device", "cpu", "--json", str(tmp_path / "b.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "b.json").read_text())
    assert set(result["step_seconds"]) == {"open_clip", "clip", "flip", "clip-pgs", "powerclip", "powerclip-M5",
                                           "powerclip-M15"}
    assert all(v > 0 for v in result["step_seconds"].values())
    assert set(result["ratios"]) == {"clip / open_clip throughput", "powerclip / clip step",
                                     "clip-pgs / flip step (0.5)", "flip 0.5 / clip step",
                                     "powerclip M=15 / M=5 step"}


def test_compare_trains_each_method_and_tabulates_the_evaluation(tmp_path, monkeypatch):
    """Every run is pretrain(PretrainOptions(...)) and the evaluation evaluate(EvaluateOptions(...)): no argv list
    goes from one job to another."""
    import train.eval.evaluate as ev
    import train.pretrain.engine as pt
    from train.pretrain.compare import main

    calls = []
    real_pretrain, real_evaluate = pt.pretrain, ev.evaluate

    def pretrain(opts):
        assert isinstance(opts, pt.PretrainOptions)
        calls.append((opts.method, opts.max_steps, opts.lr, opts.method_options))
        return real_pretrain(opts)

    def evaluate(opts):
        assert isinstance(opts, ev.EvaluateOptions)
        calls.append(("evaluate", len(opts.model)))
        return real_evaluate(opts)

    def no_argv(*args, **kwargs):
        raise AssertionError("a job was called through its command line")

    monkeypatch.setattr(pt, "pretrain", pretrain)
    monkeypatch.setattr(ev, "evaluate", evaluate)
    for module in (pt, ev):
        monkeypatch.setattr(module, "main", no_argv)
    world = tmp_path / "toy"
    toyworld.generate(world, 30, seed=1, workers=1)  # seed 1: the test split has single-object scenes (zero-shot)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["--out", str(tmp_path / "cmp"), "--data", str(world), "--methods", "clip,filip",
                     "--minutes-per-method", "0.005", "--batch-size", "4", "--workers", "0",
                     "--calibration-steps", "2", "--extra", "--lr 5e-4 --filip-chunk 2"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert [c[:3] for c in calls[:2]] == [("clip", 2, 5e-4), ("filip", 2, 5e-4)]  # calibrations, --extra applied
    assert calls[1][3] == {"filip_chunk": 2} and calls[-1] == ("evaluate", 2)
    table = (tmp_path / "cmp" / "compare.md").read_text().splitlines()
    assert table[0] == "| | clip | filip |" and table[2].startswith("| training steps (epochs) |")
    rows = {line.split("|")[1].strip() for line in table[2:]}
    assert {"retrieval T2I R@1", "retrieval I2T R@1", "zero-shot top-1", "toyworld all"} <= rows
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert data["runs"]["filip"]["steps"] >= 1 and "retrieval" in data["results"]["filip"]


def test_compare_takes_typed_pretrain_options_from_python(tmp_path):
    """From Python the runs' common settings are a PretrainOptions, checked like the flags, not a string of flags."""
    import train.pretrain.engine as pt
    from train.pretrain.compare import CompareOptions, compare, parse_args

    assert parse_args(["--extra", "--lr 5e-4"]).pretrain.lr == 5e-4
    with pytest.raises(ValueError, match="pass pretrain=PretrainOptions"):
        compare(CompareOptions(out=str(tmp_path / "a"), extra="--lr 5e-4"))
    with pytest.raises(ValueError, match="lr: "):
        compare(CompareOptions(out=str(tmp_path / "b"), pretrain=pt.PretrainOptions(lr=-1.0)))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before any work
