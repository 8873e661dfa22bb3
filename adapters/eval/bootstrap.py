"""Paired bootstrap intervals over test images for model-vs-reference deltas, and mean +/- sd over training seeds.

A table's figure is a mean over queries (captions, images, hard-negative items) of a per-query value: a hit (0/1) for
R@k and accuracies, an AP for mAP. Its uncertainty from the choice of test images is estimated by resampling the
*images* with replacement, each with all of its queries (a caption goes with its image, a hard negative with its
image), B times; the 95% interval is the 2.5th..97.5th percentile of the B resampled figures (percentile
bootstrap, Efron & Tibshirani 1993, ch. 13). The resample is *paired*: the same resampled images for the
reference (the frozen base) and every other column, so the interval is that of the difference itself, and an
image that is hard for both models cancels out. A delta is *significant* when its interval excludes 0.

What stays fixed: the ranking candidates. A resampled figure reuses each query's rank among the whole test set
(the usual bootstrap over queries); it does not re-rank among the resampled images.

Fast path (:func:`bootstrap_figures`): per-image sums of the values and per-image query counts are computed once
([U] per metric), the B resamples are multinomial counts W [B, U] (how often each image was drawn), and every
resampled figure is 100 * (W @ sums) / (W @ counts): a matrix product instead of B passes over the queries (tested
against the literal resample-and-average reference). Default B = 2000 (:data:`DEFAULT_RESAMPLES`): the interval's
end points then move by well under a tenth of their width between seeds.

Several training seeds (``--seeds N``): each column's figure is the mean over its N runs and the table shows mean
+/- sd (sd over the N runs, ddof 1). The interval is the bootstrap interval of the *seed-averaged* delta: each
query's value is first averaged over the N runs (the base is one model; the data are the same for every run), then
resampled as above. It says whether the seed-averaged adapter differs from the base beyond the noise of the test
images; the seed-to-seed spread is reported next to it as the sd, not folded into the interval (with N = 3 a
bootstrap over seeds would itself be noise). Read a significant delta whose size is comparable to the sd with care.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import numpy as np

DEFAULT_RESAMPLES = 2000
LEVEL = 0.95
_BLOCK = 256  # resamples per matrix product: bounds W to 256 x U floats


@dataclass
class PerQuery:
    """One model's per-query values, for the bootstrap. ``families``: name -> the unit (test image) key of every
    query of that family, in query order (queries of one family share one query order: the captions of the
    retrieval split, its images, the items of a benchmark). ``metrics``: table row name -> (family, values [Q]
    float64, NaN for a query the row does not count). The row's figure is 100 * the mean of its non-NaN values."""

    families: dict[str, tuple] = field(default_factory=dict)
    metrics: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)

    def add_family(self, name: str, unit_keys: Sequence[Hashable]) -> None:
        self.families[name] = tuple(unit_keys)

    def add(self, metric: str, family: str, values) -> None:
        values = np.asarray(values, dtype=np.float64)
        if family not in self.families:
            raise KeyError(f"unknown family {family!r}; add it first")
        if values.shape != (len(self.families[family]),):
            raise ValueError(f"{metric}: {values.shape[0] if values.ndim else 0} values for the "
                             f"{len(self.families[family])} queries of {family}")
        self.metrics[metric] = (family, values)

    def figure(self, metric: str) -> float:
        """100 * the mean of the metric's counted values (NaN when none counts)."""
        values = self.metrics[metric][1]
        kept = values[~np.isnan(values)]
        return float(100 * kept.mean()) if len(kept) else float("nan")


def resample_counts(n_units: int, n_resamples: int, seed: int) -> np.ndarray:
    """[n_resamples, n_units] float64: how often each unit is drawn in each resample of n_units draws with
    replacement (each row sums to n_units). Seeded: the same (n_units, n_resamples, seed) gives the same counts."""
    rng = np.random.default_rng([seed, 0xB007])
    return rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=n_resamples).astype(np.float64)


def unit_sums(values: np.ndarray, units: np.ndarray, n_units: int) -> tuple[np.ndarray, np.ndarray]:
    """(sums [U, M], counts [U, M]) of ``values`` [Q, M] per unit (``units`` [Q] in [0, U)); NaN values are left
    out of both."""
    values = np.asarray(values, dtype=np.float64)
    counted = ~np.isnan(values)
    sums = np.zeros((n_units, values.shape[1]))
    counts = np.zeros((n_units, values.shape[1]))
    np.add.at(sums, units, np.where(counted, values, 0.0))
    np.add.at(counts, units, counted.astype(np.float64))
    return sums, counts


def bootstrap_figures(sums: np.ndarray, counts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """[B, M] resampled figures (percent): 100 * (W @ sums) / (W @ counts) for W = ``weights`` [B, U]; NaN where a
    resample holds no query of a metric (a small group can be missed entirely)."""
    out = np.empty((weights.shape[0], sums.shape[1]))
    for a in range(0, weights.shape[0], _BLOCK):
        w = weights[a:a + _BLOCK]
        num, den = w @ sums, w @ counts
        with np.errstate(invalid="ignore", divide="ignore"):
            out[a:a + _BLOCK] = np.where(den > 0, 100 * num / np.where(den > 0, den, 1.0), np.nan)
    return out


def percentile_interval(samples: np.ndarray, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) percentiles of ``samples`` [B, ...] along axis 0 for a central ``level`` interval, NaN-aware."""
    tail = 100 * (1 - level) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column (a group no image has): NaN, no noise
        lo, hi = np.nanpercentile(samples, [tail, 100 - tail], axis=0)
    return lo, hi


def compare_columns(per_query: Mapping[str, PerQuery], columns: Mapping[str, Sequence[str]], reference: str | None,
                    n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0, level: float = LEVEL) -> dict:
    """Bootstrap every metric of every column against the reference column.

    ``per_query``: model label -> :class:`PerQuery`; ``columns``: column name -> the labels of its runs (one per
    training seed; a column of one run is a single model); ``reference``: the column the others are compared
    with (None: no deltas). For each column and metric with per-query values in every run returns
    ``{"value": seed-averaged figure, "ci": [lo, hi] of that figure}`` and, for non-reference columns whose
    queries are the reference's (same images, same order), ``"delta"``, ``"delta_ci": [lo, hi]`` and
    ``"significant"`` (the interval excludes 0). Metrics whose queries differ between runs or from the reference
    (another data set, images skipped by one model) get no interval. ``n_resamples`` 0: {} (no bootstrap)."""
    if n_resamples <= 0:
        return {}
    out: dict[str, dict] = {name: {} for name in columns}
    # per column: metric -> (family keys, seed-averaged values), only where every run has it on the same queries
    averaged: dict[str, dict[str, tuple[tuple, np.ndarray]]] = {}
    for name, labels in columns.items():
        runs = [per_query[label] for label in labels if label in per_query]
        if len(runs) != len(labels) or not runs:
            averaged[name] = {}
            continue
        metrics = {}
        for metric, (family, values) in runs[0].metrics.items():
            keys = runs[0].families[family]
            stack = [values]
            for other in runs[1:]:
                if metric not in other.metrics:
                    break
                fam, vals = other.metrics[metric]
                if other.families[fam] != keys or not np.array_equal(np.isnan(vals), np.isnan(values)):
                    break
                stack.append(vals)
            else:
                metrics[metric] = (keys, np.mean(stack, axis=0))
        averaged[name] = metrics
    ref = averaged.get(reference, {}) if reference is not None else {}
    # one resample per set of queries (family keys), shared by every column: the pairing
    groups: dict[tuple, list[tuple[str, str]]] = {}
    for name, metrics in averaged.items():
        for metric, (keys, _) in metrics.items():
            groups.setdefault(keys, []).append((name, metric))
    for keys, members in groups.items():
        unit_keys = list(dict.fromkeys(keys))
        index = {k: n for n, k in enumerate(unit_keys)}
        units = np.array([index[k] for k in keys], dtype=np.int64)
        weights = resample_counts(len(unit_keys), n_resamples, seed)
        metric_names = list(dict.fromkeys(m for _, m in members))
        col = {m: k for k, m in enumerate(metric_names)}
        ref_values = None
        if any(m in ref and ref[m][0] == keys for m in metric_names):
            ref_values = np.column_stack([ref[m][1] if m in ref and ref[m][0] == keys else np.full(len(keys), np.nan)
                                          for m in metric_names])
            ref_samples = bootstrap_figures(*unit_sums(ref_values, units, len(unit_keys)), weights)
        by_column: dict[str, list[str]] = {}
        for name, metric in members:
            by_column.setdefault(name, []).append(metric)
        for name, metrics in by_column.items():
            values = np.column_stack([averaged[name][m][1] for m in metrics])
            sums, counts = unit_sums(values, units, len(unit_keys))
            samples = bootstrap_figures(sums, counts, weights)
            lo, hi = percentile_interval(samples, level)
            figure = 100 * sums.sum(0) / np.maximum(counts.sum(0), 1)
            for k, metric in enumerate(metrics):
                entry = {"value": float(figure[k]), "ci": [float(lo[k]), float(hi[k])]}
                if name != reference and ref_values is not None and metric in ref and ref[metric][0] == keys:
                    j = col[metric]
                    ref_counted = ~np.isnan(ref_values[:, j])
                    if np.array_equal(ref_counted, ~np.isnan(values[:, k])):
                        delta = samples[:, k] - ref_samples[:, j]
                        dlo, dhi = percentile_interval(delta[:, None], level)
                        ref_figure = 100 * np.nanmean(ref_values[:, j]) if ref_counted.any() else np.nan
                        entry.update(delta=float(figure[k] - ref_figure), delta_ci=[float(dlo[0]), float(dhi[0])],
                                     significant=bool(dlo[0] > 0 or dhi[0] < 0))
                out[name][metric] = entry
    return out


def mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """(mean, sample sd with ddof 1; None for a single value) of one figure over runs."""
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), (float(arr.std(ddof=1)) if len(arr) > 1 else None)
