"""``python -m train.eval.nla_report --out DIR``: how well the NLAs approximate the exact powerset similarities,
what they cost, and which alpha to use -- PowerCLIP Figures 5, 7 and 9 reproduced, plus alpha calibration.

Sections (every number lands in ``DIR/report.json``; plots as PNG):

1. **Similarity accuracy** (Fig. 7, supplement App. C): NLA-T1 vs exact T2R and NLA-T2 vs exact R2T over
   every (image, text) pair of many small batches, for tau in {0.1, 0.01, 0.001} and alpha in
   {0, 0.25, 0.5, 0.75, 1}: Pearson r, mean / max absolute error, bias, and Theorem 1's bound
   ``tau M log 2`` checked on every pair. ``t2r_scatter.png``, ``r2t_scatter.png``.
2. **Loss accuracy** (Fig. 5): the bidirectional triplet loss of each batch computed from the NLA and from
   the exact similarities (T2R and R2T terms apart), Pearson r over batches. ``loss_scatter.png``,
   ``loss_correlation.png``.
3. **Cost vs M** (Fig. 9): time and peak memory of one loss step (forward + backward) for M = 2..16, NLA
   and exact (closed-form T2R + enumerated R2T); the exact one stops where it would exceed a time or memory
   budget and is recorded as skipped. ``cost_vs_m.png``.
4. **Alpha calibration** (beyond the paper): Theorem 2 gives, per pair, an alpha* with Lambda(alpha*) = R2T
   (the limit tau -> 0); we solve it per pair by bisection (Lambda is non-decreasing in alpha) and report
   its distribution, and estimate the single alpha-hat that minimises the mean absolute error of NLA-T2
   at the working tau against exact R2T (grid + golden-section refinement), at several small M, with its
   error next to the paper's alpha = 0.75. ``alpha_calibration.png``.

Data: ``random`` -- random unit vectors as in App. C: M region embeddings per image, texts of 2..P leaves
whose unit embeddings are ``normalise(c r_m + sqrt(1 - c^2) noise)`` for a random region m of their own
image (c ~ U(0, --coupling) per text, so matched pairs score higher and the loss is informative; c = 0 is
pure noise), nodes = sums of leaves over a random binary tree. ``cache`` (with ``--cache``) -- the same on
embeddings from a ``python -m extract`` cache with components patches, tokens, tree, regions.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from adapters.losses.contrastive import triplet_rows
from adapters.losses.nla import (MAX_EXACT_REGIONS, PowerCLIPLossConfig, leaf_embeddings, nla_t1, nla_t2,
                          node_embeddings, pair_scale, r2t_exact, region_embeddings, t2r_exact)
from extract.common.cli import Parser, help_description, run_job, say
from extract.common.config import fraction, nonnegative_int, parse_with_config, positive_float, positive_int, save_config
from extract.common.memory import frozen_heap
from train.eval.nla_batches import loss_step, make_batch, random_tree
from train.measure import MIB, load_warning, machine_load, peak_growth, rss_method, time_call

LOG2 = math.log(2.0)
CACHE_KEYS = ("patch_tokens", "region_masks", "region_valid", "token_embed", "token_mask", "leaf_tokens",
              "node_leaves")


# ------------------------------------------------------------------------------------------------- data
def random_batches(n_batches: int, b: int, m: int, max_leaves: int, d: int, coupling: float,
                   seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of b (image, text) pairs of random unit vectors (see the module docstring), float64:
    regions [b, M, d], region_mask [b, M], nodes [b, K, d], node_mask [b, K], node_sizes [b, K] with
    K = 2 max_leaves - 1 (texts with fewer leaves are padded)."""
    g = torch.Generator().manual_seed(seed)
    k_max = 2 * max_leaves - 1
    for _ in range(n_batches):
        regions = F.normalize(torch.randn(b, m, d, generator=g, dtype=torch.float64), dim=-1)
        nodes = torch.zeros(b, k_max, d, dtype=torch.float64)
        nmask = torch.zeros(b, k_max, dtype=torch.bool)
        sizes = torch.zeros(b, k_max, dtype=torch.float64)
        for i in range(b):
            p = int(torch.randint(2, max_leaves + 1, (1,), generator=g))
            tree = random_tree(p, g)  # [2p - 1, p]
            c = float(torch.rand(1, generator=g, dtype=torch.float64)) * coupling
            src = regions[i, torch.randint(m, (p,), generator=g)]  # the region each leaf describes
            noise = F.normalize(torch.randn(p, d, generator=g, dtype=torch.float64), dim=-1)
            leaves = F.normalize(c * src + math.sqrt(1 - c * c) * noise, dim=-1)
            nodes[i, :len(tree)] = tree.double() @ leaves
            nmask[i, :len(tree)] = True
            sizes[i, :len(tree)] = tree.sum(-1).double()
        yield {"regions": regions, "region_mask": torch.ones(b, m, dtype=torch.bool), "nodes": nodes,
               "node_mask": nmask, "node_sizes": sizes}


def cache_batches(cache_dir: str, n_batches: int, b: int, seed: int) -> tuple[list[dict[str, torch.Tensor]], dict]:
    """Batches of b random captions (and their images) from a feature cache, as region / node embeddings."""
    from extract.cache import FeatureCache

    cache = FeatureCache.open(cache_dir)
    missing = [k for k in CACHE_KEYS if k not in cache.keys]
    if missing:
        raise ValueError(f"cache {cache.path} lacks {', '.join(missing)}: build it with "
                         "`python -m extract ... --components patches,tokens,tree,regions`")
    rng = np.random.default_rng(seed)
    n = min(n_batches * b, cache.num_captions)
    rows = rng.permutation(cache.num_captions)[:n - n % b] if n >= b else np.arange(0)
    if len(rows) < 2:
        raise ValueError(f"cache {cache.path} has {cache.num_captions} caption(s); need at least 2 per batch")
    b = min(b, len(rows))
    out = []
    for s in range(0, len(rows) - b + 1, b):
        x = cache.batch(rows[s:s + b], CACHE_KEYS)
        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in x.items()}
        bb, m = t["region_masks"].shape[:2]
        if m > MAX_EXACT_REGIONS:
            raise ValueError(f"the cache has M = {m} regions per image; exact similarities need M <= "
                             f"{MAX_EXACT_REGIONS}: rebuild it with --num-regions {MAX_EXACT_REGIONS} or fewer")
        masks = t["region_masks"].reshape(bb, m, -1) & t["region_valid"][..., None]
        regions, rvalid = region_embeddings(t["patch_tokens"].double(), masks)
        tok_ok = t["token_mask"].bool()[:, None, :]
        leaves, lvalid = leaf_embeddings(t["token_embed"].double(), t["leaf_tokens"].bool() & tok_ok)
        node_leaves = t["node_leaves"].bool() & lvalid[:, None, :]
        out.append({"regions": regions, "region_mask": rvalid, "nodes": node_embeddings(leaves, node_leaves),
                    "node_mask": node_leaves.any(-1), "node_sizes": node_leaves.sum(-1).double()})
    info = {"path": str(cache.path), "captions": cache.num_captions, "batches": len(out), "batch": b,
            "M": int(out[0]["region_mask"].shape[1]), "K": int(out[0]["node_mask"].shape[1]),
            "mean_valid_regions": float(torch.cat([o["region_mask"].sum(1) for o in out]).float().mean()),
            "mean_valid_nodes": float(torch.cat([o["node_mask"].sum(1) for o in out]).float().mean())}
    return out, info


# ---------------------------------------------------------------------------------------------- metrics
def pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson r, or None when either side is constant."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return None
    return float(np.clip(np.corrcoef(x, y)[0, 1], -1.0, 1.0))


def errors(approx: np.ndarray, exact: np.ndarray) -> dict:
    d = np.asarray(approx, np.float64) - np.asarray(exact, np.float64)
    return {"pearson": pearson(approx, exact), "mae": float(np.abs(d).mean()), "max_abs_err": float(np.abs(d).max()),
            "bias": float(d.mean())}


def _pair_q(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.einsum("imd,jkd->ijmk", batch["regions"].double(), batch["nodes"].double())
    return q, batch["region_mask"][:, None, :], batch["node_mask"][None, :, :]


def _triplet(s: torch.Tensor, batch: dict, cfg: PowerCLIPLossConfig) -> float:
    """The bidirectional triplet term of the PowerCLIP loss for one batch's similarity matrix."""
    if cfg.normalize:
        s = s / pair_scale(batch["region_mask"], batch["node_mask"], batch["node_sizes"]).double()
    pos = torch.arange(len(s))
    return float(triplet_rows(s, pos, cfg.margin, hardest=cfg.hardest)
                 + triplet_rows(s.T, pos, cfg.margin, hardest=cfg.hardest))


@torch.no_grad()
def accuracy(batches, taus: Sequence[float], alphas: Sequence[float], cfg: PowerCLIPLossConfig) -> dict:
    """Sections 1 and 2 on one data source: per-pair values and per-batch losses, exact and NLA."""
    pairs: dict = {"t2r": [], "r2t": [], "m_valid": [], "t1": {t: [] for t in taus},
                   "t2": {(t, a): [] for t in taus for a in alphas}}
    losses: dict = {"t2r": [], "r2t": [], "t1": {t: [] for t in taus}, "t2": {(t, a): [] for t in taus for a in alphas}}
    for batch in batches:
        q, rm, nm = _pair_q(batch)
        t2r, r2t = t2r_exact(q, rm, nm), r2t_exact(q, rm, nm)
        pairs["t2r"].append(t2r.flatten())
        pairs["r2t"].append(r2t.flatten())
        pairs["m_valid"].append(batch["region_mask"].sum(-1)[:, None].expand_as(t2r).flatten())
        losses["t2r"].append(_triplet(t2r, batch, cfg))
        losses["r2t"].append(_triplet(r2t, batch, cfg))
        for t in taus:
            s = nla_t1(q, t, rm, nm)
            pairs["t1"][t].append(s.flatten())
            losses["t1"][t].append(_triplet(s, batch, cfg))
            for a in alphas:
                s = nla_t2(q, t, a, rm, nm)
                pairs["t2"][(t, a)].append(s.flatten())
                losses["t2"][(t, a)].append(_triplet(s, batch, cfg))
    cat = lambda xs: torch.cat(xs).numpy()  # noqa: E731
    exact_t2r, exact_r2t, m_valid = cat(pairs["t2r"]), cat(pairs["r2t"]), cat(pairs["m_valid"])
    out: dict = {"n_pairs": int(len(exact_t2r)), "n_batches": len(losses["t2r"]), "t2r": {}, "r2t": {},
                 "loss_t2r": {}, "loss_r2t": {}}
    raw: dict = {"t2r": exact_t2r, "r2t": exact_r2t, "t1": {}, "t2": {}, "loss_t2r": np.array(losses["t2r"]),
                 "loss_r2t": np.array(losses["r2t"]), "loss_t1": {}, "loss_t2": {}}
    for t in taus:
        s = cat(pairs["t1"][t])
        gap = s - exact_t2r
        bound = t * m_valid * LOG2
        out["t2r"][str(t)] = {**errors(s, exact_t2r), "bound_max": float(bound.max()),
                              "max_gap_over_bound": float((gap / np.maximum(bound, 1e-300)).max()),
                              "within_theorem1": bool(((gap >= -1e-9) & (gap <= bound + 1e-9)).all())}
        out["loss_t2r"][str(t)] = errors(losses["t1"][t], losses["t2r"])
        raw["t1"][t], raw["loss_t1"][t] = s, np.array(losses["t1"][t])
        out["r2t"][str(t)], out["loss_r2t"][str(t)] = {}, {}
        for a in alphas:
            s = cat(pairs["t2"][(t, a)])
            out["r2t"][str(t)][str(a)] = errors(s, exact_r2t)
            out["loss_r2t"][str(t)][str(a)] = errors(losses["t2"][(t, a)], losses["r2t"])
            raw["t2"][(t, a)], raw["loss_t2"][(t, a)] = s, np.array(losses["t2"][(t, a)])
    return {"summary": out, "raw": raw}


# -------------------------------------------------------------------------------------------- cost vs M
def cost_vs_m(ms: Sequence[int], b: int, k: int, d: int, cfg: PowerCLIPLossConfig, device, repeats: int,
              budget_s: float, budget_bytes: float) -> dict:
    """Section 3: one loss step (forward + backward) per M for the NLA and the exact loss."""
    rows, exact_open, last_exact = [], True, None
    # each peak measurement trims the heap first; frozen, that walks only what the steps made, not the whole process
    with frozen_heap():
        for m in ms:
            batch = make_batch(b, m, k, d, seed=m, device=device)
            row: dict = {"M": m}
            row["nla_seconds"] = time_call(lambda: loss_step("nla", batch, cfg), device, repeats=repeats)
            with peak_growth(device) as peak:
                loss_step("nla", batch, cfg)
            row["nla_peak_bytes"] = peak["bytes"]
            # The exact backward keeps Q_{A,B} for all 2^M subsets: B^2 2^M K floats (plus one transient chunk).
            need = 4.0 * b * b * (2 ** m) * k * 2
            reason = None
            if m > MAX_EXACT_REGIONS:
                reason = f"M > {MAX_EXACT_REGIONS}"
            elif not exact_open:
                reason = "an earlier M was skipped"
            elif need > budget_bytes:
                reason = f"needs ~{need / 2 ** 30:.1f} GiB > {budget_bytes / 2 ** 30:.1f} GiB budget"
            elif last_exact is not None and last_exact * 2.0 > budget_s:
                reason = f"predicted ~{last_exact * 2:.1f} s > {budget_s:.0f} s budget (it doubles per mask)"
            if reason is None:
                row["exact_seconds"] = last_exact = time_call(lambda: loss_step("exact", batch, cfg), device,
                                                              repeats=1, warmup=0)
                with peak_growth(device) as peak:
                    loss_step("exact", batch, cfg)
                row["exact_peak_bytes"] = peak["bytes"]
                row["exact"] = "measured"
            else:
                exact_open = False
                row.update(exact_seconds=None, exact_peak_bytes=None, exact=f"skipped: {reason}")
            rows.append(row)
            batch = None  # free before the next M allocates its own
    return {"B": b, "K": k, "d": d, "device": str(device), "memory_method": rss_method() if
            torch.device(device).type == "cpu" else "cuda-allocator", "rows": rows}


# ------------------------------------------------------------------------------------ alpha calibration
def lam_alpha(q: torch.Tensor, rm: torch.Tensor, nm: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Lambda(alpha) = max_B [(1 - alpha)/2 Qbar_B + alpha sum_m relu Q_{m,B}] (eq. 45, 47; max_A Q_{A,B} =
    sum_m relu Q_{m,B}), with alpha broadcast against the pair shape of q [..., M, K]."""
    qz = torch.where(rm[..., None], q, torch.zeros_like(q))
    qbar, pos = qz.sum(-2), qz.clamp_min(0).sum(-2)
    gam = (1 - alpha[..., None]) / 2 * qbar + alpha[..., None] * pos
    return gam.masked_fill(~nm.expand_as(gam), float("-inf")).amax(-1)


def alpha_star(q: torch.Tensor, rm: torch.Tensor, nm: torch.Tensor, r2t: torch.Tensor, iters: int = 50) -> torch.Tensor:
    """Per pair, the alpha* in [0, 1] with Lambda(alpha*) = R2T (Theorem 2's limit), by bisection; NaN where
    Lambda is flat (Lambda(0) = Lambda(1): every alpha works)."""
    shape = r2t.shape
    lo, hi = torch.zeros(shape, dtype=q.dtype), torch.ones(shape, dtype=q.dtype)
    l0, l1 = lam_alpha(q, rm, nm, lo), lam_alpha(q, rm, nm, hi)
    for _ in range(iters):
        mid = (lo + hi) / 2
        below = lam_alpha(q, rm, nm, mid) < r2t
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    out = (lo + hi) / 2
    return torch.where((l1 - l0) > 1e-12 * (1 + l1.abs()), out, torch.full_like(out, float("nan")))


@torch.no_grad()
def calibrate(batches, tau: float, paper_alpha: float = 0.75, grid: int = 21) -> dict:
    """Section 4 on one set of batches: per-pair alpha* and the MAE-optimal alpha-hat of NLA-T2 at tau."""
    qs = [_pair_q(b) for b in batches]
    exact = [r2t_exact(q, rm, nm) for q, rm, nm in qs]
    stars = torch.cat([alpha_star(q, rm, nm, e).flatten() for (q, rm, nm), e in zip(qs, exact)]).numpy()
    ex = torch.cat([e.flatten() for e in exact]).numpy()

    def approx(a: float) -> np.ndarray:
        return torch.cat([nla_t2(q, tau, a, rm, nm).flatten() for q, rm, nm in qs]).numpy()

    def mae(a: float) -> float:
        return float(np.abs(approx(a) - ex).mean())

    alphas = np.linspace(0, 1, grid)
    curve = [mae(float(a)) for a in alphas]
    best = float(alphas[int(np.argmin(curve))])
    lo, hi = max(0.0, best - 1 / (grid - 1)), min(1.0, best + 1 / (grid - 1))
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(25):  # golden-section refinement: the MAE is unimodal around the grid minimum
        a1, a2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if mae(a1) <= mae(a2):
            hi = a2
        else:
            lo = a1
    hat = (lo + hi) / 2
    valid = stars[np.isfinite(stars)]
    return {"tau": tau, "n_pairs": int(len(ex)), "alpha_hat": hat, "mae_alpha_hat": mae(hat),
            "mae_paper_alpha": mae(paper_alpha), "paper_alpha": paper_alpha,
            "pearson_alpha_hat": pearson(approx(hat), ex), "pearson_paper_alpha": pearson(approx(paper_alpha), ex),
            "alpha_star_median": float(np.median(valid)) if len(valid) else None,
            "alpha_star_q25_q75": [float(np.quantile(valid, 0.25)), float(np.quantile(valid, 0.75))]
            if len(valid) else None, "alpha_star_defined": int(len(valid)),
            "curve": {"alpha": alphas.tolist(), "mae": curve}, "_stars": valid}


# ------------------------------------------------------------------------------------------------ plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subsample(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.arange(n) if n <= k else np.random.default_rng(seed).choice(n, k, replace=False)


def _scatter(ax, x, y, title: str, idx) -> None:
    x, y = np.asarray(x)[idx], np.asarray(y)[idx]
    ax.scatter(x, y, s=3, alpha=0.4, linewidths=0)
    lo, hi = float(min(x.min(), y.min())), float(max(x.max(), y.max()))
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.7)
    ax.set_title(title, fontsize=8)
    ax.tick_params(labelsize=6)


def plot_accuracy(acc: dict, taus, alphas, out: Path, prefix: str) -> list[Path]:
    plt = _plt()
    raw, summ = acc["raw"], acc["summary"]
    idx = _subsample(len(raw["t2r"]), 3000)
    files = []
    fig, axes = plt.subplots(1, len(taus), figsize=(3 * len(taus), 3), squeeze=False)
    for c, t in enumerate(taus):
        r = summ["t2r"][str(t)]["pearson"]
        _scatter(axes[0, c], raw["t2r"], raw["t1"][t], f"NLA-T1 tau={t}  r={r if r is None else round(r, 4)}", idx)
        axes[0, c].set_xlabel("exact T2R", fontsize=7)
    axes[0, 0].set_ylabel("NLA-T1", fontsize=7)
    fig.tight_layout()
    files.append(out / f"{prefix}t2r_scatter.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(len(taus), len(alphas), figsize=(2.6 * len(alphas), 2.6 * len(taus)), squeeze=False)
    for r_, t in enumerate(taus):
        for c, a in enumerate(alphas):
            p = summ["r2t"][str(t)][str(a)]["pearson"]
            _scatter(axes[r_, c], raw["r2t"], raw["t2"][(t, a)],
                     f"tau={t} alpha={a}  r={p if p is None else round(p, 4)}", idx)
        axes[r_, 0].set_ylabel("NLA-T2", fontsize=7)
    for c in range(len(alphas)):
        axes[-1, c].set_xlabel("exact R2T", fontsize=7)
    fig.tight_layout()
    files.append(out / f"{prefix}r2t_scatter.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    # Fig. 5: loss-level correlation heat map and the paper setting's scatter
    fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(12, 3.4))
    mat = np.array([[np.nan if summ["loss_r2t"][str(t)][str(a)]["pearson"] is None
                     else summ["loss_r2t"][str(t)][str(a)]["pearson"] for a in alphas] for t in taus])
    t1col = np.array([[np.nan if summ["loss_t2r"][str(t)]["pearson"] is None else summ["loss_t2r"][str(t)]["pearson"]]
                      for t in taus])
    full = np.concatenate([t1col, mat], axis=1)
    lo = float(np.nanmin(full)) if np.isfinite(full).any() else 0.0
    im = a0.imshow(full, vmin=min(lo, 0.99) - 0.01, vmax=1, cmap="viridis")
    a0.set_xticks(range(len(alphas) + 1), ["T2R"] + [f"R2T a={a}" for a in alphas], fontsize=6, rotation=30)
    a0.set_yticks(range(len(taus)), [f"tau={t}" for t in taus], fontsize=7)
    for (i, j), v in np.ndenumerate(full):
        a0.text(j, i, "-" if not np.isfinite(v) else f"{v:.3f}", ha="center", va="center", fontsize=6, color="w")
    a0.set_title("loss Pearson r (NLA vs exact)", fontsize=8)
    fig.colorbar(im, ax=a0, fraction=0.046)
    tmid = taus[len(taus) // 2]
    amid = 0.75 if 0.75 in alphas else alphas[len(alphas) // 2]
    bidx = np.arange(len(raw["loss_t2r"]))
    _scatter(a1, raw["loss_t2r"], raw["loss_t1"][tmid], f"L_T2R per batch, tau={tmid}", bidx)
    _scatter(a2, raw["loss_r2t"], raw["loss_t2"][(tmid, amid)], f"L_R2T per batch, tau={tmid} alpha={amid}", bidx)
    for ax in (a1, a2):
        ax.set_xlabel("exact", fontsize=7)
        ax.set_ylabel("NLA", fontsize=7)
    fig.tight_layout()
    files.append(out / f"{prefix}loss_correlation.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def plot_cost(cost: dict, out: Path) -> Path:
    plt = _plt()
    rows = cost["rows"]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(9, 3.4))
    for key, label, style in (("nla", "NLA", "o-"), ("exact", "exact", "s-")):
        pts = [(r["M"], r[f"{key}_seconds"]) for r in rows if r.get(f"{key}_seconds") is not None]
        if pts:
            a0.plot(*zip(*pts), style, label=label)
        pts = [(r["M"], r[f"{key}_peak_bytes"] / MIB) for r in rows if r.get(f"{key}_peak_bytes") is not None]
        if pts:
            a1.plot(*zip(*pts), style, label=label)
    skipped = [r["M"] for r in rows if r.get("exact_seconds") is None]
    for ax, ylab in ((a0, "seconds per loss step (fwd+bwd)"), (a1, "peak memory added (MiB)")):
        if any(v > 0 for line in ax.get_lines() for v in line.get_ydata()):
            ax.set_yscale("log")  # (a test-sized run can add 0 MiB everywhere: that axis stays linear)
        ax.set_xlabel("M (region masks)")
        ax.set_ylabel(ylab, fontsize=8)
        if skipped:
            ax.axvspan(min(skipped) - 0.5, max(skipped) + 0.5, color="0.9", label="exact skipped")
        ax.legend(fontsize=7)
    a0.set_title(f"B={cost['B']} K={cost['K']} d={cost['d']} on {cost['device']}", fontsize=8)
    fig.tight_layout()
    path = out / "cost_vs_m.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_calibration(cal: list[dict], out: Path) -> Path:
    plt = _plt()
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(9, 3.4))
    for c in cal:
        line, = a0.plot(c["curve"]["alpha"], c["curve"]["mae"], label=f"{c['label']}: alpha-hat {c['alpha_hat']:.3f}")
        a0.axvline(c["alpha_hat"], color=line.get_color(), ls=":", lw=0.8)
        if len(c["_stars"]):
            a1.hist(c["_stars"], bins=40, range=(0, 1), histtype="step", density=True, color=line.get_color(),
                    label=c["label"])
    a0.axvline(0.75, color="k", ls="--", lw=0.8, label="paper 0.75")
    a0.set_yscale("log")
    a0.set_xlabel("alpha")
    a0.set_ylabel(f"MAE of NLA-T2 vs exact R2T (tau={cal[0]['tau']})", fontsize=7)
    a0.legend(fontsize=6)
    a1.set_xlabel("per-pair alpha* (Lambda(alpha*) = R2T)")
    a1.set_ylabel("density")
    a1.legend(fontsize=6)
    fig.tight_layout()
    path = out / "alpha_calibration.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -------------------------------------------------------------------------------------------------- CLI
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if ".." in part:
            a, b = part.split("..")
            out += list(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def build_parser() -> Parser:
    p = Parser(prog="python -m train.eval.nla_report", description=help_description(__doc__))
    p.add_argument("--out", metavar="DIR", help="output folder (report.json, config.json, PNGs; required)")
    p.add_argument("--cache", default=None, help="also evaluate on a `python -m extract` cache with components "
                                                 "patches,tokens,tree,regions")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seeds the random batches")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="device of the cost sweep (accuracy runs on CPU in float64)")
    g = p.add_argument_group("accuracy (sections 1, 2)")
    g.add_argument("--samples", type=positive_int, default=6400,
                   help="(image, text) pairs per source for sections 1, 2 and 4 (batches of --batch x --batch)")
    g.add_argument("--batch", type=positive_int, default=8, help="batch size of the loss-level comparison")
    g.add_argument("--regions", type=positive_int, default=10, help="M for the random source (the paper's 10)")
    g.add_argument("--max-leaves", type=positive_int, default=6,
                   help="leaves per random text (2..this; K = 2P - 1 nodes)")
    g.add_argument("--dim", type=positive_int, default=512, help="embedding width of the random source")
    g.add_argument("--coupling", type=fraction, default=0.6,
                   help="max cosine of a leaf with its own image's region, in [0, 1) (0 = pure random vectors)")
    g.add_argument("--taus", default="0.1,0.01,0.001", help="temperatures tau, comma-separated")
    g.add_argument("--alphas", default="0,0.25,0.5,0.75,1", help="NLA-T2 alphas in [0, 1], comma-separated")
    g = p.add_argument_group("cost vs M (section 3)")
    g.add_argument("--cost-m", default="2..16", help="M values of the cost sweep (e.g. 2..16 or 2,4,8)")
    g.add_argument("--cost-batch", type=positive_int, default=32, help="batch size B of one loss step")
    g.add_argument("--cost-k", type=positive_int, default=16, help="tree nodes per text K")
    g.add_argument("--cost-dim", type=positive_int, default=512, help="embedding width d")
    g.add_argument("--cost-repeats", type=positive_int, default=3, help="timed repeats per point (the best counts)")
    g.add_argument("--exact-budget-s", type=positive_float, default=5.0,
                   help="skip exact steps predicted slower than this (seconds)")
    g.add_argument("--exact-budget-gib", type=positive_float, default=2.0,
                   help="skip exact steps needing more memory than this (GiB)")
    g = p.add_argument_group("alpha calibration (section 4)")
    g.add_argument("--calib-m", default="4,6,8,10", help="M values of the alpha calibration (random source)")
    g.add_argument("--calib-tau", type=positive_float, default=0.01, help="the working tau alpha-hat is fitted at")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_config(p, argv)
    if not args.out:  # not required=True in the parser: a mistyped flag is then named as such
        p.error("--out is required, e.g. --out runs/nla_report")
    try:
        args.tau_list, args.alpha_list = _floats(args.taus), _floats(args.alphas)
        args.cost_m_list, args.calib_m_list = _ints(args.cost_m), _ints(args.calib_m)
    except ValueError as e:
        p.error(f"bad list: {e}")
    if not args.tau_list or any(t <= 0 for t in args.tau_list):
        p.error("--taus: positive values, comma-separated")
    if not args.alpha_list or any(not 0 <= a <= 1 for a in args.alpha_list):
        p.error("--alphas: values in [0, 1], comma-separated")
    if args.regions < 1 or args.regions > MAX_EXACT_REGIONS or any(m > MAX_EXACT_REGIONS or m < 1
                                                                   for m in args.calib_m_list):
        p.error(f"--regions / --calib-m: 1..{MAX_EXACT_REGIONS} (exact similarities enumerate 2^M subsets)")
    if args.max_leaves < 2 or args.batch < 2 or args.samples < args.batch ** 2:
        p.error("--max-leaves and --batch must be >= 2 and --samples >= --batch^2")
    return args


def _clean(x):
    """JSON-safe copy (drops private '_' keys, numpy scalars to floats)."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(args, out / "config.json")
    cfg = PowerCLIPLossConfig()
    taus, alphas = args.tau_list, args.alpha_list
    n_batches = max(1, args.samples // args.batch ** 2)
    report: dict = {"paper_setting": {"tau": 0.01, "alpha": 0.75, "M": 10}, "sources": {}, "files": [],
                    "section_seconds": {}}
    files: list[Path] = []
    tick = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal tick
        now = time.perf_counter()
        report["section_seconds"][name] = now - tick
        tick = now

    cache_batches_ = None
    if args.cache:  # read (and validate) the cache first: a bad --cache fails before minutes of work
        cache_batches_, info = cache_batches(args.cache, n_batches, args.batch, args.seed)
    say(f"[1-2] accuracy on random unit vectors: {n_batches} batches of {args.batch}, M={args.regions}, "
          f"d={args.dim}, up to {args.max_leaves} leaves")
    batches = list(random_batches(n_batches, args.batch, args.regions, args.max_leaves, args.dim, args.coupling,
                                  args.seed))
    acc = accuracy(batches, taus, alphas, cfg)
    report["sources"]["random"] = {"M": args.regions, "K_max": 2 * args.max_leaves - 1, **acc["summary"]}
    files += plot_accuracy(acc, taus, alphas, out, "")
    if cache_batches_ is not None:
        say(f"[1-2] accuracy on cache {info['path']}: {info['batches']} batches of {info['batch']}, "
              f"M={info['M']} (mean valid {info['mean_valid_regions']:.1f}), K={info['K']} "
              f"(mean valid {info['mean_valid_nodes']:.1f})")
        acc_c = accuracy(cache_batches_, taus, alphas, cfg)
        report["sources"]["cache"] = {**info, **acc_c["summary"]}
        files += plot_accuracy(acc_c, taus, alphas, out, "cache_")
    lap("accuracy")

    say(f"[3] cost of one loss step vs M = {args.cost_m_list[0]}..{args.cost_m_list[-1]} "
          f"(B={args.cost_batch}, K={args.cost_k}, d={args.cost_dim}, {args.device})")
    load = machine_load()
    cost = cost_vs_m(args.cost_m_list, args.cost_batch, args.cost_k, args.cost_dim, replace(cfg), args.device,
                     args.cost_repeats, args.exact_budget_s, args.exact_budget_gib * 2 ** 30)
    cost["threads"], cost["load_before"], cost["load_after"] = torch.get_num_threads(), load, machine_load()
    for ld in (load, cost["load_after"]):
        if torch.device(args.device).type == "cpu" and (msg := load_warning(ld, torch.get_num_threads())):
            print(msg)
            break
    report["cost"] = cost
    files.append(plot_cost(cost, out))
    lap("cost")

    say(f"[4] alpha calibration at tau={args.calib_tau}, M in {args.calib_m_list}")
    cal = []
    for i, m in enumerate(args.calib_m_list):
        bs = batches if m == args.regions else list(random_batches(
            n_batches, args.batch, m, args.max_leaves, args.dim, args.coupling, args.seed + 1000 + i))
        cal.append({"label": f"random M={m}", "M": m, **calibrate(bs, args.calib_tau)})
    if cache_batches_ is not None:
        cal.append({"label": "cache", "M": report["sources"]["cache"]["M"],
                    **calibrate(cache_batches_, args.calib_tau)})
    report["calibration"] = cal
    files.append(plot_calibration(cal, out))
    lap("calibration")

    report["files"] = [f.name for f in files]
    report["seconds"] = time.perf_counter() - t_start
    report = _clean(report)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report, taus, alphas)
    say(f"wrote {out / 'report.json'} and {len(files)} plots in {report['seconds']:.1f} s")
    return report


def _fmt(x, spec=".4f") -> str:
    return "-" if x is None else format(x, spec)


def print_summary(report: dict, taus, alphas) -> None:
    for name, src in report["sources"].items():
        print(f"\n{name}: {src['n_pairs']} pairs, {src['n_batches']} batches")
        print("  T2R  tau      r(pairs)  MAE       max|err|  bound     r(loss)")
        for t in taus:
            s, lo = src["t2r"][str(t)], src["loss_t2r"][str(t)]
            print(f"       {t:<8g} {_fmt(s['pearson'])}    {_fmt(s['mae'], '.2e')}  {_fmt(s['max_abs_err'], '.2e')}  "
                  f"{_fmt(s['bound_max'], '.2e')}  {_fmt(lo['pearson'])}")
        print("  R2T  tau      " + "  ".join(f"a={a:<5g}r/r(loss)" for a in alphas))
        for t in taus:
            cells = [f"{_fmt(src['r2t'][str(t)][str(a)]['pearson'], '.3f')}/"
                     f"{_fmt(src['loss_r2t'][str(t)][str(a)]['pearson'], '.3f')}  " for a in alphas]
            print(f"       {t:<8g} " + " ".join(cells))
    c = report["cost"]
    print(f"\ncost per loss step (fwd+bwd), B={c['B']} K={c['K']} d={c['d']}, {c['device']}, memory: "
          f"{c['memory_method']}")
    print("  M   NLA ms   NLA MiB   exact ms   exact MiB")
    mib = lambda x: None if x is None else x / MIB  # noqa: E731
    for r in c["rows"]:
        ex = (f"{r['exact_seconds'] * 1e3:9.1f}  {_fmt(mib(r['exact_peak_bytes']), '9.1f')}"
              if r["exact_seconds"] is not None else f"  {r['exact']}")
        print(f"  {r['M']:<3d} {r['nla_seconds'] * 1e3:7.1f}  {_fmt(mib(r['nla_peak_bytes']), '8.1f')}  {ex}")
    print("\nalpha calibration (NLA-T2 vs exact R2T, mean abs error)")
    for k in report["calibration"]:
        print(f"  {k['label']:<14} alpha-hat {k['alpha_hat']:.3f}: MAE {k['mae_alpha_hat']:.2e} (r "
              f"{_fmt(k['pearson_alpha_hat'])}) vs alpha 0.75: MAE {k['mae_paper_alpha']:.2e} (r "
              f"{_fmt(k['pearson_paper_alpha'])}); per-pair alpha* median {_fmt(k['alpha_star_median'], '.3f')}")


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
