"""``python -m train.bench.adapter``: why adapters train from a feature cache, in figures measured in one run.

    python -m train.bench.adapter                       # ComAlign, ViT-B-32 geometry, random weights
    python -m train.bench.adapter --method powerclip --samples 2048 --device cuda

1. **Cached vs backbone-fed epoch.** One epoch of head training over ``--samples`` (image, caption) pairs read
   from a feature cache (memory-mapped shards, the training loop's own step: gather, AdamW step) against the
   same head fed through the frozen backbone: per sample the backbone must embed what the cache holds — the
   image and the caption, plus for component methods every entity / relation crop and phrase (``--entities``
   / ``--relations`` per sample, all valid: the paper's caps, ComAlign §IV-A). The backbone's cost per sample
   is measured on ``--backbone-samples`` samples (random pixels and captions, same counts) and scaled to the
   epoch; the backbone-fed epoch is that plus the same head training. The cache holds synthetic arrays of the
   backbone's geometry (embedding width, patch grid), so no extraction runs here.
2. **FLOP rate.** The head's training step (forward + backward, FLOPs counted by
   ``torch.utils.flop_counter``) against this machine's dense fp32 matmul rate, measured in the same run.

Weights are random (``--pretrained none``): speed does not depend on them. Figures print as a table and go to
``--out`` as JSON when given. Crops are fed to the backbone already resized (decode, crop and resize cost
nothing here), and phrases are not deduplicated: both favour the backbone path, so the ratio is a lower bound.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from adapters.heads.base import to_tensors
from adapters.registry import ADAPTERS
from extract.cache import CacheDir, FeatureCache
from extract.components.overlap import FEATURES as OVERLAP_FEATURES
from extract.components.thumbnails import SIDE as THUMB_SIDE
from extract.common.cli import Parser, option, parse_options, run_job
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int, positive_int


@dataclass
class BenchmarkOptions:
    """What ``python -m train.bench.adapter`` measures, as data (``run(BenchmarkOptions(samples=512))``)."""

    method: str = option("comalign", choices=ADAPTERS.names(), help="adapter head to time")
    base: str = option("ViT-B-32", help="backbone geometry (built with random weights)")
    samples: int = option(2048, type=positive_int, help="pairs in the cached epoch")
    batch_size: int = option(256, type=positive_int, help="contrastive batch of the cached epoch")
    backbone_samples: int = option(4, type=positive_int, help="samples pushed through the backbone (scaled to the "
                                                              "epoch)")
    backbone_batch: int = option(64, type=positive_int, help="backbone batch size (crops / texts)")
    entities: int = option(10, type=positive_int, help="entity components per sample (all valid)")
    relations: int = option(10, type=positive_int, help="relation components per sample (all valid)")
    regions: int = option(10, type=positive_int, help="region masks per image")
    tokens: int = option(20, type=positive_int, help="caption length in tokens")
    matmul_size: int = option(2048, type=positive_int, help="n of the n x n x n dense matmul")
    device: str | None = option(None, help="torch device (default: cuda when present, else cpu)")
    out: str | None = option(None, help="write the figures as JSON here")
    seed: int = option(0, type=nonnegative_int, help="seeds the synthetic cache, the head and the data order")

    def __post_init__(self):
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"


def build_parser() -> Parser:
    return build_cli(BenchmarkOptions, "python -m train.bench.adapter", __doc__)


def parse_args(argv: Sequence[str] | None = None) -> BenchmarkOptions:
    def fits(ns):
        if ns.batch_size > ns.samples:
            raise ValueError(f"--batch-size {ns.batch_size} exceeds --samples {ns.samples}: the epoch would have no step")

    return parse_options(BenchmarkOptions, build_parser(), argv, fits)


# --------------------------------------------------------------------------------------------- synthetic cache
def synthetic_arrays(keys: Sequence[str], n: int, dim: int, grid: tuple[int, int], args, rng) -> dict[str, np.ndarray]:
    """Arrays of the cache layout (``extract/cache.py``) for ``n`` pairs: unit-norm fp16 features, all
    components valid, random grid boxes as regions, a phrase tree of 4 two-token leaves."""
    from extract.components.regions import pair_rows, random_grid_boxes

    def unit(*shape):
        x = rng.standard_normal((*shape, dim)).astype(np.float32)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float16)

    e, r, m, length = args.entities, args.relations, args.regions, args.tokens
    out: dict[str, np.ndarray] = {}
    for key in keys:
        if key in ("image_embed", "text_embed"):
            out[key] = unit(n)
        elif key in ("ventity_embed", "entity_embed"):
            out[key] = unit(n, e)
        elif key in ("vrelation_embed", "relation_embed", "role_subject_embed", "role_predicate_embed",
                     "role_object_embed"):
            out[key] = unit(n, r)
        elif key in ("ventity_valid", "entity_valid"):
            out[key] = np.ones((n, e), bool)
        elif key == "entity_count":  # no numerals: every phrase as a caption without a count says it
            out[key] = np.zeros((n, e), np.int16)
        elif key in ("vrelation_valid", "relation_valid", "role_valid"):
            out[key] = np.ones((n, r), bool)
        elif key == "ventity_image_size":  # the boxes below are in a 224-px image
            out[key] = np.full((n, 2), 224, np.float32)
        elif key == "ventity_boxes":  # random xyxy boxes in a 224-px image
            corner = rng.uniform(0, 160, (n, e, 2)).astype(np.float32)
            out[key] = np.concatenate([corner, corner + rng.uniform(8, 64, (n, e, 2)).astype(np.float32)], -1)
        elif key == "ventity_overlap":  # no two of the random boxes' pixels compared: no overlap evidence
            out[key] = np.zeros((n, e, e, OVERLAP_FEATURES), np.float16)
        elif key == "ventity_pixels":  # black thumbnails (extract/components/thumbnails.py): the same arithmetic, no draw
            out[key] = np.zeros((n, e, THUMB_SIDE, THUMB_SIDE, 3), np.uint8)
        elif key == "vrelation_pairs":  # the first r pairs (i < j) of the e entities, as extract.components.regions lists them
            out[key] = np.broadcast_to(pair_rows(e, r), (n, r, 2)).copy()
        elif key == "patch_tokens":
            out[key] = unit(n, grid[0] * grid[1])
        elif key == "region_masks":
            out[key] = np.stack([random_grid_boxes(grid, m, rng)[1] for _ in range(n)])
        elif key == "region_valid":
            out[key] = np.ones((n, m), bool)
        elif key == "token_embed":
            out[key] = unit(n, length)
        elif key == "token_mask":
            out[key] = np.ones((n, length), bool)
        elif key == "leaf_tokens":  # leaf k = tokens 1+2k, 2+2k (after the start token)
            t = np.zeros((n, 16, length), bool)
            for k in range(4):
                t[:, k, 1 + 2 * k:3 + 2 * k] = True
            out[key] = t
        elif key == "node_leaves":  # 4 single leaves, two pairs, the root
            nodes = np.zeros((n, 16, 16), bool)
            for k in range(4):
                nodes[:, k, k] = True
            nodes[:, 4, :2] = nodes[:, 5, 2:4] = nodes[:, 6, :4] = True
            out[key] = nodes
        elif key == "n_leaves":
            out[key] = np.full(n, 4, np.int32)
        elif key == "n_nodes":
            out[key] = np.full(n, 7, np.int32)
        else:
            raise ValueError(f"the benchmark cannot synthesise cache array {key!r}; add it to synthetic_arrays")
    return out


def synthetic_cache(root: Path, keys: Sequence[str], n: int, dim: int, grid, args) -> FeatureCache:
    """A one-caption-per-image cache of ``n`` pairs in shards of 8192 images."""
    rng = np.random.default_rng(args.seed)
    cache = CacheDir(root, {"synthetic": {"n": n, "dim": dim, "keys": sorted(keys), "seed": args.seed}})
    cache.prepare()
    shard = 8192
    n_shards = -(-n // shard)
    for k in range(n_shards):
        rows = min(shard, n - k * shard)
        arrays = synthetic_arrays(keys, rows, dim, grid, args, rng)
        arrays["caption_image"] = np.arange(rows, dtype=np.int32)
        meta = {"images": rows, "captions": rows, "image_ids": [str(k * shard + i) for i in range(rows)],
                "caption_ids": [str(k * shard + i) for i in range(rows)], "skipped": [], "converted": []}
        cache.write_shard(k, arrays, meta)
    cache.write_manifest(n_shards, {})
    return FeatureCache(cache.path)


# --------------------------------------------------------------------------------------------- measurements
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def dense_matmul_rate(device, n: int, repeats: int = 5) -> float:
    """Best fp32 FLOP/s of an n x n x n matmul (2 n^3 FLOPs) over ``repeats`` runs (after a warm-up)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def train_epoch(head, cache: FeatureCache, batch_size: int, device, seed: int, max_steps: int | None = None) -> dict:
    """One epoch of the training loop's steps over the cache; returns seconds, steps, samples, step seconds."""
    from accelerate import Accelerator

    from train.adapter.step import AdapterRun, compute_gradients, optimizer_step

    ns = argparse.Namespace(grad_clip=0.0)
    ctx = AdapterRun(Accelerator(cpu=torch.device(device).type == "cpu"), 0, 1, torch.device(device), None)
    opt = torch.optim.AdamW(head.param_groups(0.1), lr=1e-4)
    keys = list(dict.fromkeys([*head.image_keys, *head.text_keys]))
    order = np.random.default_rng(seed).permutation(cache.num_captions)
    batches = [order[a:a + batch_size] for a in range(0, len(order) - batch_size + 1, batch_size)][:max_steps]
    head.train()
    compute_gradients(head, *_split(to_tensors(cache.batch(batches[0], keys), device), head), 1, ctx)  # warm-up
    opt.zero_grad(set_to_none=True)
    _sync(device)
    step_times = []
    t0 = time.perf_counter()
    for rows in batches:
        s0 = time.perf_counter()
        arrays = to_tensors(cache.batch(rows, keys), device)
        out = compute_gradients(head, *_split(arrays, head), 1, ctx)
        optimizer_step(head, opt, out, ns, ctx)
        _sync(device)
        step_times.append(time.perf_counter() - s0)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "steps": len(batches), "samples": len(batches) * batch_size, "step_seconds": step_times}


def _split(arrays: dict, head) -> tuple[dict, dict]:
    return {k: arrays[k] for k in head.image_keys}, {k: arrays[k] for k in head.text_keys}


def step_flops(head, cache: FeatureCache, batch_size: int, device) -> int:
    """FLOPs of one training step's forward + backward (matmuls, attention, convolutions)."""
    from torch.utils.flop_counter import FlopCounterMode

    keys = list(dict.fromkeys([*head.image_keys, *head.text_keys]))
    images, texts = _split(to_tensors(cache.batch(np.arange(batch_size), keys), device), head)
    head.train()
    with FlopCounterMode(display=False) as counter:
        out = head.loss(head.encode_image(images), head.encode_text(texts))
        out["loss"].backward()
    head.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


@torch.no_grad()
def backbone_seconds_per_sample(backbone, head_cls, args) -> dict:
    """What the backbone computes per pair when nothing is cached (module docstring), timed on
    ``--backbone-samples`` pairs: seconds per sample for the image side and the text side."""
    n = args.backbone_samples
    components = set(head_cls.components)
    crops = 1 + (args.entities if "entities" in components else 0) + (args.relations if "relations" in components else 0)
    phrases = 1 + (args.entities if "entities" in components else 0) + (args.relations if "relations" in components else 0)
    h, w = backbone.image_size
    g = torch.Generator().manual_seed(args.seed)
    images = torch.randn(n * crops, 3, h, w, generator=g)
    words = ["red", "circle", "left", "of", "blue", "square", "large", "green", "star", "above"]
    texts = [" ".join(words[(i + k) % len(words)] for k in range(max(1, args.tokens - 2))) for i in range(n * phrases)]
    bs = args.backbone_batch
    backbone.encode_images(images[:2].to(backbone.device))  # warm-up
    _sync(backbone.device)
    t0 = time.perf_counter()
    for a in range(0, len(images), bs):
        backbone.encode_images(images[a:a + bs].to(backbone.device))
    _sync(backbone.device)
    t_img = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a in range(0, len(texts), bs):
        tok = backbone.tokenize(texts[a:a + bs])
        backbone.encode_token_ids(tok.ids, tok.attention_mask)
    _sync(backbone.device)
    t_txt = time.perf_counter() - t0
    return {"image_forwards_per_sample": crops, "text_forwards_per_sample": phrases,
            "image_seconds_per_sample": t_img / n, "text_seconds_per_sample": t_txt / n}


def run(args) -> dict:
    from extract.models.backbone import load_backbone

    torch.manual_seed(args.seed)
    head_cls = ADAPTERS.get(args.method)
    backbone = load_backbone(args.base, "none", device=args.device)
    dim, grid = backbone.embed_dim, backbone.grid
    head = head_cls.from_config({}, dim).to(args.device)
    keys = list(dict.fromkeys([*head_cls.image_keys, *head_cls.text_keys]))
    figures: dict = {"method": args.method, "base": args.base, "device": str(args.device), "embed_dim": dim,
                     "samples": args.samples, "batch_size": args.batch_size, "threads": torch.get_num_threads()}
    rate_before = dense_matmul_rate(args.device, args.matmul_size)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        cache = synthetic_cache(Path(tmp), keys, args.samples, dim, grid, args)
        figures["cache_write_seconds"] = time.perf_counter() - t0
        flops = step_flops(head, cache, args.batch_size, args.device)
        epoch = train_epoch(head, cache, args.batch_size, args.device, args.seed)
    backbone_cost = backbone_seconds_per_sample(backbone, head_cls, args)
    per_sample = backbone_cost["image_seconds_per_sample"] + backbone_cost["text_seconds_per_sample"]
    fed_epoch = epoch["seconds"] + per_sample * epoch["samples"]
    images_only = epoch["seconds"] + backbone_cost["image_seconds_per_sample"] * epoch["samples"]
    # the limit is measured before and after the epoch and the higher rate kept (a shared machine's load varies;
    # the higher limit gives the lower, conservative ratio)
    rate = max(rate_before, dense_matmul_rate(args.device, args.matmul_size))
    median_step = float(np.median(epoch["step_seconds"]))
    figures.update(
        cached_epoch_seconds=epoch["seconds"], steps=epoch["steps"],
        backbone=backbone_cost, backbone_fed_epoch_seconds=fed_epoch,
        speedup=fed_epoch / epoch["seconds"], speedup_counting_image_side_only=images_only / epoch["seconds"],
        step_flops=flops, median_step_seconds=median_step, head_flop_rate=flops / median_step,
        epoch_flop_rate=flops * epoch["steps"] / epoch["seconds"], matmul_flop_rate=rate,
        head_vs_matmul=flops / median_step / rate, epoch_vs_matmul=flops * epoch["steps"] / epoch["seconds"] / rate)
    return figures


def report(f: dict) -> str:
    b = f["backbone"]
    rows = [
        ("cached epoch", f"{f['cached_epoch_seconds']:.2f} s ({f['steps']} steps x {f['batch_size']} on {f['device']}, "
                         f"{f['threads']} threads)"),
        ("backbone per sample", f"{b['image_seconds_per_sample'] * 1e3:.1f} ms images ({b['image_forwards_per_sample']} "
                                f"forwards) + {b['text_seconds_per_sample'] * 1e3:.1f} ms texts "
                                f"({b['text_forwards_per_sample']} forwards)"),
        ("backbone-fed epoch", f"{f['backbone_fed_epoch_seconds']:.1f} s (scaled from the measured samples)"),
        ("speed-up (target >= 50x)", f"{f['speedup']:.1f}x (image side only: {f['speedup_counting_image_side_only']:.1f}x)"),
        ("head step", f"{f['step_flops'] / 1e9:.2f} GFLOP in {f['median_step_seconds'] * 1e3:.1f} ms (median) = "
                      f"{f['head_flop_rate'] / 1e9:.1f} GFLOP/s; whole epoch incl. reading "
                      f"{f['epoch_flop_rate'] / 1e9:.1f} GFLOP/s"),
        ("dense fp32 matmul", f"{f['matmul_flop_rate'] / 1e9:.1f} GFLOP/s"),
        ("head / matmul (target >= 50%)", f"{100 * f['head_vs_matmul']:.1f}% (epoch incl. reading: "
                                          f"{100 * f['epoch_vs_matmul']:.1f}%)"),
    ]
    width = max(len(k) for k, _ in rows)
    return f"{f['method']} on {f['base']} geometry (D = {f['embed_dim']}), {f['samples']} samples\n" + \
        "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: BenchmarkOptions) -> None:
        figures = run(opts)
        print(report(figures))
        if opts.out:
            Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
            Path(opts.out).write_text(json.dumps(figures, indent=2) + "\n")

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
