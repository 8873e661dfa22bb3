"""train/bench/pretrain.py runs end to end (a smoke run on the tiny model; the figures themselves are the
script's output, never asserted here)."""
from __future__ import annotations

import json

import torch


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
