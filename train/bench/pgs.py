"""``python -m train.bench.pgs``: where CLIP-PGS's patch selection spends its time, part by part, at the
geometry of a ViT (ViT-B/16 by default: 224 px, 16 px patches, 768-wide patch features).

CLIP-PGS pays for its selection on every step (CLIP-PGS §3.2: seeds, feature and pixel similarity, optimal
transport normalisation, Sobel edges); its claim is that this costs under 3% of FLIP's step (§4). The pre-training
benchmark (``python -m train.bench.pretrain``) gives the step and the selection's share ("method" phase); this one
splits the selection so a slow part can be found and fixed: each part is timed alone (medians, synchronised on a
GPU), then ``pgs_select`` whole (and compiled, with ``--compile``), on random bf16 images and patch features.
``--profile`` adds a ``torch.profiler`` table of the whole selection, sorted by device time (CPU time on a CPU).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import torch

from adapters.objectives.base import runs_ahead
from adapters.objectives.clip_pgs import PGSConfig, compiled_order, cosine_matrix, pgs_select, pixel_patches, \
    sinkhorn, sobel_patch_edges
from extract.common.cli import Parser, help_description, run_job
from extract.common.config import positive_int
from train.measure import batch_sizes, load_warning, machine_load, sync, time_call


DIFFER = "compiled, kept patches differing (%)"


def build_parser() -> Parser:
    p = Parser(prog="python -m train.bench.pgs", description=help_description(__doc__))
    p.add_argument("--batch-size", default="128,256", help="images per selection; a comma list measures each")
    p.add_argument("--image-size", type=positive_int, default=224, help="image side in pixels")
    p.add_argument("--patch", type=positive_int, default=16, help="patch side in pixels")
    p.add_argument("--dim", type=positive_int, default=768, help="width of the patch features")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed calls per figure (the median is kept)")
    p.add_argument("--profile", action="store_true", help="also print a torch.profiler table of the selection")
    p.add_argument("--compile", action="store_true",
                   help="also time the selection compiled, as train.pretrain --compile runs it (inductor; the first "
                        "call of each batch size compiles, untimed)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures to this JSON file")
    return p


def measure(b: int, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Milliseconds of each part of the selection and of the whole, for one batch size."""
    side, patch = args.image_size, (args.patch, args.patch)
    grid = (side // args.patch, side // args.patch)
    n = grid[0] * grid[1]
    g = torch.Generator().manual_seed(0)
    images = torch.randn(b, 3, side, side, generator=g).to(device, torch.bfloat16)
    features = torch.randn(b, n, args.dim, generator=g).to(device, torch.bfloat16)
    noise = torch.rand(b, n, generator=g).to(device)
    cfg = PGSConfig()
    pixels = pixel_patches(images, patch)
    s = cosine_matrix(features)
    parts = {
        "pixel patches": lambda: pixel_patches(images, patch),
        "pixel cosine": lambda: cosine_matrix(pixels),
        "feature cosine": lambda: cosine_matrix(features),
        "sinkhorn": lambda: sinkhorn(s, cfg.sinkhorn_eps, cfg.sinkhorn_iters),
        "sobel edges": lambda: sobel_patch_edges(images, grid, patch),
        "selection": lambda: pgs_select(images, features, noise, cfg, 0.5, grid, patch,
                                        pad_to_bound=runs_ahead(device)),  # as the objective calls it
    }
    if args.compile:
        fast = compiled_order("inductor", "default")
        parts["selection, compiled"] = lambda: pgs_select(images, features, noise, cfg, 0.5, grid, patch,
                                                          pad_to_bound=runs_ahead(device), order_fn=fast)
    with torch.no_grad():
        out = {k: 1e3 * time_call(fn, device, repeats=args.repeats) for k, fn in parts.items()}
        if args.compile:  # the fast path against its reference: the share of (image, slot) choices that differ
            a, b = parts["selection"](), parts["selection, compiled"]()
            out[DIFFER] = 100 * float((a[0] != b[0]).float().mean())
        if args.profile:
            print(_profile(parts["selection"], device))
    return out


def _profile(fn, device: torch.device, calls: int = 5) -> str:
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=50)


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = batch_sizes(args.batch_size)
    if args.image_size < args.patch:
        raise ValueError(f"--image-size {args.image_size} is smaller than one --patch {args.patch}")
    load = machine_load()
    print(f"CLIP-PGS selection on {device}, torch {torch.__version__}: {args.image_size} px, {args.patch} px patches, "
          f"features {args.dim} wide; medians of {args.repeats} calls, ms")
    if device.type == "cpu" and (msg := load_warning(load, torch.get_num_threads())):
        print(msg)
    figures = {}
    for b in sizes:
        ms = figures[b] = measure(b, args, device)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in ms.items() if k != "selection" and "%" not in k)
        print(f"batch {b}: selection {ms['selection']:.2f} ms ({parts})" + (
            f"; compiled, kept patches differing from eager: {ms[DIFFER]:.2f}%" if DIFFER in ms else ""))
    out = {"device": str(device), "torch": torch.__version__, "load_before": load, "image_size": args.image_size,
           "patch": args.patch, "dim": args.dim, "ms": {str(b): v for b, v in figures.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
