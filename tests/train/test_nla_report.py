"""python -m train.eval.nla_report at toy sizes: the files it promises, a report.json whose numbers are consistent
with the theorems and with each other, on random vectors and on a real (tiny) feature cache; and the alpha
calibration's pieces against the library's own Lambda."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from adapters.losses.nla import nla_t2_bounds, r2t_exact
from extract.worlds import toyworld
from extract.options import ExtractOptions
from extract.pipeline import build_cache
from train.eval import nla_report

TINY = ["--samples", "144", "--batch", "4", "--regions", "5", "--max-leaves", "3", "--dim", "16",
        "--cost-m", "2..6", "--cost-batch", "4", "--cost-k", "4", "--cost-dim", "16", "--cost-repeats", "1",
        "--calib-m", "3,5", "--threads", "1"]


def _check_pearson(r):
    assert r is None or -1.0 <= r <= 1.0


def _check_source(src: dict, taus: list[float], alphas: list[float]):
    assert src["n_pairs"] == src["n_batches"] * 16
    for t in taus:
        t1 = src["t2r"][str(t)]
        _check_pearson(t1["pearson"])
        assert t1["within_theorem1"] and t1["max_gap_over_bound"] <= 1.0 + 1e-9  # Theorem 1 on every pair
        assert 0 <= t1["mae"] <= t1["max_abs_err"] <= t1["bound_max"] + 1e-9
        assert t1["bias"] >= -1e-9  # softplus >= relu: NLA-T1 never undershoots
        _check_pearson(src["loss_t2r"][str(t)]["pearson"])
        for a in alphas:
            e = src["r2t"][str(t)][str(a)]
            _check_pearson(e["pearson"])
            assert 0 <= e["mae"] <= e["max_abs_err"]
            _check_pearson(src["loss_r2t"][str(t)][str(a)]["pearson"])
    # eq. 78 at the smallest tau: alpha = 0 undershoots R2T, alpha = 1 overshoots it
    t = min(taus)
    assert src["r2t"][str(t)]["0.0"]["bias"] <= 1e-9
    assert src["r2t"][str(t)]["1.0"]["bias"] >= -t * src["M"] * math.log(2) - 1e-9
    # the smaller tau, the closer NLA-T1 (Theorem 1: error ~ tau)
    maes = [src["t2r"][str(t)]["mae"] for t in sorted(taus)]
    assert maes == sorted(maes)


@pytest.mark.slow
def test_report_on_random_vectors(tmp_path):
    out = tmp_path / "rep"
    assert nla_report.main(["--out", str(out), *TINY, "--exact-budget-gib", str(4.0 * 16 * 32 * 4 * 2 / 2**30)]) == 0
    rep = json.loads((out / "report.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["regions"] == 5 and cfg["seed"] == 0
    for name in ("t2r_scatter.png", "r2t_scatter.png", "loss_correlation.png", "cost_vs_m.png",
                 "alpha_calibration.png"):
        assert name in rep["files"] and (out / name).stat().st_size > 1000
    taus, alphas = [0.1, 0.01, 0.001], [0.0, 0.25, 0.5, 0.75, 1.0]
    _check_source(rep["sources"]["random"], taus, alphas)
    # cost: NLA measured at every M; exact measured while within budget (here: up to M = 5), then skipped
    rows = rep["cost"]["rows"]
    assert [r["M"] for r in rows] == [2, 3, 4, 5, 6]
    assert all(r["nla_seconds"] > 0 for r in rows)
    assert [r["exact"] == "measured" for r in rows] == [True, True, True, True, False]
    assert rows[-1]["exact_seconds"] is None and "GiB" in rows[-1]["exact"]
    if rep["cost"]["memory_method"] == "hwm-reset":
        assert all(r["nla_peak_bytes"] is not None and r["nla_peak_bytes"] >= 0 for r in rows)
    # calibration: alpha-hat minimises the MAE, so it is never worse than the paper's 0.75 (on the grid)
    for c in rep["calibration"]:
        assert 0.0 <= c["alpha_hat"] <= 1.0
        assert c["mae_alpha_hat"] <= c["mae_paper_alpha"] + 1e-12
        assert c["mae_alpha_hat"] <= min(c["curve"]["mae"]) + 1e-12
        assert 0.0 <= c["alpha_star_median"] <= 1.0
        lo, hi = c["alpha_star_q25_q75"]
        assert 0.0 <= lo <= c["alpha_star_median"] <= hi <= 1.0
    assert [c["M"] for c in rep["calibration"]] == [3, 5]
    assert set(rep["section_seconds"]) == {"accuracy", "cost", "calibration"}


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("nla_cache")
    toyworld.generate(root / "toy", n=12, seed=0, workers=1)
    build_cache(root / "toy", root / "cache", components=["patches", "tokens", "tree", "regions"], num_regions=4,
                workers=0, batch_size=8, shard_size=8)
    return root / "cache"


@pytest.mark.slow
def test_report_on_cache(tmp_path, tiny_cache):
    out = tmp_path / "rep"
    argv = ["--out", str(out), *TINY, "--cache", str(tiny_cache), "--cost-m", "2,3", "--calib-m", "3"]
    assert nla_report.main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    src = rep["sources"]["cache"]
    nodes = ExtractOptions().max_nodes  # K is the cache's node padding: extraction's default cap
    assert src["M"] == 4 and src["K"] == nodes and 0 < src["mean_valid_nodes"] <= nodes
    _check_source(src, [0.1, 0.01, 0.001], [0.0, 0.25, 0.5, 0.75, 1.0])
    assert (out / "cache_r2t_scatter.png").is_file() and (out / "cache_t2r_scatter.png").is_file()
    assert rep["calibration"][-1]["label"] == "cache"


def test_cache_batches_match_direct_embeddings(tiny_cache):
    """Region / node embeddings from the cache equal the library functions applied by hand to one row."""
    from adapters.losses.nla import leaf_embeddings, node_embeddings, region_embeddings
    from extract.cache import FeatureCache

    batches, info = nla_report.cache_batches(str(tiny_cache), 1, 4, seed=3)
    cache = FeatureCache.open(tiny_cache)
    rows = np.random.default_rng(3).permutation(cache.num_captions)[:4]
    x = cache.batch(rows[:1])
    masks = torch.from_numpy(x["region_masks"]).reshape(1, 4, -1) & torch.from_numpy(x["region_valid"])[..., None]
    reg, rv = region_embeddings(torch.from_numpy(x["patch_tokens"]).double(), masks)
    lt = torch.from_numpy(x["leaf_tokens"]) & torch.from_numpy(x["token_mask"]).bool()[:, None, :]
    leaves, lv = leaf_embeddings(torch.from_numpy(x["token_embed"]).double(), lt)
    nl = torch.from_numpy(x["node_leaves"]) & lv[:, None, :]
    torch.testing.assert_close(batches[0]["regions"][:1], reg)
    torch.testing.assert_close(batches[0]["nodes"][:1], node_embeddings(leaves, nl))
    assert batches[0]["node_mask"][0].sum() == int(x["n_nodes"][0])
    assert info["batches"] == 1


def test_missing_cache_fails_with_a_message(tmp_path, capsys):
    assert nla_report.main(["--out", str(tmp_path / "o"), *TINY, "--cache", str(tmp_path / "nothing")]) == 2
    assert "python -m extract" in capsys.readouterr().err


def test_bad_arguments_are_refused(tmp_path, capsys):
    for bad in (["--taus", "0.1,-1"], ["--alphas", "0,2"], ["--regions", "17"], ["--samples", "3"]):
        with pytest.raises(SystemExit) as e:
            nla_report.parse_args(["--out", str(tmp_path), *bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and bad[0] in err, err  # one line naming the flag it refused


def test_lambda_and_alpha_star_against_library_bounds():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 5, 6, generator=g, dtype=torch.float64)
    rm = torch.rand(3, 1, 5, generator=g) < 0.8
    nm = torch.rand(1, 4, 6, generator=g) < 0.8
    rm[..., 0], nm[..., 0] = True, True
    for a in (0.0, 0.3, 1.0):
        lam = nla_report.lam_alpha(q, rm, nm, torch.full((3, 4), a, dtype=torch.float64))
        torch.testing.assert_close(lam, nla_t2_bounds(q, 0.01, a, rm, nm)[1])
    r2t = r2t_exact(q, rm, nm)
    star = nla_report.alpha_star(q, rm, nm, r2t)
    ok = torch.isfinite(star)
    assert ok.any() and ((star[ok] >= 0) & (star[ok] <= 1)).all()
    torch.testing.assert_close(nla_report.lam_alpha(q, rm, nm, torch.nan_to_num(star))[ok], r2t[ok],
                               rtol=0, atol=1e-9)  # Theorem 2: Lambda(alpha*) = R2T


def test_random_batches_shapes_and_coupling():
    b = next(nla_report.random_batches(1, 6, 4, 3, 32, 0.0, seed=1))
    assert b["regions"].shape == (6, 4, 32) and b["nodes"].shape == (6, 5, 32)
    torch.testing.assert_close(b["regions"].norm(dim=-1), torch.ones(6, 4, dtype=torch.float64))
    k = b["node_mask"].sum(-1)
    assert ((k == 3) | (k == 5)).all()  # 2 or 3 leaves -> 3 or 5 nodes
    assert (b["node_sizes"].max(-1).values == (k + 1) / 2).all()  # the root holds every leaf
    # coupling: leaves describe regions of their own image, so matched pairs score higher
    cb = list(nla_report.random_batches(20, 8, 4, 3, 64, 0.9, seed=2))
    diag = off = 0.0
    for x in cb:
        s = torch.einsum("imd,jkd->ij", x["regions"], x["nodes"] * x["node_mask"][..., None])
        diag += s.diag().mean().item()
        off += (s.sum() - s.diag().sum()).item() / (8 * 7)
    assert diag > off + 1.0


def test_pearson_and_errors():
    assert nla_report.pearson(np.ones(5), np.arange(5)) is None
    assert nla_report.pearson(np.arange(5), 2 * np.arange(5) + 1) == pytest.approx(1.0)
    e = nla_report.errors(np.array([1.0, 2.0]), np.array([0.0, 4.0]))
    assert e["mae"] == 1.5 and e["max_abs_err"] == 2.0 and e["bias"] == -0.5
    assert math.isclose(e["pearson"], 1.0)
