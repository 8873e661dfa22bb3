"""train/bench/pretrain.py runs end to end (a smoke run on the tiny model; the timings themselves are the script's
output, never asserted here), and its FLOP count and MFU are checked against hand counts (train/bench/mfu.py)."""
from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.slow
def test_benchmark_measures_every_configuration_at_every_batch_size(tmp_path):
    from train.bench.pretrain import CONFIGS, PHASES, main

    assert main(["--model", "tiny", "--batch-size", "2,4", "--rounds", "1", "--steps", "1", "--warmup", "1",
                 "--profile-steps", "1", "--device", "cpu", "--peak-tflops", "1", "--threads", "1", "--json",
                 str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert [r["batch_size"] for r in result["runs"]] == [2, 4]
    small, large = result["runs"]
    for run in result["runs"]:
        assert set(run["step_seconds"]) == set(CONFIGS) and all(v > 0 for v in run["step_seconds"].values())
        assert set(run["ratios"]) == {"clip / open_clip throughput", "clip MFU", "powerclip / clip step",
                                      "clip-pgs / flip step (0.5)", "flip 0.5 / clip step",
                                      "powerclip M=15 / M=5 step"}
        flops = run["flops_per_step"]
        assert flops["open_clip"] == flops["clip"] > flops["flip"] > 0  # half the patches: fewer FLOPs
        assert flops["powerclip-M5"] < flops["powerclip-M15"]
        for c in CONFIGS:  # MFU is achieved FLOP/s over the peak given (1 TFLOP/s)
            assert run["mfu"][c] == pytest.approx(flops[c] / run["step_seconds"][c] / 1e12)
        assert set(run["profile_seconds"]) == set(CONFIGS[1:])
        for c, phases in run["profile_seconds"].items():
            assert list(phases) == list(PHASES) and phases["image tower"] > 0 and phases["backward"] > 0
        assert run["peak_memory_gib"]["clip"] is None  # CPU: no device memory to report
        assert run["host_syncs_per_step"]["clip"] is None  # CPU: nothing runs ahead to be stopped
    assert large["flops_per_step"]["clip"] > small["flops_per_step"]["clip"]
    assert "| ratio | measured | target |" in result["markdown"] and "batch 4:" in result["markdown"]


def test_flops_are_torch_counts_of_the_model_math_and_mfu_needs_a_peak():
    from train.bench.mfu import count_flops, mfu, peak_tflops

    a, b = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4)
    assert count_flops(lambda: a @ b) == 2 * 8 * 16 * 4  # a multiply-add is 2 FLOPs
    assert count_flops(lambda: (a @ b).sum().backward()) == 2 * (2 * 8 * 16 * 4)  # + the backward's dA = dY B^T
    assert peak_tflops("cpu", "amp_bf16") is None and mfu(10 ** 12, 1.0, None) is None
    assert peak_tflops("cpu", "fp32", override=2.0) == 2.0 and mfu(10 ** 12, 1.0, 2.0) == 0.5


@pytest.mark.parametrize("name, precision, peak", [("NVIDIA H100 80GB HBM3", "amp_bf16", 989.4),
                                                   ("NVIDIA H100 PCIe", "amp_bf16", 756.0),
                                                   ("NVIDIA H200", "amp", 989.4), ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
                                                   ("NVIDIA A100-SXM4-80GB", "amp_bf16", 312.0),
                                                   ("NVIDIA L40S", "amp_bf16", 362.1), ("Some New GPU", "amp", None)])
def test_the_peak_is_the_named_parts_dense_figure_for_the_precision(monkeypatch, name, precision, peak):
    from train.bench.mfu import peak_tflops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops("cuda", precision) == peak


@pytest.mark.slow
def test_a_time_limit_stops_after_the_current_round_and_says_what_was_left(capsys):
    from train.bench.pretrain import BenchmarkOptions, benchmark

    result = benchmark(BenchmarkOptions(model="tiny", batch_size="2,4", rounds=3, profile_steps=0, time_limit=1e-9,
                                        device="cpu", threads=1))
    assert [r["batch_size"] for r in result["runs"]] == [2]
    assert all(len(v) == 1 for v in result["runs"][0]["rounds"].values())  # the first round always runs
    out = capsys.readouterr().out
    assert "1 of 3 rounds at batch 2" in out and "batch 4 not measured" in out
