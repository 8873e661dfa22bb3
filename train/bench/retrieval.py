"""``python -m train.bench.retrieval``: retrieval metrics over 25k captions x 5k images of cached-size
features (D = 512), timed in one run: the stored-matrix path, the streaming path (memory bounded to one
chunk) and, as the ratio's baseline, the bare matmul that any implementation must pay. Target: < 2 s.
``--true-per-caption K`` also times both paths with multi-positive retrieval (``adapters.eval.multipositive``), each
caption true of K random images besides its own."""
from __future__ import annotations

import argparse
import time
from typing import Sequence

from extract.common.cli import Parser, help_description, run_job
from extract.common.config import nonnegative_int, positive_int


def build_parser() -> Parser:
    p = Parser(prog="python -m train.bench.retrieval", description=help_description(__doc__))
    p.add_argument("--images", type=positive_int, default=5000, help="random image features")
    p.add_argument("--captions-per-image", type=positive_int, default=5, help="random caption features per image")
    p.add_argument("--dim", type=positive_int, default=512, help="feature width D")
    p.add_argument("--chunk", type=positive_int, default=256, help="captions scored per chunk")
    p.add_argument("--true-per-caption", type=nonnegative_int, default=0,
                   help="also time multi-positive retrieval, each caption true of this many other random images "
                        "(0: not timed)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Time the bare matmul and both retrieval paths (and, with ``--true-per-caption``, both with multi-positive
    retrieval); prints one line each and returns the seconds (``{"matmul": s, "stored matrix": s, "streaming, one
    chunk in memory": s}``, plus the same keys with " + multi-positive")."""
    import torch

    from adapters.eval.retrieval import feature_score_fn, retrieval_metrics, retrieval_queries

    g = torch.Generator().manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(args.images, args.dim, generator=g), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(args.images * args.captions_per_image, args.dim, generator=g),
                                        dim=-1)
    cap = torch.arange(len(txt)) // args.captions_per_image
    t = time.perf_counter()
    img @ txt.T
    t_mm = time.perf_counter() - t
    print(f"{len(txt)} captions x {len(img)} images, D={args.dim}, {torch.get_num_threads()} threads; "
          f"bare matmul {t_mm:.2f} s")
    seconds = {"matmul": t_mm}
    for label, max_bytes in (("stored matrix", 1 << 31), ("streaming, one chunk in memory", 0)):
        t = time.perf_counter()
        m = retrieval_metrics(feature_score_fn(img, txt), len(img), cap, chunk=args.chunk, max_bytes=max_bytes)
        seconds[label] = dt = time.perf_counter() - t
        print(f"  {label}: {dt:.2f} s ({dt / t_mm:.2f}x the matmul; target < 2 s), "
              f"T2I R@1 {m['text_to_image']['R@1']:.3f}, I2T R@1 {m['image_to_text']['R@1']:.3f}")
    if args.true_per_caption:
        truth = torch.zeros(len(img), len(txt), dtype=torch.bool)
        truth[torch.randint(0, len(img), (args.true_per_caption, len(txt)), generator=g), torch.arange(len(txt))] = True
        for label, max_bytes in (("stored matrix", 1 << 31), ("streaming, one chunk in memory", 0)):
            t = time.perf_counter()
            q = retrieval_queries(feature_score_fn(img, txt), len(img), cap, chunk=args.chunk, max_bytes=max_bytes,
                                  truth=truth)
            seconds[f"{label} + multi-positive"] = dt = time.perf_counter() - t
            print(f"  {label} + multi-positive ({args.true_per_caption} more true images per caption): {dt:.2f} s "
                  f"({dt - seconds[label]:+.2f} s), T2I mAP {100 * float(q.multi.t2i_ap.mean()):.3f}")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
