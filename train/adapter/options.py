"""``python -m train.adapter``: train a compositional adapter head on a frozen backbone, from cached features
(or, with ``--unfreeze``, together with the backbone from raw data).

This module holds its options: :class:`AdapterOptions` (one dataclass for the command line, ``--config`` YAML and
Python), the parser that adds the method's head flags and ``python -m extract``'s pass-through flags, and
:func:`resolve`, the checks and method-dependent defaults every run goes through. The run itself:
``train.adapter.engine``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from adapters.heads.base import AdapterHead
from adapters.registry import ADAPTERS
from extract.components.hard_negatives import HardNegativeOptions, format_types, parse_types
from extract.common.cli import Parser, check_options, from_namespace, option
from extract.common.cli import build_parser as build_cli
from extract.common.config import (config_file, fraction, nonnegative_float, nonnegative_int, parse_with_config,
                                   positive_float, positive_int)
from extract.common.source_args import SourceOptions
from train.bad_steps import MAX_BAD_STEPS
from train.adapter.negatives import WORLD_NEGATIVES, split_world
from train.adapter.stopping import EVAL_STEPS

DEFAULT_LR = 5e-4          # head learning rate when its class names no head_lr
DEFAULT_BATCH_SIZE = 256   # per process, when --unfreeze does not take the head class's unfreeze_batch_size
PROG = "python -m train.adapter"


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
                                         "replace-obj, replace-rel, swap-att, swap-obj, each TYPE*N for N of "
                                         "it per caption (extract/components/hard_negatives.py); world: a toy "
                                         "world's own negatives of its training captions, each false of its scene "
                                         "(negatives.json; train/adapter/negatives.py), alone or first in the list "
                                         "(world,replace-rel*2). Default: the method's own, "
                                         "its head class's hard_negatives: all for grounded, none for the others")
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
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # else extract's --conf reads as --config
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
    world, drawn = split_world(spec)
    hard = format_types(parse_types(drawn))
    if world:
        hard = WORLD_NEGATIVES + ("," + hard if hard != "none" else "")
    if world and opts.unfreeze:
        raise ValueError("--hard-negatives world reads the world's negatives with the cached features; with --unfreeze "
                         "draw them from the parse instead (--hard-negatives all)")
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


def options_json(opts: AdapterOptions) -> dict:
    """``opts`` as plain JSON values (config.json, the run folder's claim, checkpoints)."""
    return json.loads(json.dumps(dataclasses.asdict(opts), default=str))
