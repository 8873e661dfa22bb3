"""``python -m train.adapter``: train a compositional adapter head on a frozen backbone, from cached features
(or, with ``--unfreeze``, together with the backbone from raw data).

    python -m train.adapter --method comalign --data toy/ --out runs/comalign             # tiny backbone, toy world
    python -m train.adapter --base ViT-B-32 --method comalign --data pairs.csv --detector yolov9c.pt \\
        --val-data val.csv --test-data test.csv --out runs/b32-comalign
    accelerate launch --multi_gpu --num_processes 4 -m train.adapter --base ViT-L-14 --method comalign ...

What it does, in order:

1. Resolves ``--method`` in the registry (``adapters.registry.ADAPTERS``; an unknown name lists the choices)
   and loads the frozen backbone: absent weights fail here, in seconds, naming the file to supply.
2. Gets the feature caches the method needs (its head class names the components; ``train.adapter_data``):
   built with ``python -m extract``'s code when missing, reused by fingerprint when present; a ``--cache`` built
   for another backbone or without the needed components is an error naming both. Held-out split: a toy
   world's ``val`` split, ``--val-data``, or a seeded ``--val-fraction`` of the training images (all captions
   of a held-out image are held out).
3. Trains with AdamW (no decay on biases, gains and scalars), warm-up + cosine or StepLR (``--schedule``),
   autocast (``--precision``), gradient accumulation, on one device or several (``accelerate launch`` /
   ``torchrun``: each rank's loss sees the global batch, gathered by the head). Batches are caption rows
   gathered from the memory-mapped cache, shuffled per epoch by ``(seed, epoch)``, with no image twice in a
   batch (``train.adapter_data.epoch_batches``).
4. Evaluates on the held-out split every epoch from cached features (retrieval R@k; per-type accuracy on the
   toy world's hard negatives), logs to ``metrics.csv``, ``history.json`` and TensorBoard (``RUN/tb``), and
   writes ``RUN/checkpoints/last.safetensors`` (``--resume`` continues from it exactly: weights, optimizer,
   schedule, RNG and position in the data order).
5. Fits the head's inference-only parameters on the held-out split (``fit_inference``: ComAlign's fusion
   weights, eq. 10-11), saves ``RUN/adapter.safetensors`` (+ ``.json``), a self-describing checkpoint that
   ``python -m train.evaluate --model RUN/adapter.safetensors`` and serving rebuild from the file alone, and
   writes the test-split table of the frozen base vs base + adapter (``RUN/eval/results.{json,md,png}``).

Gradient accumulation (``--accum-steps K``) splits each batch into K micro-batches for memory, with the
gradient of the whole batch: representations of every micro-batch are computed without gradients, the loss
is taken on the full batch, and each micro-batch is re-encoded with gradients and back-propagated against its
slice of the representation gradients (gradient caching, Gao et al. 2021, as open_clip's ``--accum-freq``);
the RNG state of each micro-batch's first pass is replayed, so even dropout sees the same masks.

Divergence: a step whose loss or gradients are not finite is skipped (no update) and logged; ``--max-bad-steps``
of them in a row abort the run with exit status 3, keeping the last good checkpoint.

``--unfreeze`` (heads whose class sets ``supports_unfreeze``, e.g. SmartCLIP's official recipe) fine-tunes the
backbone with the head (``train.adapter_live``): no feature cache; images and captions are read from the raw
source with the same held-out rules and batch order, the backbone runs in train mode with gradients in its own
AdamW groups at ``--backbone-lr`` (default: the head class's ``backbone_lr``), ``--context-length 248``
stretches the text positions first (Long-CLIP, ``extract.long_context``; the first 20 stay fixed). Held-out
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
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from adapters.base import AdapterHead, to_tensors
from adapters.checkpoint import load_training_state, read_meta, save_adapter, save_backbone_weights, \
    save_training_state
from adapters.registry import ADAPTERS
from adapters.scoring import cat_reps
from extract.config import (fraction, nonnegative_float, nonnegative_int, parse_with_config, positive_float,
                            positive_int, save_config)
from extract.tensorfile import first_nonfinite
from train.adapter_data import (cache_config, caption_rows_of, check_cache, epoch_batches, extraction_argv,
                                is_toyworld, obtain_cache, split_images)
from train.adapter_eval import CachedBase, HeldOut, attach_toyworld_negatives, encode_heldout, evaluate_heldout, \
    heldout_split

# python -m extract flags that train.adapter sets itself (or names differently) and does not pass through
_EXTRACT_OWN = {"help", "config", "base", "pretrained", "data", "out", "split", "components", "device", "precision",
                "batch_size", "workers", "image_root"}
# arguments that must not change across --resume for the continuation to be exact
_RESUME_KEYS = ("method", "base", "epochs", "batch_size", "accum_steps", "lr", "weight_decay", "beta1", "beta2", "eps",
                "schedule", "warmup", "step_epochs", "gamma", "precision", "grad_clip", "seed", "unfreeze",
                "backbone_lr", "context_length")
# values of keys added since the first checkpoints, so those still resume
_RESUME_KEY_DEFAULTS = {"unfreeze": False, "backbone_lr": None, "context_length": None}
DIVERGED = 3
DEFAULT_LR = 5e-4          # head learning rate when its class names no head_lr
DEFAULT_BATCH_SIZE = 256   # per process, when --unfreeze does not take the head class's unfreeze_batch_size


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the message names the last good checkpoint."""


# --------------------------------------------------------------------------------------------- CLI
def _extract_actions():
    from extract.pipeline import build_parser as extract_parser

    return [a for a in extract_parser()._actions if a.dest not in _EXTRACT_OWN and a.option_strings]


def build_parser(head_cls: type[AdapterHead] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.adapter", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", default=None, help=f"adapter method: {', '.join(ADAPTERS.names())}")
    p.add_argument("--base", default="tiny", help="backbone alias or open_clip model name (ViT-B-32, ViT-L-14, ...)")
    p.add_argument("--pretrained", default=None, help="tag, checkpoint path or 'none' (default: the alias's)")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, help="training data: toy-world folder, CSV/TSV, COCO JSON, .tar shards")
    d.add_argument("--val-data", default=None, help="held-out data (default: the toy world's val split, else "
                                                    "--val-fraction of the training images)")
    d.add_argument("--val-fraction", type=fraction, default=0.05, help="held-out share of training images without "
                                                                    "--val-data (their captions are held out too)")
    d.add_argument("--test-data", default=None, help="data for the final table (default: the toy world's test split, "
                                                     "else --val-data)")
    d.add_argument("--benchmark", action="append", default=[], metavar="NAME=PATH",
                   help="compositional benchmark for the final table (train.evaluate's --benchmark)")
    d.add_argument("--image-root", default=None, help="folder relative image paths start from (CSV/COCO/benchmarks)")
    d.add_argument("--cache-dir", default="runs/cache", help="feature caches (one sub-folder per settings fingerprint)")
    d.add_argument("--cache", default=None, help="train from this finished cache (checked against --base and --method)")
    d.add_argument("--components", default="", help="extract these components too (comma list), so one cache serves "
                                                    "several methods")
    d.add_argument("--workers", type=nonnegative_int, default=None, help="extraction: image decoding processes")
    d.add_argument("--extract-batch-size", type=positive_int, default=128, help="extraction: backbone batch size")
    d.add_argument("--extract-precision", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="extraction: backbone precision")
    o = p.add_argument_group("optimisation")
    o.add_argument("--epochs", type=positive_int, default=10, help="passes over the training captions")
    o.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"contrastive batch per process (the global batch is this x processes); default "
                        f"{DEFAULT_BATCH_SIZE}, with --unfreeze the head class's unfreeze_batch_size (a global batch) "
                        "divided by the number of processes")
    o.add_argument("--accum-steps", type=positive_int, default=1, help="split each batch into this many micro-batches "
                                                              "(same gradient, less memory)")
    o.add_argument("--lr", type=positive_float, default=None,
                   help=f"head learning rate (default: the head class's head_lr, else {DEFAULT_LR:g})")
    o.add_argument("--weight-decay", type=nonnegative_float, default=0.1)
    o.add_argument("--beta1", type=fraction, default=0.9)
    o.add_argument("--beta2", type=fraction, default=0.98)
    o.add_argument("--eps", type=positive_float, default=1e-6)
    o.add_argument("--schedule", default="cosine", choices=["cosine", "step", "constant"],
                   help="cosine: linear warm-up then cosine to 0; step: StepLR (the ComAlign paper's)")
    o.add_argument("--warmup", type=nonnegative_int, default=100, help="warm-up steps (cosine; at most a tenth of the run)")
    o.add_argument("--step-epochs", type=positive_int, default=5, help="StepLR: epochs between decays")
    o.add_argument("--gamma", type=positive_float, default=0.1, help="StepLR: decay factor")
    o.add_argument("--grad-clip", type=nonnegative_float, default=0.0, help="clip the gradient norm (0: off)")
    o.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="autocast for the head")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--device", default=None, help="default: accelerate's device (cuda if present, else cpu)")
    u = p.add_argument_group("fine-tuning the backbone (--unfreeze)")
    u.add_argument("--unfreeze", action="store_true",
                   help="train the backbone with the head, from raw images and captions (heads whose class sets "
                        "supports_unfreeze)")
    u.add_argument("--backbone-lr", type=positive_float, default=None,
                   help="backbone learning rate (default: the head class's backbone_lr)")
    u.add_argument("--context-length", type=positive_int, default=None,
                   help="stretch the text context to this many tokens first (Long-CLIP; 248 in SmartCLIP; the "
                        "first 20 positions stay fixed)")
    r = p.add_argument_group("run")
    r.add_argument("--out", default=None, help="run folder: checkpoints, logs, evaluation")
    r.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue from OUT/checkpoints/last.safetensors (or the given training-state file)")
    r.add_argument("--save-every", type=nonnegative_int, default=0, help="also save the training state every N steps (0: epoch "
                                                             "ends only)")
    r.add_argument("--stop-after-steps", type=nonnegative_int, default=0,
                   help="save and stop after this many steps in total (time-boxed jobs; continue with --resume)")
    r.add_argument("--max-bad-steps", type=positive_int, default=10, help="abort after this many non-finite steps in a row")
    r.add_argument("--eval-batch-size", type=positive_int, default=1024)
    r.add_argument("--final-eval", action=argparse.BooleanOptionalAction, default=True,
                   help="write the frozen base vs base + adapter table on the test split")
    r.add_argument("--eval-tasks", default="retrieval,compositional", help="train.evaluate tasks of the final table")
    x = p.add_argument_group("extraction (python -m extract options; the method's own needs are the default)")
    for a in _extract_actions():
        # SUPPRESS: only flags given by the user appear in args (the method's extract_options fill the rest)
        kw = dict(dest=a.dest, default=argparse.SUPPRESS, help=f"{a.help} (python -m extract's default: {a.default})")
        if a.choices is not None:
            kw["choices"] = a.choices
        if a.type is not None:
            kw["type"] = a.type
        x.add_argument(*a.option_strings, **kw)
    p.head_dests = {}  # Config field -> argparse dest
    if head_cls is not None:
        taken = {s for a in p._actions for s in a.option_strings}
        h = p.add_argument_group(f"{head_cls.name} head (defaults: {head_cls.__name__}.Config)")
        for f in dataclasses.fields(head_cls.Config):
            flag = "--" + f.name.replace("_", "-")
            dest = f.name
            if flag in taken or dest in {a.dest for a in p._actions}:
                flag, dest = "--head-" + f.name.replace("_", "-"), "head_" + f.name
            default = f.default if f.default is not dataclasses.MISSING else None
            kw = dict(dest=dest, default=argparse.SUPPRESS, help=f"{f.metadata.get('help', '')} (default: {default!r})")
            if isinstance(default, bool):
                kw["action"] = argparse.BooleanOptionalAction
            elif default is not None:
                kw["type"] = type(default)
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            h.add_argument(flag, **kw)
            p.head_dests[f.name] = dest
    return p


def _method_name(argv: Sequence[str] | None) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--method")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.method is None and known.config and Path(known.config).is_file():
        import yaml

        try:
            values = yaml.safe_load(Path(known.config).read_text()) or {}
        except (yaml.YAMLError, OSError, UnicodeDecodeError):
            return None  # parse_with_config reports what is wrong with the file
        method = values.get("method") if isinstance(values, dict) else None
        return method if isinstance(method, str) else None
    return known.method


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    method = _method_name(argv)
    if method is not None and method not in ADAPTERS:
        build_parser().error(f"argument --method: invalid choice: {method!r} (choose from "
                             f"{', '.join(map(repr, ADAPTERS.names()))})")
    head_cls = ADAPTERS.get(method) if method else None
    p = build_parser(head_cls)
    args = parse_with_config(p, argv)
    if head_cls is None:
        p.error(f"--method is required; choose from {', '.join(ADAPTERS.names())}")
    if not args.out:
        p.error("--out is required (the run folder)")
    if not args.data and not args.cache:
        p.error("--data is required (or --cache with a finished cache)")
    _check_unfreeze(p, args, head_cls)
    if args.lr is None:
        args.lr = float(getattr(head_cls, "head_lr", None) or DEFAULT_LR)
    if args.batch_size is None:
        per_run = getattr(head_cls, "unfreeze_batch_size", None) if args.unfreeze else None
        world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
        args.batch_size = max(2, per_run // world) if per_run else DEFAULT_BATCH_SIZE
    if args.batch_size < 2 or args.batch_size % args.accum_steps:
        p.error("--batch-size must be >= 2 and a multiple of --accum-steps")
    if not args.val_data and not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction must be in (0, 1) without --val-data, got {args.val_fraction:g}")
    args.head_config = {f: getattr(args, d) for f, d in p.head_dests.items() if getattr(args, d, None) is not None}
    args.extract_options = {**head_cls.extract_options,
                            **{a.dest: getattr(args, a.dest) for a in _extract_actions() if getattr(args, a.dest, None) is not None}}
    args.components = sorted({c.strip() for c in args.components.split(",") if c.strip()} | set(head_cls.components))
    return args


def _check_unfreeze(p: argparse.ArgumentParser, args, head_cls) -> None:
    """--unfreeze / --backbone-lr / --context-length: allowed combinations, and the backbone lr default."""
    from train.adapter_live import unfreeze_methods, unfreeze_support

    if not args.unfreeze:
        for flag, value in (("--backbone-lr", args.backbone_lr), ("--context-length", args.context_length)):
            if value is not None:
                p.error(f"{flag} only applies with --unfreeze (the cached path never changes the backbone)")
        return
    why = unfreeze_support(head_cls)
    if why is not None:
        p.error(f"--unfreeze: method {head_cls.name!r} trains on cached features only ({why}); methods that support "
                f"--unfreeze: {', '.join(unfreeze_methods(ADAPTERS)) or 'none'}")
    if args.cache:
        p.error("--unfreeze reads raw images and captions (--data); a feature cache (--cache) holds frozen features")
    if args.extract_precision != "fp32":
        p.error("--unfreeze keeps fp32 weights for the optimizer; use --precision bf16/fp16 for mixed precision, not "
                "--extract-precision")
    if args.backbone_lr is None:
        args.backbone_lr = getattr(head_cls, "backbone_lr", None)
        if args.backbone_lr is None:
            p.error(f"--unfreeze: {head_cls.__name__} names no backbone_lr; pass --backbone-lr")
    if args.context_length is not None and args.context_length < 2:
        p.error("--context-length must be at least 2 tokens")


# --------------------------------------------------------------------------------------------- data
@dataclass
class RunData:
    train_cache: object
    train_rows: np.ndarray          # caption rows trained on
    caption_image: np.ndarray       # [num_captions] global image row of every caption of the training cache
    val: HeldOut
    world: Path | None              # the toy world folder, when training on one
    extractor: object               # LiveExtractor with the training cache's settings
    test_argv: list[str]            # train.evaluate data arguments of the final table ([] = none)


def prepare_data(args, head_cls, backbone, is_main: bool) -> RunData:
    """Caches for training and the held-out split (built or reused), the split itself, and the final table's data."""
    from adapters.adapter_scorer import LiveExtractor

    world = Path(args.data) if args.data and is_toyworld(args.data) else None
    common = dict(base=args.base, pretrained=args.pretrained, components=args.components, options=args.extract_options,
                  device=str(backbone.device), batch_size=args.extract_batch_size, precision=args.extract_precision,
                  workers=args.workers if args.workers is not None else _default_workers())
    if args.image_root:
        common["options"] = {**common["options"], "image_root": args.image_root}

    def cache_for(data, split=None):
        return obtain_cache(extraction_argv(data, args.cache_dir, split=split, **common), backbone)

    if args.cache:
        from extract.cache import FeatureCache

        train_cache = FeatureCache.open(args.cache)
        check_cache(train_cache, head_cls, backbone, args.extract_options)
    else:
        train_cache = cache_for(args.data, "train" if world else None)
    caption_image = train_cache.caption_image_index()
    annotations = world
    extraction = cache_config(train_cache)
    box_source = (train_cache.settings.get("boxes") or {}).get("source")
    if box_source == "gt" and world is None:
        annotations = extraction.get("annotations")
    extractor = LiveExtractor(backbone, extraction, box_source=box_source, annotations=annotations)

    if world is not None and not args.val_data:
        val_cache = cache_for(world, "val")
        val = heldout_split(val_cache, name="val")
        train_rows = np.arange(train_cache.num_captions)
    elif args.val_data:
        val_cache = cache_for(args.val_data, "val" if is_toyworld(args.val_data) else None)
        val = heldout_split(val_cache, name="val")
        train_rows = np.arange(train_cache.num_captions)
    else:
        train_images, val_images = split_images(train_cache.num_images, args.val_fraction, args.seed)
        val = heldout_split(train_cache, val_images, name=f"val ({args.val_fraction:g} of the training images)")
        train_rows = caption_rows_of(caption_image, train_images)
    negatives_world = world if not args.val_data else (Path(args.val_data) if is_toyworld(args.val_data) else None)
    if negatives_world is not None and is_main:
        attach_toyworld_negatives(val, negatives_world, "val", extractor)

    return RunData(train_cache, train_rows, caption_image, val, world, extractor, final_table_data(args))


def final_table_data(args) -> list[str]:
    """train.evaluate data arguments of the final table: --test-data, else the toy world's test split, else
    --val-data (+ --benchmark files); [] when there is none."""
    test_argv: list[str] = []
    spec = args.test_data or (args.data if args.data and is_toyworld(args.data) else None) or args.val_data
    if spec is not None:
        test_argv = ["--data", str(spec), "--split", "test"] if is_toyworld(spec) else ["--retrieval-data", str(spec)]
    for b in args.benchmark:
        test_argv += ["--benchmark", b]
    if test_argv and args.image_root:
        test_argv += ["--image-root", args.image_root]
    if test_argv:
        from extract.source_args import FLAGS, source_flags

        for dest, value in source_flags(args).items():  # the test table is read like the training one
            test_argv += [FLAGS[dest], str(value)]
    return test_argv


def _default_workers() -> int:
    from extract.pipeline import DEFAULT_WORKERS

    return DEFAULT_WORKERS


# --------------------------------------------------------------------------------------------- optimisation
def make_optimizer(head: AdapterHead, args, backbone_model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """AdamW over the head's param groups at ``--lr`` (a group may carry its own lr) and, with ``backbone_model``
    (``--unfreeze``), the backbone's own groups at ``--backbone-lr`` after them."""
    groups = head.param_groups(args.weight_decay)
    if not groups:
        raise ValueError(f"{head.name}: nothing to train (every parameter is frozen with this config)")
    if backbone_model is not None:
        from train.adapter_live import backbone_param_groups

        groups = groups + backbone_param_groups(backbone_model, args.weight_decay, args.backbone_lr)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)


def make_scheduler(optimizer, args, total_steps: int, steps_per_epoch: int):
    """Per optimizer step: warm-up + cosine to 0, StepLR every ``--step-epochs`` epochs, or constant."""
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
class _Ctx:
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


def compute_gradients(head: AdapterHead, images: dict, texts: dict, accum: int, ctx: _Ctx) -> dict:
    """Back-propagate the head's loss on one (local) batch; returns the loss dict. ``accum > 1``: gradient
    caching over micro-batches (module docstring), same gradient as ``accum = 1``. ``head``: anything with the
    head's ``encode_image`` / ``encode_text`` / ``loss`` (``train.adapter_live.LiveModel`` for --unfreeze), and
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


def _all_ranks(flag: bool, ctx: _Ctx) -> bool:
    if ctx.world <= 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _mean_over_ranks(out: dict, ctx: _Ctx) -> dict[str, float]:
    """The loss dict's values for the log: on several ranks their mean, which is the global batch's loss."""
    names = list(out)
    values = torch.stack([out[k].detach().float().reshape(()) for k in names])
    if ctx.world > 1:
        import torch.distributed as dist

        dist.all_reduce(values)
        values /= ctx.world
    return dict(zip(names, values.tolist()))


def optimizer_step(head: torch.nn.Module, optimizer, out: dict, args, ctx: _Ctx) -> str | None:
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


# --------------------------------------------------------------------------------------------- the run
def _jsonable(args) -> dict:
    return json.loads(json.dumps(vars(args), default=str))


def _describe_base(args, backbone) -> dict:
    info = backbone.describe(hash_weights=True)
    pretrained = args.pretrained
    if pretrained and os.path.exists(pretrained):
        pretrained = os.path.abspath(pretrained)  # the checkpoint must find it from any working directory
    return {"base": args.base, "pretrained": pretrained, "weights_sha256": info.get("weights_sha256"), "describe": info}


def _flat_metrics(result: dict) -> dict[str, float]:
    from train.evaluate import headline

    return headline(result)


def _summary_line(metrics: dict[str, float]) -> str:
    keys = [k for k in ("retrieval T2I R@1", "retrieval I2T R@1", "toyworld all") if k in metrics]
    return ", ".join(f"{k.replace('retrieval ', '')} {metrics[k]:.2f}" for k in keys)


def train(args) -> dict:
    """The whole run (module docstring). Returns a summary: paths, final metrics, steps, skipped steps."""
    from accelerate import Accelerator

    from extract.backbone import load_backbone

    head_cls = ADAPTERS.get(args.method)
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[args.precision]
    cpu = args.device is not None and torch.device(args.device).type == "cpu"
    accelerator = Accelerator(cpu=cpu or not torch.cuda.is_available(), mixed_precision=mixed)
    device = torch.device(args.device) if args.device and not cpu else accelerator.device
    rank, world = accelerator.process_index, accelerator.num_processes
    is_main = accelerator.is_main_process
    say = print if is_main else (lambda *a, **k: None)
    out = Path(args.out)

    # 1. the backbone first: absent weights fail in about a second, before any data is read or extracted
    backbone = load_backbone(args.base, args.pretrained, device=device, precision=args.extract_precision)
    check_batch_fits(args, world)  # from the data's index: minutes of extraction must not end in "lower --batch-size"
    base_info = _describe_base(args, backbone)  # the original weights, before any fine-tuning
    # 2. caches (built or reused) and splits; with --unfreeze the raw source's splits (train.adapter_live)
    live = base_val = None
    if args.unfreeze:
        from extract.long_context import extend_backbone_context
        from train.adapter_live import prepare_live

        live = prepare_live(args, backbone, base_info["describe"])
        if is_main and not args.resume:  # the frozen base's held-out figures, before stretching or training
            base_val = live.heldout(args.extract_batch_size, _workers(args))
        if args.context_length is not None:
            # Long-CLIP §3.1: first 20 positions kept (and frozen by a gradient hook), the rest stretched
            extend_backbone_context(backbone, args.context_length, freeze_kept=True)
        backbone.unfreeze()
        train_rows, caption_image = live.train_rows, live.caption_image
        extraction, test_argv, data_key = live.extraction, final_table_data(args), f"live {live.train.name}"
    else:
        data = prepare_data(args, head_cls, backbone, is_main)
        cache = data.train_cache
        missing = sorted((set(head_cls.image_keys) | set(head_cls.text_keys)) - set(cache.keys))
        if missing:
            raise ValueError(f"cache {cache.path} lacks arrays {missing} that {args.method} reads")
        train_rows, caption_image, test_argv, data_key = data.train_rows, data.caption_image, data.test_argv, \
            cache.fingerprint
        extraction = {"fingerprint": cache.fingerprint, "settings": cache.settings, "args": cache_config(cache),
                      "path": str(cache.path)}
    global_batch = args.batch_size * world
    n_train_images = len(np.unique(caption_image[train_rows]))
    if global_batch > n_train_images:
        raise ValueError(f"the global batch ({global_batch}) exceeds the {n_train_images} training images: a batch "
                         "holds each image at most once (no caption is a negative of its own image); lower --batch-size")
    steps_per_epoch = len(train_rows) // global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_rows)} training captions make no batch of {global_batch}; lower --batch-size")
    total_steps = steps_per_epoch * args.epochs

    # 3. head, optimizer, schedule. Seeded right here: extraction may have drawn from the global RNG (DataLoader
    # seeds), and every rank must start from the same weights; dropout then gets a per-rank stream.
    torch.manual_seed(args.seed)
    head = head_cls.from_config(args.head_config, backbone.embed_dim).to(device)
    torch.manual_seed(args.seed + 1 + rank)
    # what trains: the head, or (--unfreeze) backbone + head behind the head's interface over raw inputs
    model = head
    modules = {}
    if live is not None:
        from train.adapter_live import LiveModel

        model, modules = LiveModel(backbone, head), {"backbone": backbone.model}
    optimizer = make_optimizer(head, args, backbone.model if live is not None else None)
    scheduler = make_scheduler(optimizer, args, total_steps, steps_per_epoch)
    scaler = accelerator.scaler if mixed == "fp16" else None
    ctx = _Ctx(accelerator, rank, world, device, scaler)
    resume_key = {k: getattr(args, k) for k in _RESUME_KEYS} | {
        "head_config": head.config_dict(), "weights_sha256": base_info["weights_sha256"],
        "cache": data_key, "world_size": world, "train_rows": int(len(train_rows))}
    state_path = out / "checkpoints" / "last.safetensors"
    start_epoch = start_batch = step = 0
    bad_in_a_row, skipped_total = 0, 0
    history: list[dict] = []
    if args.resume:
        path = Path(args.resume) if args.resume != "auto" else state_path
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no training state at {path} (a run saves it at every epoch end)")
        theirs = {**_RESUME_KEY_DEFAULTS, **read_meta(path).get("resume_key", {})}
        diff = [f"{k}: {theirs.get(k)!r} -> {v!r}" for k, v in resume_key.items() if theirs.get(k) != v]
        if diff:
            raise ValueError(f"--resume {path}: this run's settings differ from the checkpoint's, so it would not "
                             "continue the same run:\n  " + "\n  ".join(diff))
        meta = load_training_state(path, head, optimizer, scheduler, scaler, modules)
        start_epoch, start_batch, step = meta["epoch"], meta["batch"], meta["step"]
        bad_in_a_row, skipped_total = meta.get("bad_in_a_row", 0), meta.get("skipped_total", 0)
        history = meta.get("history", [])
        torch.set_rng_state(load_rng_for_rank(path, rank))
        say(f"resuming {path} at epoch {start_epoch}, batch {start_batch} (step {step})")
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(_jsonable(args), out / "config.json")
    logs = _Logs(out, is_main, step if args.resume else None)
    val = base_val if live is not None else data.val  # held-out arrays (live: re-encoded every epoch)
    held = (f"held-out {len(live.val.records)} images / {len(live.val.texts)} captions" if live is not None else
            f"held-out {len(val.image_rows)} images / {len(val.caption_rows)} captions"
            + (f" + {len(val.negatives)} hard negatives" if val.negatives else ""))
    say(f"{args.method} on {args.base}{' (fine-tuning the backbone)' if live is not None else ''}: {len(train_rows)} "
        f"training captions of {n_train_images} images, {held}; {steps_per_epoch} steps/epoch x {args.epochs} epochs, "
        f"global batch {global_batch} on {world} process(es), "
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable parameters"
        + (f" (backbone lr {args.backbone_lr:g}, head lr {args.lr:g}"
           + (f", text context {backbone.context_length}" if args.context_length else "") + ")" if live else ""))
    if is_main and not args.resume:
        base_metrics = _flat_metrics(evaluate_heldout(CachedBase(), val, device, args.eval_batch_size))
        say(f"frozen base on {val.name}: {_summary_line(base_metrics)}")
        history.append({"epoch": 0, "step": 0, "model": "base", **base_metrics})

    def save_state(epoch: int, batch: int) -> bool:
        """Training state at (epoch, next batch); refused (False) during a run of skipped steps or when the weights
        are not finite, so the file on disk stays the last good state."""
        if bad_in_a_row or first_nonfinite(dict(model.named_parameters())) is not None:
            why = (f"{bad_in_a_row} step(s) in a row skipped as non-finite" if bad_in_a_row else "the weights are not finite")
            kept = (f"{state_path} keeps the last good state" if state_path.is_file() else
                    "no good state has been saved yet")
            say(f"warning: not saving at step {step}: {why}; {kept}")
            return False
        if is_main:
            save_training_state(state_path, head, optimizer, scheduler, scaler, {
                "epoch": epoch, "batch": batch, "step": step, "bad_in_a_row": bad_in_a_row,
                "skipped_total": skipped_total, "history": history, "resume_key": resume_key,
                "args": _jsonable(args), "base": base_info, "extraction": extraction}, modules)
            _save_rank_rng(state_path, rank)
        else:
            _save_rank_rng(state_path, rank)
        accelerator.wait_for_everyone()
        return True

    keys = list(dict.fromkeys([*head_cls.image_keys, *head_cls.text_keys]))
    stopped = False
    t_start = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        batches = epoch_batches(train_rows, caption_image, global_batch, args.seed, epoch, steps_per_epoch)
        model.train()
        first = start_batch if epoch == start_epoch else 0
        if live is not None:  # images decoded and captions tokenized by DataLoader workers, batches in this order
            from train.adapter_live import batch_loader

            loader = iter(batch_loader(live.train, [bt[rank * args.batch_size:(rank + 1) * args.batch_size]
                                                    for bt in batches[first:]], backbone, _workers(args)))
        bar = tqdm(range(first, len(batches)), desc=f"epoch {epoch + 1}/{args.epochs}", unit="step",
                   disable=not is_main, dynamic_ncols=True, leave=False)
        for b in bar:
            t0 = time.perf_counter()
            if live is not None:
                images, texts = _live_batch(next(loader), live, ctx, say)
            else:
                local = batches[b][rank * args.batch_size:(rank + 1) * args.batch_size]
                arrays = to_tensors(cache.batch(local, keys), device)
                images = {k: arrays[k] for k in head_cls.image_keys}
                texts = {k: arrays[k] for k in head_cls.text_keys}
            out_step = compute_gradients(model, images, texts, args.accum_steps, ctx)
            lr = optimizer.param_groups[0]["lr"]
            lrs = {"lr_backbone": optimizer.param_groups[-1]["lr"]} if live is not None else {}
            reason = optimizer_step(model, optimizer, out_step, args, ctx)
            with warnings.catch_warnings():  # a skipped first step is not the misuse torch warns about
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")
                scheduler.step()  # skipped steps count: the schedule follows the step number
            step += 1
            row = {"step": step, "epoch": epoch + (b + 1) / len(batches), "lr": lr, **lrs,
                   **_mean_over_ranks(out_step, ctx), "seconds": time.perf_counter() - t0,
                   "skipped": int(reason is not None), "reason": reason or ""}
            logs.step(row)
            if reason is None:
                bad_in_a_row = 0
                bar.set_postfix(loss=f"{row['loss']:.4f}")
            else:
                bad_in_a_row += 1
                skipped_total += 1
                say(f"step {step}: skipped ({reason}); {bad_in_a_row} in a row")
                if bad_in_a_row >= args.max_bad_steps:
                    logs.close()
                    raise TrainingDiverged(
                        f"training diverged: {bad_in_a_row} non-finite steps in a row (last at step {step}). The last "
                        f"good checkpoint is kept: {state_path if state_path.exists() else '(none saved yet)'}. Lower "
                        "--lr, set --grad-clip, or check the cache for NaN features; then --resume")
            if args.save_every and step % args.save_every == 0:
                save_state(epoch, b + 1)
            if args.stop_after_steps and step >= args.stop_after_steps:
                stopped = True
                break
        bar.close()
        if stopped:
            save_state(epoch, b + 1)
            say(f"stopped after step {step} (--stop-after-steps); continue with --resume")
            break
        start_batch = 0
        if is_main:
            if live is not None:  # the held-out split through the backbone as it is now
                val = live.heldout(args.extract_batch_size, _workers(args)).keep_warnings_of(val)
            metrics = _flat_metrics(evaluate_heldout(head, val, device, args.eval_batch_size))
            history.append({"epoch": epoch + 1, "step": step, "model": args.method, **metrics})
            logs.scalars("val", metrics, step)
            say(f"epoch {epoch + 1}/{args.epochs}: {val.name}: {_summary_line(metrics)}")
            (out / "history.json").write_text(json.dumps(history, indent=2) + "\n")
        save_state(epoch + 1, 0)
    logs.close()
    summary = {"out": str(out), "steps": step, "skipped_steps": skipped_total, "stopped": stopped,
               "seconds": time.perf_counter() - t_start, "history": history}
    if stopped or not is_main:
        accelerator.wait_for_everyone()  # matched by rank 0's barrier after its final steps
        return summary

    # 5. inference-only parameters on the held-out split, the checkpoint, the final table
    model.eval()
    if live is not None and val is None:  # resumed after the last epoch's evaluation
        val = live.heldout(args.extract_batch_size, _workers(args))
    image_reps, text_reps = encode_heldout(head, val, device, args.eval_batch_size)
    fitted = head.fit_inference(image_reps, text_reps, val.caption_image)
    if fitted:
        say("fitted on the held-out split: " + ", ".join(f"{k} {v:.4g}" for k, v in fitted.items()))
    final_val = _flat_metrics(evaluate_heldout(head, val, device, args.eval_batch_size))
    tuned = {}
    if live is not None:  # the fine-tuned backbone next to the adapter, named (and hashed) in its description
        tuned = {"backbone": {**save_backbone_weights(out / "backbone.safetensors", backbone.model),
                              "context_length": args.context_length, "lr": args.backbone_lr}}
        if live.report.skips:
            live.report.to_json(out / "data_report.json")
            say(f"skipped while training: {live.report.summary()} (listed in {out / 'data_report.json'})")
    adapter_path = save_adapter(out / "adapter.safetensors", head, {
        "base": base_info, "extraction": extraction, "args": _jsonable(args), "epoch": args.epochs, "step": step,
        "metrics": {"val": final_val}, "inference": fitted, "history": history, **tuned})
    say(f"checkpoint: {adapter_path} (held-out after fitting: {_summary_line(final_val)})")
    summary.update(adapter=str(adapter_path), val=final_val, inference=fitted)
    if tuned:
        summary["backbone"] = str(out / tuned["backbone"]["file"])
    if args.final_eval and test_argv:
        summary["eval"] = final_table(args, adapter_path, test_argv, device)
    elif args.final_eval:
        say("note: no test data (--test-data, --val-data or a toy world): no final table")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    accelerator.wait_for_everyone()
    return summary


def check_batch_fits(args, world: int) -> None:
    """Raise ValueError when the global batch cannot be filled from the training images the data lists: a batch
    holds each image once, so it needs at least as many training images. Counted from the source's index before
    any extraction; the exact count after decoding (or of a given --cache) is checked again later."""
    from extract.source_args import source_options
    from train.adapter_data import listed_images

    if args.cache:  # nothing expensive precedes the exact check a given cache gets in train()
        return
    options = {**source_options(args),
               **({"image_root": args.image_root} if args.image_root and not is_toyworld(args.data) else {})}
    n = listed_images(args.data, "train" if is_toyworld(args.data) else None, **options)
    if n is None:
        return
    held_out = 0
    if not args.val_data and not is_toyworld(args.data):  # --val-fraction of these images is held out
        held_out = max(1, int(round(n * args.val_fraction)))
    global_batch = args.batch_size * world
    if global_batch > n - held_out:
        raise ValueError(f"the global batch ({global_batch}) exceeds the {n - held_out} training images of "
                         f"{args.data}" + (f" ({n} listed, {held_out} held out by --val-fraction)"
                                                         if held_out else "")
                         + ": a batch holds each image at most once; lower --batch-size (checked before extraction)")


def _workers(args) -> int:
    return args.workers if args.workers is not None else _default_workers()


def _live_batch(batch: dict, live, ctx: _Ctx, say) -> tuple[dict, dict]:
    """A loaded --unfreeze batch as (images, texts) inputs of LiveModel. Undecodable images dropped their pairs;
    on several ranks every rank keeps as many pairs as the smallest local batch (gathered shapes must agree)."""
    from train.adapter_live import take

    for skip in live.note_skips(batch["skips"]):
        say(f"warning: training image {skip.id} ({skip.location}) skipped: {skip.reason} {skip.detail}".rstrip())
    n = len(batch["rows"])
    if ctx.world > 1:
        import torch.distributed as dist

        t = torch.tensor([n], device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        n = int(t.item())
    if n == 0:
        raise ValueError("a whole training batch of undecodable images: check the data with python -m "
                         "extract.check_data (its report lists them)")
    batch = take(batch, n)
    images = {"pixels": batch["pixels"].to(ctx.device)}
    texts = {"ids": batch["ids"].to(ctx.device), "attention_mask": batch["attention_mask"].to(ctx.device)}
    return images, texts


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


def final_table(args, adapter_path: Path, test_argv: list[str], device) -> dict:
    """Frozen base vs base + adapter on the test data, through train.evaluate (the checkpoint is rebuilt from
    the file alone, components extracted live)."""
    from train import evaluate as ev

    argv = ["--model", args.base]
    if args.pretrained is not None:
        argv += ["--pretrained", args.pretrained]
    argv += ["--model", str(adapter_path), *test_argv, "--tasks", args.eval_tasks, "--out", str(Path(args.out) / "eval"),
             "--device", str(device), "--batch-size", str(min(args.eval_batch_size, 256)), "--seed", str(args.seed)]
    return ev.evaluate(ev.parse_args(argv))["results"]


def run_cli(fn, args) -> int:
    """Exit status of ``fn(args)`` for a command line: 0, DIVERGED (3) after too many bad steps, 2 for what
    the user can fix (missing weights or files, bad settings, a foreign checkpoint, a missing extra), each
    printed as one ``error:`` line."""
    from adapters.checkpoint import CheckpointError
    from extract.weights import WeightsNotFoundError

    try:
        fn(args)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return DIVERGED
    except (WeightsNotFoundError, FileNotFoundError, ValueError, CheckpointError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(train, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
