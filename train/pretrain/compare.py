"""``python -m train.pretrain.compare``: the pre-training methods side by side on one toy world, at equal steps
and / or equal wall-clock, over seeds, with and without hard negatives, each final model evaluated with intervals.

    python -m train.pretrain.compare --out runs/compare                       # 5 columns, equal steps, 1 seed
    python -m train.pretrain.compare --out runs/compare --seeds 3 --hard-negatives none,all --budget steps,time
    python -m train.pretrain.compare --out runs/compare --methods clip,powerclip-S,"powerclip-S M4" \\
        --column "powerclip-S M4=powerclip --masks sam2 --regions-cache {toy_masks} --num-masks 4"

**Columns.** A column is a registered method with its own flags (``LABEL=METHOD flags``). The defaults
(:data:`DEFAULT_COLUMNS`) are the papers' comparisons: ``clip``; ``flip`` and ``clip-pgs`` at the same masking ratio
(0.5: CLIP-PGS_0.5 against FLIP_0.5, CLIP-PGS §4); ``powerclip-R`` (random boxes) and ``powerclip-S`` (masks from
``{toy_masks}``: the toy world's exact object masks, cached once in ``OUT/toy-masks`` by ``python -m extract
--regions sam2 --segmenter toy``, the oracle SAM2 would approach); ``filip`` on request. Any registered method name is
a column too. ``--hard-negatives none,all`` runs every column once per setting (NegCLIP's negatives, ``train.pretrain
--hard-negatives``); ``--seeds N`` runs each N times (seeds ``--seed`` .. ``--seed+N-1``; the world stays the same).

**Budgets.** ``steps``: every run makes ``--steps`` optimizer steps (the cosine schedule ends there). ``time``: a
short calibration run measures each column's step time on this machine, then the column trains for the steps that
fit in ``--minutes-per-method``, so a cheaper step (FLIP, CLIP-PGS) buys more of them, as in the papers' equal-time
comparisons. Steps are timed on a possibly busy machine: the table states the steps and seconds each column had.

**Evaluation.** Every run evaluates itself on the world's val split after each ``--eval-every-n-epochs`` epochs
(the curves: ``curves.png``, mean over seeds, the band min..max). The final models are evaluated by ``train.eval``
on the test split: retrieval R@k, zero-shot on its single-object scenes, every hard-negative type, and the
combinations the world holds out of training (``--holdout``; the ``held-out`` rows). A cell is mean ± sd over seeds;
every column after the first shows its difference from the first (CLIP) with a 95% paired bootstrap interval over
the test images (``adapters.eval.bootstrap``), ``*`` where the interval excludes 0. ``--vs A:B`` adds a row of
column A's difference from column B (e.g. ``clip-pgs:flip``, the CLIP-PGS paper's own comparison), from the same
per-image results.

**Unmasked tuning.** ``--unmasked-tuning-steps N`` trains every final model N more steps of plain CLIP on every patch
(FLIP §3; CLIP's own runs too, the control for the extra steps) into the column ``LABEL +tune``, evaluated beside the
others with a row ``LABEL +tune vs LABEL``: what the tuning gained. A method that masks at training sees whole images
only at test; the tuning measures how much of its deficit is that shift.

Output, per budget ``B``: ``OUT/B/<column>/seed-<s>/`` (run folders), ``OUT/B/eval/results.{json,md,png}``,
``OUT/B/curves.png``; then ``OUT/compare.md`` (every budget's table) and ``OUT/compare.json``. ``--jobs N`` trains N
runs at once, each in a process of its own with its share of the CPU threads (and its own GPU where there are
several), its output in its folder's ``train.log``. The same command
again (same ``OUT``, same settings) keeps the runs an earlier call finished (``compare_run.json`` in each run
folder) and trains only the rest: an interrupted comparison resumes after its last finished run. Under ``time``
the calibration runs again, so a run is kept only when its step count comes out the same.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import re
import shlex
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from adapters.eval.bootstrap import DEFAULT_RESAMPLES
from extract.common.cli import Parser, check_options, option, parse_options, run_job, say, set_verbosity, verbosity
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int, positive_float, positive_int, save_config
from extract.common.run_dir import NEUTRAL, claim

TOY_MASKS = "{toy_masks}"  # in a column's flags: the toy world's oracle-masks cache, built once in OUT/toy-masks
BUDGETS = ("steps", "time")
RUN_RECORD = "compare_run.json"  # in each run folder, written once the run has finished
TUNED = " +tune"  # a column's name after --unmasked-tuning-steps
# Settings that act after the runs train: a folder claimed without them (or with others) keeps its runs, so adding
# --unmasked-tuning-steps or --vs to a finished comparison tunes / reports without training it again. A tuned run
# records what it started from and its learning rate, and is kept only when both match (finished()).
AFTER_TRAINING = frozenset({"unmasked_tuning_steps", "tuning_lr", "vs", "bootstrap"})
# The world's held-out colour-shape combinations: never in a training caption, in the test split's held-out rows.
HOLDOUT = "yellow circle,purple square,orange triangle,white star"
SUMMARY_METRICS = ("retrieval T2I R@1", "retrieval I2T R@1", "zero-shot top-1", "toyworld replace-att",
                   "toyworld replace-obj", "toyworld replace-rel", "toyworld swap-att", "toyworld swap-obj",
                   "toyworld held-out all", "toyworld all")
CURVE_METRICS = ("retrieval T2I R@1", "zero-shot top-1", "toyworld swap-att", "toyworld replace-rel")


@dataclass(frozen=True)
class Column:
    """One column of the table: ``method`` (a ``PRETRAIN`` name) with its own options (``method_options`` of
    ``train.pretrain.engine.PretrainOptions``; the string ``{toy_masks}`` stands for the oracle-masks cache)."""

    label: str
    method: str
    method_options: dict = field(default_factory=dict)

    def options(self, toy_masks: str | None) -> dict:
        return {k: (toy_masks if v == TOY_MASKS else v) for k, v in self.method_options.items()}

    @property
    def needs_toy_masks(self) -> bool:
        return TOY_MASKS in self.method_options.values()


DEFAULT_COLUMNS = {c.label: c for c in (
    Column("clip", "clip"),
    Column("flip", "flip", {"mask_ratio": 0.5}),
    Column("clip-pgs", "clip-pgs", {"pgs_min_ratio": 0.5, "pgs_max_ratio": 0.5}),  # PGS_0.5: FLIP's ratio
    Column("powerclip-R", "powerclip", {"masks": "random"}),
    Column("powerclip-S", "powerclip", {"masks": "sam2", "regions_cache": TOY_MASKS}),
    Column("filip", "filip"),
)}
DEFAULT_METHODS = ("clip", "flip", "clip-pgs", "powerclip-R", "powerclip-S")


def parse_column(text: str) -> Column:
    """``"LABEL=METHOD --flag value ..."`` -> :class:`Column`; the flags are METHOD's own (``train.pretrain``'s
    groups), checked as the command line checks them."""
    from adapters.registry import PRETRAIN
    from train.pretrain.options import method_flags

    label, sep, spec = text.partition("=")
    words = shlex.split(spec)
    if not sep or not label.strip() or not words:
        raise ValueError(f"--column {text!r}: expected LABEL=METHOD [flags], e.g. 'powerclip-S M4=powerclip --masks "
                         f"sam2 --regions-cache {TOY_MASKS} --num-masks 4'")
    method, flags = words[0], words[1:]
    if method not in PRETRAIN:
        raise ValueError(f"--column {text!r}: unknown method {method!r}; choose from {', '.join(PRETRAIN.names())}")
    parser, actions = method_flags()[method]
    parser.exit_on_error = False
    try:
        ns, unknown = parser.parse_known_args(flags)
    except argparse.ArgumentError as e:
        raise ValueError(f"--column {text!r}: {e}") from None
    if unknown:
        raise ValueError(f"--column {text!r}: {' '.join(unknown)} not a flag of {method} (its flags: "
                         f"{', '.join(sorted(a.option_strings[0] for a in actions.values()))})")
    given = {d: v for d, v in vars(ns).items() if v != actions[d].default}
    return Column(label.strip(), method, given)


@dataclass
class CompareOptions:
    """What ``python -m train.pretrain.compare`` does, as data: ``compare(CompareOptions(seeds=3))``. ``methods``,
    ``hard_negatives`` and ``budget`` may be comma strings or lists; ``columns`` holds :class:`Column` s (or
    ``LABEL=METHOD flags`` strings) that add to or replace :data:`DEFAULT_COLUMNS`."""

    out: str = option("runs/compare", help="output folder: a folder per budget (runs, eval/, curves.png), "
                                           "compare.{md,json}")
    data: str | None = option(None, help="a toy-world folder (default: generate one in OUT/toyworld)")
    n: int = option(10000, type=positive_int, help="toy-world scenes to generate when --data is not given")
    holdout: str = option(HOLDOUT, help="colour-shape combinations the generated world holds out of training "
                                        "('' for none)")
    seed: int = option(0, type=nonnegative_int, help="seeds the toy world, the first run and the bootstrap")
    seeds: int = option(1, type=positive_int, help="runs per column and setting (seeds --seed .. --seed+N-1)")
    methods: Any = option(",".join(DEFAULT_METHODS),
                          help=f"comma list of columns: {', '.join(DEFAULT_COLUMNS)}, any registered method, or a "
                               "--column label; the first is every other's reference")
    column: list = option(default_factory=list, action="append", metavar="LABEL=METHOD FLAGS",
                          help="define a column: a method and its own flags, e.g. 'pgs-0.3=clip-pgs --pgs-min-ratio "
                               f"0.3' ({TOY_MASKS}: the toy world's exact object masks) (repeatable)")
    hard_negatives: Any = option("none", help="comma list of hard-negative settings, each column runs with each: "
                                              "none, all, or one type (e.g. none,all)")
    budget: Any = option("steps", help="comma list from steps (every run --steps steps), time (every column "
                                       "--minutes-per-method of training)")
    steps: int = option(500, type=positive_int, help="optimizer steps of every run, budget steps (500: 4 whole "
                                                     "epochs of the default world at batch 64)")
    minutes_per_method: float = option(3.0, type=positive_float, help="training wall-clock per run, budget time")
    model: str = option("tiny", help="open_clip architecture or plugvlm alias of every run")
    batch_size: int = option(64, type=positive_int, help="batch of every run")
    workers: int = option(1, type=nonnegative_int, help="data-loader processes")
    jobs: int = option(1, type=positive_int,
                       help="runs trained at once, each in its own process with its share of the CPU threads (and, "
                            "on a machine with several GPUs, its own GPU); a run's output goes to its train.log")
    calibration_steps: int = option(12, type=positive_int, help="steps of each column's timing run, budget time")
    eval_every_n_epochs: int = option(1, type=nonnegative_int,
                                      help="evaluate every run on the val split every N epochs: the curves (0: none)")
    bootstrap: int = option(DEFAULT_RESAMPLES, type=nonnegative_int,
                            help="bootstrap resamples of the test images for every interval (0: none)")
    unmasked_tuning_steps: int = option(0, type=nonnegative_int,
                                        help="after training, every run trains this many more steps of plain CLIP "
                                             "on every patch (FLIP's unmasked tuning, FLIP section 3), evaluated as "
                                             "the column 'LABEL +tune' beside its own, with a row of its gain "
                                             "(0: none)")
    tuning_lr: float = option(1e-4, type=positive_float,
                              help="peak learning rate of the unmasked tuning (warm-up: its first 10%%)")
    vs: Any = option("", metavar="A:B,...",
                     help="more difference rows: column A against column B with the paired interval, e.g. "
                          "'clip-pgs:flip,powerclip-S:powerclip-R' (the table's own reference is the first column)")
    extra: str = option("", help="more train.pretrain flags for every run, e.g. '--lr 5e-4 --warmup 100'")
    # Not a command-line option: the train.pretrain.engine options every run starts from (each run then sets its method,
    # folder, steps and the fields above). The command line's --extra is parsed into it; Python callers pass
    # PretrainOptions(lr=5e-4, ...) here instead of a string of flags.
    pretrain: Any = field(default=None)

    def __post_init__(self):
        from extract.components.hard_negatives import parse_types

        def listed(value) -> list[str]:
            return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)

        self.methods, self.budget = listed(self.methods), listed(self.budget)
        self.vs = [tuple(p) if not isinstance(p, str) else parse_pair(p) for p in
                   (listed(self.vs) if isinstance(self.vs, str) else self.vs or [])]
        self.hard_negatives = listed(self.hard_negatives)
        for h in self.hard_negatives:
            parse_types(h)  # a typo fails here, naming the types
        self.column = [parse_column(c) if isinstance(c, str) else c for c in self.column or []]
        if not self.methods or not self.hard_negatives or not self.budget:
            raise ValueError("methods, hard_negatives and budget each need at least one entry")
        wrong = [b for b in self.budget if b not in BUDGETS]
        if wrong:
            raise ValueError(f"budget: unknown {', '.join(wrong)}; choose from {', '.join(BUDGETS)}")
        known = {**DEFAULT_COLUMNS, **{c.label: c for c in self.column}}
        from adapters.registry import PRETRAIN

        unknown = [m for m in self.methods if m not in known and m not in PRETRAIN]
        if unknown:
            raise ValueError(f"methods: unknown {', '.join(unknown)}; choose from {', '.join(known)}, a registered "
                             f"method ({', '.join(PRETRAIN.names())}) or define one with --column LABEL=METHOD flags")

    def columns(self) -> list[Column]:
        known = {**DEFAULT_COLUMNS, **{c.label: c for c in self.column}}
        return [known.get(m) or Column(m, m) for m in self.methods]

    def names(self) -> list[str]:
        """The table's columns: every column x hard-negative setting, then each tuned (``--unmasked-tuning-steps``)."""
        names = [column_name(c, h) for c in self.columns() for h in self.hard_negatives]
        return names + ([tuned_name(n) for n in names] if self.unmasked_tuning_steps else [])

    def pairs(self) -> list[tuple[str, str]]:
        """The difference rows: each tuned column against its own (with tuning), then ``--vs``; every name checked."""
        names = self.names()
        wrong = [f"{a}:{b}" for a, b in self.vs if a not in names or b not in names or a == b]
        if wrong:
            raise ValueError(f"vs: {', '.join(wrong)} not two different columns of this table; its columns: "
                             f"{', '.join(names)}")
        own = [(tuned_name(n), n) for n in names if self.unmasked_tuning_steps and not n.endswith(TUNED)]
        return list(dict.fromkeys(own + list(self.vs)))


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


# --------------------------------------------------------------------------------------------- helpers
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


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-") or "column"


def column_name(column: Column, hard_negatives: str) -> str:
    return column.label + ("" if hard_negatives == "none" else f" +hn {hard_negatives}")


def tuned_name(name: str) -> str:
    return name + TUNED


def parse_pair(text: str) -> tuple[str, str]:
    """``"A:B"`` -> (A, B): column A's difference from column B (``--vs``)."""
    a, sep, b = text.partition(":")
    if not sep or not a.strip() or not b.strip():
        raise ValueError(f"vs: {text!r}: expected A:B (two column names, e.g. clip-pgs:flip)")
    return a.strip(), b.strip()


def finished(run_dir: Path, steps: int, tuned_from: str | None = None, tuning_lr: float | None = None) -> dict | None:
    """The record of a run an earlier call of this comparison finished (same settings: ``OUT`` was claimed with them)
    with ``steps`` steps, its weights still there; None when it has to be (re)trained. An interrupted comparison
    picks up after its last finished run instead of training every run again. A tuned run (``tuned_from``: the
    weights it started from) is kept only when it started from those weights, was written after them and was
    tuned at ``tuning_lr``."""
    path = run_dir / RUN_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = record.get("steps") == steps and Path(record.get("weights", "")).is_file()
    if ok and tuned_from is not None:
        ok = (record.get("tuned_from") == tuned_from and record.get("tuning_lr") == tuning_lr
              and Path(tuned_from).is_file() and path.stat().st_mtime >= Path(tuned_from).stat().st_mtime)
    return record if ok else None


def tuning_options(options: Any, weights: str, lr: float) -> Any:
    """A run's unmasked tuning (FLIP §3, a short phase without masking that closes the gap between masked training
    and unmasked inference): plain CLIP on every patch from the run's final ``weights``, the column's own hard
    negatives kept, at ``lr`` after a warm-up of a tenth of the steps, without per-epoch evaluation (the tuned model
    is evaluated with the others)."""
    return dataclasses.replace(options, method="clip", method_options={}, pretrained=weights, lr=lr,
                               warmup=max(1, options.max_steps // 10), eval_every_n_epochs=0)


def train_images(world: Path) -> int:
    """Images in the toy world's train split (an epoch of train.pretrain on it)."""
    scenes = json.loads((world / "annotations.json").read_text())["scenes"]
    return sum(s.get("split") == "train" for s in scenes)


def check_towers(model: str, columns: list[Column]) -> None:
    """Every column's method can train ``model`` (FLIP and CLIP-PGS choose patches, so they need a ViT), said
    before the first run rather than after the runs before it."""
    from adapters.objectives.towers import UnsupportedModelError, check_model
    from adapters.registry import PRETRAIN
    from train.pretrain import engine as pt

    net = pt.create_model(pt.resolve_architecture(model), False, 0)[0]
    for c in columns:
        try:
            check_model(net, chooses_patches=PRETRAIN.get(c.method).chooses_patches)
        except UnsupportedModelError as e:
            raise ValueError(f"column {c.label} on --model {model}: {e}") from None


def toy_masks(world: Path, out: Path, model: str) -> str:
    """The world's exact object masks on ``model``'s patch grid, cached once (``extract.components.toy_segmenter``)."""
    from extract.pipeline import build_cache

    say(f"toy-world object masks (the oracle SAM2 would approach) -> {out}")
    build_cache(world, out, base=model, pretrained="none", components=["regions"], regions="sam2", segmenter="toy",
                num_regions=10, workers=0)
    return str(out)


# --------------------------------------------------------------------------------------------- the job
def compare(opts: CompareOptions) -> dict:
    """Train every column x hard-negative setting x seed under every budget and evaluate the final models (module
    docstring). Returns ``{"budgets": {B: {"runs", "table", "markdown"}}, "markdown"}`` and writes ``OUT/``."""
    from adapters.registry import PRETRAIN
    from extract.worlds import toyworld
    from train.pretrain import engine as pt

    check_options(opts, build_parser())
    for c in opts.columns():
        if c.method not in PRETRAIN:
            raise ValueError(f"column {c.label}: unknown method {c.method!r}; choose from "
                             f"{', '.join(PRETRAIN.names())}")
    if opts.extra.strip() and opts.pretrain is None:
        raise ValueError("extra: a string of command-line flags; from Python pass pretrain=PretrainOptions(...) "
                         "(python -m train.pretrain.compare parses --extra into it)")
    base = opts.pretrain if opts.pretrain is not None else pt.PretrainOptions()
    if not isinstance(base, pt.PretrainOptions):
        raise ValueError(f"pretrain: expected train.pretrain.engine.PretrainOptions, got {type(base).__name__}")
    check_options(base, pt.build_parser())
    for c in opts.columns():  # every column's options checked before the first step
        pt.resolve_method_options(c.method, c.options("x"))
    check_towers(opts.model, opts.columns())
    pairs = opts.pairs()  # a typo in --vs fails here, before the first run
    if opts.data and not toyworld.is_toyworld(opts.data):
        raise ValueError(f"--data {opts.data}: not a toy-world folder (python -m extract.worlds.toyworld makes one); the "
                         "comparison evaluates on a toy world's test split and its hard negatives")
    out = Path(opts.out)
    # every setting, the runs' common PretrainOptions included: a finished run is kept only under the same ones
    config = json.loads(json.dumps(dataclasses.asdict(opts), default=str))
    claim(out, config, neutral=NEUTRAL | AFTER_TRAINING)
    out.mkdir(parents=True, exist_ok=True)
    save_config(config, out / "config.json")
    world = Path(opts.data) if opts.data else out / "toyworld"
    if not opts.data and not (world / "meta.json").is_file():
        toyworld.generate(world, opts.n, opts.seed, holdout=opts.holdout)
    masks = toy_masks(world, out / "toy-masks", opts.model) if any(c.needs_toy_masks for c in opts.columns()) \
        else None
    # an epoch checkpoint where the curves want an evaluation (only the newest is kept)
    common = dict(data=str(world), model=opts.model, batch_size=opts.batch_size, workers=opts.workers,
                  tensorboard=False, save_every_n_steps=0, save_frequency=opts.eval_every_n_epochs, keep_checkpoints=1)
    settings = [(c, h) for c in opts.columns() for h in opts.hard_negatives]
    per_epoch = max(1, train_images(world) // opts.batch_size)

    def options(c: Column, h: str, seed: int, run_dir: Path, max_steps: int, **more) -> Any:
        # epochs: the count the steps span, so schedules by epoch (CLIP-PGS's alpha) see the real one
        return dataclasses.replace(base, method=c.method, method_options=c.options(masks), hard_negatives=h,
                                   seed=seed, out=str(run_dir), max_steps=max_steps,
                                   epochs=math.ceil(max_steps / per_epoch), **common, **more)

    budgets = {}
    for budget in opts.budget:
        say(f"== budget: {'equal steps' if budget == 'steps' else 'equal wall-clock'} ==")
        steps, per_step = _budget_steps(opts, budget, settings, out, options)
        runs: dict[str, dict[int, dict]] = {}
        todo = []
        for (c, h) in settings:
            name = column_name(c, h)
            for seed in range(opts.seed, opts.seed + opts.seeds):
                run_dir = out / budget / _slug(name) / f"seed-{seed}"
                done = finished(run_dir, steps[name])
                if done is None:
                    todo.append(Run(name, seed, run_dir, options(c, h, seed, run_dir, steps[name],
                                                                 eval_every_n_epochs=opts.eval_every_n_epochs)))
                else:
                    say(f"{name} seed {seed}: finished in an earlier call of this comparison, kept ({run_dir})")
                    runs.setdefault(name, {})[seed] = done

        def record(r: Run, summary: dict, seconds: float) -> None:
            desc = json.loads((r.dir / "model.json").read_text())
            done = {"seed": r.seed, "steps": desc["step"], "epochs": desc["epoch"], "weights": summary["weights"],
                    "train_seconds": seconds, "calibrated_seconds_per_step": per_step.get(r.name),
                    "curve": _curve(r.dir, per_epoch), **r.note}
            (r.dir / RUN_RECORD).write_text(json.dumps(done, indent=2) + "\n")
            say(f"{r.name} seed {r.seed}: {done['steps']} steps ({done['epochs']:.1f} epochs) in {seconds:.0f} s")
            runs.setdefault(r.name, {})[r.seed] = done

        train_runs(todo, opts.jobs, record)
        if opts.unmasked_tuning_steps:
            todo = []
            for (c, h) in settings:
                name = column_name(c, h)
                for seed in range(opts.seed, opts.seed + opts.seeds):
                    run_dir, start = out / budget / _slug(tuned_name(name)) / f"seed-{seed}", runs[name][seed]
                    done = finished(run_dir, opts.unmasked_tuning_steps, tuned_from=start["weights"],
                                    tuning_lr=opts.tuning_lr)
                    if done is None:
                        todo.append(Run(tuned_name(name), seed, run_dir,
                                        tuning_options(options(c, h, seed, run_dir, opts.unmasked_tuning_steps),
                                                       start["weights"], opts.tuning_lr),
                                        note={"tuned_from": start["weights"], "tuning_lr": opts.tuning_lr}))
                    else:
                        say(f"{tuned_name(name)} seed {seed}: finished in an earlier call of this comparison, kept")
                        runs.setdefault(tuned_name(name), {})[seed] = done
            say(f"unmasked tuning: {opts.unmasked_tuning_steps} steps of plain CLIP from every final model")
            train_runs(todo, opts.jobs, record)
        ordered = {name: [runs[name][s] for s in range(opts.seed, opts.seed + opts.seeds)] for name in opts.names()}
        budgets[budget] = _evaluate(opts, budget, world, ordered, out / budget, pairs)
    text = "\n".join(f"## {'Equal steps' if b == 'steps' else 'Equal wall-clock'}\n\n{r['markdown']}"
                     for b, r in budgets.items())
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps({"config": config, "budgets": {
        b: {"runs": r["runs"], "table": r["table"]} for b, r in budgets.items()}}, indent=2, default=str) + "\n")
    return {"budgets": budgets, "markdown": text}


run = compare  # the name this job had before it took options


@dataclass
class Run:
    """One training run of the comparison: its column, seed, folder and complete options."""

    name: str
    seed: int
    dir: Path
    options: Any
    note: dict = field(default_factory=dict)  # more fields for its record (compare_run.json)


def train_runs(todo: list[Run], jobs: int, record) -> None:
    """Train ``todo``, ``jobs`` at a time, calling ``record(run, summary, seconds)`` as each finishes. One job trains
    in this process; more start a process per run (:mod:`train.child`: nothing of this process's state is shared),
    each with its share of the threads (:func:`train.child.job_plan`). A run that fails stops new ones from starting;
    those already running finish and are recorded, so the same command again resumes after them."""
    from train.pretrain import engine as pt

    if jobs == 1 or len(todo) <= 1:
        for r in todo:
            t0 = time.perf_counter()
            summary = pt.pretrain(dataclasses.replace(r.options, out=str(_fresh(r.dir))))
            record(r, summary, time.perf_counter() - t0)
        return
    from multiprocessing.connection import wait

    import torch

    from train.child import Child, ChildFailed, context, cores, job_plan

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    threads, slot_gpu = job_plan(jobs, cores(), gpus)
    ctx = context(["train.pretrain.engine", __name__])
    queue, free, running, failed = list(todo), list(range(jobs)), {}, None
    say(f"{len(todo)} runs, {jobs} at a time ({threads} CPU threads each{', one GPU each' if gpus > 1 else ''})")
    try:
        while running or (queue and failed is None):
            while queue and free and failed is None:
                slot, r = free.pop(0), queue.pop(0)
                _fresh(r.dir).mkdir(parents=True)
                gpu = slot_gpu[slot] if r.options.device is None else None
                child = Child(f"{r.name} seed {r.seed}", "train.pretrain.engine:pretrain", {"opts": r.options},
                              r.dir / "train.log", threads=threads, gpu=gpu, ctx=ctx)
                running[child.sentinel] = (slot, r, child)
                say(f"{r.name} seed {r.seed}: started (log: {child.log})")
            wait(list(running), timeout=60)
            for sentinel in [s for s, v in running.items() if v[2].done()]:
                slot, r, child = running.pop(sentinel)
                free.append(slot)
                try:
                    summary = child.join()
                except ChildFailed as e:
                    failed = failed or e
                    continue
                record(r, summary, time.perf_counter() - child.started)
    finally:
        for _, _, child in running.values():  # interrupted: no run outlives the comparison
            child.stop()
    if failed:
        raise RuntimeError(f"{failed}. The runs that finished are kept: the same command again resumes.")


def _budget_steps(opts: CompareOptions, budget: str, settings: list, out: Path, options) -> tuple[dict, dict]:
    """Steps of every column under ``budget``: ``--steps`` each, or what fits in ``--minutes-per-method`` at the step
    time a calibration run measures (every column first, back to back, so a machine that gets busier or quieter
    later shifts them alike). Returns ``({name: steps}, {name: calibrated s/step})``."""
    from train.pretrain import engine as pt

    names = [column_name(c, h) for c, h in settings]
    if budget == "steps":
        return {n: opts.steps for n in names}, {}
    import torch

    from train.child import cores, job_plan

    per_step, threads = {}, torch.get_num_threads()
    if opts.jobs > 1:  # timed on the threads each run will have (the runs beside it may still slow it)
        torch.set_num_threads(job_plan(opts.jobs, cores(), 0)[0])
    try:
        for (c, h), name in zip(settings, names):
            calib = _fresh(out / "calibration" / _slug(name))
            pt.pretrain(options(c, h, opts.seed, calib, opts.calibration_steps, log_every_n_steps=1,
                                eval_every_n_epochs=0))
            per_step[name] = _step_seconds(calib / "log.csv")
    finally:
        torch.set_num_threads(threads)
    return {n: max(1, int(opts.minutes_per_method * 60 / per_step[n])) for n in names}, per_step


def _curve(run_dir: Path, per_epoch: int) -> list[dict]:
    """The run's per-epoch evaluation on the val split: ``[{"step", "epoch", metrics...}]`` in epoch order."""
    steps = json.loads((run_dir / "model.json").read_text())["step"]
    points = []
    for path in sorted((run_dir / "eval").glob("epoch_*.json")):
        epoch = int(path.stem.split("_")[1])
        points.append({"epoch": epoch, "step": min(steps, epoch * per_epoch), **json.loads(path.read_text())})
    return points


def _evaluate(opts: CompareOptions, budget: str, world: Path, runs: dict, out: Path,
              pairs: Sequence[tuple[str, str]] = ()) -> dict:
    """train.eval on the test split, one column per setting (its seeds' runs averaged), the first the reference;
    then each pair (A, B) of ``pairs``: A's difference from B on the same per-image results (no second pass)."""
    from train.eval import evaluate as ev

    names = list(runs)
    flat = [(name, r) for name in names for r in runs[name]]
    report = ev.evaluate(ev.EvaluateOptions(
        data=str(world), split="test", out=str(out / "eval"), tasks=["retrieval", "zeroshot", "compositional"],
        model=[opts.model] * len(flat), pretrained=[r["weights"] for _, r in flat],
        columns=[name for name, _ in flat], result_labels=[f"{name} seed {r['seed']}" for name, r in flat],
        bootstrap=opts.bootstrap, seed=opts.seed))
    plot = curves_plot(runs, out / "curves.png")
    table = dict(report["table"])
    if pairs:
        table["pairs"] = pair_rows(report, pairs, opts.bootstrap, opts.seed)
    markdown = (_budget_table(runs) + "\n" + summary_table(table) + "\nEvery figure (train.eval's report, "
                f"{out / 'eval' / 'results.md'}):\n\n" + report["markdown"] + (f"\nCurves: {plot}\n" if plot else ""))
    return {"runs": runs, "table": table, "markdown": markdown, "reports": report["reports"]}


def pair_rows(report: dict, pairs: Sequence[tuple[str, str]], resamples: int, seed: int) -> dict:
    """``{"A vs B": {metric: {"delta", "delta_ci", "significant"}}}``: column A's seed-averaged difference from column
    B with the paired bootstrap over the test images, from ``train.eval``'s per-image results (``report``)."""
    from train.eval.report import comparison

    columns = report["table"]["columns"]
    rows = {}
    for a, b in pairs:
        table = comparison(report["results"], {b: columns[b], a: columns[a]}, report["per_query"], resamples, seed)
        rows[f"{a} vs {b}"] = {m: {k: e[k] for k in ("delta", "delta_ci", "significant") if k in e}
                               for m, e in table["metrics"][a].items() if "delta" in e}
    return rows


def summary_table(table: dict, metrics: Sequence[str] = SUMMARY_METRICS) -> str:
    """The headline figures, a row per column: mean ± sd over seeds, and after the reference the difference from
    it with its 95% paired bootstrap interval, ``*`` where the interval excludes 0 (``train.eval.evaluate.cell``
    at one decimal)."""
    from train.eval.report import cell

    cols = [m for m in metrics if any(m in v for v in table["metrics"].values())]
    lines = ["| column | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, entries in table["metrics"].items():
        cells = [cell(entries.get(m), digits=1, mark="*") for m in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, entries in (table.get("pairs") or {}).items():  # only the difference: a cell without a mean
        cells = [difference(entries[m]) if m in entries else "–" for m in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ref = table.get("reference")
    legend = (f"mean ± sd over seeds; ({'difference from ' + ref if ref else ''} [95% paired bootstrap interval over "
              "test images], * excludes 0)") if ref else "mean ± sd over seeds"
    if table.get("pairs"):
        legend += "; a row 'A vs B': A's mean minus B's, with the same interval"
    return "\n".join(lines) + "\n\n" + legend + "\n"


def difference(entry: dict, digits: int = 1) -> str:
    """A cell of a difference row: ``+1.2 [+0.3, +2.0]*`` (``*``: the interval excludes 0)."""
    f = f"+.{digits}f"
    text = format(entry["delta"], f)
    ci = entry.get("delta_ci")
    if ci and all(math.isfinite(v) for v in ci):
        text += f" [{ci[0]:{f}}, {ci[1]:{f}}]" + ("*" if entry.get("significant") else "")
    return text


def _budget_table(runs: dict) -> str:
    lines = ["| | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    lines.append("| training steps (epochs) | " + " | ".join(
        f"{statistics.mean(r['steps'] for r in rs):.0f} ({statistics.mean(r['epochs'] for r in rs):.1f})"
        for rs in runs.values()) + " |")
    lines.append("| training seconds per run | " + " | ".join(
        f"{statistics.mean(r['train_seconds'] for r in rs):.0f}" for rs in runs.values()) + " |")
    if any(rs[0]["calibrated_seconds_per_step"] for rs in runs.values()):  # tuned columns were not calibrated: -
        lines.append("| s / step (calibrated) | " + " | ".join(
            f"{rs[0]['calibrated_seconds_per_step']:.3f}" if rs[0]["calibrated_seconds_per_step"] else "–"
            for rs in runs.values()) + " |")
    return "\n".join(lines) + "\n"


def curves_plot(runs: dict, path: Path, metrics: Sequence[str] = CURVE_METRICS) -> Path | None:
    """Val-split curves of :data:`CURVE_METRICS` against steps: per column the mean over seeds, the band min..max.
    None (and a note) without matplotlib or without per-epoch evaluations."""
    if not any(r["curve"] for rs in runs.values() for r in rs):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'plugvlm[train]'); no curves.png written")
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for name, rs in runs.items():
            by_step: dict[int, list[float]] = {}
            for r in rs:
                for p in r["curve"]:
                    if metric in p:
                        by_step.setdefault(p["step"], []).append(p[metric])
            if not by_step:
                continue
            xs = sorted(by_step)
            line, = ax.plot(xs, [statistics.mean(by_step[x]) for x in xs], marker="o", ms=3, label=name)
            if len(rs) > 1:
                ax.fill_between(xs, [min(by_step[x]) for x in xs], [max(by_step[x]) for x in xs],
                                color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(metric + " (val)", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("percent")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: CompareOptions) -> None:
        print("\n" + compare(opts)["markdown"])

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
