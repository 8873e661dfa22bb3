"""python -m train.bench.nla at toy sizes (structure and consistency of what it prints and returns, never
its timings), and the helpers it shares with the report: the exact loss against a hand composition, the
random tree, and the peak-memory measurement against a known allocation."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from adapters.losses.contrastive import clip_loss, triplet_rows
from adapters.losses.nla import NLAConfig, PowerCLIPLossConfig, exact_pair_similarities, pair_scale
from train import measure
from train.bench import nla as nb
from train.eval import nla_batches

TOY = ["--batch", "6", "--k", "4", "--dim", "16", "--m-low", "2", "--m-high", "4", "--exact-m", "4",
       "--exact-batch", "4", "--mem-batch", "24", "--mem-m", "3", "--chunk-size", "5", "--repeats", "1"]


@pytest.mark.slow
def test_benchmark_runs_and_reports_consistent_figures(capsys, tmp_path):
    out = nb.run(nb.build_parser().parse_args([*TOY, "--json", str(tmp_path / "b.json")]))
    text = capsys.readouterr().out
    for tag in ("(a)", "(b)", "(c)", "target <= 1.5x", "target >= 50x", "target <= 2 GiB"):
        assert tag in text
    a, b, c = out["a"], out["b"], out["c"]
    assert a["ratio"] > 0 and a["met"] == (a["ratio"] <= 1.5) and a["seconds_low"] > 0 and a["seconds_high"] > 0
    assert (a["M_low"], a["M_high"], a["B"]) == (2, 4, 6)
    assert b["ratio"] > 0 and b["met"] == (b["ratio"] >= 50)
    assert c["method"] in ("hwm-reset", "ru_maxrss-fresh-process", "unavailable")
    assert c["unchunked_q_bytes"] == 24 * 24 * 3 * 4 * 4
    if c["method"] == "hwm-reset":
        assert c["forward_peak_bytes"] >= 0 and c["grad_peak_bytes"] >= 0
        assert c["met"] == (c["forward_peak_bytes"] <= 2 * 2**30)
    assert (tmp_path / "b.json").is_file()
    assert ("MISSED" in text) == (not a["met"] or not b["met"] or c["met"] is False)
    f = out["d"]
    assert "(d)" in text and f["seconds_fused"] > 0 and (f["B"], f["M"]) == (6, 3)
    assert f["speedup_vs_checkpointed"] > 0 and f["speedup_vs_plain"] > 0


def test_only_selects_figures(capsys):
    out = nb.run(nb.build_parser().parse_args([*TOY, "--only", "b"]))
    assert "b" in out and "a" not in out and "c" not in out and "d" not in out
    assert nb.main([*TOY, "--only", "z"]) == 2
    assert "unknown figure" in capsys.readouterr().err


def test_paired_ratio_alternates_and_takes_the_median_round(monkeypatch):
    """On a virtual clock (no real timing): each call advances it by its scripted cost."""
    clock = [0.0]
    monkeypatch.setattr(nb.time, "perf_counter", lambda: clock[0])
    num_costs, den_costs, calls = iter([9.0, 3.0, 30.0, 4.0, 6.0]), iter([9.0, 1.0, 1.0, 2.0, 1.0]), []

    def make(costs, name):
        def f():
            calls.append(name)
            clock[0] += next(costs)
        return f

    r = nb.paired_ratio(make(num_costs, "num"), make(den_costs, "den"), "cpu", rounds=4)
    assert calls == ["num", "den"] * 5  # one warm-up each, then alternating rounds
    assert r["ratio"] == 6.0  # per-round ratios 3, 30, 2, 6 -> the upper median
    assert (r["seconds_num"], r["seconds_den"]) == (3.0, 1.0)  # fastest of each


def test_exact_loss_equals_hand_composition():
    batch = nla_batches.make_batch(5, 3, 4, 8, seed=2, requires_grad=False)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    cfg = PowerCLIPLossConfig(lam=0.4, margin=0.1, w_t2r=0.3, w_r2t=0.7)
    t2r, r2t = exact_pair_similarities(batch["regions"], batch["region_mask"], batch["nodes"], batch["node_mask"])
    s = (0.3 * t2r + 0.7 * r2t) / pair_scale(batch["region_mask"], batch["node_mask"], batch["node_sizes"]).double()
    pos = torch.arange(5)
    want = clip_loss(batch["image_features"], batch["text_features"], 100.0) + 0.4 * (
        triplet_rows(s, pos, 0.1) + triplet_rows(s.T, pos, 0.1))
    assert nla_batches.exact_loss(batch, cfg).item() == pytest.approx(want.item(), rel=1e-5)


def test_nla_loss_approaches_exact_loss_with_tiny_tau_on_t2r():
    batch = nla_batches.make_batch(6, 4, 5, 8, seed=3)
    cfg = PowerCLIPLossConfig(w_t2r=1.0, w_r2t=0.0, margin=0.5, nla=NLAConfig(1e-5, 1e-5, 0.75))
    assert nla_batches.nla_loss(batch, cfg).item() == pytest.approx(nla_batches.exact_loss(batch, cfg).item(), abs=1e-4)
    # ... and both step functions leave finite gradients on every input
    for kind in ("nla", "exact"):
        nla_batches.loss_step(kind, batch, replace(cfg, w_r2t=0.5))
        assert all(torch.isfinite(batch[k].grad).all() for k in ("regions", "nodes", "image_features"))


@pytest.mark.parametrize("p", [1, 2, 5, 9])
def test_random_tree_is_a_binary_span_tree(p):
    tree = nla_batches.random_tree(p, torch.Generator().manual_seed(p))
    assert tree.shape == (2 * p - 1, p)
    assert len({tuple(r.tolist()) for r in tree}) == 2 * p - 1  # distinct nodes
    for row in tree:  # every node a contiguous span
        idx = row.nonzero().flatten()
        assert (idx == torch.arange(idx[0], idx[-1] + 1)).all()
    assert tree[:p].sum(-1).eq(1).all() and tree[-1].all()  # leaves first, root last
    assert nla_batches.random_tree(p, torch.Generator().manual_seed(0), max_nodes=3).shape[0] == min(3, 2 * p - 1)


def test_make_batch_shapes():
    b = nla_batches.make_batch(3, 4, 16, 8, seed=0)
    assert b["regions"].shape == (3, 4, 8) and b["nodes"].shape == (3, 16, 8) and b["node_sizes"].shape == (3, 16)
    assert b["regions"].requires_grad and not b["region_mask"].requires_grad
    torch.testing.assert_close(b["regions"].norm(dim=-1), torch.ones(3, 4))


def test_peak_growth_sees_a_known_allocation():
    if measure.rss_method() != "hwm-reset":
        pytest.skip("this kernel does not let a process reset its RSS high-water mark")
    with measure.peak_growth() as big:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page touched
        del x
    with measure.peak_growth() as small:
        y = torch.ones(2 * 2**20 // 4)
        del y
    assert big["method"] == "hwm-reset"
    assert 60 * 2**20 <= big["bytes"] <= 90 * 2**20
    assert small["bytes"] < 20 * 2**20  # the reset works: the earlier 64 MiB peak is not counted again


def test_load_warning_only_when_busy():
    assert measure.load_warning({"load_1min": 0.5, "cpus": 2, "busy": False}, 2) is None
    msg = measure.load_warning({"load_1min": 5.0, "cpus": 2, "busy": True}, 2)
    assert "busy" in msg and "--threads 1" in msg
    assert "--threads 1" not in measure.load_warning({"load_1min": 5.0, "cpus": 2, "busy": True}, 1)
    load = measure.machine_load()
    assert load["cpus"] >= 1 and (load["busy"] is None or isinstance(load["busy"], bool))
