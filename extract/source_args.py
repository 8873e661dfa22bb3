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
(:class:`extract.data.CSVSource`) name these flags.
"""
from __future__ import annotations

import argparse
import codecs
from typing import Any

__all__ = ["DEFAULTS", "FLAGS", "add_source_args", "parse_encoding", "parse_separator", "source_flags",
           "source_options"]

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


def add_source_args(parser: argparse.ArgumentParser, title: str = "data source") -> argparse._ArgumentGroup:
    """Add ``--csv-img-key``, ``--csv-caption-key``, ``--csv-separator`` and ``--csv-encoding`` to ``parser`` as one
    argument group (returned). Values are checked while parsing, so a bad separator or an unknown encoding is an
    argparse error (exit status 2), also when it comes from ``--config``."""
    # Defaults are named in the group's description, not with %(default)s in each help: train.adapter copies
    # python -m extract's flags with default=SUPPRESS, and ArgumentDefaultsHelpFormatter adds them anyway.
    g = parser.add_argument_group(title, "how CSV/TSV caption tables are read (defaults: columns filepath and title, "
                                         "tab for .tsv and comma otherwise, UTF-8); other sources ignore these")
    g.add_argument(FLAGS["csv_img_key"], default=DEFAULTS["csv_img_key"], metavar="COLUMN",
                   help="CSV/TSV column of image paths")
    g.add_argument(FLAGS["csv_caption_key"], default=DEFAULTS["csv_caption_key"], metavar="COLUMN",
                   help="CSV/TSV column of captions")
    g.add_argument(FLAGS["csv_separator"], default=DEFAULTS["csv_separator"], metavar="SEP",
                   type=_argparse_type(parse_separator),
                   help="field separator: one character, or '\\t' / tab (none: by extension)")
    g.add_argument(FLAGS["csv_encoding"], default=DEFAULTS["csv_encoding"], metavar="ENCODING",
                   type=_argparse_type(parse_encoding), help="text encoding of the table, e.g. utf-16, latin-1")
    return g


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


def source_flags(args: argparse.Namespace) -> dict[str, str]:
    """The options that differ from their defaults, keyed by argparse dest (``{"csv_img_key": "image"}``), to
    pass on to another command: ``--csv-img-key image``. Defaults are left out, so a command line (and a cache
    fingerprint built from one) stays as it was for data that needs none of them."""
    return {dest: getattr(args, dest) for dest, default in DEFAULTS.items()
            if getattr(args, dest, default) != default}
