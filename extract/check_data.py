"""``python -m extract.check_data SOURCE``: decode every image and caption of a data source once and report
what would be skipped, before a long run finds out. Prints the counts and writes a JSON report."""
from __future__ import annotations

import argparse
from typing import Sequence

from torch.utils.data import DataLoader
from tqdm import tqdm

from extract.config import parse_with_config
from extract.data import IndexedSource, SampleDataset, collate_skipping, open_source


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m extract.check_data", description=__doc__.split("\n")[0][3:])
    p.add_argument("source", help="CSV/TSV file, COCO captions JSON, toy-world folder, .tar shard(s) or brace pattern")
    p.add_argument("--split", default=None, help="toy world only: train, val or test (default train)")
    p.add_argument("--image-root", default=None, help="CSV/COCO: folder relative image paths start from "
                   "(default: the file's folder)")
    p.add_argument("--unusual", choices=["convert", "skip"], default="convert",
                   help="CMYK / 16-bit / transparent images: convert them (reported) or skip them")
    p.add_argument("--workers", type=int, default=2, help="decoding processes (indexed sources)")
    p.add_argument("--report", default=None, help="write the JSON report here")
    return parse_with_config(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    options = {"unusual": args.unusual}
    if args.split:
        options["split"] = args.split
    if args.image_root:
        options["image_root"] = args.image_root
    source = open_source(args.source, **options)
    images = captions = 0
    if isinstance(source, IndexedSource):  # decode in worker processes; skips come back with each batch
        loader = DataLoader(SampleDataset(source), batch_size=64, num_workers=args.workers,
                            collate_fn=collate_skipping)
        for good, skips in tqdm(loader, desc=source.name, unit="batch"):
            source.report.add_batch(good, skips)
            images += len(good["image_ids"])
            captions += sum(len(c) for c in good["captions"])
    else:
        for sample in tqdm(source, desc=source.name, unit="image"):
            images += 1
            captions += len(sample.captions)
    print(f"{source.name}: {images} good images with {captions} captions; {source.report.summary()}")
    if args.report:
        source.report.to_json(args.report)
        print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
