"""``python -m extract.data.check SOURCE``: decode every image and caption of a data source once and report
what would be skipped, before a long run finds out.

The report is the one ``python -m extract`` writes for the same source: the same one-line summary (images and
captions skipped, by reason; images converted) and, with ``--report``, the same ``report.json`` (summary, counts,
every skipped or converted item with its file:line or shard::key). Takes the same data-source flags
(``--csv-img-key``, ``--csv-caption-key``, ``--csv-separator``, ``--csv-encoding``, see
:mod:`extract.common.source_args`). Exit status 0 when the source was read (whatever it holds), 2 with a one-line
``error: ...`` when it cannot be read at all (a missing file, wrong columns, another separator or encoding).

From Python: ``check_data(CheckDataOptions(source="pairs.csv"))`` returns the counts instead of printing them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# torch (DataLoader) and the data sources load in check_data(): --help and argument errors stay cheap
from extract.common.cli import Parser, check_options, option, parse_options, progress, run_job
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int
from extract.common.source_args import SourceOptions, open_options


@dataclass
class CheckDataOptions(SourceOptions):
    """What ``python -m extract.data.check`` does, as data: ``check_data(CheckDataOptions(source="pairs.csv"))``
    reads the same source as the command line with that argument."""

    source: str | None = option(None, positional=True, nargs="?", metavar="SOURCE",
                                help="CSV/TSV file, COCO captions JSON, toy-world folder, .tar shard(s) or brace "
                                     "pattern")
    split: str | None = option(None, help="toy world only: train, val or test (default: train)")
    image_root: str | None = option(None, help="CSV/COCO: folder relative image paths start from (default: the "
                                               "file's folder)")
    unusual: str = option("convert", choices=["convert", "skip"],
                          help="CMYK / 16-bit / transparent images: convert them (reported) or skip them")
    workers: int = option(2, type=nonnegative_int, help="decoding processes (indexed sources; 0: in this process)")
    report: str | None = option(None, metavar="PATH", help="write the JSON report here (default: none written)")


def build_parser() -> Parser:
    return build_cli(CheckDataOptions, "python -m extract.data.check", __doc__)


def parse_args(argv: Sequence[str] | None = None) -> CheckDataOptions:
    def required(ns):  # optional in the parser, checked here: a mistyped flag is then named as such
        if not ns.source:
            raise ValueError("the data source is required, e.g. python -m extract.data.check pairs.csv")

    return parse_options(CheckDataOptions, build_parser(), argv, required)


def check_data(opts: CheckDataOptions) -> dict:
    """Read the whole source ``opts`` describes once; write ``opts.report`` if set. Returns ``{"source": name,
    "images": good images, "captions": their captions, "summary": the report's one line, "counts": skipped /
    converted by reason, "report": the JSON path or None}``. Raises FileNotFoundError / ValueError / ImportError
    when the source cannot be read at all."""
    from torch.utils.data import DataLoader

    from extract.data.sources import IndexedSource, SampleDataset, collate_skipping, open_source

    check_options(opts, build_parser())
    if not opts.source:
        raise ValueError("no data source given (CheckDataOptions.source)")
    options = open_options(opts)
    source = open_source(opts.source, **options)
    images = captions = 0
    if isinstance(source, IndexedSource):  # decode in worker processes; skips come back with each batch
        loader = DataLoader(SampleDataset(source), batch_size=64, num_workers=opts.workers,
                            collate_fn=collate_skipping)
        for good, skips in progress(loader, desc=f"checking {source.name}", unit="batch"):
            source.report.add_batch(good, skips)
            images += len(good["image_ids"])
            captions += sum(len(c) for c in good["captions"])
    else:  # a stream records its refusals and conversions itself
        for sample in progress(source, desc=f"checking {source.name}", unit="image"):
            images += 1
            captions += len(sample.captions)
    if opts.report:
        source.report.to_json(opts.report)
    return {"source": source.name, "images": images, "captions": captions, "summary": source.report.summary(),
            "counts": source.report.counts(), "report": opts.report}


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: CheckDataOptions) -> None:
        result = check_data(opts)
        print(f"checked {result['source']}: {result['images']} good images with {result['captions']} captions\n"
              f"  {result['summary']}" + (f"\n  report: {result['report']}" if result["report"] else ""))

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
