"""Without --epochs, python -m train.adapter trains until its held-out score stops improving, cools the learning rate
down and stops, saying why (train/adapter/stopping.py): the rule's decisions on given scores, the score itself, and a
run on the session's 120-scene toy world that stops by the rule, logs it and resumes into the same decisions."""
from __future__ import annotations

import csv
import json

import pytest
import torch
from safetensors import safe_open

from adapters.checkpoint import read_meta
from train.adapter.engine import AdapterOptions, main, resolve
from train.adapter.stopping import EVAL_STEPS, Plateau, held_out_score

from fixtures.toy import adapter_argv, toy_root


def _rule(**kw) -> Plateau:
    settings = dict(patience=2, min_delta=0.5, cooldown=0.2, max_epochs=100, steps_per_epoch=10, warmup=5)
    settings.update(kw)
    return Plateau(**settings, end_epoch=settings["max_epochs"])


def test_the_cooldown_starts_after_patience_evaluations_without_a_gain_and_lasts_a_fifth_in_whole_epochs():
    rule = _rule()
    assert rule.eval_every == 2 == -(-EVAL_STEPS // 10)  # 10 steps an epoch: evaluations at least 20 steps apart
    assert [rule.lr_factor(s) for s in (0, 4, 5, 500)] == [0.2, 1.0, 1.0, 1.0]  # warm-up, then stable
    for epochs, score in ((2, 60.0), (4, 70.0), (6, 70.4), (8, 70.3)):  # +0.4 is not a gain of 0.5
        rule.update(epochs, epochs * 10, score)
    assert rule.phase == "cooldown" and rule.best == 70.0 and rule.best_step == 40
    # a fifth of 8 epochs, rounded up to whole epochs: 2 epochs, 20 steps, from step 80
    assert (rule.cooldown_start, rule.cooldown_steps, rule.end_epoch) == (80, 20, 10)
    assert "not improved by 0.5 in 2 evaluations (40 steps; best 70.00 at step 40, epoch 4)" in rule.reason
    assert [rule.lr_factor(s) for s in (80, 90, 100)] == [1.0, 0.5, 0.0]
    assert rule.due(10) and rule.due(9) is False  # epoch 10 is the last and on the interval (off it: the next test)
    rule.update(9, 90, None)
    assert not rule.done
    lines = rule.update(10, 100, 70.2)
    assert rule.done and "stopped after epoch 10 (step 100): the cool-down has ended" in lines[-1]
    # an epoch may take fewer steps than its captions fill: the cool-down spans the steps the epochs will take
    short = _rule()
    for epochs, score in ((2, 60.0), (4, 60.0), (6, 60.0)):
        short.update(epochs, epochs * 10, score, steps_of=lambda e: 7)
    assert (short.phase, short.cooldown_steps, short.end_epoch) == ("cooldown", 14, 8)
    # the state round-trips (a --resume continues the same decisions)
    again = _rule()
    again.load(json.loads(json.dumps(rule.state())))
    assert again.state() == rule.state()


def test_the_last_epoch_is_evaluated_where_it_falls_between_two_evaluations_on_the_interval():
    """5 steps an epoch: evaluations every 4 epochs. The cool-down decided at epoch 12 lasts a fifth of 12 epochs,
    rounded up to 3, so the run ends after epoch 15, not a multiple of 4: the rule evaluates it all the same (the
    weights the run ends with are scored, and the stop is said after that score), and no epoch between."""
    rule = _rule(steps_per_epoch=5)
    assert rule.eval_every == 4
    evaluated = []
    for epoch in range(1, 100):
        if rule.due(epoch):
            evaluated.append(epoch)
        lines = rule.update(epoch, epoch * 5, 60.0 if rule.due(epoch) else None)
        if rule.done:
            break
    assert (rule.cooldown_start, rule.end_epoch, epoch) == (60, 15, 15)
    assert evaluated == [s[0] for s in rule.scores] == [4, 8, 12, 15]
    assert lines[0].startswith("held-out score 60.00") and "stopped after epoch 15 (step 75)" in lines[-1]
    assert [rule.due(e) for e in (13, 14, 15, 16)] == [False, False, True, True]


def test_a_gain_resets_the_patience_and_max_epochs_starts_the_cooldown_in_time():
    rule = _rule(patience=3)
    for epochs, score in ((3, 50.0), (6, 50.2), (9, 51.0), (12, 51.1), (15, 52.0)):
        rule.update(epochs, epochs * 10, score)
    assert rule.phase == "stable" and (rule.best, rule.best_epoch, rule.since_best) == (52.0, 15, 0)
    capped = _rule(max_epochs=10)
    for epochs in range(1, 9):
        capped.update(epochs, epochs * 10, 50.0 + epochs if capped.due(epochs) else None)
        if capped.phase != "stable":
            break
    # still improving at epoch 8; a fifth of 8 epochs is 2, which ends at 10
    assert capped.phase == "cooldown" and capped.end_epoch == 10 and "--max-epochs 10 is near" in capped.reason


def test_the_score_is_the_mean_of_retrieval_and_binding_each_type_weighing_the_same():
    retrieval = {f"retrieval {d} R@{k}": 60.0 for d in ("T2I", "I2T") for k in (1, 5, 10)}
    assert held_out_score(retrieval) == 60.0
    binding = {"toyworld replace-rel": 50.0, "toyworld swap-att": 100.0, "toyworld all": 99.0,
               "toyworld held-out swap-att": 0.0}  # "all" and tags are not types
    assert held_out_score({**retrieval, **binding}) == pytest.approx((60.0 + 75.0) / 2)
    assert held_out_score({}) is None


def test_without_epochs_the_options_say_so_and_a_zero_cooldown_is_refused():
    opts = resolve(AdapterOptions(method="comalign"))
    assert opts.epochs is None and (opts.patience, opts.min_delta, opts.cooldown) == (3, 0.5, 0.2)
    with pytest.raises(ValueError, match="--cooldown must be above 0 without --epochs"):
        resolve(AdapterOptions(method="comalign", cooldown=0.0))
    assert resolve(AdapterOptions(method="comalign", epochs=3, cooldown=0.0)).epochs == 3


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return toy_root(tmp_path_factory)


def _argv(root, out, *extra):
    # an impossible gain (--min-delta 1000) so the rule decides at its second evaluation: a short run
    return adapter_argv(root, "smartclip", out, "--patience", "1", "--min-delta", "1000", "--no-final-eval", *extra)


def _head(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith("head.")}


@pytest.mark.slow
def test_a_run_without_epochs_stops_by_the_rule_says_why_and_resumes_into_the_same_decisions(root, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_argv(root, out)) == 0
    said = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    stop = summary["stopping"]
    every = stop["scores"][0][0]
    per_epoch = stop["scores"][0][1] // every
    assert every == -(-EVAL_STEPS // per_epoch)  # evaluations at least EVAL_STEPS apart
    cool = -(-2 * every // 5)  # a fifth of the epochs before it, rounded up
    assert [s[0] for s in stop["scores"]] == [every, 2 * every, 2 * every + cool]
    assert "has not improved by 1000 in 1 evaluations" in stop["reason"]
    assert "cooling down: the held-out score has not improved" in said and "the cool-down has ended" in said
    assert "until the held-out score stops improving" in said
    with open(out / "metrics.csv", newline="") as f:
        lrs = [float(r["lr"]) for r in csv.DictReader(f)]
    assert len(lrs) == summary["steps"] == (2 * every + cool) * per_epoch
    start, peak = 2 * every * per_epoch, max(lrs)  # the cool-down's first step: linear to 0
    assert lrs[start - 1] == lrs[start] == peak and lrs[-1] == pytest.approx(peak / (cool * per_epoch))
    assert all(a > b for a, b in zip(lrs[start:], lrs[start + 1:]))
    history = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in history[1:]] == [s[0] for s in stop["scores"]] and "held-out score" in history[1]
    assert read_meta(out / "adapter.safetensors")["epoch"] == 2 * every + cool

    # stopped mid-epoch between the rule's two evaluations, then resumed: the same decisions, the same weights
    again = tmp_path / "resumed"
    assert main(_argv(root, again, "--stop-after-steps", str(every * per_epoch + 3))) == 0
    assert main([*_argv(root, again), "--resume"]) == 0
    assert json.loads((again / "summary.json").read_text())["stopping"] == stop
    a, b = _head(out / "adapter.safetensors"), _head(again / "adapter.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
