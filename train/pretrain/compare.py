"""``python -m train.pretrain.compare``: the pre-training methods side by side at equal wall-clock on the toy world.

    python -m train.pretrain.compare --out runs/compare --minutes-per-method 3
    python -m train.pretrain.compare --out runs/compare --minutes-per-method 10 --methods clip,powerclip --n 10000

For each method: a short calibration run measures its step time on this machine; the method then trains for
as many steps as fit in ``--minutes-per-method`` (the cosine schedule ends at that step), so a cheaper step (FLIP,
CLIP-PGS) buys more steps, as in the papers' equal-time comparisons. Every final model is evaluated by the
evaluation suite (``train.eval``: retrieval R@1/5/10 on the toy world's test split, zero-shot on its
single-object scenes, the toy world's hard negatives per type). Output in ``--out``: one run folder per method,
``compare.md`` (the table, one column per method), ``compare.json`` and the evaluation's own reports in
``eval/``. Steps are timed on a possibly busy machine: the table states the steps and seconds each method had.
"""
from __future__ import annotations

import dataclasses
import json
import math
import csv
import shlex
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from extract.common.cli import Parser, check_options, option, parse_options, run_job, say, set_verbosity, verbosity
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int, positive_float, positive_int, save_config
from extract.common.run_dir import claim

DEFAULT_METHODS = ("clip", "flip", "clip-pgs", "filip", "powerclip")


@dataclass
class CompareOptions:
    """What ``python -m train.pretrain.compare`` does, as data: ``compare(CompareOptions(data="toy"))``.
    ``methods`` may be a comma string or a list."""

    out: str = option("runs/compare", help="output folder: a run folder per method, compare.{md,json}, eval/")
    data: str | None = option(None, help="a toy-world folder (default: generate one in OUT/toyworld)")
    n: int = option(2000, type=positive_int, help="toy-world scenes to generate when --data is not given")
    seed: int = option(0, type=nonnegative_int, help="seeds the toy world and every run")
    methods: Any = option(",".join(DEFAULT_METHODS), help="comma list of registered pre-training methods")
    minutes_per_method: float = option(3.0, type=positive_float, help="training wall-clock per method")
    model: str = option("tiny", help="open_clip architecture or plugvlm alias of every run")
    batch_size: int = option(64, type=positive_int, help="batch of every run")
    workers: int = option(1, type=nonnegative_int, help="data-loader processes")
    calibration_steps: int = option(12, type=positive_int, help="steps of each method's timing run")
    extra: str = option("", help="more train.pretrain flags for every run, e.g. '--lr 5e-4 --num-masks 5'")
    # Not a command-line option: the train.pretrain.engine options every run starts from (each run then sets its method,
    # folder, steps and the fields above). The command line's --extra is parsed into it; Python callers pass
    # PretrainOptions(lr=5e-4, ...) here instead of a string of flags.
    pretrain: Any = field(default=None)

    def __post_init__(self):
        if isinstance(self.methods, str):
            self.methods = [m.strip() for m in self.methods.split(",") if m.strip()]
        self.methods = list(self.methods)


def build_parser() -> Parser:
    return build_cli(CompareOptions, "python -m train.pretrain.compare", __doc__)


def parse_args(argv: Sequence[str] | None = None) -> CompareOptions:
    """The command line as CompareOptions, ``--extra`` parsed into ``pretrain`` (train.pretrain.engine's own checks)."""
    opts = parse_options(CompareOptions, build_parser(), argv)
    if opts.extra.strip():
        from train.pretrain import engine as pt

        level = verbosity()
        opts.pretrain = pt.parse_args(shlex.split(opts.extra))
        set_verbosity(level)  # parsing --extra must not undo this command's --quiet / --verbose
    return opts


def _step_seconds(log_csv: Path) -> float:
    """Median step time of a calibration run (its first steps warm up, so they are left out)."""
    with open(log_csv, newline="") as f:
        times = [float(r["batch_time"]) for r in csv.DictReader(f)]
    tail = times[3:] or times
    return statistics.median(tail)


def _fresh(run_dir: Path) -> Path:
    """A run folder of this comparison, emptied: the comparison's folder was claimed with these settings, so what
    is there is an earlier run of it, whose step counts (timed anew) would make train.pretrain.engine refuse it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    return run_dir


def compare(opts: CompareOptions) -> dict:
    """Calibrate, train and evaluate every method of ``opts.methods`` (module docstring); returns ``{"runs",
    "results", "markdown"}`` and writes ``compare.{md,json}`` and ``eval/`` under ``opts.out``."""
    from adapters.registry import PRETRAIN
    from extract.data import toyworld
    from train.eval import evaluate as ev
    from train.pretrain import engine as pt

    check_options(opts, build_parser())
    unknown = [m for m in opts.methods if m not in PRETRAIN]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(PRETRAIN.names())}")
    if opts.extra.strip() and opts.pretrain is None:
        raise ValueError("extra: a string of command-line flags; from Python pass pretrain=PretrainOptions(...) "
                         "(python -m train.pretrain.compare parses --extra into it)")
    base = opts.pretrain if opts.pretrain is not None else pt.PretrainOptions()
    if not isinstance(base, pt.PretrainOptions):
        raise ValueError(f"pretrain: expected train.pretrain.engine.PretrainOptions, got {type(base).__name__}")
    check_options(base, pt.build_parser())
    out = Path(opts.out)
    claim(out, dataclasses.asdict(opts))
    out.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.asdict(opts), out / "config.json")
    data = Path(opts.data) if opts.data else out / "toyworld"
    if not opts.data and not (data / "annotations.json").is_file():
        toyworld.generate(data, opts.n, opts.seed)
    common = dict(data=str(data), model=opts.model, batch_size=opts.batch_size, workers=opts.workers, seed=opts.seed,
                  tensorboard=False, save_every_n_steps=0, save_frequency=0, eval_every_n_epochs=0)
    # Calibrate every method first, back to back, so a machine that gets busier or quieter later shifts them alike.
    per_step, images = {}, 0
    for method in opts.methods:
        calib = _fresh(out / "calibration" / method)
        pt.pretrain(dataclasses.replace(base, method=method, out=str(calib), epochs=base.epochs or pt.EPOCHS,
                                        max_steps=opts.calibration_steps, log_every_n_steps=1, **common))
        per_step[method] = _step_seconds(calib / "log.csv")
        images = json.loads((calib / "model.json").read_text())["data"]["images"]
    steps_per_epoch = max(1, images // opts.batch_size)
    runs = {}
    for method in opts.methods:
        steps = max(1, int(opts.minutes_per_method * 60 / per_step[method]))
        epochs = math.ceil(steps / steps_per_epoch)  # schedules by epoch (CLIP-PGS's alpha) see the real count
        run_dir = _fresh(out / method)
        t0 = time.perf_counter()
        summary = pt.pretrain(dataclasses.replace(base, method=method, out=str(run_dir), max_steps=steps,
                                                  epochs=epochs, **common))
        desc = json.loads((run_dir / "model.json").read_text())
        runs[method] = {"calibrated_seconds_per_step": per_step[method], "steps": desc["step"], "epochs": desc["epoch"],
                        "train_seconds": time.perf_counter() - t0, "weights": summary["weights"]}
        say(f"{method}: {per_step[method]:.3f} s/step -> {desc['step']} steps ({desc['epoch']:.1f} epochs) in "
            f"{runs[method]['train_seconds']:.0f} s")
    report = ev.evaluate(ev.EvaluateOptions(data=str(data), out=str(out / "eval"),
                                            tasks=["retrieval", "zeroshot", "compositional"],
                                            model=[opts.model] * len(opts.methods),
                                            pretrained=[runs[m]["weights"] for m in opts.methods]))
    results = dict(zip(opts.methods, report["results"].values()))
    table = _table(runs, results)
    (out / "compare.md").write_text(table)
    (out / "compare.json").write_text(json.dumps({"runs": runs, "results": results}, indent=2, default=str) + "\n")
    return {"runs": runs, "results": results, "markdown": table}


run = compare  # the name this job had before it took options


def _table(runs: dict, results: dict) -> str:
    from train.eval.evaluate import headline

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
    def job(opts: CompareOptions) -> None:
        print("\n" + compare(opts)["markdown"])

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
