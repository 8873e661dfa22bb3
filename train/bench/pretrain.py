"""``python -m train.bench.pretrain``: throughput, model-FLOPs utilisation, peak memory and a profile of the
pre-training objectives' steps, measured in one run on the same model, batches and machine.

    python -m train.bench.pretrain                               # ViT-B-16 geometry, batch 8, on CPU
    python -m train.bench.pretrain --device cuda --batch-size 128,256 --precision amp_bf16 --compile   # one GPU

Figures, for every ``--batch-size`` (each the median over ``--rounds`` of the mean step time over ``--steps``
steps, after warm-up; every configuration is timed in every round, interleaved, so a machine whose load drifts
slows them alike -- on a shared CPU, single steps still vary by 2x, so use many rounds or a quiet machine):

- samples/s; GFLOP per step (model FLOPs, forward and backward, counted by ``torch.utils.flop_counter`` on the
  eager step: :mod:`train.bench.mfu`), achieved TFLOP/s and MFU against the device's dense peak for the
  precision (GPUs in ``train.bench.mfu.PEAK_TFLOPS``, or ``--peak-tflops``); peak device memory of the
  configuration's steps (CUDA); the host synchronisations in one of our steps (CUDA's sync debug mode: a value
  read on the host, a blocking copy; each one stops the host from queueing ahead of the device);
- a profile of each of our steps (``--profile-steps`` more steps with :class:`adapters.objectives.phases.PhaseTimer`,
  which synchronises the device at each phase boundary, so these steps are slower than the timed ones): data (the
  batch's host-to-device copy; loading itself is the run log's ``data_time``), image tower, text tower, the
  method's own work (patch choice, regions, phrase trees: the forward minus its towers), loss, backward,
  optimizer, other;
- ratios against the targets: ``clip`` vs open_clip's own trainer (``open_clip_train.train.train_one_epoch`` on
  the same synthetic batches with open_clip's ClipLoss, AdamW and cosine schedule, on its own copy of the same
  weights, eager: open_clip's default); ``powerclip`` (M = 10 random boxes, phrase trees precomputed as the data
  workers do) / ``clip``; ``clip-pgs`` at a fixed 0.5 ratio (CLIP-PGS_0.5) / ``flip`` at 0.5 (the paper's "< 3%");
  ``flip`` 0.5 / ``clip`` (the image tower is ~85% of B/16's FLOPs, so half the patches approach 0.57x);
  ``powerclip`` M = 15 / M = 5 (PowerCLIP's Fig. 9); ``clip``'s MFU where the peak is known.

``--compile`` compiles our steps' towers and CLIP-PGS's selection (``train.pretrain --compile``; the warm-up steps
compile them, not timed), in ``--compile-mode``; ``--fused-adamw`` chooses the optimizer kernel as
``train.pretrain`` does (auto: fused on CUDA).

Everything runs through ``train.pretrain.trainer.Trainer.step_async`` (forward, loss, backward, gradient checks,
AdamW; the metrics read as the engine reads them), with the data already on the device: data loading is not what is
compared. The default model is the papers' ViT-B/16 (224 px, 196 patches, 12-layer text tower): the masking ratios
are about how the image tower's cost scales with its token count, which the 64-patch, 2-layer tiny test model does
not show (its step is dominated by the 49k-token embedding table). ``--model tiny`` gives a quick smoke run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from adapters.objectives.towers import COMPILE_MODES, uses_cuda_graphs
from extract.common.cli import Parser, check_options, option, parse_options, run_job, say
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int, positive_int
from train.measure import batch_sizes

CAPTIONS = ["a small red circle to the left of a large blue square", "a green star above a purple hexagon",
            "three objects: a small yellow triangle, a large red circle and a blue star; the triangle is left of the "
            "circle", "a man riding a brown horse on a beach next to the sea", "two dogs playing with a frisbee in a "
            "park", "a plate of pasta with tomato sauce on a wooden table", "a red double-decker bus driving down a "
            "busy street", "a cat sleeping on a laptop keyboard"]
TARGETS = {"clip / open_clip throughput": (">=", 1.5), "clip MFU": (">=", 0.40),
           "powerclip / clip step": ("<=", 1.25), "clip-pgs / flip step (0.5)": ("<=", 1.03),
           "flip 0.5 / clip step": ("<=", 0.62), "powerclip M=15 / M=5 step": ("<=", 1.5)}
CONFIGS = ("open_clip", "clip", "flip", "clip-pgs", "powerclip", "powerclip-M5", "powerclip-M15")
PHASES = ("data", "image tower", "text tower", "method", "loss", "backward", "optimizer", "other")


@dataclass
class BenchmarkOptions:
    """What ``python -m train.bench.pretrain`` measures, as data: ``benchmark(BenchmarkOptions(model="tiny"))``."""

    model: str = option("ViT-B-16", help="open_clip architecture or plugvlm alias (tiny)")
    batch_size: Any = option("8", help="images per step; a comma list measures each (128,256)")
    steps: int = option(1, type=positive_int, help="timed steps per configuration and round")
    warmup: int = option(1, type=positive_int, help="untimed steps per configuration before the rounds "
                                                    "(with --compile: where it compiles)")
    rounds: int = option(5, type=positive_int, help="rounds; the figures are medians over them")
    profile_steps: int = option(2, type=nonnegative_int, help="steps per configuration timed phase by phase "
                                                              "(0: no profile)")
    num_masks: int = option(10, type=positive_int, help="PowerCLIP's M")
    device: str = option("cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    precision: str = option("fp32", choices=["fp32", "amp", "amp_bf16"], help="fp32 or autocast")
    compile: bool = option(False, action="store_true", help="torch.compile our steps' towers (train.pretrain "
                                                           "--compile); open_clip's loop stays eager")
    compile_mode: str = option("default", choices=list(COMPILE_MODES),
                               help="torch.compile mode with --compile, as train.pretrain's (reduce-overhead: CUDA "
                                    "graphs)")
    fused_adamw: str = option("auto", choices=["auto", "on", "off"], help="AdamW kernel, as train.pretrain's")
    peak_tflops: float | None = option(None, type=float, help="the device's dense peak TFLOP/s at --precision "
                                                              "(default: train.bench.mfu's table; none on CPU)")
    threads: int | None = option(None, type=positive_int, help="torch CPU threads (default: torch's)")
    time_limit: float | None = option(None, type=float, help="minutes: past them, finish the current round, skip "
                                                             "the remaining rounds and batch sizes, say so")
    json: str | None = option(None, help="also write the figures to this file")

    def __post_init__(self):
        self.batch_size = batch_sizes(self.batch_size)
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"--compile-mode {self.compile_mode} needs --compile")


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


class _Setup:
    """The model, our trainer, open_clip's copy and the prepared batches of one benchmark run."""

    def __init__(self, args: BenchmarkOptions, device: torch.device):
        import copy

        from train.pretrain.dist import Dist
        from train.pretrain.options import build_objective, PretrainOptions
        from train.pretrain.trainer import create_model, resolve_architecture, Trainer

        self.args, self.device = args, device
        self.arch = resolve_architecture(args.model)
        model, _, _, self.tok = create_model(self.arch, False, 0)
        self.theirs_model = copy.deepcopy(model).to(device)  # open_clip's loop: its own copy, eager, own AdamW
        self.theirs_model.output_dict = True  # what open_clip's trainer expects from model(images, texts)
        base = PretrainOptions(data="unused", model=args.model, precision=args.precision,
                               batch_size=max(args.batch_size), fused_adamw=args.fused_adamw)
        self.trainer = Trainer(base, Dist(device=device), model, build_objective("clip"))
        self.model = self.trainer.model
        size = self.model.visual.image_size
        self.image_size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        # the ratios' settings: FLIP and CLIP-PGS both at 0.5 (CLIP-PGS_0.5), PowerCLIP at --num-masks, and
        # PowerCLIP with fewer / more masks (Fig. 9)
        self.settings = {"clip": ("clip", {}), "flip": ("flip", {"mask_ratio": 0.5}),
                         "clip-pgs": ("clip-pgs", {"pgs_min_ratio": 0.5, "pgs_max_ratio": 0.5}),
                         "powerclip": ("powerclip", {"num_masks": args.num_masks}),
                         "powerclip-M5": ("powerclip", {"num_masks": 5}),
                         "powerclip-M15": ("powerclip", {"num_masks": 15})}
        self.objectives = {}
        for name, (method, options) in self.settings.items():
            obj = build_objective(method, options)
            obj.setup(model, {})
            self.objectives[name] = obj

    def use(self, name: str):
        """The trainer, switched to configuration ``name``'s objective (one model and optimizer for all)."""
        from train.pretrain.trainer import DDPForward

        obj = self.objectives[name]
        self.trainer.objective, self.trainer.forward = obj, DDPForward(self.trainer.model, obj)
        return self.trainer

    def batches(self, batch_size: int) -> dict[str, list[dict]]:
        """Two CPU batches per configuration, with what the data workers add (phrase trees)."""
        g = torch.Generator().manual_seed(0)
        raw = [_synthetic(batch_size, self.image_size, self.tok, g) for _ in range(2)]
        out = {"open_clip": [{"image": b["image"], "text": b["text"]} for b in raw]}
        for name, obj in self.objectives.items():
            out[name] = []
            for b in raw:  # the data workers' share, outside the timed step
                extra = obj.prepare(b["captions"], [str(i) for i in range(len(b["captions"]))], self.tok)
                out[name].append({"image": b["image"], "text": extra.pop("text", b["text"]), **extra})
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ours(setup: _Setup, name: str, batches: list[dict], steps: int, start: int) -> float:
    """``steps`` of ``Trainer.step_async``, their metrics read as the engine reads them: all at the end of the round
    where the step never waits for the device (``Trainer.defers``; the engine reads every min(--log-every-n-steps,
    --max-bad-steps) = 5 steps by default), else after every step."""
    from train.pretrain.trainer import read_steps

    trainer = setup.use(name)
    b = len(batches[0]["image"])
    _sync(setup.device)
    t0 = time.perf_counter()
    pending = []
    for k in range(steps):
        ctx = trainer.context(start + k, 0, 1).with_batch(0, b)
        pending.append(trainer.step_async([batches[k % len(batches)]], ctx, 1e-4))
        if not trainer.defers:
            read_steps(pending)
            pending = []
    read_steps(pending)
    _sync(setup.device)
    return (time.perf_counter() - t0) / steps


def _host_syncs(setup: _Setup, name: str, batch: dict) -> int | None:
    """The step's synchronisations with the host, counted by CUDA's sync debug mode (a value read on the host, a
    blocking copy): ``Trainer.step_async`` of configuration ``name`` once, its metrics read after; None off CUDA."""
    import warnings

    from train.pretrain.trainer import read_steps

    if setup.device.type != "cuda":
        return None
    trainer = setup.use(name)
    ctx = trainer.context(90_000, 0, 1).with_batch(0, len(batch["image"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            readout = trainer.step_async([batch], ctx, 1e-4)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    read_steps([readout])
    return sum("synchronizing" in str(w.message) for w in caught)


def _theirs_runner(setup: _Setup, batches: list[dict]):
    """open_clip_train's train_one_epoch over ``steps`` of ``batches``, timed."""
    from open_clip.loss import ClipLoss
    from open_clip_train.data import DataInfo
    from open_clip_train.scheduler import cosine_lr as oc_cosine_lr
    from open_clip_train.train import train_one_epoch

    from train.pretrain.trainer import param_groups

    args, model = setup.args, setup.theirs_model
    b = len(batches[0]["image"])
    oc_args = argparse.Namespace(device=str(setup.device), precision=args.precision, accum_freq=1, distill=False,
                                 skip_scheduler=False, grad_clip_norm=None, horovod=False, log_every_n_steps=10 ** 9,
                                 batch_size=b, world_size=1, rank=0, local_rank=0, wandb=False,
                                 val_frequency=0, epochs=1, distributed=False, save_logs=False)
    loss = ClipLoss(local_loss=False, gather_with_grad=False, cache_labels=True, rank=0, world_size=1)
    groups, _ = param_groups(model, 0.2)
    optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.98), eps=1e-6)  # open_clip_train.main's
    scheduler = oc_cosine_lr(optimizer, 1e-4, 1, 10 ** 6)
    pairs = [(x["image"], x["text"]) for x in batches]

    def theirs(steps: int, start: int) -> float:
        loader = _Loader([pairs[k % len(pairs)] for k in range(steps)])
        _sync(setup.device)
        t0 = time.perf_counter()
        train_one_epoch(model, {"train": DataInfo(dataloader=loader)}, loss, 0, optimizer, None, scheduler, None,
                        oc_args)
        _sync(setup.device)
        return (time.perf_counter() - t0) / steps

    return theirs


def _flops(setup: _Setup, name: str, batch: dict) -> int:
    """Model FLOPs of one eager forward + backward of configuration ``name`` (open_clip's: clip's, the same math)."""
    from train.bench.mfu import count_flops

    trainer = setup.use("clip" if name == "open_clip" else name)
    ctx = trainer.context(0, 0, 1).with_batch(0, len(batch["image"]))
    flops = count_flops(lambda: trainer.forward_backward([batch], ctx))
    trainer.optimizer.zero_grad(set_to_none=True)
    return flops


def _profile(setup: _Setup, name: str, cpu_batches: list[dict], steps: int) -> dict[str, float]:
    """Mean seconds per phase (:data:`PHASES`) over ``steps`` steps, the batch copied to the device in each."""
    from adapters.objectives.phases import PhaseTimer, phase
    from train.pretrain.data import to_device

    trainer = setup.use(name)
    b = len(cpu_batches[0]["image"])
    with PhaseTimer(setup.device) as timer:
        t0 = time.perf_counter()
        for k in range(steps):
            with phase("data"):
                batch = to_device(cpu_batches[k % len(cpu_batches)], setup.device)
            trainer.step([batch], trainer.context(50_000 + k, 0, 1).with_batch(0, b), 1e-4)
        _sync(setup.device)
        total = time.perf_counter() - t0
    t = {k: v / steps for k, v in timer.seconds.items()}
    out = {"data": t.get("data", 0.0), "image tower": t.get("image_tower", 0.0), "text tower": t.get("text_tower", 0.0),
           "loss": t.get("loss", 0.0), "backward": t.get("backward", 0.0), "optimizer": t.get("optimizer", 0.0)}
    out["method"] = max(0.0, t.get("features", 0.0) - out["image tower"] - out["text tower"])
    out["other"] = max(0.0, total / steps - sum(out.values()))
    return {k: out[k] for k in PHASES}


def _count(setup: _Setup, batch_size: int) -> dict[str, int]:
    """Model FLOPs per step of every configuration at ``batch_size``."""
    from train.pretrain.data import to_device

    cpu = setup.batches(batch_size)
    return {c: _flops(setup, c, to_device(cpu[c][0], setup.device)) for c in CONFIGS}


def _measure(setup: _Setup, batch_size: int, flops: dict[str, int], deadline: float) -> dict:
    """Every figure of one batch size (module docstring); ``flops``: :func:`_count`'s; no round starts after
    ``deadline`` (perf_counter seconds) but the first."""
    from train.bench.mfu import mfu, peak_tflops
    from train.pretrain.data import to_device

    args, device = setup.args, setup.device
    cpu = setup.batches(batch_size)
    on_device = {c: [to_device(b, device) for b in v] for c, v in cpu.items()}
    theirs = _theirs_runner(setup, on_device["open_clip"])
    runners = {"open_clip": theirs,
               **{c: (lambda n, s, c=c: _ours(setup, c, on_device[c], n, s)) for c in CONFIGS[1:]}}
    say(f"batch {batch_size}: warm-up {args.warmup} step(s) per configuration"
        f"{' (compiling the towers)' if args.compile else ''}, then {args.rounds} rounds x {args.steps} steps")
    for c in CONFIGS:
        runners[c](args.warmup, 0)
    syncs = {"open_clip": None, **{c: _host_syncs(setup, c, on_device[c][0]) for c in CONFIGS[1:]}}
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    memory: dict[str, float | None] = {c: None for c in CONFIGS}
    for r in range(args.rounds):
        if r and time.perf_counter() > deadline:
            say(f"  --time-limit reached: {r} of {args.rounds} rounds at batch {batch_size}")
            break
        for c in CONFIGS:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[c].append(runners[c](args.steps, 1000 * (r + 1)))
            if device.type == "cuda":
                memory[c] = max(memory[c] or 0.0, torch.cuda.max_memory_allocated(device) / 2 ** 30)
        say(f"  round {r + 1}: " + ", ".join(f"{c} {times[c][-1]:.3f} s" for c in CONFIGS))
    step = {c: statistics.median(v) for c, v in times.items()}
    peak = peak_tflops(device, args.precision, args.peak_tflops)
    util = {c: mfu(flops[c], step[c], peak) for c in CONFIGS}
    profile = {c: _profile(setup, c, cpu[c], args.profile_steps) for c in CONFIGS[1:]} if args.profile_steps else {}
    ratios = {"clip / open_clip throughput": step["open_clip"] / step["clip"],
              "clip MFU": util["clip"],
              "powerclip / clip step": step["powerclip"] / step["clip"],
              "clip-pgs / flip step (0.5)": step["clip-pgs"] / step["flip"],
              "flip 0.5 / clip step": step["flip"] / step["clip"],
              "powerclip M=15 / M=5 step": step["powerclip-M15"] / step["powerclip-M5"]}
    return {"batch_size": batch_size, "step_seconds": step, "rounds": times, "flops_per_step": flops,
            "tflops_per_second": {c: flops[c] / step[c] / 1e12 for c in CONFIGS}, "mfu": util,
            "peak_memory_gib": memory, "host_syncs_per_step": syncs, "profile_seconds": profile, "ratios": ratios,
            "peak_tflops": peak}


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(run: dict) -> str:
    """The three tables of one batch size: figures per configuration, profile, ratios against the targets."""
    b = run["batch_size"]
    lines = [f"batch {b}:", "", "| configuration | s / step | samples / s | GFLOP / step | TFLOP/s | MFU | peak GiB "
             "| host syncs / step |", "|---|---|---|---|---|---|---|---|"]
    for c in CONFIGS:
        lines.append(f"| {c} | {run['step_seconds'][c]:.3f} | {b / run['step_seconds'][c]:.1f} | "
                     f"{run['flops_per_step'][c] / 1e9:.4g} | {run['tflops_per_second'][c]:.3g} | "
                     f"{_fmt(run['mfu'][c] and 100 * run['mfu'][c], '.1f')}{'%' if run['mfu'][c] else ''} | "
                     f"{_fmt(run['peak_memory_gib'][c], '.2f')} | "
                     f"{_fmt(run.get('host_syncs_per_step', {}).get(c), 'd')} |")
    if run["profile_seconds"]:
        lines += ["", "| ms / step (share) | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
        for c, p in run["profile_seconds"].items():
            total = sum(p.values()) or 1.0
            lines.append(f"| {c} | " + " | ".join(f"{1e3 * p[k]:.1f} ({100 * p[k] / total:.0f}%)" for k in PHASES)
                         + " |")
    lines += ["", "| ratio | measured | target |", "|---|---|---|"]
    for k, v in run["ratios"].items():
        op, bound = TARGETS[k]
        if v is None:
            lines.append(f"| {k} | n/a (no peak for this device: --peak-tflops) | {op} {bound} |")
            continue
        ok = v >= bound if op == ">=" else v <= bound
        lines.append(f"| {k} | {v:.3f} | {op} {bound} {'(met)' if ok else '(NOT met)'} |")
    return "\n".join(lines) + "\n"


def benchmark(args: BenchmarkOptions) -> dict:
    """Measure every configuration at every batch size (module docstring); returns the settings, ``runs`` (one
    dict of figures per batch size) and ``markdown`` (the tables), also written to ``args.json`` when set."""
    check_options(args, build_parser())
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    setup = _Setup(args, device)
    flops = {b: _count(setup, b) for b in args.batch_size}  # on the eager model, before anything is compiled
    if args.compile:
        from adapters.objectives.towers import compile_towers

        compile_towers(setup.model, mode=args.compile_mode)  # ours alone: open_clip's loop has its own weights
        for obj in setup.objectives.values():  # CLIP-PGS's selection, as train.pretrain --compile does
            obj.compile("inductor", args.compile_mode)
        setup.trainer.graphs = uses_cuda_graphs(args.compile_mode, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    say(f"{setup.arch}, {args.precision} on {device} ({name}); batch {', '.join(map(str, args.batch_size))}"
        f"{f'; towers compiled (mode {args.compile_mode})' if args.compile else ''}")
    runs = []
    deadline = t0 + 60 * args.time_limit if args.time_limit else float("inf")
    for b in args.batch_size:
        if runs and time.perf_counter() > deadline:
            say(f"--time-limit reached: batch {b} not measured")
            continue
        runs.append(_measure(setup, b, flops[b], deadline))
    result = {"model": setup.arch, "batch_sizes": args.batch_size, "device": str(device), "device_name": name,
              "precision": args.precision, "compile": args.compile, "compile_mode": args.compile_mode,
              "threads": torch.get_num_threads(), "runs": runs,
              "markdown": "\n".join(markdown(r) for r in runs)}
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
