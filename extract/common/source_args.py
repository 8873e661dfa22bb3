"""The data-source options every command that reads image-caption data shares, in one argument group.

They say how a CSV/TSV caption table is read, with open_clip's flag names where it has them::

    --csv-img-key      column of image paths             (default filepath)
    --csv-caption-key  column of captions                (default title)
    --csv-separator    one character, or \\t / tab        (default: tab for .tsv, comma otherwise)
    --csv-encoding     text encoding, e.g. utf-16, latin-1 (default utf-8; a UTF-8 byte-order mark is dropped)

Use::

    p = argparse.ArgumentParser()
    add_source_args(p)
    args = p.parse_args(argv)
    source = open_source(args.data, **source_options(args), image_root=..., split=...)

``open_source`` hands these options to CSV/TSV tables only; COCO JSON, toy worlds and webdataset shards ignore
them, so one set of flags serves every spec. A command that starts another one (an adapter run extracting its
cache) passes them on with :func:`source_flags`. Errors about columns, separator or encoding
(:class:`extract.data.sources.CSVSource`) name these flags.
"""
from __future__ import annotations

import argparse
import codecs
from dataclasses import dataclass
from typing import Any

from extract.common.cli import add_options, option
from extract.common.config import fraction
from extract.data.boxes import DEFAULT_MAX_MISSING, MAX_MISSING_HELP

__all__ = ["DEFAULTS", "FLAGS", "SourceOptions", "add_source_args", "encoding_type", "parse_encoding", "parse_separator",
           "open_options", "separator_type", "source_flags", "source_options"]

# argparse dest -> default; the CSVSource keyword each one becomes is in _OPTION
DEFAULTS: dict[str, Any] = {"csv_img_key": "filepath", "csv_caption_key": "title", "csv_separator": None,
                            "csv_encoding": "utf-8"}
FLAGS = {dest: "--" + dest.replace("_", "-") for dest in DEFAULTS}
_OPTION = {"csv_img_key": "img_key", "csv_caption_key": "caption_key", "csv_separator": "sep",
           "csv_encoding": "encoding"}

# Spellings of separators that are awkward to type in a shell or a YAML file.
_SEPARATOR_NAMES = {"\\t": "\t", "tab": "\t", "comma": ",", "semicolon": ";", "pipe": "|", "space": " "}


def parse_separator(text: str) -> str:
    """The one-character separator ``text`` names: the character itself, or ``\\t`` / ``tab`` (also ``comma``,
    ``semicolon``, ``pipe``, ``space``). Raises ValueError naming ``--csv-separator`` otherwise."""
    sep = _SEPARATOR_NAMES.get(text.lower() if len(text) > 1 else text, text)
    if len(sep) != 1 or sep in "\r\n\"":
        raise ValueError(f"--csv-separator must be one character (or \\t / tab for a tab), got {text!r}")
    return sep


def parse_encoding(text: str) -> str:
    """``text`` if Python knows the encoding (``utf-8``, ``utf-16``, ``latin-1``, ``cp1252``...); raises ValueError
    naming ``--csv-encoding`` otherwise."""
    try:
        codecs.lookup(text)
    except LookupError:
        raise ValueError(f"--csv-encoding {text!r} is no text encoding Python knows (try utf-8, utf-16, latin-1 "
                         f"or cp1252)") from None
    return text


def _argparse_type(parse):
    def convert(text: str) -> str:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


separator_type = _argparse_type(parse_separator)
encoding_type = _argparse_type(parse_encoding)


@dataclass
class SourceOptions:
    """The four options as dataclass fields: a job's options dataclass inherits them (``extract.common.cli``), so its
    command line gets the group and :func:`source_options` reads them from an instance as from a Namespace."""

    csv_img_key: str = option(DEFAULTS["csv_img_key"], metavar="COLUMN", group="data source",
                              help="CSV/TSV column of image paths (other sources ignore the --csv-* options)")
    csv_caption_key: str = option(DEFAULTS["csv_caption_key"], metavar="COLUMN", group="data source",
                                  help="CSV/TSV column of captions")
    csv_separator: str | None = option(DEFAULTS["csv_separator"], type=separator_type, metavar="SEP",
                                       group="data source", help="field separator: one character, or '\\t' / tab "
                                                                 "(default: tab for .tsv, comma otherwise)")
    csv_encoding: str = option(DEFAULTS["csv_encoding"], type=encoding_type, metavar="ENCODING", group="data source",
                               help="text encoding of the table, e.g. utf-16, latin-1 (a UTF-8 byte-order mark is "
                                    "dropped)")


@dataclass
class BoxOptions:
    """Where an adapter trained on boxes gets the boxes of images it has not seen, and the share of a collection's
    images its box file may leave out (jobs that score new data with an adapter inherit these fields: ``train.eval``,
    ``serve.index``)."""

    annotations: str | None = option(None, group="adapters",
                                     help="ground-truth boxes to score adapters with: COCO instances, Visual Genome "
                                          "objects.json or a toy-world folder; given, they replace the detector of an "
                                          "adapter trained on detected boxes (default: --data when it is a toy world, "
                                          "for adapters trained on ground-truth boxes only)")
    detector: str | None = option(None, group="adapters",
                                  help="YOLO weights to detect boxes with instead of the adapter's own source "
                                       "(default: the detector its run folder carries, or the annotations)")
    max_missing_boxes: float = option(DEFAULT_MAX_MISSING, type=fraction, metavar="SHARE", group="adapters",
                                      help=MAX_MISSING_HELP)


def add_source_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--csv-img-key``, ``--csv-caption-key``, ``--csv-separator`` and ``--csv-encoding`` to ``parser`` as one
    argument group ("data source"). Values are checked while parsing, so a bad separator or an unknown encoding is
    an argparse error (exit status 2), also when it comes from ``--config``."""
    return add_options(parser, SourceOptions)


def source_options(args: argparse.Namespace) -> dict[str, Any]:
    """``{"img_key", "caption_key", "sep", "encoding"}`` for ``open_source(spec, **options)`` (or ``CSVSource``).

    Reads ``args.csv_img_key``, ``csv_caption_key``, ``csv_separator``, ``csv_encoding``; a missing attribute
    (a Namespace built by hand) takes its default. ``sep`` is None for "by extension". Raises ValueError for a bad
    separator or encoding (already refused by the parser when it came from one)."""
    values = {dest: getattr(args, dest, default) for dest, default in DEFAULTS.items()}
    if values["csv_separator"] is not None:
        values["csv_separator"] = parse_separator(values["csv_separator"])
    values["csv_encoding"] = parse_encoding(values["csv_encoding"] or DEFAULTS["csv_encoding"])
    return {_OPTION[dest]: value for dest, value in values.items()}


def open_options(opts: Any) -> dict[str, Any]:
    """``open_source(spec, **open_options(opts))`` for a job's options: the --csv-* options plus ``unusual``,
    ``split`` and ``image_root`` where ``opts`` has them set."""
    extra = {k: getattr(opts, k, None) for k in ("unusual", "split", "image_root")}
    return {**source_options(opts), **{k: v for k, v in extra.items() if v}}


def source_flags(args: argparse.Namespace) -> dict[str, str]:
    """The options that differ from their defaults, keyed by argparse dest (``{"csv_img_key": "image"}``), to
    pass on to another command: ``--csv-img-key image``. Defaults are left out, so a command line (and a cache
    fingerprint built from one) stays as it was for data that needs none of them."""
    return {dest: getattr(args, dest) for dest, default in DEFAULTS.items()
            if getattr(args, dest, default) != default}
