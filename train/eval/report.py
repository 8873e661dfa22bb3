"""What ``python -m train.eval`` reports: the warnings a result deserves, the headline figures (one flat
row name per figure, the names the demo, the training engines and the comparisons read), the side-by-side table
with paired bootstrap intervals, and its Markdown and plots."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from adapters.eval.bootstrap import DEFAULT_RESAMPLES, PerQuery, compare_columns, mean_sd
from adapters.eval.retrieval import group_rows

#CROSS

def result_warnings(model: str, results: dict) -> list[str]:
    """One "warning: ..." line per task of one model's results whose numbers need a caveat: non-finite scores
    (counted and ranked last, naming the model), a linear probe skipped for non-finite embeddings, and a split
    too small for its metrics (the split's warning, the same for every model)."""
    lines = []
    for task, label in (("retrieval", "retrieval"), ("zeroshot", "zero-shot")):
        r = results.get(task) or {}
        if r.get("nonfinite_scores"):
            lines.append(f"warning: {model} gave {r['nonfinite_scores']} non-finite {label} scores "
                         f"(of {r['n_scores']}); they rank last")
        if r.get("warning"):
            lines.append(f"warning: {label}: {r['warning']}")
    comp = {name: c for name, c in (results.get("compositional") or {}).items() if c.get("nonfinite_scores")}
    if comp:
        lines.append(f"warning: {model} gave {sum(c['nonfinite_scores'] for c in comp.values())} non-finite "
                     f"compositional scores (of {sum(c['n_scores'] for c in comp.values())} in "
                     f"{', '.join(comp)}); they rank last")
    probe = results.get("linear_probe") or {}
    if probe.get("nonfinite_embeddings"):
        lines.append(f"warning: linear probe skipped: {probe['skipped']}")
    return lines


def headline(results: dict) -> dict[str, float]:
    """The numbers a table shows for one model: flat {metric: value}."""
    flat = {}
    r = results.get("retrieval")
    if r:
        for d, tag in (("text_to_image", "T2I"), ("image_to_text", "I2T")):
            for k in ("R@1", "R@5", "R@10"):
                flat[f"retrieval {tag} {k}"] = r[d][k]
        mp = r.get("multi_positive")
        if mp:  # a toy world: captions true of several images (adapters.eval.multipositive)
            for k in ("R@1", "R@5", "R@10"):
                flat[f"retrieval T2I any-true {k}"] = mp["text_to_image"][k]
            flat["retrieval T2I mAP"] = mp["text_to_image"]["mAP"]
            if mp["image_to_text"].get("n"):
                flat["retrieval I2T any-true R@1"] = mp["image_to_text"]["R@1"]
                flat["retrieval I2T mAP"] = mp["image_to_text"]["mAP"]
            for group, row in mp["text_to_image_by"].items():
                if row.get("n"):
                    for metric, _ in group_rows(group, None, None):
                        flat[metric] = row["R@1" if "any-true" in metric else "mAP"]
    z = results.get("zeroshot")
    if z and "top1" in z:
        flat["zero-shot top-1"] = z["top1"]
        if "top5" in z:
            flat["zero-shot top-5"] = z["top5"]
    for name, c in (results.get("compositional") or {}).items():
        for sub, row in c["per_type"].items():
            for metric, v in row.items():
                if metric != "n":
                    flat[f"{name} {sub}" + ("" if metric == "acc" else f" {metric}")] = v
        for sub, row in (c.get("summary") or {}).items():
            for metric, v in row.items():
                if metric not in ("n", "individual"):
                    flat[f"{name} {sub} {metric}"] = v
    p = results.get("linear_probe")
    if p and "top1" in p:
        flat["linear probe top-1"] = p["top1"]
    return flat


def comparison(all_results: dict[str, dict], columns: dict[str, list[str]], per_query: dict[str, PerQuery],
               n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict:
    """The table of a comparison: per column (its runs: one model, or one per training seed) and :func:`headline`
    metric, ``mean`` and ``sd`` over the runs (``sd`` None for one run) and ``runs`` (each run's figure); the
    bootstrap's ``ci`` (95% interval of the seed-averaged figure over resampled test images) and, for every column
    after the first (the reference, e.g. the frozen base), ``delta`` (mean - the reference's), ``delta_ci`` and
    ``significant`` (the interval excludes 0). Figures without per-query values (the linear probe) get a delta but
    no interval. ``adapters.eval.bootstrap`` says how, and what the interval leaves out."""
    names = list(columns)
    reference = names[0] if len(names) > 1 else None
    boot = compare_columns(per_query, columns, reference, n_resamples, seed)
    metrics: dict[str, dict] = {}
    for name, labels in columns.items():
        flats = [headline(all_results[label]) for label in labels]
        entries = {}
        for metric in dict.fromkeys(m for f in flats for m in f):
            runs = [f[metric] for f in flats if metric in f]
            if len(runs) != len(flats):
                continue  # not every run has it (a skipped task): no figure rather than a mean of a subset
            mean, sd = mean_sd(runs)
            entry = {"mean": mean, "sd": sd, "runs": runs}
            found = boot.get(name, {}).get(metric, {})
            entry.update({k: found[k] for k in ("ci", "delta_ci", "significant") if k in found})
            entries[metric] = entry
        metrics[name] = entries
    for name in names[1:]:
        for metric, entry in metrics[name].items():
            if metric in metrics[reference]:
                entry["delta"] = entry["mean"] - metrics[reference][metric]["mean"]
    return {"reference": reference, "columns": dict(columns), "metrics": metrics,
            "bootstrap": {"resamples": n_resamples, "seed": seed, "level": 0.95, "unit": "test image",
                          "paired": True}}


def cell(entry: dict | None, digits: int = 2, mark: str = " *") -> str:
    """A table cell of :func:`comparison`'s: mean (± sd over seeds), then, after the reference column, the
    difference from it with its 95% paired bootstrap interval and ``mark`` where the interval excludes 0."""
    if entry is None:
        return "–"
    f = f".{digits}f"
    text = format(entry["mean"], f) + (f" ± {entry['sd']:{f}}" if entry.get("sd") is not None else "")
    if "delta" in entry:
        ci = entry.get("delta_ci")
        if ci and all(math.isfinite(v) for v in ci):
            text += (f" ({entry['delta']:+{f}} [{ci[0]:+{f}}, {ci[1]:+{f}}]"
                     f"{mark if entry.get('significant') else ''})")
        else:
            text += f" ({entry['delta']:+{f}})"
    return text


def markdown(all_results: dict[str, dict], table: dict | None = None) -> str:
    """The side-by-side table: one column per model (or per column of :func:`comparison`), one row per
    :func:`headline` metric; with a reference column, every other cell adds its delta, interval and mark, and a
    legend follows the table."""
    if table is None:
        table = comparison(all_results, {name: [name] for name in all_results}, {}, n_resamples=0)
    names = list(table["columns"])
    rows = list(dict.fromkeys(m for name in names for m in table["metrics"][name]))
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for metric in rows:
        lines.append(f"| {metric} | " + " | ".join(cell(table["metrics"][name].get(metric)) for name in names) + " |")
    legend = []
    runs = sorted({len(labels) for labels in table["columns"].values() if len(labels) > 1})
    if runs:
        legend.append(f"mean ± sd over {'/'.join(map(str, runs))} runs per column (training seeds; one run: no sd); "
                      "the interval is that of the seed-averaged difference")
    if table["reference"] is not None:
        b = table["bootstrap"]
        legend.append(f"(difference from {table['reference']} [95% paired bootstrap interval, {b['resamples']} "
                      "resamples of the test images]); * the interval excludes 0" if b["resamples"] else
                      f"(difference from {table['reference']}; no bootstrap: --bootstrap 0)")
    return "\n".join(lines) + "\n" + "".join(f"\n{line}" for line in legend) + ("\n" if legend else "")


def bar_plot(all_results: dict[str, dict], path: Path, table: dict | None = None) -> Path | None:
    """Grouped horizontal bars, one group per metric, one bar per column (the mean of its runs), with the 95%
    bootstrap interval of each figure as an error bar where there is one. A comparison with differences from a
    reference is drawn as :func:`delta_plot` instead: the question it answers is "does the adapter beat the base"."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'plugvlm[train]'); no PNG written")
        return None
    if table is None:
        table = comparison(all_results, {name: [name] for name in all_results}, {}, n_resamples=0)
    names = list(table["columns"])
    metrics = list(dict.fromkeys(m for n in names for m in table["metrics"][n]))
    if not metrics:
        return None
    if any("delta_ci" in e for n in names for e in table["metrics"][n].values()):
        return delta_plot(plt, table, path)
    height = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(metrics) * max(1, len(names)) + 1.5))
    for k, name in enumerate(names):
        entries = table["metrics"][name]
        ys = np.arange(len(metrics)) + k * height
        means = np.array([entries[m]["mean"] if m in entries else 0.0 for m in metrics])
        lo = np.array([entries[m]["ci"][0] if "ci" in entries.get(m, {}) else np.nan for m in metrics])
        hi = np.array([entries[m]["ci"][1] if "ci" in entries.get(m, {}) else np.nan for m in metrics])
        errors = None
        if np.isfinite(lo).any():
            errors = np.nan_to_num(np.vstack([np.clip(means - lo, 0, None), np.clip(hi - means, 0, None)]))
        label = name + (f" ({len(table['columns'][name])} seeds)" if len(table["columns"][name]) > 1 else "")
        ax.barh(ys, means, height=height, label=label, xerr=errors, error_kw={"elinewidth": 0.8, "capsize": 1.5})
    ax.set_yticks(np.arange(len(metrics)) + height * (len(names) - 1) / 2)
    ax.set_yticklabels(metrics, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("percent (error bars: 95% bootstrap interval over test images)")
    ax.set_xlim(0, 100)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def delta_plot(plt, table: dict, path: Path) -> Path:
    """One row per metric, one marker per compared column: its difference from the reference (the mean over its
    runs) with the 95% paired bootstrap interval as a line, filled where the interval excludes 0; a vertical
    line at 0. Each column's markers sit at their own height inside the metric's row, in the table's order."""
    names = [n for n in table["columns"] if n != table["reference"]]
    metrics = list(dict.fromkeys(m for n in names for m, e in table["metrics"][n].items() if "delta" in e))
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(metrics) * max(1.0, len(names) / 3) + 1.6))
    step = 0.8 / len(names)
    colours = plt.get_cmap("tab10")
    for k, name in enumerate(names):
        entries = table["metrics"][name]
        rows = [(i, entries[m]) for i, m in enumerate(metrics) if "delta" in entries.get(m, {})]
        ys = np.array([i for i, _ in rows]) - 0.4 + step * (k + 0.5)
        deltas = np.array([e["delta"] for _, e in rows])
        lo = np.array([e.get("delta_ci", [np.nan, np.nan])[0] for _, e in rows])
        hi = np.array([e.get("delta_ci", [np.nan, np.nan])[1] for _, e in rows])
        colour = colours(k % 10)
        ax.hlines(ys, lo, hi, color=colour, linewidth=1.2)
        significant = np.array([bool(e.get("significant")) for _, e in rows])
        label = name + (f" ({len(table['columns'][name])} seeds)" if len(table["columns"][name]) > 1 else "")
        ax.scatter(deltas, ys, s=18, color=colour, label=label, zorder=3,
                   facecolors=[colour if sig else "white" for sig in significant])
    ax.axvline(0, color="black", linewidth=0.8)
    for i in range(1, len(metrics)):
        ax.axhline(i - 0.5, color="0.9", linewidth=0.5)
    ax.set_yticks(np.arange(len(metrics)))
    ax.set_yticklabels(metrics, fontsize=8)
    ax.set_ylim(len(metrics) - 0.5, -0.5)
    ax.set_xlabel(f"difference from {table['reference']} (percentage points; line: 95% paired bootstrap interval "
                  "over the test images; filled: it excludes 0)", fontsize=8)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06 * 15 / max(15, len(metrics))), ncol=2, fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
