"""``python -m train.pretrain``: pre-train an open_clip CLIP model from scratch with CLIP, FLIP, FILIP, CLIP-PGS
or PowerCLIP, on one process or many.

    python -m train.pretrain --method clip --data toy --epochs 10 --out runs/pt-clip          # CPU, one process
    torchrun --nproc_per_node 8 -m train.pretrain --method powerclip --model ViT-B-16 \\
        --data 'cc12m/{00000..01242}.tar' --train-num-samples 10968539 --batch-size 512 --precision amp_bf16
    accelerate launch --multi_gpu --num_processes 8 -m train.pretrain ...
    srun python -m train.pretrain ...   # SLURM: ranks from SLURM_PROCID / SLURM_NTASKS, MASTER_ADDR/PORT exported

The engine follows open_clip's trainer (``open_clip_train``): AdamW (0.9, 0.98, eps 1e-6), lr 1e-3, weight
decay 0.2 on every tensor but gains, biases and the logit scale, cosine schedule with linear warm-up, autocast
(``--precision amp`` / ``amp_bf16``; fp32 by default, the CPU choice), gradient checkpointing, gradient
accumulation with cached features (``--accum-freq``, open_clip's method: the negatives are the whole
accumulated batch, see below), features gathered over ranks *with* gradient and a local loss (so N ranks
give one process's loss and gradients), the logit scale clamped to ln(100) after every step.

What a method is -- its batch, its change to the forward, its loss on one or many ranks -- lives in
``adapters/pretrain/<method>.py`` (the ``PRETRAIN`` registry); this file never asks which method runs.

Gradient accumulation: every micro-batch's features are first computed without gradients; then each
micro-batch is recomputed with gradients and the loss is evaluated on the concatenation of its fresh features
with the others' cached ones, and back-propagated. Summed over micro-batches this is exactly the gradient of
the loss on the whole accumulated batch -- for contrastive losses, whose negatives couple the samples, plain
per-micro-batch accumulation would instead optimise a different (smaller-batch) objective. The price is one
extra forward pass per micro-batch.

Reliability: ``--resume latest`` continues exactly where the run stopped (weights, optimizer, scheduler, data
position; tested against an uninterrupted run after kill -9); a non-finite loss or gradient skips the step
(logged), and ``--max-bad-steps`` of them in a row stop the run with a message, the checkpoints already written
untouched. Checkpoints are open_clip's safetensors plus JSON (``train/pretrain_checkpoint.py``).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # MKL rounding independent of buffer alignment (exact resumes)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from adapters.pretrain._base import StepContext, split_features  # noqa: E402
from adapters.registry import PRETRAIN  # noqa: E402
from extract.config import (fraction, nonnegative_float, nonnegative_int, parse_with_config, positive_float,  # noqa: E402
                            positive_int, save_config)
from extract.source_args import add_source_args, source_options  # noqa: E402
from extract.tensorfile import first_nonfinite  # noqa: E402
from train import pretrain_checkpoint as ckpt  # noqa: E402
from train.pretrain_data import SeededTransform, build_train_data, to_device  # noqa: E402

PRECISIONS = {"fp32": None, "amp": torch.float16, "fp16": torch.float16, "amp_bf16": torch.bfloat16,
              "bf16": torch.bfloat16}
EVAL_TASKS = ("retrieval", "zeroshot", "compositional", "linear_probe")


class TrainingAborted(RuntimeError):
    """Too many non-finite steps in a row; the message says what was kept and what to try."""


# --------------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.pretrain", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", default="clip", choices=PRETRAIN.names(), help="pre-training objective")
    p.add_argument("--model", default="tiny",
                   help="open_clip architecture (ViT-B-16: the papers' setting) or a plugvlm alias (tiny = plugvlm-tiny)")
    p.add_argument("--quick-gelu", action="store_true",
                   help="QuickGELU activations (OpenAI CLIP's); default GELU, as open_clip trains from scratch")
    p.add_argument("--pretrained", default=None, help="initial weights (tag or file); default: random init")
    d = p.add_argument_group("data")
    d.add_argument("--data", required=False,
                   help="toy-world folder, CSV/TSV (filepath,title), COCO captions JSON, or webdataset shards "
                        "('shards/{00000..00099}.tar', a folder of .tar)")
    d.add_argument("--split", default="train", help="toy world: the split to train on")
    d.add_argument("--image-root", default=None, help="CSV / COCO: folder of relative image paths")
    d.add_argument("--train-num-samples", type=positive_int, default=None, help="webdataset: samples per epoch")
    d.add_argument("--dataset-resampled", action=argparse.BooleanOptionalAction, default=True,
                   help="webdataset: draw shards with replacement (open_clip's --dataset-resampled)")
    d.add_argument("--shuffle-buffer", type=positive_int, default=1000, help="webdataset: samples in the shuffle buffer")
    d.add_argument("--workers", type=nonnegative_int, default=min(4, max(1, (os.cpu_count() or 2) // 2)),
                   help="data-loader processes per rank (0: load in the training process)")
    d.add_argument("--augment", default="rrc", choices=["rrc", "none"],
                   help="rrc: open_clip's random resized crop (scale 0.9-1); none: the evaluation transform")
    add_source_args(p)  # --csv-img-key, --csv-caption-key, --csv-separator, --csv-encoding
    o = p.add_argument_group("optimisation")
    o.add_argument("--epochs", type=positive_int, default=32, help="passes over the training data")
    o.add_argument("--max-steps", type=positive_int, default=None, help="stop after this many optimizer steps in total")
    o.add_argument("--batch-size", type=positive_int, default=64, help="images per rank and micro-batch")
    o.add_argument("--accum-freq", type=positive_int, default=1, help="micro-batches per optimizer step (exact, see above)")
    o.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (AdamW)")
    o.add_argument("--beta1", type=fraction, default=0.9, help="AdamW beta1")
    o.add_argument("--beta2", type=fraction, default=0.98, help="AdamW beta2")
    o.add_argument("--eps", type=positive_float, default=1e-6, help="AdamW epsilon")
    o.add_argument("--wd", type=nonnegative_float, default=0.2, help="AdamW weight decay (none on biases, gains, 1-d tensors and the logit scale)")
    o.add_argument("--warmup", type=nonnegative_int, default=10000, help="linear warm-up steps (capped at 10%% of the run)")
    o.add_argument("--grad-clip-norm", type=positive_float, default=None, help="clip the gradient norm (default: off)")
    o.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS),
                   help="fp32, or autocast: amp (fp16 + loss scaling), amp_bf16")
    o.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in the backward pass")
    o.add_argument("--local-loss", action=argparse.BooleanOptionalAction, default=True,
                   help="each rank scores its rows against the gathered batch (with --gather-with-grad: exact)")
    o.add_argument("--gather-with-grad", action=argparse.BooleanOptionalAction, default=True)
    o.add_argument("--seed", type=nonnegative_int, default=0, help="seeds weights, data order and augmentation")
    o.add_argument("--max-bad-steps", type=positive_int, default=5,
                   help="non-finite loss/gradient steps in a row before the run stops")
    r = p.add_argument_group("output")
    r.add_argument("--out", default="runs/pretrain", help="run folder: checkpoints, logs, final model")
    r.add_argument("--save-every-n-steps", type=nonnegative_int, default=1000, help="step checkpoints (0: off)")
    r.add_argument("--save-frequency", type=nonnegative_int, default=1, help="epoch checkpoints every N epochs (0: off)")
    r.add_argument("--keep-checkpoints", type=nonnegative_int, default=2, help="step checkpoints kept (0: all)")
    r.add_argument("--resume", default=None, help="'latest' (this --out's newest checkpoint) or a checkpoint folder")
    r.add_argument("--log-every-n-steps", type=positive_int, default=10)
    r.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--val-data", default=None,
                   help="toy world for the evaluation hook (default: --data when it is a toy world)")
    r.add_argument("--val-split", default="val")
    r.add_argument("--eval-every-n-epochs", type=nonnegative_int, default=1, help="0: no evaluation")
    r.add_argument("--eval-tasks", default="retrieval,zeroshot,compositional",
                   help=f"comma list from {', '.join(EVAL_TASKS)}")
    r.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK when available, else cpu")
    r.add_argument("--dist-url", default="env://", help="torch.distributed init (torchrun / accelerate set env://)")
    r.add_argument("--debug-nan-steps", default="",
                   help="testing aid: comma list of step numbers (1-based, as in log.csv) whose loss is replaced by NaN")
    for name in PRETRAIN.names():
        PRETRAIN.get(name).add_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_config(p, argv)
    if not args.data:
        p.error("--data is required (a toy world: python -m extract.toyworld --out toy --n 2000)")
    args.eval_tasks = [t.strip() for t in str(args.eval_tasks).split(",") if t.strip()]
    unknown = set(args.eval_tasks) - set(EVAL_TASKS)
    if unknown:
        p.error(f"unknown --eval-tasks {', '.join(sorted(unknown))}; choose from {', '.join(EVAL_TASKS)}")
    args.debug_nan_steps = sorted({int(s) for s in str(args.debug_nan_steps).split(",") if s.strip()})
    if args.batch_size < 1 or args.accum_freq < 1:
        p.error("--batch-size and --accum-freq must be >= 1")
    return args


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
    from extract.backbone import resolve_spec

    return resolve_spec(model, "none").model


def create_model(arch: str, quick_gelu: bool, seed: int, pretrained: str | None = None):
    """(model in fp32 on CPU, train transform, eval transform, tokenizer); identical on every rank for a seed."""
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from extract.backbone import _register_configs

    _register_configs()  # plugvlm-tiny and friends
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.create_model(arch, pretrained=None, force_quick_gelu=quick_gelu)
    if pretrained:
        from extract.weights import resolve_weights

        weights = resolve_weights(arch, pretrained)
        if weights.path is not None:  # verified if plugvlm wrote it; a foreign pickle is explained, not unpickled
            from extract.backbone import load_weights_file

            load_weights_file(model, weights.path)
    pp = PreprocessCfg(**model.visual.preprocess_cfg)
    return (model, image_transform_v2(pp, is_train=True), image_transform_v2(pp, is_train=False),
            open_clip.get_tokenizer(arch))


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


class _Forward(torch.nn.Module):
    """What DDP wraps: the model plus the objective's forward, so gradient all-reduce follows its backward."""

    def __init__(self, model: torch.nn.Module, objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: dict, ctx: StepContext) -> dict:
        return self.objective.features(self.model, batch, ctx)


class Trainer:
    """Model, objective, optimizer and one optimizer step (forward, loss, backward, checks, update)."""

    def __init__(self, args: argparse.Namespace, dist: Dist, model: torch.nn.Module, objective):
        self.args, self.dist, self.objective = args, dist, objective
        self.model = model.to(dist.device)
        if args.grad_checkpointing:
            self.model.set_grad_checkpointing(True)
        groups, self.param_names = param_groups(self.model, args.wd)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)
        amp = PRECISIONS[args.precision]
        self.autocast = (lambda: torch.autocast(device_type=dist.device.type, dtype=amp)) if amp else nullcontext
        self.scaler = torch.amp.GradScaler(dist.device.type) if amp == torch.float16 else None
        wrapped = _Forward(self.model, objective)
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
                losses = self.objective.loss(self.forward(micro[0], ctxs[0]), ctxs[0])
            loss = losses["loss"] * float("nan") if poison else losses["loss"]
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
        bad = self.dist.any(not bool(torch.isfinite(losses["loss"])))
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.scaler is not None:
            # fp16: inf gradients are the loss scaler's business (it skips those steps and lowers the scale)
            norm = None
            if self.args.grad_clip_norm is not None:
                self.scaler.unscale_(self.optimizer)
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.args.grad_clip_norm)
            if not bad:
                self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
            bad = bad or not bool(torch.isfinite(norm))
            if not bad:
                if self.args.grad_clip_norm is not None:
                    torch.nn.utils.clip_grads_with_norm_(self.params, self.args.grad_clip_norm, norm)
                self.optimizer.step()
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():  # CLIP's clamp of the temperature, ln(100) (open_clip_train.train)
            self.model.logit_scale.clamp_(0, math.log(100))
        metrics = {k: float(v) for k, v in losses.items()}
        metrics["logit_scale"] = float(self.model.logit_scale.detach().exp())
        if norm is not None:
            metrics["grad_norm"] = float(norm)
        return metrics, not bad


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
def evaluate_checkpoint(weights: Path, arch: str, args: argparse.Namespace, device) -> dict[str, float]:
    """Evaluate saved weights with the evaluation suite (train.evaluate) on the toy world's ``--val-split``:
    retrieval R@k, zero-shot, compositional per type. Returns the flat headline numbers."""
    from adapters.scoring import load_scorer
    from train import evaluate as ev

    ns = argparse.Namespace(data=args.val_data, split=args.val_split, tasks=list(args.eval_tasks), retrieval_data=None,
                            cache=None, zeroshot_data=None, labels=None, templates="imagenet80", benchmark=[],
                            image_root=None, probe_data=None, probe_test=0.3, seed=args.seed, annotations=None,
                            detector=None)
    tasks = ev.load_tasks(ns)
    scorer = load_scorer(arch, str(weights), device=device)
    res: dict[str, Any] = {}
    if "retrieval" in tasks:
        res["retrieval"] = ev.run_retrieval(scorer, tasks["retrieval"], 128)
    if "zeroshot" in tasks:
        res["zeroshot"] = ev.run_zeroshot(scorer, *tasks["zeroshot"], 128)
    if "compositional" in tasks:
        res["compositional"] = {bm.name: ev.run_compositional(scorer, bm, 128) for bm in tasks["compositional"]}
    if "linear_probe" in tasks:
        res["linear_probe"] = ev.run_linear_probe(scorer, *tasks["linear_probe"], 128, args.seed)
    return ev.headline(res)


# --------------------------------------------------------------------------------------------- driver
def _describe(args, arch: str, objective, data, step: int, epoch: float, samples: int, metrics=None) -> dict:
    import open_clip

    return {"model": arch, "model_cfg": open_clip.get_model_config(arch), "quick_gelu": bool(args.quick_gelu),
            "method": objective.name, "method_config": objective.config(), "step": step, "epoch": epoch,
            "samples_seen": samples, "data": {**data.description, "skipped": data.report.counts()},
            "args": {k: v for k, v in vars(args).items()},
            "versions": {"open_clip": open_clip.__version__, "torch": torch.__version__},
            "metrics": metrics or {},
            "load": {"open_clip": f"open_clip.create_model_and_transforms({arch!r}"
                                  + (", force_quick_gelu=True" if args.quick_gelu else "") + ", pretrained=PATH)",
                     "plugvlm": f"extract.backbone.load_backbone({arch!r}, PATH)"}}


def train(args: argparse.Namespace) -> dict:
    """Run (or resume) a pre-training run; returns a summary dict. Raises TrainingAborted on divergence."""
    dist = init_distributed(args.device, args.dist_url)
    out = Path(args.out)
    arch = resolve_architecture(args.model)
    say = print if dist.is_main else (lambda *a, **k: None)
    objective = PRETRAIN.get(args.method).from_args(args)
    model, train_tf, eval_tf, tokenizer = create_model(arch, args.quick_gelu, args.seed, args.pretrained)
    fixed = bool(getattr(objective, "needs_fixed_geometry", False))
    if fixed and args.augment != "none":
        say(f"note: {args.method} with these settings needs the evaluation geometry; training without augmentation")
    transform = SeededTransform(eval_tf if (fixed or args.augment == "none") else train_tf,
                                random=not (fixed or args.augment == "none"))

    resume_path = ckpt.find_resume(out, args.resume) if args.resume else None
    resume_state = json.loads((resume_path / "state.json").read_text()) if resume_path else None
    data = build_train_data(args.data, batch_size=args.batch_size, rank=dist.rank, world_size=dist.world_size,
                            accum_freq=args.accum_freq, seed=args.seed, tokenizer=tokenizer, objective=objective,
                            transform=transform, workers=args.workers, split=args.split, image_root=args.image_root,
                            source_options=source_options(args),
                            train_num_samples=args.train_num_samples, resampled=args.dataset_resampled,
                            shuffle_buffer=args.shuffle_buffer,
                            resume_state=resume_state)
    objective.setup(model, {"source": args.data, "data": args.data, "model": args.model, "image_ids": data.image_ids,
                            "grid": tuple(model.visual.grid_size)})
    trainer = Trainer(args, dist, model, objective)
    total_steps = data.steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    warmup = min(args.warmup, max(1, total_steps // 10))  # 10k warm-up steps on a 500-step toy run would be all of it
    if args.val_data is None and Path(args.data).is_dir() and (Path(args.data) / "annotations.json").is_file():
        args.val_data = args.data

    step = epoch = start_in_epoch = bad_in_row = 0
    samples = 0
    if resume_path is not None:
        state = ckpt.load_checkpoint(resume_path, trainer.model, trainer.optimizer, trainer.param_names, trainer.scaler)
        step, epoch, start_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        samples, bad_in_row = state["samples_seen"], state["bad_in_row"]
        if state.get("global_batch") != args.batch_size * dist.world_size * args.accum_freq:
            say(f"note: the checkpoint was trained with a global batch of {state.get('global_batch')}; the data order "
                "after this resume differs from an uninterrupted run's")
        say(f"resumed from {resume_path} at step {step} (epoch {epoch}, step {start_in_epoch} of "
            f"{data.steps_per_epoch})")
    elif args.resume:
        say(f"note: --resume {args.resume}: no checkpoint in {out / 'checkpoints'} yet; starting a new run")

    ckpt_dir = out / "checkpoints"
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.clean_partial(ckpt_dir) if ckpt_dir.is_dir() else None
        save_config(args, out / "config.json")
    dist.barrier()
    log = RunLog(out, args.tensorboard, dist.is_main)
    global_batch = args.batch_size * dist.world_size * args.accum_freq
    say(f"{objective.describe()} on {arch}: {data.description.get('images', data.description.get('samples_per_epoch'))} "
        f"samples/epoch, {data.steps_per_epoch} steps/epoch of {global_batch} ({dist.world_size} rank(s) x "
        f"{args.accum_freq} x {args.batch_size}), {total_steps} steps, device {dist.device}, {args.precision}")

    def state_for(step_, epoch_, in_epoch):
        return {"step": step_, "epoch": epoch_, "step_in_epoch": in_epoch, "samples_seen": samples,
                "bad_in_row": bad_in_row, "global_batch": global_batch, "world_size": dist.world_size,
                "data_state": data.resume_state(step_), "method": args.method, "model": arch,
                "data_skipped": data.report.counts()}

    def save(name, step_, epoch_, in_epoch, metrics=None) -> Path | None:
        """Checkpoint ``name``, only from a good state: after a step that was not skipped, with finite weights
        (a run of skipped steps, or weights blown up to inf, must never overwrite what --resume would use)."""
        if bad_in_row or first_nonfinite(trainer.model.state_dict()) is not None:
            say(f"\nwarning: not writing checkpoint {name}: "
                + (f"the last {bad_in_row} step(s) were skipped as non-finite" if bad_in_row else "the weights are not finite")
                + (f"; the last good one is {last_ckpt}" if last_ckpt else "; no good checkpoint exists yet"))
            return None
        if not dist.is_main:
            return None
        path = ckpt.save_checkpoint(ckpt_dir, name, trainer.model, trainer.optimizer, trainer.param_names,
                                    trainer.scaler, state_for(step_, epoch_, in_epoch),
                                    _describe(args, arch, objective, data, step_, epoch_ + in_epoch / data.steps_per_epoch,
                                              samples, metrics))
        ckpt.prune_steps(ckpt_dir, args.keep_checkpoints)
        return path

    evals: dict[str, dict] = {}
    last_ckpt: Path | None = resume_path
    bad_steps: list[int] = []
    t_last = time.perf_counter()
    pbar = tqdm(total=total_steps, initial=step, desc=f"{args.method}", unit="step", disable=not dist.is_main,
                dynamic_ncols=True)
    try:
        while epoch < args.epochs and step < total_steps:
            in_epoch = start_in_epoch
            t_data = time.perf_counter()
            for micro in data.epoch_batches(epoch, start_in_epoch):
                if step >= total_steps:
                    break
                micro = [to_device(m, dist.device) for m in micro]
                data_time = time.perf_counter() - t_data
                ctx = trainer.context(step, epoch, args.epochs)
                lr = cosine_lr(args.lr, warmup, total_steps, step)
                metrics, ok = trainer.step(micro, ctx, lr)
                step += 1
                in_epoch += 1
                samples += global_batch
                now = time.perf_counter()
                batch_time, t_last = now - t_last, now
                # Steps are numbered from 1 everywhere (console, log.csv, checkpoint names): step k is the k-th update.
                # The row is written before a possible abort, so the last bad step is in the log too.
                if dist.is_main and (step % args.log_every_n_steps == 0 or step == 1 or not ok):
                    row = {"step": step, "epoch": epoch + in_epoch / data.steps_per_epoch, "lr": lr, **metrics,
                           "skipped_step": int(not ok), "samples_per_second": global_batch / max(batch_time, 1e-9),
                           "batch_time": batch_time, "data_time": data_time,
                           "data_skipped": sum(sum(v.values()) for k, v in data.report.counts().items() if k != "converted")}
                    log.write(step, row)
                    pbar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.2e}")
                pbar.update(1)
                if ok:
                    bad_in_row = 0
                else:
                    bad_in_row += 1
                    bad_steps.append(step)
                    say(f"\nwarning: step {step}: non-finite loss or gradient ({metrics.get('loss')}); step skipped "
                        f"({bad_in_row} in a row, --max-bad-steps {args.max_bad_steps})")
                    if bad_in_row >= args.max_bad_steps:
                        kept = (f"the last good checkpoint is {last_ckpt}" if last_ckpt else
                                "no checkpoint was written (one is written only after a good step with finite weights)")
                        raise TrainingAborted(
                            f"stopped: {bad_in_row} steps in a row had a NaN/inf loss or gradient (steps "
                            f"{', '.join(map(str, bad_steps[-bad_in_row:]))}); {kept}. "
                            + ("Resume with --resume latest after " if last_ckpt else "Start again after ")
                            + "lowering --lr, setting --grad-clip-norm 1.0, or switching --precision to amp_bf16 / fp32; "
                            "check the data with python -m extract.check_data.")
                if args.save_every_n_steps and step % args.save_every_n_steps == 0 and in_epoch < data.steps_per_epoch:
                    last_ckpt = save(f"step_{step:08d}", step, epoch, in_epoch) or last_ckpt
                    dist.barrier()
                t_data = time.perf_counter()
            if in_epoch < data.steps_per_epoch:  # stopped by --max-steps inside the epoch
                break
            epoch += 1
            start_in_epoch = 0
            if (args.save_frequency and epoch % args.save_frequency == 0) or epoch == args.epochs:
                last_ckpt = save(f"epoch_{epoch:04d}", step, epoch, 0) or last_ckpt
            if (dist.is_main and args.eval_every_n_epochs and args.val_data and last_ckpt is not None
                    and (epoch % args.eval_every_n_epochs == 0 or epoch == args.epochs)
                    and last_ckpt.name == f"epoch_{epoch:04d}"):
                evals[f"epoch_{epoch:04d}"] = res = evaluate_checkpoint(last_ckpt / "model.safetensors", arch, args,
                                                                        dist.device)
                log.write(step, res, prefix="eval")
                (out / "eval").mkdir(exist_ok=True)
                (out / "eval" / f"epoch_{epoch:04d}.json").write_text(json.dumps(res, indent=2) + "\n")
                say("\n" + f"epoch {epoch} eval: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()
                                                              if k.startswith("retrieval") and k.endswith("R@1")))
            dist.barrier()
            t_last = time.perf_counter()  # checkpoint and evaluation time is not a step's time
    finally:
        pbar.close()
        log.close()
    final_metrics = evals[max(evals)] if evals else {}
    if first_nonfinite(trainer.model.state_dict()) is not None:  # a "good" last step can still overflow a weight to inf
        raise TrainingAborted("stopped: the final weights are not finite, so they were not saved; "
                              + (f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no good checkpoint exists")
                              + ". Lower --lr or set --grad-clip-norm 1.0.")
    if dist.is_main:
        path = ckpt.save_final(out, trainer.model, _describe(args, arch, objective, data, step,
                                                             epoch + start_in_epoch / data.steps_per_epoch,
                                                             samples, final_metrics))
        data.report.to_json(out / "data_report.json")
        say(f"done: {step} steps, {samples} samples; weights {path} (+ model.json); data: {data.report.summary()}")
    dist.barrier()
    return {"step": step, "epoch": epoch, "samples": samples, "out": str(out), "eval": final_metrics,
            "bad_steps": bad_steps}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from extract.text_components import SpacyModelNotFoundError
    from extract.weights import WeightsNotFoundError

    try:
        train(args)
    except TrainingAborted as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError, WeightsNotFoundError, SpacyModelNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
