"""``python -m train.pretrain_compare``: the pre-training methods side by side at equal wall-clock on the toy world.

    python -m train.pretrain_compare --out runs/compare --minutes-per-method 3
    python -m train.pretrain_compare --out runs/compare --minutes-per-method 10 --methods clip,powerclip --n 10000

For each method: a short calibration run measures its step time on this machine; the method then trains for
as many steps as fit in ``--minutes-per-method`` (the cosine schedule ends at that step), so a cheaper step (FLIP,
CLIP-PGS) buys more steps, as in the papers' equal-time comparisons. Every final model is evaluated by the
evaluation suite (``train.evaluate``: retrieval R@1/5/10 on the toy world's test split, zero-shot on its
single-object scenes, the toy world's hard negatives per type). Output in ``--out``: one run folder per method,
``compare.md`` (the table, one column per method), ``compare.json`` and the evaluation's own reports in
``eval/``. Steps are timed on a possibly busy machine: the table states the steps and seconds each method had.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import time
from pathlib import Path
from typing import Sequence

from extract.config import nonnegative_int, parse_with_config, positive_float, positive_int, save_config

DEFAULT_METHODS = ("clip", "flip", "clip-pgs", "filip", "powerclip")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.pretrain_compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/compare")
    p.add_argument("--data", default=None, help="a toy-world folder (default: generate one in OUT/toyworld)")
    p.add_argument("--n", type=positive_int, default=2000, help="toy-world scenes to generate when --data is not given")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seeds the toy world and every run")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--minutes-per-method", type=positive_float, default=3.0, help="training wall-clock per method")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=positive_int, default=64, help="batch of every run")
    p.add_argument("--workers", type=nonnegative_int, default=1, help="data-loader processes")
    p.add_argument("--calibration-steps", type=positive_int, default=12)
    p.add_argument("--extra", default="", help="more train.pretrain flags for every run, e.g. '--lr 5e-4'")
    args = parse_with_config(p, argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    return args


def _step_seconds(log_csv: Path) -> float:
    """Median step time of a calibration run (its first steps warm up, so they are left out)."""
    with open(log_csv, newline="") as f:
        times = [float(r["batch_time"]) for r in csv.DictReader(f)]
    tail = times[3:] or times
    return statistics.median(tail)


def run(args: argparse.Namespace) -> dict:
    from extract import toyworld
    from train import evaluate as ev
    from train.pretrain import main as pretrain_main

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(args, out / "config.json")
    data = Path(args.data) if args.data else out / "toyworld"
    if not args.data and not (data / "annotations.json").is_file():
        toyworld.generate(data, args.n, args.seed)
    common = ["--data", str(data), "--model", args.model, "--batch-size", str(args.batch_size), "--workers",
              str(args.workers), "--seed", str(args.seed), "--no-tensorboard", *args.extra.split()]
    # Calibrate every method first, back to back, so a machine that gets busier or quieter later shifts them alike.
    per_step = {}
    for method in args.methods:
        calib = out / "calibration" / method
        code = pretrain_main(common + ["--method", method, "--out", str(calib), "--max-steps", str(args.calibration_steps),
                                       "--log-every-n-steps", "1", "--save-every-n-steps", "0", "--save-frequency", "0",
                                       "--eval-every-n-epochs", "0"])
        if code != 0:
            raise RuntimeError(f"calibration of {method} failed (exit {code})")
        per_step[method] = _step_seconds(calib / "log.csv")
        images = json.loads((calib / "model.json").read_text())["data"]["images"]
    steps_per_epoch = max(1, images // args.batch_size)
    runs = {}
    for method in args.methods:
        steps = max(1, int(args.minutes_per_method * 60 / per_step[method]))
        epochs = math.ceil(steps / steps_per_epoch)  # schedules by epoch (CLIP-PGS's alpha) see the real count
        run_dir = out / method
        t0 = time.perf_counter()
        code = pretrain_main(common + ["--method", method, "--out", str(run_dir), "--max-steps", str(steps),
                                       "--epochs", str(epochs), "--save-every-n-steps", "0", "--save-frequency", "0",
                                       "--eval-every-n-epochs", "0"])
        if code != 0:
            raise RuntimeError(f"training {method} failed (exit {code})")
        desc = json.loads((run_dir / "model.json").read_text())
        runs[method] = {"calibrated_seconds_per_step": per_step[method], "steps": desc["step"], "epochs": desc["epoch"],
                        "train_seconds": time.perf_counter() - t0, "weights": str(run_dir / "model.safetensors")}
        print(f"{method}: {per_step[method]:.3f} s/step -> {desc['step']} steps ({desc['epoch']:.1f} epochs) in "
              f"{runs[method]['train_seconds']:.0f} s")
    arch = args.model
    ns = ev.parse_args(["--data", str(data), "--out", str(out / "eval"), "--tasks", "retrieval,zeroshot,compositional",
                        *sum((["--model", arch, "--pretrained", runs[m]["weights"]] for m in args.methods), [])])
    report = ev.evaluate(ns)
    results = dict(zip(args.methods, report["results"].values()))
    table = _table(runs, results)
    (out / "compare.md").write_text(table)
    (out / "compare.json").write_text(json.dumps({"runs": runs, "results": results}, indent=2, default=str) + "\n")
    print("\n" + table)
    return {"runs": runs, "results": results}


def _table(runs: dict, results: dict) -> str:
    from train.evaluate import headline

    methods = list(runs)
    lines = ["| | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    lines.append("| training steps (epochs) | " + " | ".join(
        f"{runs[m]['steps']} ({runs[m]['epochs']:.1f})" for m in methods) + " |")
    lines.append("| s / step (calibrated) | " + " | ".join(
        f"{runs[m]['calibrated_seconds_per_step']:.3f}" for m in methods) + " |")
    flat = {m: headline(results[m]) for m in methods}
    metrics = list(dict.fromkeys(k for m in methods for k in flat[m]))
    for k in metrics:
        lines.append(f"| {k} | " + " | ".join(f"{flat[m][k]:.2f}" if k in flat[m] else "–" for m in methods) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
