"""``python -m train.adapter_compare``: train every registered adapter method on the same data and backbone, then
write one side-by-side table: the frozen base vs base + each adapter (retrieval and per-type compositional
accuracy on the test split), through ``train.evaluate``.

    python -m extract.toyworld --out toy --n 2000 --seed 0
    python -m train.adapter_compare --data toy --out runs/compare --epochs 10
    python -m train.adapter_compare --data toy --out runs/compare --methods comalign,powerclip -- --lr 1e-4

Every method is trained by ``python -m train.adapter`` in ``OUT/<method>`` (its own logs, checkpoint and
history); the components of all methods are extracted into one shared cache (``--components`` = their union),
so the backbone runs over the data once for methods whose extraction options agree. Arguments after ``--``
go to every ``train.adapter`` run unchanged. Output: ``OUT/results.{json,md,png}`` (train.evaluate's report,
one column per model) and ``OUT/compare.json`` (per method: steps, training time, held-out metrics, fitted
inference parameters).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from adapters.registry import ADAPTERS
from extract.config import nonnegative_int, parse_with_config, positive_int, save_config


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(argv if argv is not None else sys.argv[1:])
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m train.adapter_compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", required=False, help="training data (a toy-world folder gives train/val/test splits)")
    p.add_argument("--out", default="runs/compare", help="output folder")
    p.add_argument("--methods", default="all", help=f"comma list from {', '.join(ADAPTERS.names())}, or all")
    p.add_argument("--base", default="tiny", help="backbone alias or open_clip model name")
    p.add_argument("--pretrained", default=None, help="tag, checkpoint path or 'none'")
    p.add_argument("--epochs", type=positive_int, default=10, help="training epochs of every adapter")
    p.add_argument("--batch-size", type=positive_int, default=256, help="contrastive batch of every adapter")
    p.add_argument("--val-data", default=None, help="held-out data (see python -m train.adapter)")
    p.add_argument("--test-data", default=None, help="data of the table (default: the toy world's test split)")
    p.add_argument("--benchmark", action="append", default=[], metavar="NAME=PATH", help="benchmarks of the table")
    p.add_argument("--cache-dir", default=None, help="shared feature caches (default: OUT/cache)")
    p.add_argument("--eval-tasks", default="retrieval,compositional", help="train.evaluate tasks of the table")
    p.add_argument("--device", default=None)
    p.add_argument("--workers", type=nonnegative_int, default=None, help="extraction: image decoding processes")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="training seed")
    args = parse_with_config(p, argv)
    if not args.data:
        p.error("--data is required")
    names = ADAPTERS.names()
    args.methods = names if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in names]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    args.extra = extra
    return args


def compare(args) -> dict:
    from train import adapter as ad
    from train import evaluate as ev

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(args, out / "config.json")
    components = sorted({c for m in args.methods for c in ADAPTERS.get(m).components})
    common = ["--data", str(args.data), "--base", args.base, "--epochs", str(args.epochs), "--batch-size",
              str(args.batch_size), "--cache-dir", str(args.cache_dir or out / "cache"), "--seed", str(args.seed),
              "--components", ",".join(components), "--no-final-eval"]
    for flag, value in (("--pretrained", args.pretrained), ("--val-data", args.val_data), ("--device", args.device),
                        ("--workers", args.workers)):
        if value is not None:
            common += [flag, str(value)]
    runs = {}
    for method in args.methods:
        print(f"== {method} ==")
        started = time.perf_counter()
        targs = ad.parse_args([*common, "--method", method, "--out", str(out / method), *args.extra])
        summary = ad.train(targs)
        runs[method] = {"steps": summary["steps"], "seconds": time.perf_counter() - started,
                        "val": summary.get("val"), "inference": summary.get("inference"),
                        "checkpoint": summary.get("adapter")}
    table_args = argparse.Namespace(data=args.data, val_data=args.val_data, test_data=args.test_data,
                                    benchmark=args.benchmark, image_root=None)
    data_argv = ad.final_table_data(table_args)
    report = None
    if data_argv:
        argv = ["--model", args.base] + (["--pretrained", args.pretrained] if args.pretrained else [])
        for method in args.methods:
            argv += ["--model", runs[method]["checkpoint"]]
        argv += [*data_argv, "--tasks", args.eval_tasks, "--out", str(out), "--seed", str(args.seed)]
        if args.device:
            argv += ["--device", args.device]
        report = ev.evaluate(ev.parse_args(argv))
    else:
        print("note: no test data (--test-data or a toy world): no table")
    result = {"methods": runs, "table": str(out / "results.md") if report else None}
    (out / "compare.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from train.adapter import run_cli

    return run_cli(compare, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
