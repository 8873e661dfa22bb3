"""The paired bootstrap over test images: known answers (a constant delta, the normal-theory interval of a mean),
the vectorised resampling against the literal resample-and-average, pairing, units and seed averaging."""
from __future__ import annotations

import numpy as np
import pytest

from adapters.eval.bootstrap import (PerQuery, bootstrap_figures, compare_columns, mean_sd, resample_counts,
                             unit_sums)


def _model(values, units, family="retrieval captions", metric="m"):
    pq = PerQuery()
    pq.add_family(family, units)
    pq.add(metric, family, values)
    return pq


def test_a_constant_delta_has_a_zero_width_interval():
    rng = np.random.default_rng(0)
    units = np.repeat(np.arange(50), 3)  # 50 images, 3 captions each
    base = rng.random(150)
    for shift, significant in ((0.05, True), (0.0, False)):
        out = compare_columns({"base": _model(base, units), "adapter": _model(base + shift, units)},
                              {"base": ["base"], "adapter": ["adapter"]}, "base", n_resamples=300)
        entry = out["adapter"]["m"]
        assert entry["delta"] == pytest.approx(100 * shift)
        assert entry["delta_ci"] == pytest.approx([100 * shift] * 2, abs=1e-9)
        assert entry["significant"] is significant
        assert "delta" not in out["base"]["m"] and entry["value"] == pytest.approx(100 * (base.mean() + shift))


def test_interval_of_a_mean_difference_matches_normal_theory():
    """Paired differences d_i ~ N(0.02, 0.1), one per image: the 95% interval is mean(d) +/- 1.96 sd(d) / sqrt(n).
    With 3 identical captions per image the interval is the same (resampling images, not captions); resampling
    captions one by one would shrink it by sqrt(3)."""
    rng = np.random.default_rng(1)
    n = 600
    x, d = rng.random(n), rng.normal(0.02, 0.1, n)
    half = 100 * 1.96 * d.std(ddof=1) / np.sqrt(n)
    for repeat in (1, 3):
        units = np.repeat(np.arange(n), repeat)
        out = compare_columns({"b": _model(np.repeat(x, repeat), units), "a": _model(np.repeat(x + d, repeat), units)},
                              {"b": ["b"], "a": ["a"]}, "b", n_resamples=4000, seed=3)["a"]["m"]
        lo, hi = out["delta_ci"]
        assert out["delta"] == pytest.approx(100 * d.mean())
        assert (hi - lo) / 2 == pytest.approx(half, rel=0.08)
        assert (lo + hi) / 2 == pytest.approx(100 * d.mean(), abs=0.15 * half)


def test_vectorised_figures_equal_the_literal_resample():
    rng = np.random.default_rng(2)
    units = rng.integers(0, 12, 40)
    values = rng.random((40, 3))
    values[rng.random((40, 3)) < 0.3] = np.nan  # queries a row does not count
    weights = resample_counts(12, 25, seed=5)
    assert (weights.sum(1) == 12).all() and weights.min() >= 0
    fast = bootstrap_figures(*unit_sums(values, units, 12), weights)
    for b in range(25):
        drawn = np.concatenate([np.flatnonzero(units == u) for u in range(12) for _ in range(int(weights[b, u]))])
        for m in range(3):
            kept = values[drawn, m][~np.isnan(values[drawn, m])]
            want = 100 * kept.mean() if len(kept) else np.nan
            np.testing.assert_allclose(fast[b, m], want, rtol=1e-12)


def test_seeded_and_paired():
    a, b = resample_counts(30, 10, seed=7), resample_counts(30, 10, seed=7)
    assert np.array_equal(a, b) and not np.array_equal(a, resample_counts(30, 10, seed=8))
    # pairing: a model that is the base plus noise shared across images has a narrower delta interval than the
    # spread of either model's own figure
    rng = np.random.default_rng(4)
    hard = rng.random(300)  # per-image difficulty shared by both models
    units = np.arange(300)
    out = compare_columns({"b": _model(hard, units), "a": _model(hard + rng.normal(0.01, 0.01, 300), units)},
                          {"b": ["b"], "a": ["a"]}, "b", n_resamples=500)["a"]["m"]
    assert np.diff(out["delta_ci"])[0] < 0.2 * np.diff(out["ci"])[0] and out["significant"]


def test_seed_runs_are_averaged_per_query():
    rng = np.random.default_rng(5)
    units = np.repeat(np.arange(40), 2)
    base, r1, r2 = rng.random(80), rng.random(80), rng.random(80)
    per_query = {"b": _model(base, units), "s0": _model(r1, units), "s1": _model(r2, units),
                 "avg": _model((r1 + r2) / 2, units)}
    two = compare_columns(per_query, {"b": ["b"], "m": ["s0", "s1"]}, "b", n_resamples=200)["m"]["m"]
    one = compare_columns(per_query, {"b": ["b"], "m": ["avg"]}, "b", n_resamples=200)["m"]["m"]
    # the same fields, each compared on its own: pytest.approx takes no nested containers (pytest >= 9.2 refuses
    # a dict holding lists), and a bool must match exactly, not as 1.0 == approx(1)
    assert set(two) == set(one) == {"value", "ci", "delta", "delta_ci", "significant"}
    assert two["value"] == pytest.approx(one["value"]) and two["delta"] == pytest.approx(one["delta"])
    assert two["ci"] == pytest.approx(one["ci"]) and two["delta_ci"] == pytest.approx(one["delta_ci"])
    assert two["significant"] is one["significant"]
    assert mean_sd([1.0, 3.0]) == (2.0, pytest.approx(np.sqrt(2))) and mean_sd([4.0]) == (4.0, None)


def test_no_delta_when_the_queries_differ():
    units = np.arange(10)
    other = _model(np.ones(10), [f"x{k}" for k in range(10)])  # other images
    out = compare_columns({"b": _model(np.zeros(10), units), "a": other}, {"b": ["b"], "a": ["a"]}, "b", 100)
    assert "delta_ci" not in out["a"]["m"] and out["a"]["m"]["ci"] == [100.0, 100.0]
    assert compare_columns({"b": _model(np.zeros(10), units)}, {"b": ["b"]}, None, n_resamples=0) == {}
    with pytest.raises(ValueError, match="values for the 10 queries"):
        _model(np.zeros(9), units)
