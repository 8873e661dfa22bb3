"""``python -m train.retrieval_benchmark``: retrieval metrics over 25k captions x 5k images of cached-size
features (D = 512), timed in one run: the stored-matrix path, the streaming path (memory bounded to one
chunk) and, as the ratio's baseline, the bare matmul that any implementation must pay. Target: < 2 s."""
from __future__ import annotations

import argparse
import time
from typing import Sequence

import torch

from train.retrieval import feature_score_fn, retrieval_metrics


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.retrieval_benchmark", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--captions-per-image", type=int, default=5)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    args = p.parse_args(argv)
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
    for label, max_bytes in (("stored matrix", 1 << 31), ("streaming, one chunk in memory", 0)):
        t = time.perf_counter()
        m = retrieval_metrics(feature_score_fn(img, txt), len(img), cap, chunk=args.chunk, max_bytes=max_bytes)
        dt = time.perf_counter() - t
        print(f"  {label}: {dt:.2f} s ({dt / t_mm:.2f}x the matmul; target < 2 s), "
              f"T2I R@1 {m['text_to_image']['R@1']:.3f}, I2T R@1 {m['image_to_text']['R@1']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
