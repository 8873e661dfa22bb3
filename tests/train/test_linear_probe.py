"""Linear probe: optimality of the L-BFGS solution checked by hand, accuracy on separable data, the L2 choice
on validation, label mapping, errors, the CLI round trip, and (when scikit-learn is there) a reference fit."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from train.eval.linear_probe import linear_probe, main, stratified_split


def blobs(n: int, d: int = 16, c: int = 4, seed: int = 0, spread: float = 0.5):
    """Gaussian blobs around c random centres (well separated for spread 0.5): x [n, d] float32, y [n]."""
    centres = np.random.default_rng(1234).normal(size=(c, d)) * 2.0
    r = np.random.default_rng(seed)
    y = np.arange(n) % c
    return (centres[y] + spread * r.normal(size=(n, d))).astype(np.float32), y


def normalized(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# ------------------------------------------------------------------------------------- (1) optimality
def test_lbfgs_solution_is_the_optimum_and_accuracy_matches_a_hand_computed_argmax():
    x, y = blobs(90, d=6, c=3, seed=1, spread=1.5)  # overlapping classes: a finite, non-trivial optimum
    xt, yt = blobs(60, d=6, c=3, seed=2, spread=1.5)
    l2 = 2.0
    r = linear_probe(x, y, xt, yt, l2_grid=[l2])  # one value: no validation, fit on all of train
    assert r["l2"] == l2 and r["n_fit"] == 90 and r["n_val"] == 0 and r["val_curve"] == []
    w, b = r["weight"].double().numpy(), r["bias"].double().numpy()
    assert w.shape == (6, 3) and b.shape == (3,)

    # gradient of J = (1/N)[sum_i CE_i + l2/2 ||W||^2], written out by hand in numpy (softmax - one-hot)
    xn = normalized(x)
    logits = xn @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    resid = p - np.eye(3)[y]
    grad_w = (xn.T @ resid + l2 * w) / len(y)
    grad_b = resid.sum(0) / len(y)
    grad_norm = np.sqrt((grad_w ** 2).sum() + (grad_b ** 2).sum())
    assert grad_norm < 1e-4, grad_norm
    assert r["fit"]["grad_norm"] < 1e-4

    # convex objective: no random nearby point does better
    def objective(w_, b_):
        z = xn @ w_ + b_
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        return ((lse - z[np.arange(len(y)), y]).sum() + 0.5 * l2 * (w_ ** 2).sum()) / len(y)

    best = objective(w, b)
    assert best == pytest.approx(r["fit"]["objective"], abs=1e-9)
    rng = np.random.default_rng(0)
    for _ in range(20):
        assert objective(w + 1e-2 * rng.normal(size=w.shape), b + 1e-2 * rng.normal(size=b.shape)) > best

    # test accuracy = argmax(normalize(x) W + b) recomputed here
    pred = (normalized(xt) @ w + b).argmax(1)
    assert r["top1"] == pytest.approx(100 * np.mean(pred == yt))
    per_class = [100 * np.mean(pred[yt == c] == c) for c in range(3)]
    assert r["mean_per_class_top1"] == pytest.approx(np.mean(per_class))
    assert "top5" not in r  # 3 classes
    assert 40 < r["top1"] < 100  # the problem is neither trivial nor hopeless


def test_matches_scikit_learn_logistic_regression():
    sklearn_lm = pytest.importorskip("sklearn.linear_model")
    x, y = blobs(120, d=5, c=3, seed=3, spread=1.5)
    l2 = 0.5
    r = linear_probe(x, y, x[:30], y[:30], l2_grid=[l2])
    # scikit-learn: 0.5 ||W||^2 + C sum_i CE_i, intercept not penalised -> C = 1 / l2
    ref = sklearn_lm.LogisticRegression(C=1 / l2, tol=1e-10, max_iter=10000).fit(normalized(x), y)
    z = normalized(x) @ r["weight"].double().numpy() + r["bias"].double().numpy()
    probs = np.exp(z - z.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    np.testing.assert_allclose(probs, ref.predict_proba(normalized(x)), atol=1e-5)


# ------------------------------------------------------------------------------------- (2) separable blobs
@pytest.mark.parametrize("method", ["lbfgs", "sgd"])
def test_separable_blobs_reach_95_percent(method):
    x, y = blobs(400, d=16, c=6, seed=0)
    xt, yt = blobs(300, d=16, c=6, seed=1)
    kw = {"l2_grid": [1e-4, 1e-2, 1, 100]} if method == "lbfgs" else {"epochs": 15}
    r = linear_probe(x, y, xt, yt, method=method, **kw)
    assert r["top1"] >= 95 and r["top5"] >= r["top1"] and r["mean_per_class_top1"] >= 95
    assert r["n_fit"] + r["n_val"] == 400 and r["n_val"] == 6 * round(400 / 6 * 0.2)  # stratified
    assert len(r["val_curve"]) >= 4 and r["val_top1"] >= 95


def test_same_seed_same_result_and_the_split_is_stratified():
    x, y = blobs(200, d=8, c=4, seed=5, spread=1.5)
    for method, kw in (("lbfgs", {"l2_grid": [0.1, 10]}), ("sgd", {"l2_grid": [1e-4, 1e-1], "epochs": 3})):
        a = linear_probe(x, y, x[:50], y[:50], method=method, seed=7, **kw)
        b = linear_probe(x, y, x[:50], y[:50], method=method, seed=7, **kw)
        assert torch.equal(a["weight"], b["weight"]) and a["val_curve"] == b["val_curve"]
    fit, val = stratified_split(np.repeat([0, 1, 2], [10, 20, 1]), 0.2, seed=0)
    labels = np.repeat([0, 1, 2], [10, 20, 1])
    assert sorted(np.concatenate([fit, val]).tolist()) == list(range(31))
    assert np.bincount(labels[val], minlength=3).tolist() == [2, 4, 0]  # the singleton stays in fit
    assert not np.array_equal(val, stratified_split(labels, 0.2, seed=1)[1])


# ------------------------------------------------------------------------------------- (3) choice of l2
def _noisy(n, seed, d=600):
    # mostly noise: the class-mean difference (norm 2) is spread over 600 unit-variance dims and the fit
    # split (640) barely exceeds the dimension, so a weak penalty fits the noise; the heavily penalised
    # solution tends to the class-mean direction, which is Bayes-optimal for isotropic noise
    mu = np.random.default_rng(12345).normal(size=d)
    mu /= np.linalg.norm(mu)
    y = np.arange(n) % 2
    return np.where(y[:, None] == 1, mu, -mu) + np.random.default_rng(seed).normal(size=(n, d)), y


def _plentiful(n, seed, k=8):
    # plenty of data for 10 dims, but the classes separate only along x0 - x1 (x1 is a large nuisance
    # that also loads on x0): that needs large weights, which a strong penalty forbids
    r = np.random.default_rng(seed)
    y = np.arange(n) % 2
    z = 3.0 * r.normal(size=n)
    x0 = np.where(y == 1, 0.5, -0.5) + z + 0.3 * r.normal(size=n)
    return np.column_stack([x0, z, r.normal(size=(n, k))]), y


def test_validation_picks_a_stronger_penalty_for_noisy_features_than_for_plentiful_data():
    grid = [1e-2, 1, 1e2, 1e4]
    # same N, so the l2 values (penalty vs summed loss) compare directly; raw features: the geometry above
    # is what is being tested
    noisy = linear_probe(*_noisy(800, 0), *_noisy(2000, 1), l2_grid=grid, refine=False, normalize=False)
    clean = linear_probe(*_plentiful(800, 0), *_plentiful(2000, 1), l2_grid=grid, refine=False,
                         normalize=False)
    assert noisy["l2"] >= 1e2 > clean["l2"], (noisy["val_curve"], clean["val_curve"])
    # and the choice pays on test, against the opposite end of the grid
    weak = linear_probe(*_noisy(800, 0), *_noisy(2000, 1), l2_grid=[grid[0]], normalize=False)
    strong = linear_probe(*_plentiful(800, 0), *_plentiful(2000, 1), l2_grid=[grid[-1]], normalize=False)
    assert noisy["top1"] >= weak["top1"] + 2
    assert clean["top1"] >= strong["top1"] + 20 and clean["top1"] >= 90


def test_refinement_adds_points_around_the_best_grid_value():
    x, y = blobs(200, d=8, c=4, seed=5, spread=2.0)
    coarse = linear_probe(x, y, x, y, l2_grid=[1e-2, 1, 1e2], refine=False)
    fine = linear_probe(x, y, x, y, l2_grid=[1e-2, 1, 1e2])
    assert [p["l2"] for p in coarse["val_curve"]] == [1e-2, 1, 1e2]
    added = sorted({p["l2"] for p in fine["val_curve"]} - {1e-2, 1, 1e2})
    assert 2 <= len(added) <= 4 and all(1e-2 < v < 1e2 for v in added)
    assert fine["val_top1"] >= coarse["val_top1"]


# ------------------------------------------------------------------------------------- (4) labels
def test_string_and_non_contiguous_labels_give_the_same_probe():
    x, y = blobs(150, d=8, c=3, seed=0, spread=1.0)
    xt, yt = blobs(60, d=8, c=3, seed=1, spread=1.0)
    ints = np.array([3, 10, 42])
    names = np.array(["cat", "dog", "emu"])
    grid = [0.1, 10]
    base = linear_probe(x, y, xt, yt, l2_grid=grid)
    r_int = linear_probe(torch.from_numpy(x), torch.from_numpy(ints[y]), xt, list(ints[yt]), l2_grid=grid)
    r_str = linear_probe(x, list(names[y]), xt, names[yt], l2_grid=grid)
    assert r_int["classes"] == [3, 10, 42] and r_str["classes"] == ["cat", "dog", "emu"]
    assert all(type(c) is int for c in r_int["classes"])  # plain Python, JSON-ready
    for r in (r_int, r_str):
        assert torch.equal(r["weight"], base["weight"])
        assert r["top1"] == base["top1"] and r["l2"] == base["l2"]
    assert set(r_str["per_class_top1"]) == {"cat", "dog", "emu"}
    # a test set covering only some of the train classes is fine; mean per class is over those present
    keep = yt != 2
    part = linear_probe(x, names[y], xt[keep], names[yt][keep], l2_grid=grid)
    assert set(part["per_class_top1"]) == {"cat", "dog"} and part["n_classes"] == 3


# ------------------------------------------------------------------------------------- (5) errors
def test_errors_are_clear():
    x, y = blobs(40, d=4, c=2, seed=0)
    labels = np.array(["cat", "dog"])[y]
    with pytest.raises(ValueError, match="unicorn"):
        linear_probe(x, labels, x[:3], ["cat", "unicorn", "dog"], l2_grid=[1.0])
    with pytest.raises(ValueError, match="at least 2 classes"):
        linear_probe(x, ["cat"] * 40, x, ["cat"] * 40)
    with pytest.raises(ValueError, match="rows"):
        linear_probe(x, labels[:-1], x, labels)
    with pytest.raises(ValueError, match="D="):
        linear_probe(x, labels, x[:, :3], labels)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        linear_probe(x[:, 0], labels, x, labels)
    with pytest.raises(ValueError, match="method"):
        linear_probe(x, labels, x, labels, method="svm")
    bad = x.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        linear_probe(bad, labels, x, labels)
    with pytest.raises(ValueError, match="validation split is empty"):
        linear_probe(x[:2], labels[:2], x[:2], labels[:2], l2_grid=[0.1, 1])  # one sample per class


# ------------------------------------------------------------------------------------- (6) CLI
def test_cli_round_trip(tmp_path, capsys):
    x, y = blobs(120, d=8, c=3, seed=0)
    xt, yt = blobs(60, d=8, c=3, seed=1)
    names = np.array(["cat", "dog", "emu"])
    np.savez(tmp_path / "train.npz", x=x, y=names[y])
    np.savez(tmp_path / "test.npz", x=xt, y=names[yt])
    out = tmp_path / "res" / "probe.json"
    argv = ["--train", str(tmp_path / "train.npz"), "--test", str(tmp_path / "test.npz"),
            "--out", str(out), "--l2", "0.01", "1", "100", "--seed", "3"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "test top-1" in printed and "chosen" in printed
    saved = json.loads(out.read_text())
    direct = linear_probe(x, names[y], xt, names[yt], l2_grid=[0.01, 1, 100], seed=3)
    assert saved["classes"] == ["cat", "dog", "emu"] and "weight" not in saved
    assert saved["top1"] == direct["top1"] and saved["l2"] == direct["l2"] and saved["top1"] >= 95
    assert [p["l2"] for p in saved["val_curve"]] == [p["l2"] for p in direct["val_curve"]]

    # errors come back as a message and exit status 2, not a traceback
    np.savez(tmp_path / "odd.npz", x=xt[:2], y=np.array(["cat", "yak"]))
    assert main(["--train", str(tmp_path / "train.npz"), "--test", str(tmp_path / "odd.npz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "yak" in err and "Traceback" not in err
    np.savez(tmp_path / "nokeys.npz", feats=x)
    assert main(["--train", str(tmp_path / "nokeys.npz"), "--test", str(tmp_path / "test.npz")]) == 2
    assert "missing array" in capsys.readouterr().err


def _object_npz(path):
    np.savez(path, x=np.zeros((2, 3)), y=np.array([{"label": "cat"}, None], dtype=object))


@pytest.mark.parametrize("name, write, message", [
    ("junk.npz", lambda p: p.write_bytes(b"not an npz file " * 8), "is not an .npz file: numpy would read it as a "
                                                                   "pickle, and plugvlm will not unpickle it"),
    ("objects.npz", _object_npz, "array 'y' holds pickled Python objects (dtype object) and plugvlm will not unpickle"),
    ("cut.npz", lambda p: (np.savez(p, x=np.zeros((4, 3)), y=np.arange(4)), p.write_bytes(p.read_bytes()[:100])),
     "is not a readable .npz file (cut short or not an .npz"),
    ("empty.npz", lambda p: p.write_bytes(b""), "is not a readable .npz file (cut short or not an .npz"),
])
def test_an_unusable_npz_is_one_line_naming_the_file_and_never_unpickled(tmp_path, capsys, name, write, message):
    """numpy reads a file that is neither .npz nor .npy as a pickle and advised allow_pickle=True, naming no file."""
    path = tmp_path / name
    write(path)
    assert main(["--train", str(path), "--test", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}") and message in err and err.count("\n") == 1, err
    assert "allow_pickle" not in err and "Traceback" not in err


def test_cli_argument_errors_are_one_line(capsys):
    for argv, message in ((["--test", "t.npz"], "--train and --test are required"),
                          (["--train", "a.npz", "--test", "b.npz", "--val-fraction", "1.5"], "--val-fraction"),
                          (["--train", "a.npz", "--tset", "b.npz"], "unrecognized arguments: --tset")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "usage:" not in err and message in err and err.count("\n") == 2, err
