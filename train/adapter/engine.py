"""``python -m train.adapter``: train a compositional adapter head on a frozen backbone, from cached features
(or, with ``--unfreeze``, together with the backbone from raw data).

    python -m train.adapter --method comalign                                  # tiny backbone, the default toy world
    python -m train.adapter --method comalign --data toy/ --out runs/comalign  # a toy world of your own
    python -m train.adapter --base ViT-B-32 --method comalign --data pairs.csv --detector yolov9c.pt \\
        --val-data val.csv --test-data test.csv --out runs/b32-comalign
    accelerate launch --multi_gpu --num_processes 4 -m train.adapter --base ViT-L-14 --method comalign ...

From Python the same job is ``train(AdapterOptions(method="comalign", data="toy/", epochs=2))``: the command line
only parses into :class:`AdapterOptions`, and both go through :func:`resolve`'s checks.

What it does, in order:

1. Resolves ``--method`` in the registry (``adapters.registry.ADAPTERS``; an unknown name lists the choices)
   and loads the frozen backbone: absent weights fail here, in seconds, naming the file to supply. Then the
   data (default: the embedded toy world, ``extract.data.toyworld.ensure``, generated at ``runs/toy`` on first use)
   and the run folder (default ``runs/<base>-<method>``; a folder holding a run with other settings is refused,
   ``extract.common.run_dir.claim``).
2. Gets the feature caches the method needs (its head class names the components; ``train.adapter.data``):
   built with ``python -m extract``'s code when missing, reused by fingerprint when present; a ``--cache`` built
   for another backbone or without the needed components is an error naming both. Held-out split: a toy
   world's ``val`` split, ``--val-data``, or a seeded ``--val-fraction`` of the training images (all captions
   of a held-out image are held out).
3. Trains with AdamW (no decay on biases, gains and scalars), warm-up + cosine or StepLR (``--schedule``),
   autocast (``--precision``), gradient accumulation, on one device or several (``accelerate launch`` /
   ``torchrun``: each rank's loss sees the global batch, gathered by the head). Batches are caption rows
   gathered from the memory-mapped cache, shuffled per epoch by ``(seed, epoch)``, with no image twice in a
   batch (``train.adapter.data.epoch_batches``).
4. Evaluates on the held-out split from cached features (retrieval R@k; per-type accuracy on the toy world's hard
   negatives), logs to ``metrics.csv``, ``history.json`` and TensorBoard (``RUN/tb``), and writes
   ``RUN/checkpoints/last.safetensors`` (``--resume`` continues from it exactly: weights, optimizer, schedule, RNG,
   position in the data order and the stopping rule's state). Without ``--epochs`` the run ends when the held-out
   figures stop improving, after a cool-down of the learning rate (``train.adapter.stopping``); with it, after that
   many epochs of warm-up + cosine (or ``--schedule``).
5. Fits the head's inference-only parameters on the held-out split (``fit_inference``: ComAlign's fusion
   weights, eq. 10-11), saves ``RUN/adapter.safetensors`` (+ ``.json``), a self-describing checkpoint that
   ``python -m train.eval --model RUN/adapter.safetensors`` and serving rebuild from the file alone, and
   writes the test-split table of the frozen base vs base + adapter (``RUN/eval/results.{json,md,png}``).

Gradient accumulation (``--accum-steps K``) splits each batch into K micro-batches for memory, with the
gradient of the whole batch: representations of every micro-batch are computed without gradients, the loss
is taken on the full batch, and each micro-batch is re-encoded with gradients and back-propagated against its
slice of the representation gradients (gradient caching, Gao et al. 2021, as open_clip's ``--accum-freq``);
the RNG state of each micro-batch's first pass is replayed, so even dropout sees the same masks.

Divergence: a step whose loss or gradients are not finite is skipped (no update) and logged; ``--max-bad-steps``
of them in a row abort the run with exit status 3, keeping the last good checkpoint.

``--unfreeze`` (heads whose class sets ``supports_unfreeze``, e.g. SmartCLIP's official recipe) fine-tunes the
backbone with the head (``train.adapter.live``): no feature cache; images and captions are read from the raw
source with the same held-out rules and batch order, the backbone runs in train mode with gradients in its own
AdamW groups at ``--backbone-lr`` (default: the head class's ``backbone_lr``), ``--context-length 248``
stretches the text positions first (Long-CLIP, ``extract.models.long_context``; the first 20 stay fixed). Held-out
evaluation re-encodes the held-out split with the current backbone every epoch; the checkpoint adds
``RUN/backbone.safetensors`` (open_clip's state dict), named with its SHA-256 and context length in the adapter's
description, so ``load_scorer(RUN/adapter.safetensors)`` rebuilds the fine-tuned model from the run folder alone.
The head's learning rate defaults to its class's ``head_lr`` (when it names one) in both modes.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from adapters.heads.base import AdapterHead, to_tensors
from adapters.checkpoint import load_training_state, read_meta, save_adapter, save_backbone_weights, \
    save_training_state
from adapters.registry import ADAPTERS
from adapters.scoring import cat_reps
from extract.components.hard_negatives import HardNegativeOptions, parse_types
from extract.common.cli import Parser, check_options, from_namespace, option, progress, run_job, say
from extract.common.cli import build_parser as build_cli
from extract.common.config import (config_file, fraction, nonnegative_float, nonnegative_int, parse_with_config, positive_float,
                            positive_int, save_config)
from extract.common.source_args import SourceOptions
from extract.common.tensorfile import first_nonfinite
from extract.data.toyworld import is_toyworld
from train.bad_steps import MAX_BAD_STEPS, BadSteps
from train.adapter.data import (cache_config, caption_rows_of, check_cache, epoch_batches, extraction_options,
                                final_table_data, obtain_cache, split_images)
from train.adapter.stopping import EVAL_STEPS, Plateau, held_out_score
from train.adapter.heldout import CachedBase, HeldOut, attach_toyworld_negatives, encode_heldout, evaluate_heldout, \
    heldout_split

# options that must not change across --resume for the continuation to be exact
_RESUME_KEYS = ("method", "base", "epochs", "patience", "min_delta", "cooldown", "max_epochs", "batch_size",
                "accum_steps", "lr", "weight_decay", "beta1", "beta2", "eps",
                "schedule", "warmup", "step_epochs", "gamma", "precision", "grad_clip", "seed", "unfreeze",
                "backbone_lr", "context_length")
# values of keys added since the first checkpoints, so those still resume
_RESUME_KEY_DEFAULTS = {"unfreeze": False, "backbone_lr": None, "context_length": None, "patience": 3,
                        "min_delta": 0.5, "cooldown": 0.2, "max_epochs": 30}
DEFAULT_LR = 5e-4          # head learning rate when its class names no head_lr
DEFAULT_BATCH_SIZE = 256   # per process, when --unfreeze does not take the head class's unfreeze_batch_size
PROG = "python -m train.adapter"


# --------------------------------------------------------------------------------------------- options
class _OptionalValue(argparse.Action):
    """``--resume [PATH]``: the value, or "auto" (the run folder's own training state) when none follows."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, "auto" if values is None else values)


@dataclass
class AdapterOptions(SourceOptions, HardNegativeOptions):
    """What ``python -m train.adapter`` does, as data: ``train(AdapterOptions(method="comalign", data="toy"))`` runs
    the same job as the command line with those flags, after the same checks (:func:`resolve`).

    ``head_config``: fields of the method's ``Config`` (the flags its head group generates; ``{"layers": 1}``).
    ``extract_options``: ``python -m extract`` options passed through to the extraction (``{"detector": "y.pt"}``;
    the method's own ``extract_options`` fill the rest). ``components``: a comma string or a list. Left at None,
    ``data`` is the embedded toy world, ``out`` ``runs/<base>-<method>``, and ``lr`` / ``batch_size`` /
    ``backbone_lr`` the head class's (:func:`resolve` fills them). ``resume``: "auto" (or True) for the run
    folder's own training state, or a training-state file."""

    method: str | None = option(None, choices=ADAPTERS.names(), help="adapter head to train (required)")
    hard_negatives: object = option(None, group="hard negatives",
                                    help="NegCLIP's hard negatives as extra image->text columns, drawn per training "
                                         "caption from its parse: none, all, or a comma list from replace-att, "
                                         "replace-obj, replace-rel, swap-att, swap-obj "
                                         "(extract/components/hard_negatives.py; default: the method's own, "
                                         "its head class's hard_negatives: all for grounded, none for the others)")
    base: str = option("tiny", help="backbone alias or open_clip model name (ViT-B-32, ViT-L-14, ...)")
    pretrained: str | None = option(None, help="tag, checkpoint path or 'none' (default: the alias's weights)")
    # data
    data: str | None = option(None, group="data",
                              help="training data: toy-world folder, CSV/TSV, COCO JSON, .tar shards (default: the "
                                   "embedded toy world, generated at runs/toy on first use)")
    val_data: str | None = option(None, group="data", help="held-out data (default: the toy world's val split, else "
                                                           "--val-fraction of the training images)")
    val_fraction: float = option(0.05, type=fraction, group="data",
                                 help="held-out share of training images without --val-data (their captions are held "
                                      "out too)")
    test_data: str | None = option(None, group="data", help="data for the final table (default: the toy world's test "
                                                            "split, else --val-data)")
    benchmark: list = option(default_factory=list, action="append", metavar="NAME=PATH", group="data",
                             help="compositional benchmark for the final table (train.eval's --benchmark; "
                                  "repeatable)")
    image_root: str | None = option(None, group="data",
                                    help="folder relative image paths start from (CSV/COCO/benchmarks)")
    cache_dir: str = option("runs/cache", group="data", help="feature caches (one sub-folder per settings fingerprint)")
    cache: str | None = option(None, group="data",
                               help="train from this finished cache (checked against --base and --method)")
    components: Any = option("", group="data", help="extract these components too (comma list; the method's own are "
                                                    "always extracted), so one cache serves several methods")
    workers: int | None = option(None, type=nonnegative_int, group="data",
                                 help="extraction: image decoding processes (default: python -m extract's)")
    extract_batch_size: int = option(128, type=positive_int, group="data", help="extraction: backbone batch size")
    extract_precision: str = option("fp32", choices=["fp32", "fp16", "bf16"], group="data",
                                    help="extraction: backbone precision")
    # optimisation
    epochs: int | None = option(None, type=positive_int, group="optimisation",
                                help="passes over the training captions, with --schedule (default: none, train "
                                     "until the held-out score stops improving, then cool down: the options under "
                                     "'when to stop'; train/adapter/stopping.py)")
    batch_size: int | None = option(None, type=positive_int, group="optimisation",
                                    help=f"contrastive batch per process (the global batch is this x processes; "
                                         f"default {DEFAULT_BATCH_SIZE}, with --unfreeze the head class's "
                                         "unfreeze_batch_size, a global batch, divided by the number of processes)")
    accum_steps: int = option(1, type=positive_int, group="optimisation",
                              help="split each batch into this many micro-batches (same gradient, less memory)")
    lr: float | None = option(None, type=positive_float, group="optimisation",
                              help=f"head learning rate (default: the head class's head_lr, else {DEFAULT_LR:g})")
    weight_decay: float = option(0.1, type=nonnegative_float, group="optimisation",
                                 help="AdamW weight decay (none on biases, gains and the logit scale)")
    beta1: float = option(0.9, type=fraction, group="optimisation", help="AdamW beta1")
    beta2: float = option(0.98, type=fraction, group="optimisation", help="AdamW beta2")
    eps: float = option(1e-6, type=positive_float, group="optimisation", help="AdamW epsilon")
    schedule: str = option("cosine", choices=["cosine", "step", "constant"], group="optimisation",
                           help="cosine: linear warm-up then cosine to 0; step: StepLR (the ComAlign paper's)")
    warmup: int = option(100, type=nonnegative_int, group="optimisation",
                         help="warm-up steps (cosine; at most a tenth of the run)")
    step_epochs: int = option(5, type=positive_int, group="optimisation", help="StepLR: epochs between decays")
    gamma: float = option(0.1, type=positive_float, group="optimisation", help="StepLR: decay factor")
    # when to stop without --epochs (train.adapter.stopping)
    patience: int = option(3, type=positive_int, group="when to stop (without --epochs)",
                           help=f"held-out evaluations (at least {EVAL_STEPS} steps apart) without a gain of "
                                "--min-delta before the cool-down starts")
    min_delta: float = option(0.5, type=nonnegative_float, group="when to stop (without --epochs)",
                              help="the gain, in points of the held-out score, that counts as an improvement")
    cooldown: float = option(0.2, type=fraction, group="when to stop (without --epochs)",
                             help="the cool-down's length, a share of the steps before it (whole epochs): the "
                                  "learning rate falls linearly to 0, then the run ends")
    max_epochs: int = option(30, type=positive_int, group="when to stop (without --epochs)",
                             help="the most epochs a run takes, its cool-down included")
    grad_clip: float = option(0.0, type=nonnegative_float, group="optimisation",
                              help="clip the gradient norm (0: off)")
    precision: str = option("fp32", choices=["fp32", "bf16", "fp16"], group="optimisation",
                            help="autocast for the head")
    seed: int = option(0, type=nonnegative_int, group="optimisation",
                       help="seeds the head's initialisation, dropout, the batch order and a --val-fraction split "
                            "(default: 0)")
    device: str | None = option(None, group="optimisation",
                                help="torch device (default: accelerate's: cuda when present, else cpu)")
    # fine-tuning the backbone
    unfreeze: bool = option(False, action="store_true", group="fine-tuning the backbone (--unfreeze)",
                            help="train the backbone with the head, from raw images and captions (heads whose class "
                                 "sets supports_unfreeze)")
    backbone_lr: float | None = option(None, type=positive_float, group="fine-tuning the backbone (--unfreeze)",
                                       help="backbone learning rate (default: the head class's backbone_lr)")
    context_length: int | None = option(None, type=positive_int, group="fine-tuning the backbone (--unfreeze)",
                                        help="stretch the text context to this many tokens first (Long-CLIP; 248 in "
                                             "SmartCLIP; the first 20 positions stay fixed)")
    # run
    out: str | None = option(None, group="run", help="run folder: checkpoints, logs, evaluation (default: "
                                                     "runs/<base>-<method>)")
    resume: str | None = option(None, action=_OptionalValue, nargs="?", metavar="STATE", group="run",
                                help="continue from OUT/checkpoints/last.safetensors (or the given training-state "
                                     "file)")
    save_every: int = option(0, type=nonnegative_int, group="run",
                             help="also save the training state every N steps (0: at epoch ends only)")
    stop_after_steps: int = option(0, type=nonnegative_int, group="run",
                                   help="save and stop after this many steps in total (time-boxed jobs; continue "
                                        "with --resume; 0: off)")
    max_bad_steps: int = option(MAX_BAD_STEPS, type=positive_int, group="run",
                                help="abort after this many non-finite steps in a row")
    eval_batch_size: int = option(1024, type=positive_int, group="run",
                                  help="held-out evaluation: rows encoded at once")
    eval_every: int = option(1, type=nonnegative_int, group="run",
                             help="with --epochs: held-out evaluation every N epochs, logged and in history.json "
                                  "(0: only the final one, after the last epoch and the inference fit); without "
                                  f"--epochs the stopping rule evaluates at least {EVAL_STEPS} steps apart")
    final_eval: bool = option(True, action=argparse.BooleanOptionalAction, group="run",
                              help="write the frozen base vs base + adapter table on the test split (default: on)")
    eval_tasks: str = option("retrieval,compositional", group="run", help="train.eval tasks of the final table")
    # the generated groups (the method's head flags, python -m extract's flags)
    head_config: dict = field(default_factory=dict)
    extract_options: dict = field(default_factory=dict)


def _extract_actions() -> list[argparse.Action]:
    """python -m extract's options that pass through: all but those an adapter run sets itself (its own fields,
    some named differently: --extract-batch-size, --extract-precision) and the per-cache ``split``."""
    from extract.options import build_parser as extract_parser

    own = {f.name for f in dataclasses.fields(AdapterOptions)} | {"split", "help", "config", "quiet", "verbose"}
    return [a for a in extract_parser()._actions if a.dest not in own and a.option_strings]


def build_parser(head_cls: type[AdapterHead] | None = None) -> Parser:
    """The command line: :class:`AdapterOptions`' flags, python -m extract's pass-through flags and, given the
    method's head class, one flag per field of its ``Config``. ``parser.head_dests`` / ``parser.extract_dests``
    map those fields to their argparse dests."""
    p = build_cli(AdapterOptions, PROG, __doc__)
    x = p.add_argument_group("extraction (python -m extract options; the method's own needs are the default)")
    p.extract_dests = {}
    for a in _extract_actions():
        # SUPPRESS: only flags given by the user appear (the method's extract_options fill the rest)
        kw = dict(dest=a.dest, default=argparse.SUPPRESS, help=f"{a.help} (python -m extract's default: {a.default})")
        for key in ("choices", "type", "metavar"):
            if getattr(a, key) is not None:
                kw[key] = getattr(a, key)
        x.add_argument(*a.option_strings, **kw)
        p.extract_dests[a.dest] = a.dest
    p.head_dests = {}
    if head_cls is not None:
        p.head_dests = _add_head_group(p, head_cls)
    return p


def _add_head_group(p: argparse.ArgumentParser, head_cls: type[AdapterHead]) -> dict[str, str]:
    """One flag per field of ``head_cls.Config`` (``--head-NAME`` where NAME is taken by another option); returns
    field -> dest. A field another head group of ``p`` already has shares its flag (several methods' union)."""
    head_flags = p.__dict__.setdefault("head_flags", {})  # flag -> dest, over every head group of p
    taken = {s for a in p._actions for s in a.option_strings} - set(head_flags)
    dests = {a.dest for a in p._actions} - set(head_flags.values())
    group = p.add_argument_group(f"{head_cls.name} head (defaults: {head_cls.__name__}.Config)")
    out = {}
    for f in dataclasses.fields(head_cls.Config):
        flag, dest = "--" + f.name.replace("_", "-"), f.name
        if flag in taken or dest in dests:
            flag, dest = "--head-" + f.name.replace("_", "-"), "head_" + f.name
        if flag in head_flags:
            out[f.name] = head_flags[flag]
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        kw = dict(dest=dest, default=argparse.SUPPRESS, help=f"{f.metadata.get('help', '')} (default: {default!r})")
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        elif default is not None:
            kw["type"] = type(default)
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        group.add_argument(flag, **kw)
        out[f.name] = head_flags[flag] = dest
    return out


def _method_and_config(argv: Sequence[str] | None) -> tuple[str | None, dict | None]:
    """``--method`` (from the command line, else from ``--config``'s file) and that file's values, read once: the
    method decides the parser (its head's flags), which then parses everything with the same values."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--method")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    values = None
    if known.config:  # the parser that reports a bad file is built only when there is one to report
        values = config_file(Path(known.config), lambda message: build_parser().error(message))
    method = known.method if known.method is not None else (values or {}).get("method")
    return (method if isinstance(method, str) or method is None else str(method)), values


def _generated(ns: argparse.Namespace, dests: dict[str, str]) -> dict:
    """Values of a generated group's flags that were given (their defaults are SUPPRESS), by field name."""
    return {name: getattr(ns, dest) for name, dest in dests.items() if getattr(ns, dest, None) is not None}


def parse_args(argv: Sequence[str] | None = None) -> AdapterOptions:
    """The command line as resolved :class:`AdapterOptions`; a bad flag or combination exits with status 2 and one
    line naming it."""
    method, values = _method_and_config(argv)
    if method is not None and method not in ADAPTERS:
        build_parser().error(f"argument --method: invalid choice: {method!r} (choose from "
                             f"{', '.join(map(repr, ADAPTERS.names()))})")
    p = build_parser(ADAPTERS.get(method) if method else None)
    ns = parse_with_config(p, argv, values)
    if ns.method is None:
        p.error(f"--method is required; choose from {', '.join(ADAPTERS.names())}")
    try:
        return resolve(from_namespace(AdapterOptions, ns, head_config=_generated(ns, p.head_dests),
                                      extract_options=_generated(ns, p.extract_dests)), parser=p)
    except ValueError as e:
        p.error(str(e))


def parse_overrides(argv: Sequence[str], methods: Sequence[str], prog: str = PROG) -> dict:
    """``train.adapter`` flags given once for several runs (``train.adapter.compare``'s arguments after ``--``) as
    :class:`AdapterOptions` field values: only the flags given, head flags of any of ``methods`` into
    ``head_config``, extraction flags into ``extract_options``. Exits with status 2 on a bad flag."""
    p = build_parser()

    def error(message: str):
        p.exit(2, f"{prog}: error: after --: {message}\n  (`{PROG} --method NAME --help` lists these flags)\n")

    p.error = error
    heads = {}
    for m in methods:
        heads.update(_add_head_group(p, ADAPTERS.get(m)))
    for a in p._actions:
        a.default = argparse.SUPPRESS  # only what was given
    ns = p.parse_args(list(argv))
    names = {f.name for f in dataclasses.fields(AdapterOptions)}
    out = {k: v for k, v in vars(ns).items() if k in names}
    head = _generated(ns, {k: d for k, d in heads.items()})
    extract = _generated(ns, p.extract_dests)
    return {**out, **({"head_config": head} if head else {}), **({"extract_options": extract} if extract else {})}


def _checked(values: dict, dests: dict[str, str], parser: argparse.ArgumentParser, what: str) -> dict:
    """``values`` (field -> value) through the checks of their generated flags; ValueError for an unknown field."""
    from extract.common.config import config_value

    actions = {a.dest: a for a in parser._actions}
    unknown = sorted(set(values) - set(dests))
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(sorted(dests))}")
    out = {}
    for name, value in values.items():
        try:
            out[name] = value if value is None else config_value(parser, actions[dests[name]], value)
        except ValueError as e:
            raise ValueError(f"{what}[{name!r}]: {e}") from None
    return out


def resolve(opts: AdapterOptions, parser: Parser | None = None) -> AdapterOptions:
    """``opts`` checked as the command line checks its flags (types, choices, ranges, allowed combinations:
    ValueError naming the option) with the defaults that depend on the method filled in: ``lr``, ``batch_size``,
    ``backbone_lr`` from the head class, its components added to ``components`` and its ``extract_options`` under
    the given ones. Idempotent, and done once: options it returned come back unchanged (the command line resolves,
    then :func:`train` asks again). ``parser``: the command line's, which has the method's flags already. ``data``
    and ``out`` stay as given: the run resolves them after the backbone loads (:func:`place_run`)."""
    if getattr(opts, "_resolved", False):
        return opts
    names = ", ".join(ADAPTERS.names())
    if opts.method is None:
        raise ValueError(f"--method is required; choose from {names}")
    if opts.method not in ADAPTERS:
        raise ValueError(f"--method {opts.method!r}: no such method; choose from {names}")
    head_cls = ADAPTERS.get(opts.method)
    if opts.resume is True:
        opts = dataclasses.replace(opts, resume="auto")
    elif opts.resume is False:
        opts = dataclasses.replace(opts, resume=None)
    p = parser if parser is not None else build_parser(head_cls)
    check_options(opts, p)
    head_config = _checked(dict(opts.head_config or {}), p.head_dests, p, "head_config")
    extract = _checked(dict(opts.extract_options or {}), p.extract_dests, p, "extract_options")
    opts = dataclasses.replace(opts, head_config=head_config,
                               extract_options={**head_cls.extract_options, **extract})
    _check_unfreeze(opts, head_cls)
    lr = opts.lr if opts.lr is not None else float(getattr(head_cls, "head_lr", None) or DEFAULT_LR)
    batch_size = opts.batch_size
    if batch_size is None:
        per_run = getattr(head_cls, "unfreeze_batch_size", None) if opts.unfreeze else None
        world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
        batch_size = max(2, per_run // world) if per_run else DEFAULT_BATCH_SIZE
    if batch_size < 2 or batch_size % opts.accum_steps:
        raise ValueError("--batch-size must be >= 2 and a multiple of --accum-steps")
    if not opts.val_data and not 0 < opts.val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1) without --val-data, got {opts.val_fraction:g}")
    given = opts.components.split(",") if isinstance(opts.components, str) else list(opts.components or [])
    components = sorted({str(c).strip() for c in given if str(c).strip()} | set(head_cls.components))
    backbone_lr = opts.backbone_lr
    if opts.unfreeze and backbone_lr is None:
        backbone_lr = getattr(head_cls, "backbone_lr", None)
        if backbone_lr is None:
            raise ValueError(f"--unfreeze: {head_cls.__name__} names no backbone_lr; pass --backbone-lr")
    if opts.epochs is None and not opts.cooldown > 0:
        raise ValueError("--cooldown must be above 0 without --epochs (the run ends when its cool-down does)")
    spec = opts.hard_negatives if opts.hard_negatives is not None else getattr(head_cls, "hard_negatives", "none")
    hard = ",".join(parse_types(spec)) or "none"
    resolved = dataclasses.replace(opts, lr=lr, batch_size=batch_size, components=components,
                                   backbone_lr=backbone_lr, hard_negatives=hard)
    object.__setattr__(resolved, "_resolved", True)  # not a field: dataclasses.replace of it starts unresolved
    return resolved


def _check_unfreeze(opts: AdapterOptions, head_cls) -> None:
    """--unfreeze / --backbone-lr / --context-length: the allowed combinations (ValueError otherwise)."""
    from train.adapter.live import unfreeze_methods, unfreeze_support

    if not opts.unfreeze:
        for flag, value in (("--backbone-lr", opts.backbone_lr), ("--context-length", opts.context_length)):
            if value is not None:
                raise ValueError(f"{flag} only applies with --unfreeze (the cached path never changes the backbone)")
        return
    why = unfreeze_support(head_cls)
    if why is not None:
        raise ValueError(f"--unfreeze: method {head_cls.name!r} trains on cached features only ({why}); methods that "
                         f"support --unfreeze: {', '.join(unfreeze_methods(ADAPTERS)) or 'none'}")
    if opts.cache:
        raise ValueError("--unfreeze reads raw images and captions (--data); a feature cache (--cache) holds frozen "
                         "features")
    if opts.extract_precision != "fp32":
        raise ValueError("--unfreeze keeps fp32 weights for the optimizer; use --precision bf16/fp16 for mixed "
                         "precision, not --extract-precision")
    if opts.context_length is not None and opts.context_length < 2:
        raise ValueError("--context-length must be at least 2 tokens")


# --------------------------------------------------------------------------------------------- optimisation
def make_optimizer(head: AdapterHead, args, backbone_model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """AdamW over the head's param groups at ``--lr`` (a group may carry its own lr) and, with ``backbone_model``
    (``--unfreeze``), the backbone's own groups at ``--backbone-lr`` after them."""
    groups = head.param_groups(args.weight_decay)
    if not groups:
        raise ValueError(f"{head.name}: nothing to train (every parameter is frozen with this config)")
    if backbone_model is not None:
        from train.adapter.live import backbone_param_groups

        groups = groups + backbone_param_groups(backbone_model, args.weight_decay, args.backbone_lr)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)


def make_scheduler(optimizer, args, total_steps: int, steps_per_epoch: int, plateau: Plateau | None = None):
    """Per optimizer step: warm-up + cosine to 0, StepLR every ``--step-epochs`` epochs, or constant; without
    ``--epochs``, ``plateau``'s warm-up, stable phase and cool-down (train.adapter.stopping)."""
    if plateau is not None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, plateau.lr_factor)
    if args.schedule == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, args.step_epochs * steps_per_epoch),
                                               gamma=args.gamma)
    warmup = min(args.warmup, max(total_steps // 10, 0)) if args.schedule == "cosine" else 0
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if args.schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class AdapterRun:
    accelerator: object
    rank: int
    world: int
    device: torch.device
    scaler: object | None

    def autocast(self):
        return self.accelerator.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()


def _rng_state(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _leaves(reps: dict) -> dict:
    return {k: v.detach().requires_grad_(True) if v.is_floating_point() else v for k, v in reps.items()}


def compute_gradients(head: AdapterHead, images: dict, texts: dict, accum: int, ctx: AdapterRun) -> dict:
    """Back-propagate the head's loss on one (local) batch; returns the loss dict. ``accum > 1``: gradient
    caching over micro-batches (module docstring), same gradient as ``accum = 1``. ``head``: anything with the
    head's ``encode_image`` / ``encode_text`` / ``loss`` (``train.adapter.live.LiveModel`` for --unfreeze), and
    ``images`` / ``texts`` dicts of tensors with the batch first."""
    if accum == 1:
        with ctx.autocast():
            out = head.loss(head.encode_image(images), head.encode_text(texts), rank=ctx.rank, world_size=ctx.world)
        ctx.backward(out["loss"])
        return out
    n = len(next(iter(images.values())))
    bounds = np.linspace(0, n, accum + 1).astype(int)
    parts = [(a, b, {k: v[a:b] for k, v in images.items()}, {k: v[a:b] for k, v in texts.items()})
             for a, b in zip(bounds[:-1], bounds[1:])]
    states, cached = [], []
    with torch.no_grad():
        for _, _, img, txt in parts:
            states.append(_rng_state(ctx.device))
            with ctx.autocast():
                cached.append((head.encode_image(img), head.encode_text(txt)))
    resume_state = _rng_state(ctx.device)
    image_reps = _leaves(cat_reps([c[0] for c in cached]))
    text_reps = _leaves(cat_reps([c[1] for c in cached]))
    with ctx.autocast():
        out = head.loss(image_reps, text_reps, rank=ctx.rank, world_size=ctx.world)
    ctx.backward(out["loss"])  # gradients of the representations (+ of parameters the loss uses directly)
    for (a, b, img, txt), state in zip(parts, states):
        _set_rng_state(state, ctx.device)
        with ctx.autocast():
            live = (head.encode_image(img), head.encode_text(txt))
        terms = [(v.float() * full[key].grad[a:b].float()).sum()
                 for reps, full in zip(live, (image_reps, text_reps)) for key, v in reps.items()
                 if v.requires_grad and full[key].grad is not None]
        if terms:
            torch.stack(terms).sum().backward()
    _set_rng_state(resume_state, ctx.device)
    return out


_BUCKET_ELEMENTS = 1 << 24  # 64 MB of fp32 per all-reduce: a head is one bucket, an unfrozen backbone a few


def _all_reduce_grads(params: list[torch.nn.Parameter], world: int) -> None:
    """Average gradients over ranks, one flat all-reduce per bucket of parameters (what DDP does), so an unfrozen
    ViT-L does not need a second full copy of its gradients at once."""
    import torch.distributed as dist

    # every rank runs the same code, so the same parameters have gradients everywhere
    params = [p for p in params if p.grad is not None]
    start = 0
    while start < len(params):
        end, size = start, 0
        while end < len(params) and (end == start or size + params[end].numel() <= _BUCKET_ELEMENTS):
            size += params[end].numel()
            end += 1
        bucket = params[start:end]
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in bucket:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        start = end


def _all_ranks(flag: bool, ctx: AdapterRun) -> bool:
    if ctx.world <= 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _mean_over_ranks(out: dict, ctx: AdapterRun) -> dict[str, float]:
    """The loss dict's values for the log: on several ranks their mean, which is the global batch's loss."""
    names = list(out)
    values = torch.stack([out[k].detach().float().reshape(()) for k in names])
    if ctx.world > 1:
        import torch.distributed as dist

        dist.all_reduce(values)
        values /= ctx.world
    return dict(zip(names, values.tolist()))


def optimizer_step(head: torch.nn.Module, optimizer, out: dict, args, ctx: AdapterRun) -> str | None:
    """Average gradients over ranks, check them, clip, step (``head``: every trained parameter, the backbone's
    too with --unfreeze). Returns None on success, else why it was skipped."""
    params = [p for p in head.parameters() if p.requires_grad]
    if ctx.world > 1:
        _all_reduce_grads(params, ctx.world)
    if ctx.scaler is not None:
        ctx.scaler.unscale_(optimizer)
    loss_ok = _all_ranks(bool(torch.isfinite(out["loss"].detach()).all()), ctx)
    grads = [p.grad for p in params if p.grad is not None]
    grads_ok = bool(torch.stack([g.detach().float().abs().sum() for g in grads]).isfinite().all()) if grads else True
    reason = None if loss_ok and grads_ok else ("non-finite loss" if not loss_ok else "non-finite gradients")
    if reason is None:
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        if ctx.scaler is not None:
            ctx.scaler.step(optimizer)
        else:
            optimizer.step()
    if ctx.scaler is not None:
        ctx.scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return reason


# --------------------------------------------------------------------------------------------- logs
class _Logs:
    """metrics.csv (one row per step, skipped steps included) and TensorBoard scalars; rank 0 only."""

    def __init__(self, out: Path, enabled: bool, resume_step: int | None):
        self.enabled, self.path = enabled, out / "metrics.csv"
        self.rows: list[dict] = []
        self.fields: list[str] | None = None
        self.tb = None
        if not enabled:
            return
        if self.path.is_file() and resume_step is not None:  # drop rows a killed run wrote after the checkpoint
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.fields = reader.fieldnames
                kept = [r for r in reader if int(r["step"]) <= resume_step]
            self._rewrite(kept)
        elif self.path.exists():
            self.path.unlink()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"), purge_step=resume_step + 1 if resume_step is not None else None)
        except ImportError:
            print("note: tensorboard is not installed (pip install 'plugvlm[train]'); logging to metrics.csv only")

    def _rewrite(self, rows: list[dict]) -> None:
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields)
            w.writeheader()
            w.writerows(rows)

    def step(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.fields is None:
            self.fields = list(row) + [k for k in ("skipped", "reason") if k not in row]
            self._rewrite([])
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore").writerow(row)
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"train/{k}", v, row["step"])

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


# --------------------------------------------------------------------------------------------- the run, step by step
def _jsonable(opts: AdapterOptions) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(opts), default=str))


def _describe_base(opts: AdapterOptions, backbone) -> dict:
    info = backbone.describe(hash_weights=True)
    pretrained = opts.pretrained
    if pretrained and os.path.exists(pretrained):
        pretrained = os.path.abspath(pretrained)  # the checkpoint must find it from any working directory
    return {"base": opts.base, "pretrained": pretrained, "weights_sha256": info.get("weights_sha256"), "describe": info}


def _flat_metrics(result: dict) -> dict[str, float]:
    from train.eval.evaluate import headline

    return headline(result)


def _summary_line(metrics: dict[str, float]) -> str:
    keys = [k for k in ("retrieval T2I R@1", "retrieval I2T R@1", "toyworld all") if k in metrics]
    return ", ".join(f"{k.replace('retrieval ', '')} {metrics[k]:.2f}" for k in keys)


@dataclass
class Env:
    """Where the run happens (:func:`setup`): processes and device, the frozen backbone, the run folder."""

    accelerator: object
    ctx: AdapterRun
    is_main: bool
    backbone: object
    base_info: dict           # the original weights, before any fine-tuning
    out: Path | None = None   # set by place_run

    @property
    def state_path(self) -> Path:
        return self.out / "checkpoints" / "last.safetensors"

    def say(self, *parts) -> None:
        """A status line, from rank 0 only (silenced by --quiet)."""
        if self.is_main:
            say(*parts)

    def warn(self, text: str) -> None:
        """A warning line, from rank 0 only (kept by --quiet)."""
        if self.is_main:
            print(text)


@dataclass
class TrainData:
    """What the loop trains and evaluates on (:func:`load_data`)."""

    train_rows: np.ndarray       # caption rows trained on
    caption_image: np.ndarray    # [num_captions] image row of every caption of the training data
    extraction: dict             # how the arrays were made (the checkpoint's description)
    key: str                     # identifies the training data across --resume (the cache's fingerprint)
    test: dict                   # train.eval.evaluate data options of the final table ({}: none)
    global_batch: int = 0
    steps_per_epoch: int = 0
    cache: object = None         # the training FeatureCache (cached path)
    live: object = None          # train.adapter.live.LiveData (--unfreeze)
    val: HeldOut | None = None   # held-out arrays; with --unfreeze re-encoded every epoch (None until needed)
    negatives: object = None     # train.adapter.negatives.TrainNegatives (--hard-negatives)


@dataclass
class Model:
    """What trains (:func:`build_model`)."""

    head: AdapterHead
    trained: torch.nn.Module     # the head, or (--unfreeze) backbone + head behind the head's interface
    modules: dict                # extra modules of the training state ({"backbone": ...} with --unfreeze)
    optimizer: torch.optim.Optimizer
    scheduler: object
    resume_key: dict             # what a --resume must agree on
    plateau: Plateau | None = None  # without --epochs: when the run stops (train.adapter.stopping)


@dataclass
class State:
    """Where the run is: the position of the next batch and the counters, all in the training state, so
    ``--resume`` continues exactly."""

    epoch: int = 0
    batch: int = 0               # next batch of ``epoch``
    step: int = 0
    history: list = field(default_factory=list)
    bad: BadSteps = field(default_factory=BadSteps)  # skipped steps (train.bad_steps: the policy of both engines)
    stopped: bool = False        # by --stop-after-steps


@dataclass
class Run:
    """One run's pieces, as the steps after :func:`start_or_resume` share them."""

    opts: AdapterOptions
    env: Env
    data: TrainData
    model: Model
    state: State
    logs: _Logs


def setup(opts: AdapterOptions) -> Env:
    """Processes and device (accelerate), then the frozen backbone: absent weights fail here, in about a second,
    before any data is read, generated or extracted."""
    from accelerate import Accelerator

    from extract.models.backbone import load_backbone

    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[opts.precision]
    cpu = opts.device is not None and torch.device(opts.device).type == "cpu"
    accelerator = Accelerator(cpu=cpu or not torch.cuda.is_available(), mixed_precision=mixed)
    device = torch.device(opts.device) if opts.device and not cpu else accelerator.device
    ctx = AdapterRun(accelerator, accelerator.process_index, accelerator.num_processes, device,
               accelerator.scaler if mixed == "fp16" else None)
    backbone = load_backbone(opts.base, opts.pretrained, device=device, precision=opts.extract_precision)
    return Env(accelerator, ctx, accelerator.is_main_process, backbone, _describe_base(opts, backbone))


def place_run(opts: AdapterOptions, env: Env) -> AdapterOptions:
    """``opts`` with its data and run folder: without ``--data`` (or ``--cache``) the embedded toy world, generated
    on first use (``extract.data.toyworld.ensure``); without ``--out`` ``runs/<base>-<method>``. The folder is claimed
    (``extract.common.run_dir.claim``): one holding a run with other settings is refused, unless ``--resume``."""
    from extract.data import toyworld
    from extract.common.run_dir import claim, default_out

    if opts.data is None and opts.cache is None:
        env.say(f"no --data: training on the embedded toy world {_length(opts)}")
        if env.is_main:  # DEFAULT_N read at call time, so a test can make the default world small
            toyworld.ensure(toyworld.DEFAULT_PATH, toyworld.DEFAULT_N, toyworld.DEFAULT_SEED, say=env.say)
        env.accelerator.wait_for_everyone()
        opts = dataclasses.replace(opts, data=str(toyworld.DEFAULT_PATH))
    if opts.out is None:
        opts = dataclasses.replace(opts, out=str(default_out(opts.base, opts.method)))
        env.say(f"no --out: the run folder is {opts.out}")
    claim(Path(opts.out), _jsonable(opts), resume=bool(opts.resume))
    env.out = Path(opts.out)
    return opts


def load_data(opts: AdapterOptions, env: Env) -> TrainData:
    """The caches (built or reused) and the held-out split, or with ``--unfreeze`` the raw source's splits
    (``train.adapter.live``); the global batch checked against the training images."""
    check_batch_fits(opts, env.ctx.world)  # from the data's index: minutes of extraction must not end in an error
    data = _live_data(opts, env) if opts.unfreeze else _cached_data(opts, env)
    data.global_batch = opts.batch_size * env.ctx.world
    n_images = len(np.unique(data.caption_image[data.train_rows]))
    if data.global_batch > n_images:
        raise ValueError(f"the global batch ({data.global_batch}) exceeds the {n_images} training images: a batch "
                         "holds each image at most once (no caption is a negative of its own image); lower --batch-size")
    data.steps_per_epoch = len(data.train_rows) // data.global_batch
    if data.steps_per_epoch == 0:
        raise ValueError(f"{len(data.train_rows)} training captions make no batch of {data.global_batch}; lower "
                         "--batch-size")
    return data


def _cached_data(opts: AdapterOptions, env: Env) -> TrainData:
    """Caches for training and the held-out split (built or reused), the split itself and the toy world's hard
    negatives of the held-out images."""
    from adapters.adapter_scorer import LiveExtractor

    head_cls = ADAPTERS.get(opts.method)
    device, workers = str(env.backbone.device), _workers(opts)
    world = Path(opts.data) if opts.data and is_toyworld(opts.data) else None

    def cache_for(data, split=None):
        return obtain_cache(extraction_options(opts, data, split, device=device, workers=workers), env.backbone)

    if opts.cache:
        from extract.cache import FeatureCache

        cache = FeatureCache.open(opts.cache)
        check_cache(cache, head_cls, env.backbone, opts.extract_options)
    else:
        cache = cache_for(opts.data, "train" if world else None)
    missing = sorted((set(head_cls.image_keys) | set(head_cls.text_keys)) - set(cache.keys))
    if missing:
        raise ValueError(f"cache {cache.path} lacks arrays {missing} that {opts.method} reads")
    caption_image = cache.caption_image_index()
    extraction = cache_config(cache)
    box_source = (cache.settings.get("boxes") or {}).get("source")
    annotations = extraction.get("annotations") if box_source == "gt" and world is None else world
    extractor = LiveExtractor(env.backbone, extraction, box_source=box_source, annotations=annotations)

    if opts.val_data or world is not None:
        spec = opts.val_data or world
        val = heldout_split(cache_for(spec, "val" if is_toyworld(spec) else None), name="val")
        train_rows = np.arange(cache.num_captions)
    else:
        train_images, val_images = split_images(cache.num_images, opts.val_fraction, opts.seed)
        val = heldout_split(cache, val_images, name=f"val ({opts.val_fraction:g} of the training images)")
        train_rows = caption_rows_of(caption_image, train_images)
    negatives_world = world if not opts.val_data else (Path(opts.val_data) if is_toyworld(opts.val_data) else None)
    if negatives_world is not None and env.is_main:
        attach_toyworld_negatives(val, negatives_world, "val", extractor)
    description = {"fingerprint": cache.fingerprint, "settings": cache.settings, "args": extraction,
                   "path": str(cache.path)}
    negatives = None
    if opts.hard_negatives != "none":
        negatives = _training_negatives(opts, env, cache, train_rows, extractor, world)
    return TrainData(train_rows, caption_image, description, cache.fingerprint, final_table_data(opts), cache=cache,
                     val=val, negatives=negatives)


def _training_negatives(opts: AdapterOptions, env: Env, cache, train_rows: np.ndarray, extractor, world):
    """--hard-negatives: every training caption's negatives, drawn from the training captions' vocabulary and encoded
    once (``train.adapter.negatives``); on a toy world none names a held-out combination."""
    from extract.common.source_args import source_options
    from train.adapter.negatives import build_negatives, caption_texts

    if opts.cache:
        raise ValueError("--hard-negatives reads the training captions from --data; it does not work with --cache "
                         "alone: pass --data (the cache is reused by fingerprint)")
    options = {"image_root": opts.image_root} if opts.image_root and world is None else {}
    texts = caption_texts(cache, opts.data, "train" if world else None, {**options, **source_options(opts)})
    from extract.data.toyworld import heldout_of

    forbid = heldout_of(world) if world is not None else frozenset()
    return build_negatives(texts, train_rows, parse_types(opts.hard_negatives), extractor.text_arrays, seed=opts.seed,
                           forbid=forbid, batch_size=opts.extract_batch_size, say=env.say)


def _live_data(opts: AdapterOptions, env: Env) -> TrainData:
    """--unfreeze: the raw source's splits, and (fresh runs) the frozen base's held-out arrays, computed before the
    backbone is stretched or trained."""
    from train.adapter.live import prepare_live

    live = prepare_live(opts, env.backbone, env.base_info["describe"], ADAPTERS.get(opts.method))
    val = live.heldout(opts.extract_batch_size, _workers(opts)) if env.is_main and not opts.resume else None
    negatives = None
    if opts.hard_negatives != "none":  # tokenized per batch: the backbone being trained encodes them
        from extract.data.toyworld import heldout_of
        from train.adapter.negatives import LiveNegatives, draw_negatives

        drawn = draw_negatives(live.train.texts, live.train_rows, parse_types(opts.hard_negatives), seed=opts.seed,
                               forbid=heldout_of(live.world) if live.world is not None else frozenset())
        env.say(drawn.summary(len(live.train_rows)))
        negatives = LiveNegatives(drawn, env.backbone.tokenizer, env.backbone.context_length,
                                  text_arrays=live.data_arrays.texts if live.data_arrays else None)
    return TrainData(live.train_rows, live.caption_image, live.extraction, f"live {live.train.name}",
                     final_table_data(opts), live=live, val=val, negatives=negatives)


def build_model(opts: AdapterOptions, env: Env, data: TrainData) -> Model:
    """The head (and with ``--unfreeze`` the backbone made trainable, its text context stretched first), AdamW and
    the schedule."""
    head_cls = ADAPTERS.get(opts.method)
    backbone = env.backbone
    if data.live is not None:
        from extract.models.long_context import extend_backbone_context

        if opts.context_length is not None:
            # Long-CLIP §3.1: first 20 positions kept (and frozen by a gradient hook), the rest stretched
            extend_backbone_context(backbone, opts.context_length, freeze_kept=True)
        backbone.unfreeze()
    # Seeded right here: extraction may have drawn from the global RNG (DataLoader seeds), and every rank must
    # start from the same weights; dropout then gets a per-rank stream.
    torch.manual_seed(opts.seed)
    head = head_cls.from_config(opts.head_config, backbone.embed_dim).to(env.ctx.device)
    torch.manual_seed(opts.seed + 1 + env.ctx.rank)
    trained, modules = head, {}
    if data.live is not None:
        from train.adapter.live import LiveModel

        trained, modules = LiveModel(backbone, head), {"backbone": backbone.model}
    optimizer = make_optimizer(head, opts, backbone.model if data.live is not None else None)
    plateau = None
    if opts.epochs is None:  # the steps an epoch really takes (a batch holds each image once): the first epoch's
        plateau = Plateau.from_options(opts, len(_batches(opts, data, 0)))
    scheduler = make_scheduler(optimizer, opts, data.steps_per_epoch * (opts.epochs or 0), data.steps_per_epoch,
                               plateau)
    resume_key = {k: getattr(opts, k) for k in _RESUME_KEYS} | {
        "head_config": head.config_dict(), "weights_sha256": env.base_info["weights_sha256"],
        "cache": data.key, "world_size": env.ctx.world, "train_rows": int(len(data.train_rows))}
    return Model(head, trained, modules, optimizer, scheduler, resume_key, plateau)


def start_or_resume(opts: AdapterOptions, env: Env, model: Model) -> State:
    """A fresh state, or (``--resume``) the saved one with weights, optimizer, schedule and RNG restored, refused
    when the settings that decide the continuation differ. Then ``config.json`` is written."""
    state = State(bad=BadSteps(opts.max_bad_steps))
    if opts.resume:
        path = Path(opts.resume) if opts.resume != "auto" else env.state_path
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no training state at {path} (a run saves it at every epoch end)")
        theirs = {**_RESUME_KEY_DEFAULTS, **read_meta(path).get("resume_key", {})}
        diff = [f"{k}: {theirs.get(k)!r} -> {v!r}" for k, v in model.resume_key.items() if theirs.get(k) != v]
        if diff:
            raise ValueError(f"--resume {path}: this run's settings differ from the checkpoint's, so it would not "
                             "continue the same run:\n  " + "\n  ".join(diff))
        meta = load_training_state(path, model.head, model.optimizer, model.scheduler, env.ctx.scaler, model.modules)
        state = State(meta["epoch"], meta["batch"], meta["step"], meta.get("history", []),
                      bad=BadSteps(opts.max_bad_steps))
        state.bad.load(meta)
        if model.plateau is not None:
            model.plateau.load(meta.get("plateau") or {})
        torch.set_rng_state(load_rng_for_rank(path, env.ctx.rank))
        env.say(f"resuming {path} at epoch {state.epoch}, batch {state.batch} (step {state.step})")
    if env.is_main:
        env.out.mkdir(parents=True, exist_ok=True)
        save_config(_jsonable(opts), env.out / "config.json")
    return state


def begin(run: Run) -> None:
    """Say what trains on what; on a fresh start, the frozen base's held-out figures (the history's first row)."""
    opts, env, data, model = run.opts, run.env, run.data, run.model
    if data.live is not None:
        held = f"held-out {len(data.live.val.records)} images / {len(data.live.val.texts)} captions"
    else:
        held = (f"held-out {len(data.val.image_rows)} images / {len(data.val.caption_rows)} captions"
                + (f" + {len(data.val.negatives)} hard negatives" if data.val.negatives else ""))
    n_images = len(np.unique(data.caption_image[data.train_rows]))
    trainable = sum(p.numel() for p in model.trained.parameters() if p.requires_grad)
    tuned = ""
    if data.live is not None:
        tuned = (f" (backbone lr {opts.backbone_lr:g}, head lr {opts.lr:g}"
                 + (f", text context {env.backbone.context_length}" if opts.context_length else "") + ")")
    info = env.base_info["describe"]  # what is loaded, said once (open_clip's own "no pretrained weights" is muted)
    weights = {"random": "random weights", "file": f"weights {info.get('weights_file')}"}.get(
        info.get("weights"), f"open_clip weights '{info.get('pretrained')}'")
    env.say(f"backbone: {opts.base} ({info.get('model')}, {weights})")
    plateau = run.model.plateau  # without --epochs: the steps an epoch really takes
    per_epoch = plateau.steps_per_epoch if plateau is not None else data.steps_per_epoch
    env.say(f"{opts.method} on {opts.base}{' (fine-tuning the backbone)' if data.live is not None else ''}: "
            f"{len(data.train_rows)} training captions of {n_images} images, {held}; {per_epoch} steps/epoch "
            f"{_length(opts, plateau)}, global batch {data.global_batch} on {env.ctx.world} process(es), "
            f"{trainable:,} trainable parameters{tuned}")
    if env.is_main and not opts.resume:
        base = _flat_metrics(evaluate_heldout(CachedBase(), data.val, env.ctx.device, opts.eval_batch_size))
        env.say(f"frozen base on {data.val.name}: {_summary_line(base)}")
        run.state.history.append({"epoch": 0, "step": 0, "model": "base", **base})


def train_epoch(run: Run, epoch: int) -> None:
    """The steps of one epoch from the state's position: all of them, or up to ``--stop-after-steps`` (then the
    state is saved and ``state.stopped`` set)."""
    opts, env, data, model, state = run.opts, run.env, run.data, run.model, run.state
    ctx, head_cls = env.ctx, type(model.head)
    batches = _batches(opts, data, epoch)

    def mine(rows: np.ndarray) -> np.ndarray:  # this rank's slice of a global batch
        return rows[ctx.rank * opts.batch_size:(ctx.rank + 1) * opts.batch_size]

    if data.live is not None:  # images decoded and captions tokenized by DataLoader workers, batches in this order
        from train.adapter.live import batch_loader

        loader = iter(batch_loader(data.live.train, [mine(b) for b in batches[state.batch:]], env.backbone,
                                   _workers(opts), keep_pixels=bool(data.live.data_arrays
                                                                    and data.live.data_arrays.needs_pixels)))
    keys = list(dict.fromkeys([*head_cls.image_keys, *head_cls.text_keys]))
    trained = model.trained
    if data.negatives is not None:
        from train.adapter.negatives import NegativeLoss

        trained = NegativeLoss(model.trained, opts.hard_negative_weight, data.negatives.types)
    model.trained.train()
    bar = progress(range(state.batch, len(batches)), desc=f"epoch {epoch + 1}/{opts.epochs or model.plateau.end_epoch}",
                   unit="step", disable=not env.is_main)
    for b in bar:
        t0 = time.perf_counter()
        if data.live is not None:
            images, texts, rows = _live_batch(next(loader), data.live, ctx, env.warn)
            if data.negatives is not None:
                texts.update({k: v.to(ctx.device) for k, v in data.negatives.batch(rows).items()})
        else:
            arrays = to_tensors(data.cache.batch(mine(batches[b]), keys), ctx.device)
            images, texts = {k: arrays[k] for k in head_cls.image_keys}, {k: arrays[k] for k in head_cls.text_keys}
            if data.negatives is not None:
                texts.update(to_tensors(data.negatives.batch(mine(batches[b]), head_cls.text_keys), ctx.device))
        out = compute_gradients(trained, images, texts, opts.accum_steps, ctx)
        lr = model.optimizer.param_groups[0]["lr"]
        lrs = {"lr_backbone": model.optimizer.param_groups[-1]["lr"]} if data.live is not None else {}
        reason = optimizer_step(model.trained, model.optimizer, out, opts, ctx)
        with warnings.catch_warnings():  # a skipped first step is not the misuse torch warns about
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")
            model.scheduler.step()  # skipped steps count: the schedule follows the step number
        state.step, state.batch = state.step + 1, b + 1
        row = {"step": state.step, "epoch": epoch + (b + 1) / len(batches), "lr": lr, **lrs,
               **_mean_over_ranks(out, ctx), "seconds": time.perf_counter() - t0,
               "skipped": int(reason is not None), "reason": reason or ""}
        run.logs.step(row)
        if reason is None:
            state.bad.good()
            bar.set_postfix(loss=f"{row['loss']:.4f}")
        else:
            _skipped_step(run, reason)
        if opts.save_every and state.step % opts.save_every == 0:
            save_state(run)
        if opts.stop_after_steps and state.step >= opts.stop_after_steps:
            state.stopped = True
            break
    bar.close()
    if state.stopped:
        save_state(run)
        env.say(f"stopped after step {state.step} (--stop-after-steps); continue with --resume")


def _skipped_step(run: Run, reason: str) -> None:
    """Count a step skipped as non-finite; stop the run after --max-bad-steps in a row (train.bad_steps)."""
    state = run.state
    stop = state.bad.bad(state.step)
    run.env.warn(state.bad.warning(state.step, reason))
    if stop:
        run.logs.close()
        path = run.env.state_path
        raise state.bad.stopped(str(path) if path.exists() else None, resume="--resume",
                                advice="lowering --lr, setting --grad-clip, or checking the cache for NaN features")


def save_state(run: Run) -> bool:
    """The training state at the state's position; refused (False) during a run of skipped steps or when the
    weights are not finite, so the file on disk stays the last good state."""
    env, model, state = run.env, run.model, run.state
    path = env.state_path
    if not state.bad.clean or first_nonfinite(dict(model.trained.named_parameters())) is not None:
        why = (f"{state.bad.in_a_row} step(s) in a row skipped as non-finite" if not state.bad.clean
               else "the weights are not finite")
        kept = f"{path} keeps the last good state" if path.is_file() else "no good state has been saved yet"
        env.warn(f"warning: not saving at step {state.step}: {why}; {kept}")
        return False
    if env.is_main:
        save_training_state(path, model.head, model.optimizer, model.scheduler, env.ctx.scaler, {
            "epoch": state.epoch, "batch": state.batch, "step": state.step, **state.bad.state(),
            "history": state.history, "resume_key": model.resume_key,
            "plateau": model.plateau.state() if model.plateau is not None else None,
            "args": _jsonable(run.opts), "base": env.base_info, "extraction": run.data.extraction}, model.modules)
    _save_rank_rng(path, env.ctx.rank)
    env.accelerator.wait_for_everyone()
    return True


def end_epoch(run: Run, epoch: int) -> None:
    """Held-out figures after ``epoch`` when ``--eval-every`` says so, and after the last one (rank 0; with --unfreeze
    the split re-encoded by the backbone as it is now), logged and added to history.json; then the training state at
    the next epoch's start."""
    opts, env, data, state, plateau = run.opts, run.env, run.data, run.state, run.model.plateau
    done = epoch + 1
    if plateau is not None:  # without --epochs: the stopping rule's evaluations (train.adapter.stopping)
        due = plateau.due(done)
    else:
        due = opts.eval_every > 0 and (done % opts.eval_every == 0 or done == opts.epochs)
    score = None
    if env.is_main and due:
        if data.live is not None:
            data.val = data.live.heldout(opts.extract_batch_size, _workers(opts))
        metrics = _flat_metrics(evaluate_heldout(run.model.head, data.val, env.ctx.device, opts.eval_batch_size))
        row = {"epoch": done, "step": state.step, "model": opts.method, **metrics}
        if plateau is not None:
            row["held-out score"] = score = held_out_score(metrics)
        state.history.append(row)
        run.logs.scalars("val", {k: v for k, v in row.items() if k not in ("epoch", "step", "model")}, state.step)
        env.say(f"epoch {done}/{opts.epochs or plateau.end_epoch}: {data.val.name}: {_summary_line(metrics)}")
        (env.out / "history.json").write_text(json.dumps(state.history, indent=2) + "\n")
    elif data.live is not None:
        data.val = None  # encoded by an earlier backbone: the final evaluation encodes it again
    if plateau is not None:
        if env.is_main:
            for line in plateau.update(done, state.step, score, lambda e: len(_batches(opts, data, e))):
                env.say("  " + line)
        _share_plateau(plateau, env.ctx)
    state.epoch, state.batch = done, 0
    save_state(run)


def _batches(opts: AdapterOptions, data: TrainData, epoch: int) -> list[np.ndarray]:
    """The global batches of ``epoch`` (caption rows; the same on every rank and on a --resume)."""
    return epoch_batches(data.train_rows, data.caption_image, data.global_batch, opts.seed, epoch, data.steps_per_epoch)


def _share_plateau(plateau: Plateau, ctx: AdapterRun) -> None:
    """Rank 0's decisions (it alone evaluates) to every rank: the learning rate and the last epoch follow them."""
    if ctx.world <= 1:
        return
    import torch.distributed as dist

    box = [plateau.state() if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    plateau.load(box[0])


def _length(opts: AdapterOptions, plateau: Plateau | None = None) -> str:
    """How long the run trains, in words."""
    if opts.epochs is not None:
        return f"for {opts.epochs} epoch{'s' * (opts.epochs != 1)}"
    every = f" every {plateau.eval_every} epoch{'s' * (plateau.eval_every != 1)}" if plateau else ""
    return (f"until the held-out score stops improving ({opts.patience} evaluations{every}; at most "
            f"{opts.max_epochs} epochs)")


def finish(run: Run, summary: dict) -> dict:
    """Rank 0 after the last epoch: the head's inference-only parameters fitted on the held-out split, the adapter
    checkpoint (+ the fine-tuned backbone with --unfreeze), the final table, summary.json."""
    opts, env, data, model = run.opts, run.env, run.data, run.model
    head, device, out = model.head, env.ctx.device, env.out
    model.trained.eval()
    if data.live is not None and data.val is None:  # resumed after the last epoch's evaluation, or none was due
        data.val = data.live.heldout(opts.extract_batch_size, _workers(opts))
    image_reps, text_reps = encode_heldout(head, data.val, device, opts.eval_batch_size)
    fitted = head.fit_inference(image_reps, text_reps, data.val.caption_image)
    if fitted:
        env.say("fitted on the held-out split: " + ", ".join(f"{k} {v:.4g}" for k, v in fitted.items()))
    final_val = _flat_metrics(evaluate_heldout(head, data.val, device, opts.eval_batch_size))
    tuned = {}
    if data.live is not None:  # the fine-tuned backbone next to the adapter, named (and hashed) in its description
        tuned = {"backbone": {**save_backbone_weights(out / "backbone.safetensors", env.backbone.model),
                              "context_length": opts.context_length, "lr": opts.backbone_lr}}
        if data.live.report.skips:
            data.live.report.to_json(out / "data_report.json")
            env.warn(f"warning: skipped while training: {data.live.report.summary()} (listed in "
                     f"{out / 'data_report.json'})")
    adapter_path = save_adapter(out / "adapter.safetensors", head, {
        "base": env.base_info, "extraction": data.extraction, "args": _jsonable(opts), "epoch": run.state.epoch,
        "step": run.state.step, "metrics": {"val": final_val}, "inference": fitted, "history": run.state.history,
        **tuned})
    env.say(f"checkpoint: {adapter_path} (held-out after fitting: {_summary_line(final_val)})")
    summary.update(adapter=str(adapter_path), val=final_val, inference=fitted)
    if model.plateau is not None:
        summary["stopping"] = model.plateau.summary()
    if tuned:
        summary["backbone"] = str(out / tuned["backbone"]["file"])
    if opts.final_eval and data.test:
        report = final_table(opts, adapter_path, data.test, device)
        summary.update(eval=report["results"], markdown=report["markdown"], reports=report["reports"])
    elif opts.final_eval:
        env.say("note: no test data (--test-data, --val-data or a toy world): no final table")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    env.accelerator.wait_for_everyone()
    return summary


def train(opts: AdapterOptions) -> dict:
    """The whole run (module docstring); ``opts`` gets the command line's checks first (:func:`resolve`).

    Returns a summary: ``out``, ``data``, ``steps``, ``skipped_steps``, ``stopped``, ``seconds``, ``history``, and
    after a finished run ``adapter`` (the checkpoint), ``val`` (held-out figures after fitting), ``inference``
    (fitted values), with the final table ``eval`` (train.eval's results), ``markdown`` (the table, not
    printed here) and ``reports``. Raises ValueError / OSError for what the user can fix, TrainingDiverged
    (exit status 3) after ``--max-bad-steps`` non-finite steps in a row."""
    opts = resolve(opts)
    env = setup(opts)                          # 1. processes, device, the backbone: absent weights fail here
    opts = place_run(opts, env)                #    the data (default: the toy world) and the run folder, claimed
    data = load_data(opts, env)                # 2. caches and the held-out split (raw splits with --unfreeze)
    model = build_model(opts, env, data)       # 3. head (+ backbone), optimizer, schedule
    state = start_or_resume(opts, env, model)  #    or the exact continuation of a saved state
    run = Run(opts, env, data, model, state, _Logs(env.out, env.is_main, state.step if opts.resume else None))
    begin(run)
    started = time.perf_counter()
    plateau = model.plateau                    # 4. the loop: --epochs, or until the held-out score stops improving
    while state.epoch < (opts.epochs or plateau.end_epoch) and not (plateau is not None and plateau.done):
        train_epoch(run, state.epoch)
        if state.stopped:
            break
        end_epoch(run, state.epoch)
    run.logs.close()
    summary = {"out": str(env.out), "data": opts.data, "steps": state.step, "skipped_steps": state.bad.total,
               "stopped": state.stopped, "seconds": time.perf_counter() - started, "history": state.history}
    if state.stopped or not env.is_main:
        env.accelerator.wait_for_everyone()  # matched by rank 0's barrier after its final steps
        return summary
    return finish(run, summary)                # 5. fitted inference parameters, checkpoint, final table


train_adapter = train  # the name train.demo and other jobs may import without shadowing their own train()


# --------------------------------------------------------------------------------------------- helpers
def check_batch_fits(opts: AdapterOptions, world: int) -> None:
    """Raise ValueError when the global batch cannot be filled from the training images the data lists: a batch
    holds each image once, so it needs at least as many training images. Counted from the source's index before
    any extraction; the exact count after decoding (or of a given --cache) is checked again later."""
    from extract.common.source_args import source_options
    from train.adapter.data import listed_images

    if opts.cache:  # nothing expensive precedes the exact check a given cache gets in load_data()
        return
    options = {**source_options(opts),
               **({"image_root": opts.image_root} if opts.image_root and not is_toyworld(opts.data) else {})}
    n = listed_images(opts.data, "train" if is_toyworld(opts.data) else None, **options)
    if n is None:
        return
    held_out = 0
    if not opts.val_data and not is_toyworld(opts.data):  # --val-fraction of these images is held out
        held_out = max(1, int(round(n * opts.val_fraction)))
    global_batch = opts.batch_size * world
    if global_batch > n - held_out:
        raise ValueError(f"the global batch ({global_batch}) exceeds the {n - held_out} training images of "
                         f"{opts.data}" + (f" ({n} listed, {held_out} held out by --val-fraction)" if held_out else "")
                         + ": a batch holds each image at most once; lower --batch-size (checked before extraction)")


def _default_workers() -> int:
    from extract.options import DEFAULT_WORKERS

    return DEFAULT_WORKERS


def _workers(opts: AdapterOptions) -> int:
    return opts.workers if opts.workers is not None else _default_workers()


def _live_batch(batch: dict, live, ctx: AdapterRun, warn) -> tuple[dict, dict, np.ndarray]:
    """A loaded --unfreeze batch as (images, texts) inputs of LiveModel, and its caption rows. Undecodable images
    dropped their pairs; on several ranks every rank keeps as many pairs as the smallest local batch (gathered shapes
    must agree)."""
    from train.adapter.live import take

    for skip in live.note_skips(batch["skips"]):
        warn(f"warning: training image {skip.id} ({skip.location}) skipped: {skip.reason} {skip.detail}".rstrip())
    n = len(batch["rows"])
    if ctx.world > 1:
        import torch.distributed as dist

        t = torch.tensor([n], device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        n = int(t.item())
    if n == 0:
        raise ValueError("a whole training batch of undecodable images: check the data with python -m "
                         "extract.data.check (its report lists them)")
    batch = take(batch, n)
    rows = batch["rows"].numpy()
    from_data = live.batch_arrays(rows, batch["sizes"], batch["raws"])  # region masks, trees (heads that read them)
    images = {"pixels": batch["pixels"], **from_data[0]}
    texts = {"ids": batch["ids"], "attention_mask": batch["attention_mask"], **from_data[1]}
    return {k: v.to(ctx.device) for k, v in images.items()}, {k: v.to(ctx.device) for k, v in texts.items()}, rows


def _save_rank_rng(state_path: Path, rank: int) -> None:
    """Each rank's torch RNG next to the training state (rank 0's is also inside it)."""
    from adapters.checkpoint import save_atomic

    save_atomic({"torch": torch.get_rng_state()}, state_path.with_name(f"rng-rank{rank}.safetensors"))


def load_rng_for_rank(state_path: Path, rank: int) -> torch.Tensor:
    from adapters.checkpoint import read_tensors  # verified against the digest save_atomic wrote

    path = Path(state_path).with_name(f"rng-rank{rank}.safetensors")
    if path.is_file():
        return read_tensors(path)["torch"]
    return torch.get_rng_state()


def final_table(opts: AdapterOptions, adapter_path: Path, test: dict, device) -> dict:
    """Frozen base vs base + adapter on the test data (``test``: EvaluateOptions data fields), through
    train.eval.evaluate (the checkpoint is rebuilt from the file alone, components extracted live). Returns
    train.eval's report, the table in ``markdown`` (not printed)."""
    from train.eval.evaluate import EvaluateOptions, evaluate

    return evaluate(EvaluateOptions(
        model=[opts.base, str(adapter_path)], pretrained=[opts.pretrained] if opts.pretrained is not None else [],
        tasks=opts.eval_tasks, out=str(Path(opts.out) / "eval"), device=str(device),
        batch_size=min(opts.eval_batch_size, 256), seed=opts.seed, **test))


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: AdapterOptions) -> None:
        summary = train(opts)
        if summary.get("markdown"):  # the final table, once
            print(summary["markdown"])
            say("reports: " + ", ".join(summary["reports"]))

    return run_job(job, parse_args(argv))
