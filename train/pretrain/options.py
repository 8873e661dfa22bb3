"""``python -m train.pretrain``: pre-train an open_clip CLIP model from scratch with CLIP, FLIP, FILIP, CLIP-PGS
or PowerCLIP, on one process or many.

This module holds its options: :class:`PretrainOptions` (one dataclass for the command line, ``--config`` YAML and
Python), each registered objective's own flags, and the objective they build. The run itself:
``train.pretrain.engine``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from adapters.objectives.towers import COMPILE_MODES
from adapters.registry import PRETRAIN
from extract.common.cli import Parser, from_namespace, option
from extract.common.cli import build_parser as build_cli
from extract.common.config import (config_value, fraction, nonnegative_float, nonnegative_int, parse_with_config,
                                   positive_float, positive_int)
from extract.components.hard_negatives import HardNegativeOptions, format_types, parse_types
from extract.common.source_args import SourceOptions
from train.bad_steps import MAX_BAD_STEPS

PRECISIONS = {"fp32": None, "amp": torch.float16, "fp16": torch.float16, "amp_bf16": torch.bfloat16,
              "bf16": torch.bfloat16}
EVAL_TASKS = ("retrieval", "zeroshot", "compositional", "linear_probe")
EPOCHS = 32  # --epochs on data the user names (the papers' CC12M runs)
TOY_EPOCHS = 5  # --epochs on the embedded toy world: a first run that ends in minutes on a laptop CPU
DEFAULT_WORKERS = min(4, max(1, (os.cpu_count() or 2) // 2))



@dataclass
class PretrainOptions(SourceOptions, HardNegativeOptions):
    """What ``python -m train.pretrain`` does, as data: ``pretrain(PretrainOptions(method="clip", data="toy"))``
    runs what the command line with those flags runs, through the same checks.

    Fields left at None are chosen by the run (and written, resolved, to ``OUT/config.json``): ``data`` the
    embedded toy world, ``epochs`` ``TOY_EPOCHS`` there and ``EPOCHS`` elsewhere, ``out``
    ``runs/pretrain-MODEL-METHOD``, ``val_data`` ``data`` when it is a toy world. ``method_options`` holds the
    objectives' own flags by name (``{"mask_ratio": 0.75}``; any registered method's, the chosen method's are
    used, its flags' defaults fill the rest). ``eval_tasks`` and ``debug_nan_steps`` may be comma strings."""

    method: str = option("clip", choices=PRETRAIN.names(), help="pre-training objective (adapters/objectives/)")
    model: str = option("tiny", help="open_clip architecture (ViT-B-16: the papers' setting) or a plugvlm alias "
                                     "(tiny = plugvlm-tiny)")
    quick_gelu: bool = option(False, action="store_true",
                              help="QuickGELU activations (OpenAI CLIP's); default GELU, as open_clip trains from "
                                   "scratch")
    pretrained: str | None = option(None, help="initial weights (tag or file); default: random init")
    data: str | None = option(None, group="data",
                              help="toy-world folder, CSV/TSV (filepath,title), COCO captions JSON, or webdataset "
                                   "shards ('shards/{00000..00099}.tar', a folder of .tar); default: the embedded "
                                   "toy world runs/toy, generated on first use")
    split: str = option("train", group="data", help="toy world: the split to train on (a 3D world's 'pretrain': its "
                                                     "train scenes and their objects' crops, what its base trained on)")
    image_root: str | None = option(None, group="data", help="CSV / COCO: folder of relative image paths")
    train_num_samples: int | None = option(None, type=positive_int, group="data",
                                           help="webdataset: samples per epoch")
    dataset_resampled: bool = option(True, action=argparse.BooleanOptionalAction, group="data",
                                     help="webdataset: draw shards with replacement (open_clip's --dataset-resampled)")
    shuffle_buffer: int = option(1000, type=positive_int, group="data",
                                 help="webdataset: samples in the shuffle buffer")
    workers: int = option(DEFAULT_WORKERS, type=nonnegative_int, group="data",
                          help="data-loader processes per rank (0: load in the training process)")
    augment: str = option("rrc", choices=["rrc", "none"], group="data",
                          help="rrc: open_clip's random resized crop (scale 0.9-1); none: the evaluation transform")
    epochs: int | None = option(None, type=positive_int, group="optimisation",
                                help=f"passes over the training data (default: {EPOCHS}; {TOY_EPOCHS} on the embedded "
                                     "toy world, i.e. when no --data is given)")
    max_steps: int | None = option(None, type=positive_int, group="optimisation",
                                   help="stop after this many optimizer steps in total")
    batch_size: int = option(64, type=positive_int, group="optimisation", help="images per rank and micro-batch")
    accum_freq: int = option(1, type=positive_int, group="optimisation",
                             help="micro-batches per optimizer step (exact, with cached features)")
    lr: float = option(1e-3, type=positive_float, group="optimisation", help="peak learning rate (AdamW)")
    beta1: float = option(0.9, type=fraction, group="optimisation", help="AdamW beta1")
    beta2: float = option(0.98, type=fraction, group="optimisation", help="AdamW beta2")
    eps: float = option(1e-6, type=positive_float, group="optimisation", help="AdamW epsilon")
    wd: float = option(0.2, type=nonnegative_float, group="optimisation",
                       help="AdamW weight decay (none on biases, gains, 1-d tensors and the logit scale)")
    warmup: int = option(10000, type=nonnegative_int, group="optimisation",
                         help="linear warm-up steps (capped at 10%% of the run)")
    grad_clip_norm: float | None = option(None, type=positive_float, group="optimisation",
                                          help="clip the gradient norm (default: off)")
    precision: str = option("fp32", choices=sorted(PRECISIONS), group="optimisation",
                            help="fp32, or autocast: amp (fp16 + loss scaling), amp_bf16")
    grad_checkpointing: bool = option(False, action="store_true", group="optimisation",
                                      help="recompute activations in the backward pass")
    compile: bool = option(False, action="store_true", group="optimisation",
                           help="torch.compile the image and text towers, in place (the first steps compile: about a "
                                "minute on CPU); the same losses and gradients as eager, to rounding")
    compile_backend: str = option("inductor", choices=["inductor", "aot_eager", "eager"], group="optimisation",
                                  help="torch.compile backend for --compile (aot_eager / eager: to tell a compiler "
                                       "problem from a model one)")
    compile_mode: str = option("default", choices=list(COMPILE_MODES), group="optimisation",
                               help="torch.compile mode for --compile (inductor): reduce-overhead and max-autotune "
                                    "replay the towers as CUDA graphs (on CUDA; one graph set per input shape), "
                                    "max-autotune-no-cudagraphs tunes kernels only")
    fused_adamw: str = option("auto", choices=["auto", "on", "off"], group="optimisation",
                              help="AdamW's fused kernel, one launch for every tensor (auto: on CUDA; off: the "
                                   "foreach kernel open_clip uses; a resumed run keeps its checkpoint's)")
    local_loss: bool = option(True, action=argparse.BooleanOptionalAction, group="optimisation",
                              help="each rank scores its rows against the gathered batch (with --gather-with-grad: "
                                   "exact)")
    gather_with_grad: bool = option(True, action=argparse.BooleanOptionalAction, group="optimisation",
                                    help="gather the other ranks' features with their gradient")
    seed: int = option(0, type=nonnegative_int, group="optimisation",
                       help="seeds weights, data order and augmentation")
    max_bad_steps: int = option(MAX_BAD_STEPS, type=positive_int, group="optimisation",
                                help="non-finite loss/gradient steps in a row before the run stops")
    hard_negative_vocab: str | None = option(None, group="hard negatives",
                                             help="captions (CSV with a title column, or text, one a line) whose "
                                                  "words replacements draw from (default: the training captions; "
                                                  "needed for webdataset shards)")
    out: str | None = option(None, group="output",
                             help="run folder: checkpoints, logs, final model (default: runs/pretrain-MODEL-METHOD)")
    save_every_n_steps: int = option(1000, type=nonnegative_int, group="output", help="step checkpoints (0: off)")
    save_frequency: int = option(1, type=nonnegative_int, group="output",
                                 help="epoch checkpoints every N epochs (0: off; the last epoch is always saved)")
    keep_checkpoints: int = option(1, type=nonnegative_int, group="output",
                                   help="checkpoints kept, step and epoch alike: the N newest, plus the best evaluated "
                                        "one (highest mean retrieval R@1) and the one 'latest' names (0: keep all)")
    resume: str | None = option(None, group="output",
                                help="'latest' (this --out's newest checkpoint) or a checkpoint folder")
    log_every_n_steps: int = option(10, type=positive_int, group="output",
                                    help="a log.csv row every N steps (and for the first and every skipped step)")
    tensorboard: bool = option(True, action=argparse.BooleanOptionalAction, group="output",
                               help="also log to TensorBoard in OUT/tb")
    val_data: str | None = option(None, group="output",
                                  help="toy world for the per-epoch evaluation (default: --data when it is a toy "
                                       "world)")
    val_split: str = option("val", group="output", help="split of --val-data to evaluate on")
    eval_every_n_epochs: int = option(1, type=nonnegative_int, group="output",
                                      help="evaluate the epoch checkpoint every N epochs (0: no evaluation)")
    eval_tasks: Any = option("retrieval,zeroshot,compositional", group="output",
                             help=f"comma list from {', '.join(EVAL_TASKS)}")
    device: str | None = option(None, group="output", help="default: cuda:LOCAL_RANK when available, else cpu")
    dist_url: str = option("env://", group="output",
                           help="torch.distributed init (torchrun / accelerate set env://)")
    debug_nan_steps: Any = option("", group="output",
                                  help="testing aid: comma list of step numbers (1-based, as in log.csv) whose loss "
                                       "is replaced by NaN")
    method_options: dict = field(default_factory=dict)  # the objectives' own flags, parsed by their add_args

    def __post_init__(self):
        if isinstance(self.eval_tasks, str):
            self.eval_tasks = [t.strip() for t in self.eval_tasks.split(",") if t.strip()]
        self.eval_tasks = list(self.eval_tasks)
        unknown = set(self.eval_tasks) - set(EVAL_TASKS)
        if unknown:
            raise ValueError(f"unknown --eval-tasks {', '.join(sorted(unknown))}; choose from {', '.join(EVAL_TASKS)}")
        if isinstance(self.debug_nan_steps, str):
            self.debug_nan_steps = [s for s in self.debug_nan_steps.split(",") if s.strip()]
        try:
            self.debug_nan_steps = sorted({int(s) for s in self.debug_nan_steps})
        except ValueError:
            raise ValueError(f"--debug-nan-steps: expected comma-separated step numbers, got "
                             f"{self.debug_nan_steps!r}") from None
        if self.compile_mode != "default" and not (self.compile and self.compile_backend == "inductor"):
            raise ValueError(f"--compile-mode {self.compile_mode} is a mode of inductor: add --compile (and leave "
                             "--compile-backend at inductor), or drop --compile-mode")
        self.method_options = {str(k).replace("-", "_"): v for k, v in dict(self.method_options or {}).items()}
        self.hard_negatives = format_types(parse_types(self.hard_negatives))


def method_flags() -> dict[str, tuple[argparse.ArgumentParser, dict[str, argparse.Action]]]:
    """Each registered objective's own flags: ``{method: (a parser holding just them, {dest: action})}``."""
    flags = {}
    for name in PRETRAIN.names():
        p = argparse.ArgumentParser(add_help=False)
        PRETRAIN.get(name).add_args(p)
        flags[name] = (p, {a.dest: a for a in p._actions})
    return flags


def resolve_method_options(method: str, given: dict[str, Any]) -> dict[str, Any]:
    """``method``'s own options: its flags' defaults updated with ``given`` (keys are flag dests; keys of other
    registered methods are ignored). Each value passes the check its flag makes on the command line; a key no
    method has is a ValueError listing the accepted ones."""
    flags = method_flags()
    known = {d for _, actions in flags.values() for d in actions}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"method_options: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}")
    parser, actions = flags[method]
    resolved = {d: a.default for d, a in actions.items()}
    for dest, value in given.items():
        if dest not in actions or value == actions[dest].default:
            continue
        try:
            resolved[dest] = config_value(parser, actions[dest], value)
        except ValueError as e:
            raise ValueError(f"method_options[{dest!r}] ({method}): {e}") from None
    return resolved


def run_config(opts: PretrainOptions) -> dict[str, Any]:
    """The options as ``OUT/config.json`` records them: one key per flag (the method's own flags beside the
    others, as on the command line, so the file also works as ``--config``). ``model.json``'s ``args`` are the
    fields themselves (``PretrainOptions(**args)``)."""
    config = dataclasses.asdict(opts)
    config.update(config.pop("method_options"))
    return config


def build_objective(method: str, options: dict[str, Any] | None = None):
    """The registered objective ``method``, built by its ``from_args`` from ``options`` (see
    :func:`resolve_method_options`)."""
    return PRETRAIN.get(method).from_args(argparse.Namespace(**resolve_method_options(method, options or {})))


def build_parser() -> Parser:
    """The command line: :class:`PretrainOptions`' fields, then one group per objective with its own flags."""
    p = build_cli(PretrainOptions, "python -m train.pretrain", __doc__)
    for name in PRETRAIN.names():
        PRETRAIN.get(name).add_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> PretrainOptions:
    """Options from the command line (and ``--config``); argument errors exit with status 2 and one line."""
    p = build_parser()
    ns = parse_with_config(p, argv)
    chosen: dict[str, Any] = {}
    for name, (_, actions) in method_flags().items():
        for dest, action in actions.items():
            # the chosen method's flags all; another method's only when set (a shared --extra line, a config)
            if name == ns.method or getattr(ns, dest) != action.default:
                chosen[dest] = getattr(ns, dest)
    try:
        return from_namespace(PretrainOptions, ns, method_options=chosen)
    except ValueError as e:
        p.error(str(e))
