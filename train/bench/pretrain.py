"""``python -m train.bench.pretrain``: step-time ratios of the pre-training objectives, measured in one run on
the same model, batch and machine (the speed targets below).

    python -m train.bench.pretrain                               # ViT-B-16 geometry, batch 8, on CPU
    python -m train.bench.pretrain --device cuda --batch-size 128 --precision amp_bf16 --steps 10

Figures (each the median over ``--rounds`` of the mean step time over ``--steps`` steps, after warm-up; every
configuration is timed in every round, interleaved, so a machine whose load drifts slows them alike -- on a
shared CPU, single steps still vary by 2x, so use many rounds or a quiet machine):

- ``clip`` vs open_clip's own trainer: ``open_clip_train.train.train_one_epoch`` on the same synthetic
  batches, with open_clip's ClipLoss, AdamW and cosine schedule, on the very same model object
  (target: our throughput >= 0.95x theirs);
- ``powerclip`` (M = 10 random boxes, phrase trees precomputed as the data workers do) / ``clip`` (<= 1.25x;
  the paper reports 1.72x for its implementation);
- ``clip-pgs`` at a fixed 0.5 ratio (CLIP-PGS_0.5) / ``flip`` at 0.5 (<= 1.03x: the paper's "< 3%");
- ``flip`` at 0.5 / ``clip`` (<= 0.65x);
- ``powerclip`` with M = 15 / M = 5 masks (<= 1.5x): PowerCLIP's Fig. 9 (training time vs number of masks);
  our bound for the NLA loss, which ``python -m train.bench.nla`` also measures for the loss alone.

Everything runs through ``train.pretrain.engine.Trainer.step`` (forward, loss, backward, gradient checks, AdamW), with
the data already in memory: data loading is not what is compared. The default model is the papers' ViT-B/16
(224 px, 196 patches, 12-layer text tower): the masking ratios are about how the image tower's cost scales
with its token count, which the 64-patch, 2-layer tiny test model does not show (its step is dominated by the
49k-token embedding table). ``--model tiny`` gives a quick smoke run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from extract.common.cli import Parser, check_options, option, parse_options, run_job, say
from extract.common.cli import build_parser as build_cli
from extract.common.config import positive_int

CAPTIONS = ["a small red circle to the left of a large blue square", "a green star above a purple hexagon",
            "three objects: a small yellow triangle, a large red circle and a blue star; the triangle is left of the "
            "circle", "a man riding a brown horse on a beach next to the sea", "two dogs playing with a frisbee in a "
            "park", "a plate of pasta with tomato sauce on a wooden table", "a red double-decker bus driving down a "
            "busy street", "a cat sleeping on a laptop keyboard"]
TARGETS = {"clip / open_clip throughput": (">=", 0.95), "powerclip / clip step": ("<=", 1.25),
           "clip-pgs / flip step (0.5)": ("<=", 1.03), "flip 0.5 / clip step": ("<=", 0.65),
           "powerclip M=15 / M=5 step": ("<=", 1.5)}


@dataclass
class BenchmarkOptions:
    """What ``python -m train.bench.pretrain`` measures, as data: ``benchmark(BenchmarkOptions(model="tiny"))``."""

    model: str = option("ViT-B-16", help="open_clip architecture or plugvlm alias (tiny)")
    batch_size: int = option(8, type=positive_int, help="images per step")
    steps: int = option(1, type=positive_int, help="timed steps per configuration and round")
    warmup: int = option(1, type=positive_int, help="untimed steps per configuration before the rounds")
    rounds: int = option(5, type=positive_int, help="rounds; the figures are medians over them")
    num_masks: int = option(10, type=positive_int, help="PowerCLIP's M")
    device: str = option("cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    precision: str = option("fp32", choices=["fp32", "amp", "amp_bf16"], help="fp32 or autocast")
    threads: int | None = option(None, type=positive_int, help="torch CPU threads (default: torch's)")
    json: str | None = option(None, help="also write the figures to this file")


def build_parser() -> Parser:
    return build_cli(BenchmarkOptions, "python -m train.bench.pretrain", __doc__)


def parse_args(argv: Sequence[str] | None = None) -> BenchmarkOptions:
    return parse_options(BenchmarkOptions, build_parser(), argv)


def _synthetic(batch: int, image_size, tok, generator) -> dict:
    images = torch.randn(batch, 3, *image_size, generator=generator)
    captions = [CAPTIONS[k % len(CAPTIONS)] for k in range(batch)]
    return {"image": images, "captions": captions, "text": tok(captions)}


class _Loader:
    """What open_clip_train's train_one_epoch reads from ``data['train'].dataloader``."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.batches = batches
        self.num_batches = len(batches)
        self.num_samples = sum(len(b[0]) for b in batches)

    def __iter__(self):
        return iter(self.batches)


def benchmark(args: BenchmarkOptions) -> dict:
    """Time every configuration (module docstring); returns the figures (``step_seconds``, ``rounds``, ``ratios``,
    the settings, and ``markdown``: the two tables), also written to ``args.json`` when set."""
    from open_clip.loss import ClipLoss
    from open_clip_train.data import DataInfo
    from open_clip_train.scheduler import cosine_lr as oc_cosine_lr
    from open_clip_train.train import train_one_epoch

    from train.pretrain.engine import (Dist, PretrainOptions, Trainer, DDPForward, build_objective, create_model,
                                resolve_architecture)
    from train.pretrain.data import to_device

    check_options(args, build_parser())
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    arch = resolve_architecture(args.model)
    model, _, _, tok = create_model(arch, False, 0)
    model.output_dict = True  # what open_clip's trainer expects from model(images, texts)
    base = PretrainOptions(data="unused", model=args.model, precision=args.precision, batch_size=args.batch_size)
    trainer = Trainer(base, Dist(device=device), model, build_objective("clip"))
    size = tuple(model.visual.image_size) if isinstance(model.visual.image_size, (tuple, list)) \
        else (model.visual.image_size,) * 2
    g = torch.Generator().manual_seed(0)
    batches = [_synthetic(args.batch_size, size, tok, g) for _ in range(2)]

    def prepared_objective(name: str, options: dict):
        obj = build_objective(name, options)
        obj.setup(model, {})
        prepared = []
        for b in batches:  # the data workers' share (phrase trees), outside the timed step
            extra = obj.prepare(b["captions"], [str(i) for i in range(len(b["captions"]))], tok)
            prepared.append(to_device({"image": b["image"], "text": extra.pop("text", b["text"]), **extra}, device))
        return obj, prepared

    # the ratios' settings: FLIP and CLIP-PGS both at 0.5 (CLIP-PGS_0.5), PowerCLIP at --num-masks
    settings = {"clip": {}, "flip": {"mask_ratio": 0.5}, "clip-pgs": {"pgs_min_ratio": 0.5, "pgs_max_ratio": 0.5},
                "powerclip": {"num_masks": args.num_masks}}
    objectives = {name: prepared_objective(name, options) for name, options in settings.items()}
    for m in (5, 15):  # Fig. 9: the same step with fewer / more masks
        objectives[f"powerclip-M{m}"] = prepared_objective("powerclip", {"num_masks": m})

    def ours(name: str, steps: int, start: int) -> float:
        obj, prepared = objectives[name]
        trainer.objective, trainer.forward = obj, DDPForward(trainer.model, obj)
        t0 = time.perf_counter()
        for k in range(steps):
            ctx = trainer.context(start + k, 0, 1).with_batch(0, args.batch_size)
            trainer.step([prepared[k % len(prepared)]], ctx, 1e-4)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    oc_args = argparse.Namespace(device=str(device), precision=args.precision, accum_freq=1, distill=False,
                                 skip_scheduler=False, grad_clip_norm=None, horovod=False, log_every_n_steps=10 ** 9,
                                 batch_size=args.batch_size, world_size=1, rank=0, local_rank=0, wandb=False,
                                 val_frequency=0, epochs=1, distributed=False, save_logs=False)
    oc_loss = ClipLoss(local_loss=False, gather_with_grad=False, cache_labels=True, rank=0, world_size=1)
    oc_sched = oc_cosine_lr(trainer.optimizer, 1e-4, 1, 10 ** 6)
    oc_batches = [(b["image"], b["text"]) for b in batches]

    def theirs(steps: int) -> float:
        loader = _Loader([oc_batches[k % len(oc_batches)] for k in range(steps)])
        t0 = time.perf_counter()
        train_one_epoch(model, {"train": DataInfo(dataloader=loader)}, oc_loss, 0, trainer.optimizer, None, oc_sched,
                        None, oc_args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    configs = ["open_clip", "clip", "flip", "clip-pgs", "powerclip", "powerclip-M5", "powerclip-M15"]
    runners = {"open_clip": lambda n, s: theirs(n), **{c: (lambda n, s, c=c: ours(c, n, s)) for c in configs[1:]}}
    say(f"{arch}, batch {args.batch_size}, {args.precision} on {device} ({torch.get_num_threads()} CPU threads): "
          f"warm-up {args.warmup}, then {args.rounds} rounds x {args.steps} steps per configuration")
    for c in configs:
        runners[c](args.warmup, 0)
    times: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs:
            times[c].append(runners[c](args.steps, 1000 * (r + 1)))
        say(f"  round {r + 1}: " + ", ".join(f"{c} {times[c][-1]:.3f} s" for c in configs))
    step = {c: statistics.median(v) for c, v in times.items()}
    ratios = {"clip / open_clip throughput": step["open_clip"] / step["clip"],
              "powerclip / clip step": step["powerclip"] / step["clip"],
              "clip-pgs / flip step (0.5)": step["clip-pgs"] / step["flip"],
              "flip 0.5 / clip step": step["flip"] / step["clip"],
              "powerclip M=15 / M=5 step": step["powerclip-M15"] / step["powerclip-M5"]}
    lines = ["| configuration | s / step (median) | samples / s |", "|---|---|---|"]
    lines += [f"| {c} | {step[c]:.3f} | {args.batch_size / step[c]:.1f} |" for c in configs]
    lines += ["", "| ratio | measured | target |", "|---|---|---|"]
    for k, v in ratios.items():
        op, bound = TARGETS[k]
        ok = v >= bound if op == ">=" else v <= bound
        lines.append(f"| {k} | {v:.3f} | {op} {bound} {'(met)' if ok else '(NOT met)'} |")
    result = {"model": arch, "batch_size": args.batch_size, "device": str(device), "precision": args.precision,
              "threads": torch.get_num_threads(), "step_seconds": step, "rounds": times, "ratios": ratios,
              "markdown": "\n".join(lines) + "\n"}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


run = benchmark  # the name this job had before it took options


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: BenchmarkOptions) -> None:
        print("\n" + benchmark(opts)["markdown"])

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
