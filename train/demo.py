"""The demo: the main job end to end on the embedded default, the toy world.

``python -m train.demo`` checks the backbone (absent weights fail at once, naming the file), generates the toy
world, pre-trains the tiny backbone on it with CLIP's objective (``python -m train.pretrain``; a few minutes on
a CPU) unless ``--pretrained`` names weights, then trains every registered adapter on that frozen base
(``python -m train.adapter_compare``: one shared feature cache, one ``train.adapter`` run per method) and prints
the side-by-side table of the frozen base vs base + each adapter on the test split: retrieval R@k and
accuracy per hard-negative type.

Everything lands in ``--out``: ``toyworld/``, ``base/`` (the pre-trained backbone, open_clip-loadable
``model.safetensors`` + ``model.json``), ``adapters/`` (cache, one run folder per method, ``results.{json,md,png}``),
``demo_report.json`` and the resolved ``config.json``. Rerunning reuses the toy world, the base and the cache
when their settings are unchanged.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

from adapters.registry import ADAPTERS
from extract import toyworld
from extract.config import nonnegative_int, parse_with_config, positive_int, save_config


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="output directory")
    p.add_argument("--n", type=positive_int, default=2000, help="toy-world scenes to generate")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seeds the toy world, pre-training and adapters")
    p.add_argument("--base", default="tiny", help="backbone alias or open_clip model name")
    p.add_argument("--pretrained", default=None,
                   help="weights of --base (tag, file or 'none'); default for the tiny base: pre-train it on the "
                        "toy world first; for other bases: the alias's default weights")
    p.add_argument("--pretrain-epochs", type=positive_int, default=10, help="epochs of CLIP pre-training of the tiny base")
    p.add_argument("--pretrain-batch-size", type=positive_int, default=64, help="pre-training batch")
    p.add_argument("--methods", default="all", help=f"adapters to train: comma list from "
                                                    f"{', '.join(ADAPTERS.names())}, or all")
    p.add_argument("--epochs", type=positive_int, default=5, help="adapter training epochs")
    p.add_argument("--batch-size", type=positive_int, default=128, help="adapter training batch")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--workers", type=nonnegative_int, default=2, help="data-loading worker processes")
    return parse_with_config(p, argv)


def _pretrain_base(args, world: Path, out: Path) -> Path:
    """CLIP pre-training of the tiny base on the toy world's train split; reused when already done with the
    same settings (model.json records them)."""
    from train import pretrain

    weights, described = out / "model.safetensors", out / "model.json"
    argv = ["--method", "clip", "--model", args.base, "--data", str(world), "--epochs", str(args.pretrain_epochs),
            "--batch-size", str(args.pretrain_batch_size), "--seed", str(args.seed), "--out", str(out),
            "--workers", str(args.workers), "--eval-every-n-epochs", "0", "--save-every-n-steps", "0",
            "--no-tensorboard"]
    if args.device:
        argv += ["--device", args.device]
    pargs = pretrain.parse_args(argv)
    if weights.is_file() and described.is_file():
        old = json.loads(described.read_text()).get("args", {})
        # options left at None are resolved by the run itself (e.g. --val-data from --data)
        if all(old.get(k) == v for k, v in vars(pargs).items()
               if v is not None and k not in ("device", "workers", "resume")):
            print(f"  reusing {weights} (same settings)")
            return weights
    pretrain.train(pargs)
    return weights


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    save_config(args, out / "config.json")
    t_start = time.perf_counter()
    from extract.backbone import load_backbone
    from extract.weights import WeightsNotFoundError

    pretrain_base = args.pretrained is None and args.base.startswith("tiny")
    # the backbone first: missing weights must fail before any other work
    print(f"[1/4] backbone: {args.base} (weights: "
          f"{'pre-trained on the toy world next' if pretrain_base else args.pretrained or 'alias default'})")
    try:
        backbone = load_backbone(args.base, "none" if pretrain_base else args.pretrained, device="cpu")
    except (WeightsNotFoundError, ValueError) as e:
        print(f"error: {e}")
        return 2
    info = backbone.describe()
    print(f"  {info['model']}: embed dim {info['embed_dim']}, {info['grid'][0]}x{info['grid'][1]} patches, "
          f"{info['context_length']} tokens")
    del backbone

    world = out / "toyworld"
    print(f"[2/4] toy world: {args.n} scenes, seed {args.seed} -> {world}")
    meta = json.loads((world / "meta.json").read_text()) if (world / "meta.json").is_file() else {}
    # regenerating would give the same bytes but new mtimes, which the feature cache's fingerprint sees
    if (meta.get("n"), meta.get("seed"), meta.get("version")) == (args.n, args.seed, toyworld.VERSION):
        print("  reusing it (same n, seed and generator version)")
    else:
        print(toyworld.format_summary(toyworld.generate(world, args.n, args.seed)))

    pretrained = args.pretrained
    if pretrain_base:
        print(f"[3/4] pre-training the {args.base} base on the toy world (CLIP, {args.pretrain_epochs} epochs)")
        t0 = time.perf_counter()
        pretrained = str(_pretrain_base(args, world, out / "base"))
        print(f"  base: {pretrained} ({time.perf_counter() - t0:.0f} s)")
    else:
        print("[3/4] pre-training skipped: using the given weights")

    print(f"[4/4] adapters on the frozen base: {args.methods}")
    from train import adapter_compare

    cargv = ["--data", str(world), "--out", str(out / "adapters"), "--base", args.base, "--methods", args.methods,
             "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
             "--workers", str(args.workers)]
    if pretrained is not None:
        cargv += ["--pretrained", pretrained]
    if args.device:
        cargv += ["--device", args.device]
    result = adapter_compare.compare(adapter_compare.parse_args(cargv))
    table = Path(result["table"]) if result.get("table") else None
    if table is not None:
        print("\nfrozen base vs base + adapter (toy world test split; retrieval R@k and hard-negative accuracy, %):")
        print(table.read_text())
    report = {"backbone": info, "pretrained": pretrained, "toyworld": str(world), "adapters": result,
              "seconds": time.perf_counter() - t_start}
    (out / "demo_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"done in {report['seconds']:.0f} s: {out / 'demo_report.json'}"
          + (f", {table}, {table.with_suffix('.png')}" if table else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
