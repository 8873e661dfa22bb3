"""Linear probe on frozen image features: multinomial logistic regression, L2 strength chosen on validation.

The protocol is CLIP's (Radford et al. 2021, sec. 3.2 and appendix A.3), which the CLIP-PGS and PowerCLIP
linear-probe tables follow: logistic regression fitted with L-BFGS on frozen features, its L2 penalty swept
on a validation split held out of the training set, then a refit on the whole training set at the chosen
strength and one evaluation on the test set.

``method="lbfgs"`` minimises, full batch, in float64 (the problem is convex and small; float64 lets L-BFGS
reach a tight optimum)::

    J(W, b) = (1/N) * [ sum_i CE(x_i W + b, y_i) + (l2 / 2) * ||W||_F^2 ]        W [D, C], b [C]

i.e. scikit-learn's ``LogisticRegression`` objective with ``l2 = 1 / C`` divided by N (same minimiser, a
well-scaled gradient), so CLIP's sweep of C over 1e-6..1e6 is a sweep of ``l2`` over 1e6..1e-6. The bias is
not penalised. Because the penalty is not divided by N, the same ``l2`` regularises a larger training set
relatively less, as for scikit-learn: the refit on train = fit + val keeps the prior strength fixed.

``method="sgd"`` (for datasets too large for full-batch L-BFGS) trains an ``nn.Linear`` with AdamW on
mini-batches of cross-entropy, a cosine learning-rate schedule and zero initialisation; there ``l2`` is
AdamW's decoupled weight decay on the weight (not the bias), so its values are not comparable with the
lbfgs ones and it has its own default grid.

Features are L2-normalised per row by default (``normalize=True``): CLIP features are used normalised.
They are not standardised (CLIP does not). Labels may be any sortable hashables (ints, non-contiguous,
strings); they are mapped to indices in sorted order and the class list is returned.

``python -m train.eval.linear_probe --train TRAIN.npz --test TEST.npz [--method lbfgs] [--out result.json]``
reads arrays ``x`` [N, D] and ``y`` [N] from each file.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from adapters.eval.ranking import positive_ranks
from extract.common.cli import Parser, help_description, run_job, say
from extract.common.config import (fraction, nonnegative_float, nonnegative_int, parse_with_config, positive_float,
                            positive_int)

# CLIP sweeps C = 1/l2 over 1e-6..1e6; 9 log-spaced values (1.5 decades apart) plus a refinement around
# the best one cost far less than CLIP's 96 points and land within ~0.4 decade of the same optimum.
DEFAULT_LBFGS_GRID = tuple(float(v) for v in np.logspace(-6, 6, 9))
# AdamW shrinks the weight by lr * wd per step: with lr <= 1e-2 the largest value (10) shrinks it by at
# most 10% a step, never past zero (lr * wd > 1 would flip its sign and diverge).
DEFAULT_SGD_GRID = tuple(float(v) for v in np.logspace(-7, 1, 9))
METHODS = ("lbfgs", "sgd")


# --------------------------------------------------------------------------------------------- inputs
def _labels_list(y) -> list:
    """Labels as a list of plain Python scalars (tensor / numpy / sequence accepted)."""
    if isinstance(y, torch.Tensor):
        return y.detach().cpu().reshape(-1).tolist()
    if isinstance(y, np.ndarray):
        if y.ndim != 1:
            raise ValueError(f"labels must be 1-D, got shape {tuple(y.shape)}")
        return y.tolist()
    return [v.item() if hasattr(v, "item") else v for v in y]


def _sorted_classes(labels: list) -> list:
    uniq = set(labels)
    try:
        return sorted(uniq)
    except TypeError:  # mixed types (e.g. 3 and "cat"): a deterministic order all the same
        return sorted(uniq, key=lambda v: (type(v).__name__, repr(v)))


def _features(x, name: str, dtype: torch.dtype) -> torch.Tensor:
    """[N, D] tensor of ``dtype`` on the CPU; rejects other shapes and non-finite values."""
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    if t.ndim != 2:
        raise ValueError(f"{name} must be [N, D], got shape {tuple(t.shape)}")
    t = t.to(dtype)
    bad_rows = int((~torch.isfinite(t)).any(1).sum())
    if bad_rows:
        raise ValueError(f"{name} holds NaN or infinite values in {bad_rows} of {t.shape[0]} rows")
    return t


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=1)  # a zero row stays zero (eps in the denominator)


def stratified_split(y: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of indices 0..N-1 into (fit, val), both sorted.

    Each class gives round(n_c * val_fraction) of its samples to validation but always keeps at least one in
    the fit part, so every class is learnable; a class with one sample goes entirely to fit. ``y`` [N] ints.
    """
    rng = np.random.default_rng(seed)
    val = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_val = min(int(round(len(idx) * val_fraction)), len(idx) - 1)
        val.append(idx[:n_val])
    val_idx = np.sort(np.concatenate(val)) if val else np.zeros(0, dtype=np.int64)
    mask = np.ones(len(y), dtype=bool)
    mask[val_idx] = False
    return np.flatnonzero(mask), val_idx


# --------------------------------------------------------------------------------------------- metrics
def _ranks(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # adapters.eval.ranking's rules, as every metric: ties count against the model (rank = 1 + #{other classes
    # scoring >= the true one}, so a constant predictor gets no credit) and a non-finite score ranks last
    return positive_ranks(scores, labels, dim=1)[0]


def accuracies(scores: torch.Tensor, labels: torch.Tensor, classes: Sequence) -> dict:
    """Top-1 (and top-5 when C >= 5), mean per-class top-1 and per-class top-1, all in percent.

    ``scores`` [N, C], ``labels`` [N] class indices. The mean per-class accuracy averages over the classes
    present in ``labels`` (CLIP's metric for e.g. Aircraft, Pets, Caltech-101, Flowers).
    """
    rank = _ranks(scores, labels)
    out = {"top1": float((rank <= 1).double().mean() * 100)}
    if scores.shape[1] >= 5:
        out["top5"] = float((rank <= 5).double().mean() * 100)
    per_class = {}
    for c in labels.unique().tolist():
        per_class[str(classes[c])] = float((rank[labels == c] <= 1).double().mean() * 100)
    out["mean_per_class_top1"] = sum(per_class.values()) / len(per_class)
    out["per_class_top1"] = per_class
    return out


# --------------------------------------------------------------------------------------------- fitting
def probe_objective(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    l2: float) -> torch.Tensor:
    """The lbfgs objective J(W, b) = (1/N) [sum_i CE(x_i W + b, y_i) + (l2/2) ||W||^2].

    ``x`` [N, D] (already normalised if the probe normalises), ``y`` [N] indices, ``weight`` [D, C],
    ``bias`` [C]; returns a scalar.
    """
    n = x.shape[0]
    return F.cross_entropy(x @ weight + bias, y, reduction="sum") / n + 0.5 * l2 * weight.pow(2).sum() / n


def _fit_lbfgs(x, y, n_classes, l2, max_iter, init=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Minimise :func:`probe_objective`; ``init`` (W, b) warm-starts (the sweep goes strong -> weak)."""
    n, d = x.shape
    # Precondition: optimise V = W / s with s = 1/sqrt(1 + l2/N). A strong penalty gives the W block a
    # curvature ~l2/N against ~1/C for the unpenalised bias; at l2/N ~ 1e3 L-BFGS then crawls for hundreds
    # of iterations. In V both blocks have curvature <= ~1. Same minimiser, same objective values.
    s = 1.0 / math.sqrt(1.0 + l2 / n)
    if init is None:
        v = torch.zeros(d, n_classes, dtype=x.dtype, device=x.device)
        bias = torch.zeros(n_classes, dtype=x.dtype, device=x.device)
    else:
        v, bias = init[0].detach() / s, init[1].detach().clone()
    v.requires_grad_(True)
    bias.requires_grad_(True)
    opt = torch.optim.LBFGS([v, bias], lr=1, max_iter=max_iter, max_eval=max_iter * 5 // 4,
                            tolerance_grad=1e-7, tolerance_change=1e-12, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = probe_objective(x, y, v * s, bias, l2)
        loss.backward()
        return loss

    opt.step(closure)
    weight = (v.detach() * s).requires_grad_(True)
    bias = bias.detach().requires_grad_(True)
    loss = probe_objective(x, y, weight, bias, l2)  # the final objective and its gradient in W, for the report
    loss.backward()
    grad_norm = float(torch.cat([weight.grad.reshape(-1), bias.grad]).norm())
    info = {"iterations": int(opt.state[v].get("n_iter", 0)), "objective": float(loss.detach()),
            "grad_norm": grad_norm}
    return weight.detach(), bias.detach(), info


def _fit_sgd(x, y, n_classes, l2, *, epochs, batch_size, lr, seed) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """AdamW on mini-batches; ``l2`` is the decoupled weight decay of the weight. Returns W [D, C], b [C]."""
    n, d = x.shape
    linear = torch.nn.Linear(d, n_classes, device=x.device, dtype=x.dtype)
    with torch.no_grad():  # zero init: the problem is convex, and it leaves no global RNG state to depend on
        linear.weight.zero_()
        linear.bias.zero_()
    opt = torch.optim.AdamW([{"params": [linear.weight], "weight_decay": l2},
                             {"params": [linear.bias], "weight_decay": 0.0}], lr=lr)
    steps_per_epoch = max(1, math.ceil(n / batch_size))
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    gen = torch.Generator().manual_seed(seed)  # own generator: shuffling is reproducible, global RNG untouched
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).to(x.device)
        for start in range(0, n, batch_size):
            rows = order[start:start + batch_size]
            loss = F.cross_entropy(linear(x[rows]), y[rows])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        final = float(F.cross_entropy(linear(x), y))
    return linear.weight.detach().t().contiguous(), linear.bias.detach().clone(), {
        "steps": total, "train_loss": final}


def _evaluate(x, y, weight, bias) -> tuple[float, float]:
    """(top-1 percent, mean cross-entropy) of the linear model on (x, y)."""
    with torch.no_grad():
        logits = x @ weight + bias
        acc = float((_ranks(logits, y) <= 1).double().mean() * 100)
        return acc, float(F.cross_entropy(logits, y))


def _geometric_mid(a: float, b: float) -> float:
    return math.sqrt(a * b) if a > 0 and b > 0 else (a + b) / 2  # a 0 in a user grid: no log scale there


# --------------------------------------------------------------------------------------------- the probe
def linear_probe(train_x, train_y, test_x, test_y, *, val_fraction: float = 0.2,
                 l2_grid: Sequence[float] | None = None, method: str = "lbfgs", max_iter: int = 1000,
                 seed: int = 0, device: str | torch.device = "cpu", normalize: bool = True,
                 refine: bool | None = None, epochs: int = 30, batch_size: int = 256,
                 lr: float = 1e-2) -> dict[str, Any]:
    """Fit a linear probe on (train_x, train_y), choose its L2 strength on a held-out split, report test.

    Args:
        train_x: [N, D] features (torch tensor or numpy array, any float dtype).
        train_y: [N] labels: ints (need not be contiguous), strings, or any sortable hashable.
        test_x: [M, D] features; test_y: [M] labels, every one of which must occur in ``train_y``.
        val_fraction: share of each class held out of train for choosing ``l2`` (stratified, seeded).
        l2_grid: candidate strengths. Default: ``DEFAULT_LBFGS_GRID`` (1e-6..1e6, 9 values, ``l2 = 1/C``) or
            ``DEFAULT_SGD_GRID`` (AdamW weight decay 1e-7..10). A single value skips validation.
        method: ``"lbfgs"`` (full batch, float64) or ``"sgd"`` (AdamW mini-batches, float32).
        max_iter: L-BFGS iteration cap per fit (lbfgs only).
        seed: the split and (sgd) the shuffling; equal inputs and seed give equal results.
        device: where the fits run ("cpu", "cuda", ...).
        normalize: L2-normalise each feature row first (CLIP features are used normalised).
        refine: after the grid, twice insert geometric midpoints between the best value and its evaluated
            neighbours (coarse-then-fine, as CLIP's search). Default: on for lbfgs, off for sgd (each sgd
            fit is a full training run).
        epochs, batch_size, lr: the sgd training budget (sgd only).

    Returns a dict: ``method``, ``classes`` (index -> label, sorted), ``n_classes``, ``dim``, ``n_train``,
    ``n_fit``, ``n_val``, ``n_test``; ``l2`` (chosen), ``val_top1`` (at the chosen l2, percent),
    ``val_curve`` (list of {l2, val_top1, val_loss}, ascending l2); test ``top1``, ``top5`` (C >= 5),
    ``mean_per_class_top1``, ``per_class_top1`` ({str(label): percent}), ``train_top1``; ``fit`` (optimiser
    diagnostics of the final fit: lbfgs ``iterations``, ``objective``, ``grad_norm``); ``weight`` [D, C] and
    ``bias`` [C] (CPU tensors; scores = normalize(x) @ weight + bias when ``normalize``); ``seconds``.

    Raises:
        ValueError: fewer than 2 classes in train; test labels absent from train (named); mismatched
            shapes; non-finite features; an empty validation split when there is more than one l2 to choose.
    """
    t0 = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    dtype = torch.float64 if method == "lbfgs" else torch.float32
    xtr, xte = _features(train_x, "train_x", dtype), _features(test_x, "test_x", dtype)
    ytr_raw, yte_raw = _labels_list(train_y), _labels_list(test_y)
    if len(ytr_raw) != xtr.shape[0]:
        raise ValueError(f"train_x has {xtr.shape[0]} rows but train_y {len(ytr_raw)} labels")
    if len(yte_raw) != xte.shape[0]:
        raise ValueError(f"test_x has {xte.shape[0]} rows but test_y {len(yte_raw)} labels")
    if xtr.shape[1] != xte.shape[1]:
        raise ValueError(f"train features have D={xtr.shape[1]}, test features D={xte.shape[1]}")
    if len(yte_raw) == 0:
        raise ValueError("the test set is empty")
    classes = _sorted_classes(ytr_raw)
    if len(classes) < 2:
        raise ValueError(f"a linear probe needs at least 2 classes in train, got {len(classes)}: {classes!r}")
    index = {c: i for i, c in enumerate(classes)}
    missing = _sorted_classes([v for v in set(yte_raw) if v not in index])
    if missing:
        raise ValueError(f"{len(missing)} test class(es) have no training sample, so the probe cannot predict "
                         f"them: {missing[:20]!r}{' ...' if len(missing) > 20 else ''}")
    ytr = np.asarray([index[v] for v in ytr_raw], dtype=np.int64)
    yte = np.asarray([index[v] for v in yte_raw], dtype=np.int64)
    n_classes = len(classes)

    grid = sorted({float(v) for v in (l2_grid if l2_grid is not None else
                                      DEFAULT_LBFGS_GRID if method == "lbfgs" else DEFAULT_SGD_GRID)})
    if not grid or any(v < 0 or not math.isfinite(v) for v in grid):
        raise ValueError(f"l2_grid must hold finite values >= 0, got {l2_grid!r}")
    refine = (method == "lbfgs") if refine is None else refine

    if normalize:
        xtr, xte = _normalize(xtr), _normalize(xte)
    xtr, xte = xtr.to(device), xte.to(device)
    ytr_t, yte_t = torch.from_numpy(ytr).to(device), torch.from_numpy(yte).to(device)

    def fit(x, y, l2, init=None):
        if method == "lbfgs":
            return _fit_lbfgs(x, y, n_classes, l2, max_iter, init)
        return _fit_sgd(x, y, n_classes, l2, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed)

    # ---- choose l2 on the held-out split
    curve: dict[float, dict] = {}
    solutions: dict[float, tuple] = {}
    n_fit, n_val = len(ytr), 0
    if len(grid) == 1:
        chosen = grid[0]
    else:
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1) to choose among {len(grid)} l2 values")
        fit_idx, val_idx = stratified_split(ytr, val_fraction, seed)
        if len(val_idx) == 0:
            raise ValueError(f"the validation split is empty ({len(ytr)} train samples, val_fraction="
                             f"{val_fraction}): too few samples per class; pass a single l2 in l2_grid")
        n_fit, n_val = len(fit_idx), len(val_idx)
        fi, vi = torch.from_numpy(fit_idx).to(device), torch.from_numpy(val_idx).to(device)
        xf, yf, xv, yv = xtr[fi], ytr_t[fi], xtr[vi], ytr_t[vi]

        def evaluate(l2):
            # warm start from the nearest stronger penalty already solved: its solution is closest and
            # smaller in norm, so L-BFGS needs few iterations (the order of evaluation is fixed: deterministic)
            stronger = [v for v in solutions if v > l2]
            init = solutions[min(stronger)] if stronger else None
            w, b, _ = fit(xf, yf, l2, init)
            solutions[l2] = (w, b)
            acc, loss = _evaluate(xv, yv, w, b)
            curve[l2] = {"l2": l2, "val_top1": acc, "val_loss": loss}

        def best() -> float:
            # highest val accuracy; ties (common: a few hundred val samples) -> lower val cross-entropy,
            # then the stronger penalty
            return max(curve, key=lambda v: (curve[v]["val_top1"], -curve[v]["val_loss"], v))

        for l2 in reversed(grid):
            evaluate(l2)
        if refine:
            for _ in range(2):
                evaluated = sorted(curve)
                k = evaluated.index(best())
                for j in (k - 1, k + 1):
                    if 0 <= j < len(evaluated):
                        mid = _geometric_mid(evaluated[k], evaluated[j])
                        if mid not in curve:
                            evaluate(mid)
        chosen = best()

    # ---- refit on all of train at the chosen strength, evaluate once on test
    init = solutions.get(chosen) if method == "lbfgs" else None
    weight, bias, info = fit(xtr, ytr_t, chosen, init)
    with torch.no_grad():
        test_scores = xte @ weight + bias
        train_acc, _ = _evaluate(xtr, ytr_t, weight, bias)
    result = {
        "method": method, "classes": classes, "n_classes": n_classes, "dim": int(xtr.shape[1]),
        "n_train": len(ytr), "n_fit": n_fit, "n_val": n_val, "n_test": len(yte), "normalize": normalize,
        "l2": chosen, "val_top1": curve[chosen]["val_top1"] if chosen in curve else None,
        "val_curve": [curve[v] for v in sorted(curve)],
    }
    result.update(accuracies(test_scores.cpu(), yte_t.cpu(), classes))
    result.update({"train_top1": train_acc, "fit": info, "weight": weight.cpu(), "bias": bias.cpu(),
                   "seconds": time.perf_counter() - t0})
    return result


def jsonable(result: dict) -> dict:
    """The result without its tensors (``weight``, ``bias``): what the CLI writes as JSON."""
    return {k: v for k, v in result.items() if not isinstance(v, torch.Tensor)}


def format_result(r: dict) -> str:
    lines = [f"linear probe ({r['method']}): {r['n_classes']} classes, D={r['dim']}, train {r['n_train']} "
             f"(fit {r['n_fit']} + val {r['n_val']}), test {r['n_test']}"]
    if r["val_curve"]:
        lines.append("  l2         val top-1  val loss")
        for p in r["val_curve"]:
            mark = "  <- chosen" if p["l2"] == r["l2"] else ""
            lines.append(f"  {p['l2']:<10.3g} {p['val_top1']:8.2f}  {p['val_loss']:8.4f}{mark}")
    lines.append(f"  chosen l2 {r['l2']:.4g}; train top-1 {r['train_top1']:.2f}")
    test = f"  test top-1 {r['top1']:.2f}"
    if "top5" in r:
        test += f", top-5 {r['top5']:.2f}"
    lines.append(test + f", mean per-class top-1 {r['mean_per_class_top1']:.2f}  ({r['seconds']:.1f} s)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- CLI
def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Arrays ``x`` [N, D] and ``y`` [N] of an .npz file (no pickled objects: strings as a unicode array).

    Raises ValueError, one line naming the file, for a file that is missing, cut short, not an .npz, lacks ``x`` or
    ``y``, or holds pickled Python objects: numpy reads a file that is neither .npz nor .npy as a pickle and then
    advises ``allow_pickle=True``, which would run code from the file; plugvlm never unpickles it."""
    import zipfile

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    never = "plugvlm will not unpickle it (unpickling can run code from the file)"
    try:
        data = np.load(path, allow_pickle=False)
    except ValueError as e:
        if "pickled" in str(e):  # neither zip nor .npy magic: numpy would fall back to pickle
            raise ValueError(f"{path} is not an .npz file: numpy would read it as a pickle, and {never}; save the "
                             "arrays with numpy.savez(path, x=features, y=labels)") from None
        if "allow_pickle" in str(e):  # an .npy of dtype object
            raise ValueError(f"{path} is an .npy array of pickled Python objects (dtype object), not an .npz, and "
                             f"{never}; save the arrays with numpy.savez(path, x=features, y=labels)") from None
        raise ValueError(f"{path} is not a readable .npz file ({e})") from None
    except (EOFError, OSError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path} is not a readable .npz file (cut short or not an .npz: {type(e).__name__}: {e}); "
                         "save it again with numpy.savez(path, x=features, y=labels)") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} is a single .npy array, not an .npz holding arrays x and y: save them with "
                         "numpy.savez(path, x=features, y=labels)")
    with data:
        absent = [k for k in ("x", "y") if k not in data.files]
        if absent:
            raise ValueError(f"{path}: missing array(s) {absent}; found {data.files}")
        out = []
        for key in ("x", "y"):
            try:
                out.append(data[key])
            except ValueError as e:  # "Object arrays cannot be loaded when allow_pickle=False"
                if "allow_pickle" not in str(e):
                    raise ValueError(f"{path}: array {key!r} is not readable ({e})") from None
                raise ValueError(f"{path}: array {key!r} holds pickled Python objects (dtype object) and {never}; "
                                 "save labels as strings (np.array(labels, dtype=str)), features as floats") from None
            except (EOFError, OSError, zipfile.BadZipFile) as e:
                raise ValueError(f"{path}: array {key!r} is not readable (cut short or damaged: {type(e).__name__}: "
                                 f"{e})") from None
        return out[0], out[1]


def build_parser() -> Parser:
    p = Parser(prog="python -m train.eval.linear_probe", description=help_description(__doc__))
    p.add_argument("--train", metavar="NPZ", help=".npz with arrays x [N, D] and y [N] (required)")
    p.add_argument("--test", metavar="NPZ", help=".npz with arrays x [M, D] and y [M] (required)")
    p.add_argument("--method", default="lbfgs", choices=METHODS,
                   help="lbfgs: full-batch L-BFGS (CLIP's protocol); sgd: AdamW mini-batches for large sets")
    p.add_argument("--out", default=None, metavar="JSON", help="write the result as JSON here")
    p.add_argument("--val-fraction", type=fraction, default=0.2,
                   help="share of --train held out to choose the l2 strength")
    p.add_argument("--l2", type=nonnegative_float, nargs="+", default=None,
                   help="l2 grid (default: the method's); one value skips validation")
    p.add_argument("--max-iter", type=positive_int, default=1000, help="L-BFGS iterations per fit")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seeds the validation split (and sgd)")
    p.add_argument("--device", default="cpu", help="torch device of the fits")
    p.add_argument("--no-normalize", dest="normalize", action="store_false",
                   help="use the features as they are (default: L2-normalise rows)")
    p.add_argument("--no-refine", dest="refine", action="store_const", const=False, default=None,
                   help="skip the fine search around the best grid value")
    g = p.add_argument_group("sgd only")
    g.add_argument("--epochs", type=positive_int, default=30, help="passes over the training set")
    g.add_argument("--batch-size", type=positive_int, default=256, help="mini-batch size")
    g.add_argument("--lr", type=positive_float, default=1e-2, help="AdamW learning rate")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_config(p, argv)
    # not required=True in the parser: a mistyped flag is then named as such, and --config may set them
    if not args.train or not args.test:
        p.error("--train and --test are required, e.g. --train train.npz --test test.npz")
    return args


def probe_files(args: argparse.Namespace) -> dict:
    """``python -m train.eval.linear_probe``'s job: :func:`linear_probe` on the arrays of ``args.train`` and
    ``args.test``; prints the result and writes ``args.out``. Raises ValueError for a missing or malformed file."""
    tx, ty = load_npz(args.train)
    vx, vy = load_npz(args.test)
    result = linear_probe(tx, ty, vx, vy, val_fraction=args.val_fraction, l2_grid=args.l2,
                          method=args.method, max_iter=args.max_iter, seed=args.seed, device=args.device,
                          normalize=args.normalize, refine=args.refine, epochs=args.epochs,
                          batch_size=args.batch_size, lr=args.lr)
    print(format_result(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(jsonable(result) | {"train_file": str(args.train), "test_file": str(args.test)},
                                  indent=2) + "\n")
        say(f"wrote {out}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(probe_files, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
