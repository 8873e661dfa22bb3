"""What a compositional benchmark is once read (:class:`Item`, :class:`Benchmark`), the error a file that breaks
its published format raises (:class:`BenchmarkFormatError`), and the strict field readers every reader shares
(``train.eval.datasets`` for the readers)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable


MISSING_IMAGE = "missing image"


class BenchmarkFormatError(ValueError):
    """A benchmark file that does not follow its published format; the message names file and line/entry."""


@dataclass(frozen=True)
class Item:
    """One scored unit: which images and texts, and what is true (see ``Benchmark.kind``)."""

    item_id: str
    images: tuple[str, ...]          # absolute image paths
    texts: tuple[str, ...]
    subtype: str                     # e.g. "replace_att", "VG-Relation:on", "swap_obj", a Winoground tag
    crop: tuple[float, float, float, float] | None = None  # (x, y, w, h) px, cropped before scoring (ARO)
    tags: tuple[str, ...] = ()       # further rows the item counts in (toy world: "held-out swap-att", ...)


@dataclass
class Benchmark:
    """A benchmark's loadable items plus one record per excluded item."""

    name: str                        # a key of READERS
    kind: str                        # "text" | "image" | "group" | "set" (module docstring)
    items: list[Item]
    skipped: list[dict] = field(default_factory=list)  # {"item_id", "reason", "location", "image"}
    #: figures a benchmark's authors compute over several items (What'sUp's pair and set accuracies):
    #: (the scored items, each one's correctness) -> {row: {metric: value}}; added to the report by train.eval
    summarize: Callable[[list[Item], list[bool]], dict] | None = None


# --------------------------------------------------------------------------------------------- parsing helpers
def format_error(path: Path, where: str, message: str) -> BenchmarkFormatError:
    return BenchmarkFormatError(f"{path}: {where}: {message}" if where else f"{path}: {message}")


def read_text_file(path: Path) -> str:
    """The file's text (UTF-8, BOM dropped); undecodable bytes are a format error naming the line."""
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file not found: {path}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise format_error(path, f"line {line}", f"not UTF-8 text ({e.reason})") from None


def load_json(path: Path) -> Any:
    """The parsed file (shared while unchanged: extract.common.json_memo; the readers never edit it); a file that
    does not read or parse plainly is read again here, to say where and why."""
    from extract.common.json_memo import read_json

    try:
        return read_json(path)
    except (OSError, ValueError):  # missing, not UTF-8, a byte-order mark, invalid: the careful path says which
        pass
    try:
        return json.loads(read_text_file(path))
    except json.JSONDecodeError as e:
        raise format_error(path, f"line {e.lineno}", f"invalid JSON ({e.msg}, column {e.colno})") from None


def text_field(path: Path, where: str, record: dict, key: str) -> str:
    """A required, non-empty string value (an empty caption or id is malformed, not skippable)."""
    if key not in record:
        raise format_error(path, where, f"missing key {key!r}")
    value = record[key]
    if not isinstance(value, str):
        raise format_error(path, where, f"{key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise format_error(path, where, f"{key!r} is empty")
    return value


def number_field(path: Path, where: str, record: dict, key: str) -> float:
    if key not in record:
        raise format_error(path, where, f"missing key {key!r}")
    value = record[key]
    # bool is an int subclass in Python; a true/false box coordinate is a broken file, not 0/1.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise format_error(path, where, f"{key!r} must be a finite number, got {value!r}")
    return float(value)


def id_field(path: Path, where: str, record: dict, key: str) -> str:
    """An id that may be a number or a string (ARO image ids, Winoground ids)."""
    if key not in record:
        raise format_error(path, where, f"missing key {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, str) and not value.strip()):
        raise format_error(path, where, f"{key!r} must be an integer or a non-empty string, got {value!r}")
    return str(value)


def object_field(path: Path, where: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise format_error(path, where, f"expected a JSON object, got {type(value).__name__}")
    return value


def abspath(path: str | os.PathLike) -> str:
    # abspath, not resolve(): keep the user's symlinked dataset folders as they named them.
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


@dataclass(frozen=True)
class Pending:
    """A validated item whose images are not checked yet (validation of the whole file comes first)."""

    item: Item
    location: str


def finish(name: str, kind: str, pending: Iterable[Pending], degenerate: Iterable[dict] = ()) -> Benchmark:
    """Check image existence once per path and split the items into loaded and skipped."""
    exists: dict[str, bool] = {}  # SugarCrepe / ARO reuse an image across many items: stat each once
    items, skipped = [], list(degenerate)
    for p in pending:
        missing = next((im for im in p.item.images
                        if not exists.setdefault(im, os.path.isfile(im))), None)
        if missing is None:
            items.append(p.item)
        else:
            skipped.append({"item_id": p.item.item_id, "reason": MISSING_IMAGE, "location": p.location,
                            "image": missing})
    return Benchmark(name=name, kind=kind, items=items, skipped=skipped)


def published_files(path: Path, stems: Iterable[str], name: str) -> list[Path]:
    """A benchmark's JSON files: those of ``stems`` present in folder ``path`` (in that order), or ``path`` itself."""
    if path.is_dir():
        files = [path / f"{stem}.json" for stem in stems if (path / f"{stem}.json").is_file()]
        if not files:
            raise FileNotFoundError(f"no {name} files in {path}: expected any of "
                                    f"{', '.join(s + '.json' for s in stems)}")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file not found: {path}")
    return [path]
