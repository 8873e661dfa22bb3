"""``python -m extract.check_data SOURCE``: decode every image and caption of a data source once and report
what would be skipped, before a long run finds out.

The report is the one ``python -m extract`` writes for the same source: the same one-line summary (images and
captions skipped, by reason; images converted) and, with ``--report``, the same ``report.json`` (summary, counts,
every skipped or converted item with its file:line or shard::key). Takes the same data-source flags
(``--csv-img-key``, ``--csv-caption-key``, ``--csv-separator``, ``--csv-encoding``, see
:mod:`extract.source_args`). Exit status 0 when the source was read (whatever it holds), 2 with a one-line
``error: ...`` when it cannot be read at all (a missing file, wrong columns, another separator or encoding).
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

from torch.utils.data import DataLoader
from tqdm import tqdm

from extract.config import nonnegative_int, parse_with_config
from extract.data import IndexedSource, SampleDataset, collate_skipping, open_source
from extract.source_args import add_source_args, source_options

# the docstring's first paragraph without its leading ``command``: label
_FIRST = re.sub(r"^``[^`]*``:\s*", "", " ".join(__doc__.split("\n\n")[0].split()))
DESCRIPTION = _FIRST[:1].upper() + _FIRST[1:]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m extract.check_data", description=DESCRIPTION)
    p.add_argument("source", help="CSV/TSV file, COCO captions JSON, toy-world folder, .tar shard(s) or brace pattern")
    p.add_argument("--split", default=None, help="toy world only: train, val or test (default train)")
    p.add_argument("--image-root", default=None, help="CSV/COCO: folder relative image paths start from "
                   "(default: the file's folder)")
    p.add_argument("--unusual", choices=["convert", "skip"], default="convert",
                   help="CMYK / 16-bit / transparent images: convert them (reported) or skip them")
    p.add_argument("--workers", type=nonnegative_int, default=2, help="decoding processes (indexed sources)")
    p.add_argument("--report", default=None, help="write the JSON report here")
    add_source_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return parse_with_config(build_parser(), argv)


def check(args: argparse.Namespace) -> None:
    """Read the whole source described by ``args``, print the summary, write the report if asked. Raises
    FileNotFoundError / ValueError / ImportError when the source cannot be read at all."""
    options = {"unusual": args.unusual, **source_options(args)}
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
    else:  # a stream records its refusals and conversions itself
        for sample in tqdm(source, desc=source.name, unit="image"):
            images += 1
            captions += len(sample.captions)
    print(f"checked {source.name}: {images} good images with {captions} captions\n  {source.report.summary()}")
    if args.report:
        source.report.to_json(args.report)
        print(f"  report: {args.report}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check(args)
    except (FileNotFoundError, ValueError, ImportError) as e:  # as python -m extract: one line, status 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
