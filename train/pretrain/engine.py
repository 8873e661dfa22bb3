"""``python -m train.pretrain``: pre-train an open_clip CLIP model from scratch with CLIP, FLIP, FILIP, CLIP-PGS
or PowerCLIP, on one process or many.

    python -m train.pretrain --method powerclip                     # the embedded toy world, a few minutes on a CPU
    python -m train.pretrain --method clip --data toy --epochs 10 --out runs/pt-clip          # CPU, one process
    torchrun --nproc_per_node 8 -m train.pretrain --method powerclip --model ViT-B-16 \\
        --data 'cc12m/{00000..01242}.tar' --train-num-samples 10968539 --batch-size 512 --precision amp_bf16
    accelerate launch --multi_gpu --num_processes 8 -m train.pretrain ...
    srun python -m train.pretrain ...   # SLURM: ranks from SLURM_PROCID / SLURM_NTASKS, MASTER_ADDR/PORT exported

A run is a function of its options: ``pretrain(PretrainOptions(method="clip", data="toy", epochs=10))`` does
what the command line with those flags does (the same checks, the same files); the command line only parses
into :class:`PretrainOptions`. Without ``--data`` a run trains on the embedded toy world
(``extract.data.toyworld.ensure``: ``runs/toy``, generated on first use) for ``TOY_EPOCHS`` epochs unless ``--epochs``
says otherwise (``EPOCHS`` on data you name); without ``--out`` it writes ``runs/pretrain-MODEL-METHOD``. A run
folder holding another run's settings is refused (``extract.common.run_dir.claim``), ``--resume`` continues it.

The engine follows open_clip's trainer (``open_clip_train``): AdamW (0.9, 0.98, eps 1e-6), lr 1e-3, weight
decay 0.2 on every tensor but gains, biases and the logit scale, cosine schedule with linear warm-up, autocast
(``--precision amp`` / ``amp_bf16``; fp32 by default, the CPU choice), ``--compile`` (the towers, in place:
``adapters.objectives.towers.compile_towers``), fused AdamW on CUDA, gradient checkpointing, gradient
accumulation with cached features (``--accum-freq``, open_clip's method: the negatives are the whole
accumulated batch, see below), features gathered over ranks *with* gradient and a local loss (so N ranks
give one process's loss and gradients), the logit scale clamped to ln(100) after every step.

What a method is -- its batch, its change to the forward, its loss on one or many ranks, its own flags --
lives in ``adapters/objectives/<method>.py`` (the ``PRETRAIN`` registry); this file never asks which method runs.

Gradient accumulation: every micro-batch's features are first computed without gradients; then each
micro-batch is recomputed with gradients and the loss is evaluated on the concatenation of its fresh features
with the others' cached ones, and back-propagated. Summed over micro-batches this is exactly the gradient of
the loss on the whole accumulated batch -- for contrastive losses, whose negatives couple the samples, plain
per-micro-batch accumulation would instead optimise a different (smaller-batch) objective. The price is one
extra forward pass per micro-batch.

Reliability: ``--resume latest`` continues exactly where the run stopped (weights, optimizer, scheduler, data
position; tested against an uninterrupted run after kill -9); a non-finite loss or gradient skips the step
(logged), and ``--max-bad-steps`` of them in a row stop the run (exit status 3) with a message naming the last
good checkpoint, the checkpoints already written untouched. Checkpoints are open_clip's safetensors plus JSON
(``train/pretrain/checkpoint.py``); ``--keep-checkpoints N`` keeps the N newest, the best evaluated one and the
one ``latest`` names.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # MKL rounding independent of buffer alignment (exact resumes)

import torch  # noqa: E402

from adapters.objectives.base import StepContext, split_features  # noqa: E402
from adapters.objectives.phases import phase  # noqa: E402
from adapters.registry import PRETRAIN  # noqa: E402
from extract.models.backbone import image_grid  # noqa: E402
from extract.models.tokens import tokenizer_for  # noqa: E402
from extract.common.cli import Parser, check_options, from_namespace, option, progress, run_job, say  # noqa: E402
from extract.common.cli import build_parser as build_cli  # noqa: E402
from extract.common.config import (config_value, fraction, nonnegative_float, nonnegative_int,  # noqa: E402
                            parse_with_config, positive_float, positive_int, save_config)
from extract.components.hard_negatives import HardNegativeOptions, parse_types  # noqa: E402
from extract.common.source_args import SourceOptions, source_options  # noqa: E402
from extract.common.tensorfile import first_nonfinite  # noqa: E402
from extract.data.toyworld import is_toyworld  # noqa: E402
from train.bad_steps import MAX_BAD_STEPS, BadSteps, TrainingDiverged  # noqa: E402
from train.pretrain import checkpoint as ckpt  # noqa: E402
from train.pretrain.data import SeededTransform, build_train_data, to_device  # noqa: E402
from extract.common.run_dir import claim, default_out  # noqa: E402

PRECISIONS = {"fp32": None, "amp": torch.float16, "fp16": torch.float16, "amp_bf16": torch.bfloat16,
              "bf16": torch.bfloat16}
EVAL_TASKS = ("retrieval", "zeroshot", "compositional", "linear_probe")
EPOCHS = 32  # --epochs on data the user names (the papers' CC12M runs)
TOY_EPOCHS = 5  # --epochs on the embedded toy world: a first run that ends in minutes on a laptop CPU
DEFAULT_WORKERS = min(4, max(1, (os.cpu_count() or 2) // 2))


# --------------------------------------------------------------------------------------------- options
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
    split: str = option("train", group="data", help="toy world: the split to train on")
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
        self.method_options = {str(k).replace("-", "_"): v for k, v in dict(self.method_options or {}).items()}
        self.hard_negatives = ",".join(parse_types(self.hard_negatives)) or "none"


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


# --------------------------------------------------------------------------------------------- processes
@dataclass
class Dist:
    """This process among the data-parallel ranks (read from the environment like open_clip_train.distributed)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def all_true(self, flag: torch.Tensor) -> torch.Tensor:
        """A 0-d bool tensor, True on every rank when ``flag`` is True on every rank; it stays on the device (no
        host synchronisation)."""
        if self.world_size == 1:
            return flag
        t = flag.to(device=self.device, dtype=torch.float32).reshape(1)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return t[0] > 0.5

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item() > 0)


def world_info_from_env() -> tuple[int, int, int]:
    """(local_rank, rank, world_size) from torchrun / accelerate / SLURM / MPI variables (open_clip's order)."""
    def first(names, default):
        for n in names:
            if n in os.environ:
                return int(os.environ[n])
        return default
    local = first(("LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)
    rank = first(("RANK", "PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"), 0)
    world = first(("WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"), 1)
    return local, rank, world


def init_distributed(device: str | None, dist_url: str = "env://") -> Dist:
    local, rank, world = world_info_from_env()
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not torch.distributed.is_initialized():
        if dist_url == "env://" and "MASTER_ADDR" not in os.environ:
            raise RuntimeError("distributed run without MASTER_ADDR: launch with torchrun / accelerate, or export "
                               "MASTER_ADDR and MASTER_PORT (SLURM: the first node of $SLURM_JOB_NODELIST), or pass "
                               "--dist-url tcp://HOST:PORT")
        # SLURM gives ranks but not torchrun's variables: pass them on for the env:// rendezvous
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("LOCAL_RANK", str(local))
        backend = "nccl" if dev.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, init_method=dist_url, rank=rank, world_size=world)
    return Dist(rank=rank, local_rank=local, world_size=world, device=dev)


# --------------------------------------------------------------------------------------------- model / optimizer
def resolve_architecture(model: str) -> str:
    """open_clip model name for ``--model`` (plugvlm aliases such as ``tiny`` map to their config)."""
    from extract.models.backbone import resolve_spec

    return resolve_spec(model, "none").model


def create_model(arch: str, quick_gelu: bool, seed: int, pretrained: str | None = None):
    """(model in fp32 on CPU, train transform, eval transform, tokenizer); identical on every rank for a seed."""
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from extract.models.backbone import register_configs, quiet_open_clip

    quiet_open_clip()  # open_clip's "No pretrained weights loaded" is wrong here: weights are loaded below or trained
    register_configs()  # plugvlm-tiny and friends
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.create_model(arch, pretrained=None, force_quick_gelu=quick_gelu)
    if pretrained:
        from extract.models.weights import resolve_weights

        weights = resolve_weights(arch, pretrained)
        if weights.path is not None:  # verified if plugvlm wrote it; a foreign pickle is explained, not unpickled
            from extract.models.backbone import load_weights_file

            load_weights_file(model, weights.path, arch)
    pp = PreprocessCfg(**model.visual.preprocess_cfg)
    return (model, image_transform_v2(pp, is_train=True), image_transform_v2(pp, is_train=False),
            tokenizer_for(arch))


def param_groups(model: torch.nn.Module, wd: float) -> tuple[list[dict], list[str]]:
    """open_clip_train.main's grouping: no weight decay on gains, biases, 1-d tensors and the logit scale.
    Returns (groups, parameter names in optimizer order)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n  # noqa: E731
    decay = [(n, p) for n, p in named if not exclude(n, p)]
    no_decay = [(n, p) for n, p in named if exclude(n, p)]
    groups = [{"params": [p for _, p in no_decay], "weight_decay": 0.0},
              {"params": [p for _, p in decay], "weight_decay": wd}]
    return groups, [n for n, _ in no_decay] + [n for n, _ in decay]


def cosine_lr(base_lr: float, warmup: int, steps: int, step: int) -> float:
    """open_clip_train.scheduler.cosine_lr at ``step``: linear warm-up, then cosine decay to 0."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    e, es = step - warmup, max(1, steps - warmup)
    return 0.5 * (1 + math.cos(math.pi * e / es)) * base_lr


class DDPForward(torch.nn.Module):
    """What DDP wraps: the model plus the objective's forward, so gradient all-reduce follows its backward."""

    def __init__(self, model: torch.nn.Module, objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: dict, ctx: StepContext) -> dict:
        return self.objective.features(self.model, batch, ctx)


class Trainer:
    """Model, objective, optimizer and one optimizer step (forward, loss, backward, checks, update)."""

    def __init__(self, args: PretrainOptions, dist: Dist, model: torch.nn.Module, objective):
        self.args, self.dist, self.objective = args, dist, objective
        self.model = model.to(dist.device)
        if args.grad_checkpointing:
            self.model.set_grad_checkpointing(True)
        if args.compile:
            from adapters.objectives.towers import compile_towers

            compile_towers(self.model, backend=args.compile_backend)
        groups, self.param_names = param_groups(self.model, args.wd)
        self.params = [p for g in groups for p in g["params"]]
        fused = {"on": True, "off": False, "auto": dist.device.type == "cuda"}[args.fused_adamw]
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                                           fused=fused or None)
        amp = PRECISIONS[args.precision]
        self.autocast = (lambda: torch.autocast(device_type=dist.device.type, dtype=amp)) if amp else nullcontext
        self.scaler = torch.amp.GradScaler(dist.device.type) if amp == torch.float16 else None
        wrapped = DDPForward(self.model, objective)
        if dist.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [dist.device.index] if dist.device.type == "cuda" else None
            wrapped = DistributedDataParallel(wrapped, device_ids=ids, broadcast_buffers=False)
        self.forward = wrapped
        self.nan_steps = set(args.debug_nan_steps)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def context(self, step: int, epoch: int, epochs: int) -> StepContext:
        a = self.args
        return StepContext(step=step, epoch=epoch, progress=epoch / max(1, epochs), rank=self.dist.rank,
                           world_size=self.dist.world_size, seed=a.seed, local_loss=a.local_loss,
                           gather_with_grad=a.gather_with_grad)

    def forward_backward(self, micro: list[dict], ctx: StepContext) -> dict[str, torch.Tensor]:
        """Gradients of the loss on the step's whole batch (all micro-batches, all ranks) into ``.grad``.
        ``micro``: this rank's micro-batches, already on the device. Returns the loss parts (detached)."""
        w, r, a = self.dist.world_size, self.dist.rank, len(micro)
        b = len(micro[0]["image"])
        ctxs = [ctx.with_batch((j * w + r) * b, a * w * b) for j in range(a)]
        poison = ctx.step + 1 in self.nan_steps  # step numbers are 1-based, as in the log
        if a == 1:
            with self.autocast():
                with phase("features"):
                    features = self.forward(micro[0], ctxs[0])
                with phase("loss"):
                    losses = self.objective.loss(features, ctxs[0])
            loss = losses["loss"] * float("nan") if poison else losses["loss"]
            with phase("backward"):
                self._backward(loss)
            return {k: v.detach() for k, v in {**losses, "loss": loss}.items()}
        # open_clip's accum_freq: cache every micro-batch's features, then differentiate one at a time
        cached = []
        with torch.no_grad(), self.autocast():
            for j in range(a):
                cached.append(split_features(self.forward(micro[j], ctxs[j]))[0])
        sync_free = getattr(self.forward, "no_sync", None)
        for j in range(a):
            with (sync_free() if sync_free is not None and j < a - 1 else nullcontext()):
                with self.autocast():
                    per, shared = split_features(self.forward(micro[j], ctxs[j]))
                    full = {k: torch.cat([per[k] if i == j else cached[i][k] for i in range(a)]) for k in per}
                    # A shared tensor (the logit scale) enters each of the a losses whole: give it 1/a of the
                    # gradient each time, so the sum is the big batch's (open_clip lets it accumulate a times).
                    shared = {k: v / a + (v - v / a).detach() for k, v in shared.items()}
                    losses = self.objective.loss({**full, **shared}, ctxs[j])
                loss = losses["loss"] * float("nan") if poison else losses["loss"]
                self._backward(loss)
        return {k: v.detach() for k, v in {**losses, "loss": loss}.items()}

    def step(self, micro: list[dict], ctx: StepContext, lr: float) -> tuple[dict[str, float], bool]:
        """One optimizer step. Returns (metrics, ok); not ok = non-finite loss or gradient, step skipped."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        losses = self.forward_backward(micro, ctx)
        with phase("optimizer"):
            return self._update(losses)

    def _update(self, losses: dict[str, torch.Tensor]) -> tuple[dict[str, float], bool]:
        """Check, clip and apply the gradients; the step's one host synchronisation is reading the metrics at the
        end (with fused AdamW: before that, the check, the skip and the update all stay on the device)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.scaler is not None:
            # fp16: inf gradients are the loss scaler's business (it skips those steps and lowers the scale)
            bad = self.dist.any(not bool(torch.isfinite(losses["loss"])))
            norm = None
            if self.args.grad_clip_norm is not None:
                self.scaler.unscale_(self.optimizer)
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.args.grad_clip_norm)
            if not bad:
                self.scaler.step(self.optimizer)
            self.scaler.update()
            ok = torch.tensor(not bad, device=self.dist.device)  # beside the metrics: one copy to the host
        else:
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.dist.device)
            ok = self.dist.all_true(torch.isfinite(losses["loss"]) & torch.isfinite(norm))
            if self.args.grad_clip_norm is not None:  # a non-finite norm makes NaN gradients: skipped below
                torch.nn.utils.clip_grads_with_norm_(self.params, self.args.grad_clip_norm, norm)
            if self.optimizer.param_groups[0].get("fused"):  # a resumed optimizer keeps its checkpoint's kernel
                # the fused kernel skips the update of every tensor, and undoes its step count, where found_inf
                # is set (GradScaler's protocol), so a bad step is skipped without the host asking
                self.optimizer.found_inf = (~ok).float()
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.found_inf
            elif bool(ok):
                self.optimizer.step()
        with torch.no_grad():  # CLIP's clamp of the temperature, ln(100) (open_clip_train.train)
            self.model.logit_scale.clamp_(0, math.log(100))
        named = {**losses, "logit_scale": self.model.logit_scale.detach().exp()}
        if norm is not None:
            named["grad_norm"] = norm
        values = torch.stack([v.detach().float().reshape(()).to(ok.device) for v in named.values()]
                             + [ok.float().reshape(())]).tolist()  # the one synchronisation
        if not values[-1]:
            self.optimizer.zero_grad(set_to_none=True)
        return dict(zip(named, values[:-1])), bool(values[-1])


# --------------------------------------------------------------------------------------------- logging
class RunLog:
    """CSV (``OUT/log.csv``, one row per logged step, appended on resume) and TensorBoard (``OUT/tb``)."""

    def __init__(self, out: Path, tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.path = out / "log.csv"
        self.columns: list[str] | None = None
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tb"))
            except ImportError:
                print("note: tensorboard is not installed (pip install 'plugvlm[train]'); logging to CSV only")
        if enabled and self.path.is_file():
            with open(self.path, newline="") as f:
                self.columns = next(csv.reader(f), None)

    def write(self, step: int, row: dict[str, Any], prefix: str = "train") -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step",):
                    self.tb.add_scalar(f"{prefix}/{k}", v, step)
        if prefix != "train":
            return
        if self.columns is None:
            self.columns = list(row)
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(self.columns)
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in self.columns])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


# --------------------------------------------------------------------------------------------- evaluation hook
def eval_tasks(opts: PretrainOptions) -> dict:
    """The per-epoch evaluation's data (``train.eval.evaluate.load_tasks``), read once before training so a bad
    ``--val-data`` fails before the first step."""
    from train.eval import evaluate as ev

    return ev.load_tasks(ev.EvaluateOptions(data=opts.val_data, split=opts.val_split, tasks=list(opts.eval_tasks),
                                            seed=opts.seed))


def evaluate_checkpoint(weights: Path, arch: str, opts: PretrainOptions, device, tasks: dict | None = None
                        ) -> dict[str, float]:
    """Evaluate saved weights with the evaluation suite (``train.eval``'s functions) on the toy world's
    ``val_split``: retrieval R@k, zero-shot, compositional per type. ``tasks``: from :func:`eval_tasks` (read
    here when None). Returns the flat headline numbers."""
    from adapters.load import load_scorer
    from train.eval import evaluate as ev

    tasks = eval_tasks(opts) if tasks is None else tasks
    scorer = load_scorer(arch, str(weights), device=device)
    res: dict[str, Any] = {}
    if "retrieval" in tasks:
        res["retrieval"] = ev.run_retrieval(scorer, tasks["retrieval"], 128)
    if "zeroshot" in tasks:
        res["zeroshot"] = ev.run_zeroshot(scorer, *tasks["zeroshot"], 128)
    if "compositional" in tasks:
        res["compositional"] = {bm.name: ev.run_compositional(scorer, bm, 128) for bm in tasks["compositional"]}
    if "linear_probe" in tasks:
        res["linear_probe"] = ev.run_linear_probe(scorer, *tasks["linear_probe"], 128, opts.seed)
    return ev.headline(res)


def retrieval_score(metrics: dict[str, float]) -> float | None:
    """What "best checkpoint" means: the mean of the evaluation's retrieval R@1 (T2I and I2T); None without
    retrieval numbers."""
    r1 = [v for k, v in metrics.items() if k.startswith("retrieval") and k.endswith("R@1")]
    return sum(r1) / len(r1) if r1 else None


# --------------------------------------------------------------------------------------------- a run
def _silent(*args, **kwargs) -> None:
    pass


def resolve_options(opts: PretrainOptions, dist: Dist) -> tuple[PretrainOptions, list[str]]:
    """The options with data, epochs, out and val_data filled in where they were left to the run
    (:class:`PretrainOptions`), and one line per choice made, for the run's first lines. The embedded toy world
    is generated here when it is needed."""
    notes, changes = [], {}
    if opts.data is None:
        from extract.data import toyworld

        # module attributes read now, not bound as defaults, so a test can make the default world small
        where, n, seed = toyworld.DEFAULT_PATH, toyworld.DEFAULT_N, toyworld.DEFAULT_SEED
        if dist.is_main:
            toyworld.ensure(where, n, seed, say=say)
        dist.barrier()
        changes["data"] = str(where)
        notes.append(f"data: the embedded toy world {where} ({n} scenes, seed {seed}; no --data given)")
    if opts.epochs is None:
        changes["epochs"] = TOY_EPOCHS if opts.data is None else EPOCHS
        notes.append(f"epochs: {changes['epochs']} (the default " + (
            f"on the embedded toy world, {EPOCHS} on data you name" if opts.data is None else "")
            + "; --epochs N to change it)")
    if opts.out is None:
        changes["out"] = str(default_out("pretrain", opts.model, opts.method))
        notes.append(f"out: {changes['out']} (no --out given)")
    data = changes.get("data", opts.data)
    if opts.val_data is None and is_toyworld(data):
        changes["val_data"] = data
    return dataclasses.replace(opts, **changes), notes


def _describe(opts: PretrainOptions, arch: str, objective, data, step: int, epoch: float, samples: int,
              metrics=None) -> dict:
    """model.json: what the weights are (see train/pretrain/checkpoint.py)."""
    import open_clip

    return {"model": arch, "model_cfg": open_clip.get_model_config(arch), "quick_gelu": bool(opts.quick_gelu),
            "method": objective.name, "method_config": objective.config(), "step": step, "epoch": epoch,
            "samples_seen": samples, "data": {**data.description, "skipped": data.report.counts()},
            "args": dataclasses.asdict(opts),  # PretrainOptions(**args) is this run's options
            "versions": {"open_clip": open_clip.__version__, "torch": torch.__version__},
            "metrics": metrics or {},
            "load": {"open_clip": f"open_clip.create_model_and_transforms({arch!r}"
                                  + (", force_quick_gelu=True" if opts.quick_gelu else "") + ", pretrained=PATH)",
                     "plugvlm": f"extract.models.backbone.load_backbone({arch!r}, PATH)"}}


VOCAB_CAPTIONS = 20000  # the hard negatives' vocabulary: at most this many training captions, evenly spaced


def with_hard_negatives(objective, opts: PretrainOptions):
    """``objective`` with NegCLIP's hard-negative columns (:mod:`adapters.objectives.hard_negatives`); its
    vocabulary is filled by :func:`fill_vocabulary` once the training data is open. On a toy world, no negative
    names one of its held-out (colour, shape) combinations."""
    from adapters.objectives.hard_negatives import WithHardNegatives
    from extract.components.hard_negatives import HardNegatives, Vocabulary

    from extract.data.toyworld import heldout_of

    forbid = heldout_of(opts.data) if opts.data and is_toyworld(opts.data) else frozenset()
    generator = HardNegatives(Vocabulary(), parse_types(opts.hard_negatives), forbid)
    return WithHardNegatives(objective, generator, opts.hard_negative_weight, opts.seed)


def fill_vocabulary(generator, opts: PretrainOptions, data) -> str:
    """Build the hard negatives' vocabulary from ``--hard-negative-vocab`` or the training captions (at most
    VOCAB_CAPTIONS, evenly spaced; words seen twice when there are more than 5,000). Returns a line for the log."""
    import numpy as np

    from extract.components.hard_negatives import Vocabulary
    from extract.components.text import read_captions

    if opts.hard_negative_vocab:
        captions, where = read_captions(opts.hard_negative_vocab), opts.hard_negative_vocab
    else:
        records = getattr(data.loader.dataset, "records", None)
        if records is None:
            raise ValueError("--hard-negatives on webdataset shards needs --hard-negative-vocab CAPTIONS (a file of "
                             "training captions the replacements draw from)")
        captions, where = [c.text for r in records for c in r.captions], "the training captions"
    if not captions:
        raise ValueError(f"--hard-negatives: no captions in {where}")
    picked = [captions[i] for i in np.linspace(0, len(captions) - 1, min(len(captions), VOCAB_CAPTIONS)).astype(int)]
    generator.vocab = Vocabulary.build(generator.structures(picked), min_count=2 if len(picked) > 5000 else 1)
    v = generator.vocab
    return (f"hard negatives: vocabulary of {len(picked)} captions from {where}: {len(v.nouns)} nouns, "
            + ", ".join(f"{len(w)} {c}" for c, w in sorted(v.attributes.items())) + f", {len(v.predicates)} predicates")


class PretrainRun:
    """One pre-training run, in the order :func:`pretrain` calls its steps: ``__init__`` (model, objective,
    :meth:`open_data`, optimizer), :meth:`resume`, :meth:`start`, then per epoch :meth:`train_epoch` (each step:
    :meth:`train_step`) and :meth:`end_epoch` (:meth:`checkpoint`, :meth:`evaluate`), and :meth:`finish` (the
    final weights).

    Where the run stands -- ``step`` (optimizer steps done, so the k-th step is numbered k everywhere),
    ``epoch`` (epochs done), ``in_epoch`` (steps done in the current one), ``samples``, ``bad_in_a_row`` -- is
    what a checkpoint stores and :meth:`resume` restores."""

    def __init__(self, opts: PretrainOptions, dist: Dist):
        """Setup: the model, the objective, the data, the optimizer and the evaluation's data."""
        self.opts, self.dist = opts, dist
        self.say = say if dist.is_main else _silent
        self.warn = print if dist.is_main else _silent  # warnings stay under --quiet
        self.out = Path(opts.out)
        self.ckpt_dir = self.out / "checkpoints"
        self.arch = resolve_architecture(opts.model)
        self.objective = build_objective(opts.method, opts.method_options)
        model, train_tf, eval_tf, tokenizer = create_model(self.arch, opts.quick_gelu, opts.seed, opts.pretrained)
        fixed = bool(getattr(self.objective, "needs_fixed_geometry", False))
        if fixed and opts.augment != "none":
            self.say(f"note: {opts.method} with these settings needs the evaluation geometry; training without "
                     "augmentation")
        plain = fixed or opts.augment == "none"
        self.resume_path = ckpt.find_resume(self.out, opts.resume) if opts.resume else None
        if opts.hard_negatives != "none":
            self.objective = with_hard_negatives(self.objective, opts)
        self.data = self.open_data(tokenizer, SeededTransform(eval_tf if plain else train_tf, random=not plain))
        if opts.hard_negatives != "none":  # before the first batch: the loader's workers start with it
            self.say(fill_vocabulary(self.objective.generator, opts, self.data))
        self.objective.setup(model, {"source": opts.data, "data": opts.data, "model": opts.model,
                                     "image_ids": self.data.image_ids, "grid": image_grid(model.visual)})
        self.evaluates = bool(dist.is_main and opts.eval_every_n_epochs and opts.val_data)
        self.tasks = eval_tasks(opts) if self.evaluates else None  # a bad --val-data fails before training
        self.trainer = Trainer(opts, dist, model, self.objective)
        self.total_steps = self.data.steps_per_epoch * opts.epochs
        if opts.max_steps is not None:
            self.total_steps = min(self.total_steps, opts.max_steps)
        # 10k warm-up steps on a 500-step toy run would be all of it
        self.warmup = min(opts.warmup, max(1, self.total_steps // 10))
        self.global_batch = opts.batch_size * dist.world_size * opts.accum_freq
        self.step = self.epoch = self.in_epoch = self.samples = 0
        self.bad = BadSteps(opts.max_bad_steps)  # skipped steps (train.bad_steps: the policy of both engines)
        self.last_ckpt: Path | None = None
        self.evals: dict[str, dict] = {}  # checkpoint name -> its evaluation (OUT/eval/<name>.json)
        self.log: RunLog | None = None
        self.pbar = None

    # -- data
    def open_data(self, tokenizer, transform: SeededTransform):
        """This rank's training data (``train.pretrain.data``), positioned where the resumed checkpoint stopped."""
        o, dist = self.opts, self.dist
        resume_state = json.loads((self.resume_path / "state.json").read_text()) if self.resume_path else None
        return build_train_data(o.data, batch_size=o.batch_size, rank=dist.rank, world_size=dist.world_size,
                                accum_freq=o.accum_freq, seed=o.seed, tokenizer=tokenizer, objective=self.objective,
                                transform=transform, workers=o.workers, split=o.split, image_root=o.image_root,
                                source_options=source_options(o), train_num_samples=o.train_num_samples,
                                resampled=o.dataset_resampled, shuffle_buffer=o.shuffle_buffer,
                                resume_state=resume_state)

    # -- resume
    def resume(self) -> None:
        """Continue from ``--resume``'s checkpoint: weights, optimizer, scaler, RNG, position; the evaluations
        already made (which the best checkpoint is chosen from)."""
        if self.resume_path is None:
            if self.opts.resume:
                self.say(f"note: --resume {self.opts.resume}: no checkpoint in {self.ckpt_dir} yet; starting a new run")
            return
        t = self.trainer
        state = ckpt.load_checkpoint(self.resume_path, t.model, t.optimizer, t.param_names, t.scaler)
        self.step, self.epoch, self.in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        self.samples = state["samples_seen"]
        self.bad.load(state)
        self.last_ckpt = self.resume_path
        if state.get("global_batch") != self.global_batch:
            self.say(f"note: the checkpoint was trained with a global batch of {state.get('global_batch')}; the data "
                     "order after this resume differs from an uninterrupted run's")
        self.say(f"resumed from {self.resume_path} at step {self.step} (epoch {self.epoch}, step {self.in_epoch} of "
                 f"{self.data.steps_per_epoch})")
        for path in sorted((self.out / "eval").glob("*.json")):
            try:
                self.evals[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError):
                pass  # a report cut by the kill: that epoch just does not compete for "best"

    # -- start
    def start(self, notes: Sequence[str] = ()) -> None:
        """The run folder (config.json, leftovers of a killed run removed), the logs, and the run's first lines:
        what was chosen for the user and what will run."""
        o, d = self.opts, self.data
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.ckpt_dir.is_dir():
                ckpt.clean_partial(self.ckpt_dir)
            save_config(run_config(o), self.out / "config.json")
        self.dist.barrier()
        self.log = RunLog(self.out, o.tensorboard, self.dist.is_main)
        for line in notes:
            self.say(line)
        self.say(f"objective: {self.objective.describe()}")
        samples = d.description.get("images", d.description.get("samples_per_epoch"))
        self.say(f"{self.arch} on {o.data}: {samples} samples/epoch, {d.steps_per_epoch} steps/epoch of "
                 f"{self.global_batch} ({self.dist.world_size} rank(s) x {o.accum_freq} x {o.batch_size}), "
                 f"{self.total_steps} steps, device {self.dist.device}, {o.precision}")
        evaluation = (f"evaluated on {o.val_data} ({o.val_split}) every {o.eval_every_n_epochs} epoch(s)"
                      if self.evaluates else "no per-epoch evaluation")
        kept = "all kept" if o.keep_checkpoints == 0 else f"the newest {o.keep_checkpoints} and the best kept"
        self.say(f"writing {self.out}: checkpoints {kept}, {evaluation}")
        self.pbar = progress(total=self.total_steps, initial=self.step, desc=o.method, unit="step",
                             disable=not self.dist.is_main)
        self.t_last = time.perf_counter()

    # -- one epoch, one step
    def running(self) -> bool:
        return self.epoch < self.opts.epochs and self.step < self.total_steps

    def train_epoch(self) -> bool:
        """The current epoch's steps from where the run stands, up to its end or the step budget. Returns True
        when the epoch was completed."""
        t_data = time.perf_counter()
        for micro in self.data.epoch_batches(self.epoch, self.in_epoch):
            if self.step >= self.total_steps:
                break
            with phase("data"):
                micro = [to_device(m, self.dist.device) for m in micro]
            self.train_step(micro, data_time=time.perf_counter() - t_data)
            t_data = time.perf_counter()
        return self.in_epoch >= self.data.steps_per_epoch

    def train_step(self, micro: list[dict], data_time: float) -> None:
        """One optimizer step, its log row, the bad-step count (raises TrainingDiverged) and step checkpoints."""
        o = self.opts
        ctx = self.trainer.context(self.step, self.epoch, o.epochs)
        lr = cosine_lr(o.lr, self.warmup, self.total_steps, self.step)
        metrics, ok = self.trainer.step(micro, ctx, lr)
        self.step += 1
        self.in_epoch += 1
        self.samples += self.global_batch
        now = time.perf_counter()
        batch_time, self.t_last = now - self.t_last, now
        # Steps are numbered from 1 everywhere (console, log.csv, checkpoint names): step k is the k-th update.
        # The row is written before a possible abort, so the last bad step is in the log too.
        if self.dist.is_main and (self.step % o.log_every_n_steps == 0 or self.step == 1 or not ok):
            skipped = sum(sum(v.values()) for k, v in self.data.report.counts().items() if k != "converted")
            epoch = self.epoch + self.in_epoch / self.data.steps_per_epoch
            self.log.write(self.step, {"step": self.step, "epoch": epoch, "lr": lr, **metrics,
                                       "skipped_step": int(not ok),
                                       "samples_per_second": self.global_batch / max(batch_time, 1e-9),
                                       "batch_time": batch_time, "data_time": data_time, "data_skipped": skipped})
            self.pbar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.2e}")
        self.pbar.update(1)
        self.count_bad(ok, metrics)
        if o.save_every_n_steps and self.step % o.save_every_n_steps == 0 and self.in_epoch < self.data.steps_per_epoch:
            self.checkpoint(f"step_{self.step:08d}")
            self.dist.barrier()

    def count_bad(self, ok: bool, metrics: dict) -> None:
        """Skipped (non-finite) steps in a row; ``--max-bad-steps`` of them stop the run (train.bad_steps)."""
        if ok:
            self.bad.good()
            return
        stop = self.bad.bad(self.step)
        self.warn(self.bad.warning(self.step, f"non-finite loss or gradient: loss {metrics.get('loss')}"))
        if stop:
            raise self.bad.stopped(str(self.last_ckpt) if self.last_ckpt else None, resume="--resume latest",
                                   advice="lowering --lr, setting --grad-clip-norm 1.0, or switching --precision to "
                                   "amp_bf16 / fp32; check the data with python -m extract.data.check.")

    # -- checkpoints and evaluation
    def checkpoint(self, name: str) -> Path | None:
        """Checkpoint ``name`` at the current position, only from a good state: after a step that was not
        skipped, with finite weights (a run of skipped steps, or weights blown up to inf, must never overwrite
        what --resume would use). Then the old ones beyond ``--keep-checkpoints`` go."""
        t = self.trainer
        if not self.bad.clean or first_nonfinite(t.model.state_dict()) is not None:
            self.warn(f"warning: not writing checkpoint {name}: " + (
                f"the last {self.bad.in_a_row} step(s) were skipped as non-finite" if not self.bad.clean
                else "the weights are not finite") + (
                f"; the last good one is {self.last_ckpt}" if self.last_ckpt else "; no good checkpoint exists yet"))
            return None
        if not self.dist.is_main:
            return None
        spe = self.data.steps_per_epoch
        state = {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.in_epoch, "samples_seen": self.samples,
                 **self.bad.state(), "global_batch": self.global_batch,
                 "world_size": self.dist.world_size, "data_state": self.data.resume_state(self.step),
                 "method": self.opts.method, "model": self.arch, "data_skipped": self.data.report.counts()}
        description = _describe(self.opts, self.arch, self.objective, self.data, self.step,
                                self.epoch + self.in_epoch / spe, self.samples)
        self.last_ckpt = ckpt.save_checkpoint(self.ckpt_dir, name, t.model, t.optimizer, t.param_names, t.scaler,
                                              state, description)
        self.prune()
        return self.last_ckpt

    def best(self) -> str | None:
        """The evaluated checkpoint with the highest :func:`retrieval_score` that still exists."""
        scored = [(s, name) for name, m in self.evals.items()
                  if (s := retrieval_score(m)) is not None and (self.ckpt_dir / name).is_dir()]
        return max(scored)[1] if scored else None

    def prune(self) -> None:
        ckpt.prune(self.ckpt_dir, self.opts.keep_checkpoints, keep_also=[self.best()])

    def end_epoch(self) -> None:
        """After a completed epoch: its checkpoint (every ``--save-frequency`` epochs, and the last) and its
        evaluation (every ``--eval-every-n-epochs``, and the last)."""
        o = self.opts
        self.epoch += 1
        self.in_epoch = 0
        name = f"epoch_{self.epoch:04d}"
        last = self.epoch == o.epochs
        if (o.save_frequency and self.epoch % o.save_frequency == 0) or last:
            self.checkpoint(name)
        if (self.evaluates and self.last_ckpt is not None and self.last_ckpt.name == name
                and (self.epoch % o.eval_every_n_epochs == 0 or last)):
            self.evaluate(name)
        self.dist.barrier()
        self.t_last = time.perf_counter()  # checkpoint and evaluation time is not a step's time

    def evaluate(self, name: str) -> dict[str, float]:
        """Evaluate checkpoint ``name`` into ``OUT/eval/<name>.json`` and the logs; mark the best one."""
        res = evaluate_checkpoint(self.ckpt_dir / name / "model.safetensors", self.arch, self.opts, self.dist.device,
                                  self.tasks)
        self.evals[name] = res
        self.log.write(self.step, res, prefix="eval")
        (self.out / "eval").mkdir(exist_ok=True)
        (self.out / "eval" / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
        best = self.best()
        if best is not None:
            ckpt.mark_best(self.ckpt_dir, best)
        self.say(f"epoch {self.epoch} eval: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()
                                                          if k.startswith("retrieval") and k.endswith("R@1"))
                 + (f" (best so far: {best})" if best else ""))
        self.prune()
        return res

    # -- the end
    def close(self) -> None:
        if self.pbar is not None:
            self.pbar.close()
        if self.log is not None:
            self.log.close()

    def finish(self) -> dict:
        """The final weights (``OUT/model.safetensors`` + ``model.json``) and data report; returns the summary."""
        last_eval = self.evals[max(self.evals)] if self.evals else {}
        if first_nonfinite(self.trainer.model.state_dict()) is not None:  # a "good" last step can overflow to inf
            raise TrainingDiverged("stopped: the final weights are not finite, so they were not saved; "
                                  + (f"the last good checkpoint is {self.last_ckpt}" if self.last_ckpt
                                     else "no good checkpoint exists") + ". Lower --lr or set --grad-clip-norm 1.0.")
        best = self.best()
        weights = self.out / "model.safetensors"
        if self.dist.is_main:
            epochs = self.epoch + self.in_epoch / self.data.steps_per_epoch
            ckpt.save_final(self.out, self.trainer.model, _describe(self.opts, self.arch, self.objective, self.data,
                                                                    self.step, epochs, self.samples, last_eval))
            self.data.report.to_json(self.out / "data_report.json")
            self.say(f"done: {self.step} steps, {self.samples} samples; weights {weights} (+ model.json)"
                     + (f"; best evaluated checkpoint {self.ckpt_dir / best}" if best else ""))
            self.say(f"data: {self.data.report.summary()}")
        self.dist.barrier()
        return {"step": self.step, "epoch": self.epoch, "samples": self.samples, "out": str(self.out),
                "weights": str(weights), "eval": last_eval, "best": str(self.ckpt_dir / best) if best else None,
                "bad_steps": self.bad.steps, "options": self.opts}


def pretrain(opts: PretrainOptions) -> dict:
    """Run (or resume) the pre-training ``opts`` describes; returns ``{"step", "epoch", "samples", "out",
    "weights", "eval" (the last evaluation's headline numbers), "best" (the best evaluated checkpoint or None),
    "bad_steps", "options" (resolved)}``. Raises ValueError for bad options (the command line's checks) or a run
    folder holding another run, TrainingDiverged when training diverges."""
    check_options(opts, build_parser())
    opts = dataclasses.replace(opts, method_options=resolve_method_options(opts.method, opts.method_options))
    build_objective(opts.method, opts.method_options)  # its own checks too, before a file is written
    dist = init_distributed(opts.device, opts.dist_url)
    opts, notes = resolve_options(opts, dist)
    # continuing a checkpoint checks its own settings; "--resume latest" with nothing to resume is a new run
    resuming = bool(opts.resume) and ckpt.find_resume(Path(opts.out), opts.resume) is not None
    claim(Path(opts.out), run_config(opts), resume=resuming)
    dist.barrier()  # every rank has checked the folder before rank 0 writes its config.json
    run = PretrainRun(opts, dist)
    run.resume()
    run.start(notes)
    try:
        while run.running():
            if not run.train_epoch():  # stopped by --max-steps inside the epoch
                break
            run.end_epoch()
    finally:
        run.close()
    return run.finish()


train = pretrain  # the name this job had before it took options (train.demo, older scripts)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        return run_job(pretrain, opts)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
