"""train/pretrain/compare.py: columns x hard-negative settings x seeds under equal steps and equal wall-clock, each run
pretrain(PretrainOptions(...)), PowerCLIP-S on the toy world's oracle masks, one evaluation per budget with intervals,
the table and the curves plot."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from extract.worlds import toyworld


@pytest.mark.slow
def test_tiny_budget_writes_the_tables_and_the_curves(tmp_path, monkeypatch):
    """Every run is pretrain(PretrainOptions(...)) and the evaluation evaluate(EvaluateOptions(...)): no argv list
    goes from one job to another. PowerCLIP-S reads the masks cache the comparison built."""
    import train.eval.evaluate as ev
    import train.pretrain.engine as pt
    from train.pretrain.compare import main

    calls = []
    real_pretrain, real_evaluate = pt.pretrain, ev.evaluate

    def pretrain(opts):
        assert isinstance(opts, pt.PretrainOptions)
        calls.append((opts.method, opts.max_steps, opts.seed, opts.lr, opts.hard_negatives, opts.method_options,
                      opts.out))
        return real_pretrain(opts)

    def evaluate(opts):
        assert isinstance(opts, ev.EvaluateOptions)
        calls.append(("evaluate", opts.columns))
        return real_evaluate(opts)

    def no_argv(*args, **kwargs):
        raise AssertionError("a job was called through its command line")

    monkeypatch.setattr(pt, "pretrain", pretrain)
    monkeypatch.setattr(ev, "evaluate", evaluate)
    for module in (pt, ev):
        monkeypatch.setattr(module, "main", no_argv)
    world = tmp_path / "toy"
    toyworld.generate(world, 30, seed=1, workers=1)  # seed 1: the test split has single-object scenes (zero-shot)
    out = tmp_path / "cmp"
    argv = ["--out", str(out), "--data", str(world), "--methods", "clip,powerclip-S", "--seeds", "2", "--steps", "6",
            "--batch-size", "8", "--workers", "0", "--bootstrap", "20", "--extra", "--lr 5e-4", "-q"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    runs = [c for c in calls if c[0] != "evaluate"]
    # equal steps (the default budget): 2 columns x 2 seeds of 6 steps (2 epochs of 3)
    assert [(c[0], c[1], c[2]) for c in runs] == [("clip", 6, 0), ("clip", 6, 1), ("powerclip", 6, 0),
                                                  ("powerclip", 6, 1)]
    assert all(c[3] == 5e-4 and c[4] == "none" for c in runs)  # --extra applied
    masks = runs[2][5]
    assert masks["masks"] == "sam2" and masks["regions_cache"] == str(out / "toy-masks")
    assert [c[1] for c in calls if c[0] == "evaluate"] == [["clip", "clip", "powerclip-S", "powerclip-S"]]
    text = (out / "compare.md").read_text()
    assert "## Equal steps" in text and "| powerclip-S | " in text and "Equal wall-clock" not in text
    rows = [line for line in text.splitlines() if line.startswith("| column |")]
    assert len(rows) == 1 and "toyworld swap-att" in rows[0] and "toyworld held-out all" not in rows[0]  # no holdout
    data = json.loads((out / "compare.json").read_text())
    steps = data["budgets"]["steps"]
    assert [r["seed"] for r in steps["runs"]["powerclip-S"]] == [0, 1]
    assert steps["table"]["metrics"]["powerclip-S"]["retrieval T2I R@1"]["sd"] is not None
    assert "delta_ci" in steps["table"]["metrics"]["powerclip-S"]["toyworld swap-att"]
    assert all([p["step"] for p in r["curve"]] == [3, 6] for rs in steps["runs"].values() for r in rs)  # per epoch
    assert (out / "steps" / "curves.png").stat().st_size > 1000 and (out / "steps" / "eval" / "results.md").is_file()
    calls.clear()
    torch.set_num_threads(1)
    try:  # the same command again: the finished runs are kept, not trained again
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    assert [c[0] for c in calls] == ["evaluate"]
    assert (out / "compare.md").read_text() == text
    # --jobs 2: CLIP's two seeds again, at once, in processes of their own, each with its log: the same weights
    out2 = tmp_path / "cmp-jobs"
    swap = {str(out): str(out2), "clip,powerclip-S": "clip"}
    assert main([swap.get(a, a) for a in argv] + ["--jobs", "2"]) == 0
    data2 = json.loads((out2 / "compare.json").read_text())["budgets"]["steps"]
    assert list(data2["runs"]) == ["clip"]
    for column, recs in data2["runs"].items():
        for r1, r2 in zip(steps["runs"][column], recs, strict=True):
            assert (r1["seed"], r1["steps"]) == (r2["seed"], r2["steps"])
            w1, w2 = load_file(r1["weights"]), load_file(r2["weights"])
            assert all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1)  # threads may differ: not bitwise
            assert "step" in Path(r2["weights"]).with_name("train.log").read_text()
            assert not list(Path(r2["weights"]).parent.parent.glob("*.summary.json"))


@pytest.mark.slow
def test_a_failed_job_names_its_run_and_shows_its_log(tmp_path):
    import train.pretrain.engine as pt
    from train.pretrain.compare import Run, train_runs

    recorded = []
    bad = [Run("clip", s, tmp_path / f"seed-{s}", pt.PretrainOptions(data=str(tmp_path / "missing"), max_steps=1))
           for s in (0, 1)]
    with pytest.raises(RuntimeError, match=r"clip seed [01] failed \(ValueError: .*missing' does not exist.*the "
                                           r"traceback is in .*seed-[01]/train.log"):
        train_runs(bad, 2, lambda *a: recorded.append(a))
    assert recorded == []
    for s in (0, 1):  # the other run ran to its own end: both logs hold their tracebacks
        assert "Traceback" in (tmp_path / f"seed-{s}" / "train.log").read_text()


@pytest.mark.slow
def test_equal_wall_clock_calibrates_each_column(tmp_path):
    from train.pretrain.compare import main

    world = tmp_path / "toy"
    toyworld.generate(world, 30, seed=1, workers=1)
    out = tmp_path / "cmp"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["--out", str(out), "--data", str(world), "--methods", "clip,flip", "--budget", "time",
                     "--minutes-per-method", "0.005", "--calibration-steps", "2", "--batch-size", "8", "--workers",
                     "0", "--eval-every-n-epochs", "0", "--bootstrap", "0", "-q"]) == 0
    finally:
        torch.set_num_threads(threads)
    runs = json.loads((out / "compare.json").read_text())["budgets"]["time"]["runs"]
    for column in ("clip", "flip"):
        (run,) = runs[column]
        assert run["steps"] == max(1, int(0.3 / run["calibrated_seconds_per_step"]))  # what fits in the budget
    text = (out / "compare.md").read_text()
    assert "## Equal wall-clock" in text and "| s / step (calibrated) |" in text and "## Equal steps" not in text

def test_columns_are_checked_before_any_work(tmp_path):
    import train.pretrain.engine as pt
    from train.pretrain.compare import DEFAULT_COLUMNS, CompareOptions, compare, parse_args, parse_column

    col = parse_column("pgs 0.4=clip-pgs --pgs-min-ratio 0.4")
    assert (col.label, col.method, col.method_options) == ("pgs 0.4", "clip-pgs", {"pgs_min_ratio": 0.4})
    assert DEFAULT_COLUMNS["powerclip-S"].options("M") == {"masks": "sam2", "regions_cache": "M"}
    assert DEFAULT_COLUMNS["clip-pgs"].method_options == {"pgs_min_ratio": 0.5, "pgs_max_ratio": 0.5}  # FLIP's 0.5
    with pytest.raises(ValueError, match="--mask-ratio 0.5 not a flag of clip-pgs .its flags: --pgs-alpha"):
        parse_column("x=clip-pgs --mask-ratio 0.5")
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        parse_column("x=nope")
    with pytest.raises(ValueError, match="expected LABEL=METHOD"):
        parse_column("clip")
    opts = parse_args(["--column", "pgs-0.3=clip-pgs --pgs-min-ratio 0.3", "--methods", "clip,pgs-0.3,filip",
                       "--hard-negatives", "none,swap-att"])
    assert [c.label for c in opts.columns()] == ["clip", "pgs-0.3", "filip"] and opts.hard_negatives == ["none",
                                                                                                          "swap-att"]
    assert parse_args(["--extra", "--lr 5e-4"]).pretrain.lr == 5e-4
    with pytest.raises(ValueError, match="methods: unknown nope"):
        CompareOptions(methods="clip,nope")
    with pytest.raises(ValueError, match="budget: unknown"):
        CompareOptions(budget="epochs")
    with pytest.raises(ValueError, match="swap"):
        CompareOptions(hard_negatives="none,swap")
    with pytest.raises(ValueError, match="pass pretrain=PretrainOptions"):
        compare(CompareOptions(out=str(tmp_path / "a"), extra="--lr 5e-4"))
    with pytest.raises(ValueError, match="lr: "):
        compare(CompareOptions(out=str(tmp_path / "b"), pretrain=pt.PretrainOptions(lr=-1.0)))
    with pytest.raises(ValueError, match="not a toy-world folder"):
        compare(CompareOptions(out=str(tmp_path / "c"), data=str(tmp_path)))
    with pytest.raises(ValueError, match="column flip on --model tiny-rn: this objective needs a ViT image tower"):
        compare(CompareOptions(out=str(tmp_path / "d"), model="tiny-rn", methods="clip,powerclip-R,flip"))
    with pytest.raises(ValueError, match=r"vs: flip:clip-pgs not two different columns of this table; its "
                                         r"columns: clip, flip, clip \+tune, flip \+tune"):
        compare(CompareOptions(out=str(tmp_path / "e"), methods="clip,flip", unmasked_tuning_steps=2,
                               vs="flip +tune:clip +tune,flip:clip-pgs"))
    with pytest.raises(ValueError, match="expected A:B"):
        CompareOptions(vs="clip-pgs")
    assert parse_args(["--vs", "a:b, c : d"]).vs == [("a", "b"), ("c", "d")]
    assert not any((tmp_path / d).exists() for d in "abcde")  # refused before any work


@pytest.mark.slow
def test_unmasked_tuning_and_difference_rows(tmp_path, monkeypatch):
    """--unmasked-tuning-steps: every final model trains N steps of plain CLIP from its own weights into 'LABEL +tune';
    each tuned column gets its gain row, --vs adds rows; a difference row is the columns' means subtracted."""
    import train.pretrain.engine as pt
    from train.pretrain.compare import main

    calls = []
    real = pt.pretrain

    def pretrain(opts):
        calls.append((opts.method, opts.max_steps, opts.pretrained, opts.lr, opts.warmup, opts.method_options))
        return real(opts)

    monkeypatch.setattr(pt, "pretrain", pretrain)
    world = tmp_path / "toy"
    toyworld.generate(world, 30, seed=1, workers=1)
    out = tmp_path / "cmp"
    argv = ["--out", str(out), "--data", str(world), "--methods", "clip,flip", "--steps", "4", "--batch-size", "8",
            "--workers", "0", "--bootstrap", "20", "--eval-every-n-epochs", "0", "-q"]
    tuning = ["--unmasked-tuning-steps", "2", "--tuning-lr", "3e-4", "--vs", "flip +tune:clip +tune"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv) == 0
        trained = list(calls)
        calls.clear()
        assert main(argv + tuning) == 0  # the finished comparison, tuned: its runs are kept, only the tuning trains
        first = trained + calls
        calls.clear()
        assert main(argv + tuning) == 0  # again: every run, tuned ones included, is kept
        assert calls == []
        assert main(argv + tuning[:2] + ["--tuning-lr", "2e-4"]) == 0  # another learning rate: tuned again
        assert [(c[0], c[3]) for c in calls] == [("clip", 2e-4)] * 2
        calls.clear()
        assert main(argv + tuning) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((out / "compare.json").read_text())["budgets"]["steps"]
    runs = {name: rs[0] for name, rs in data["runs"].items()}
    assert list(runs) == ["clip", "flip", "clip +tune", "flip +tune"]
    assert [c[:2] for c in first] == [("clip", 4), ("flip", 4), ("clip", 2), ("clip", 2)]
    for (method, steps, start, lr, warmup, own), column in zip(first[2:], ("clip", "flip")):
        assert (start, lr, warmup, own) == (runs[column]["weights"], 3e-4, 1, {})  # plain CLIP from its own weights
        assert runs[column + " +tune"]["tuned_from"] == start and runs[column + " +tune"]["steps"] == 2
        before, after = load_file(start), load_file(runs[column + " +tune"]["weights"])
        assert any(not torch.equal(before[k], after[k]) for k in before)
    table = data["table"]
    assert list(table["pairs"]) == ["clip +tune vs clip", "flip +tune vs flip", "flip +tune vs clip +tune"]
    means = {name: {m: e["mean"] for m, e in entries.items()} for name, entries in table["metrics"].items()}
    for row, metrics in table["pairs"].items():
        a, _, b = row.partition(" vs ")
        for metric, entry in metrics.items():
            assert entry["delta"] == pytest.approx(means[a][metric] - means[b][metric])
            lo, hi = entry["delta_ci"]
            assert lo <= hi and entry["significant"] == (lo > 0 or hi < 0)
    text = (out / "compare.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| flip +tune vs flip |"))
    delta = table["pairs"]["flip +tune vs flip"]["retrieval T2I R@1"]["delta"]
    assert row.split(" | ")[1].startswith(f"{delta:+.1f} [")
