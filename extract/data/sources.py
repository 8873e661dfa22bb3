"""Image-caption data sources behind one interface, and the report of what they had to skip.

Every source yields :class:`Sample` objects (an RGB image with *all* of its valid captions) and
records every refused image, caption or shard in its ``report`` (:class:`SkipReport`) instead of
raising. Pairing is by identifier, never by position: a caption belongs to the image its row,
annotation or shard key names, so skipping an item can never shift the captions of the others.

Sources (``open_source`` picks one from a spec):

- :class:`CSVSource`    -- CSV/TSV with an image-path column and a caption column (open_clip's
  ``filepath`` / ``title``); rows naming the same path are one image with several captions.
- :class:`COCOSource`   -- COCO captions JSON (``images`` + ``annotations``).
- :class:`ToyWorldSource` -- the generated toy world (its COCO JSON plus scene annotations).
- :class:`WebDatasetSource` -- local webdataset ``.tar`` shards, read in streaming mode.
- :class:`ImageFolderSource` -- a plain folder of images without captions (for search indices: images are
  found by text, nothing is trained on them).

All but the webdataset source are *indexed*: ``records()`` lists the images and their captions without decoding
anything, and ``load(record)`` decodes one, which :class:`SampleDataset` uses to feed a multi-worker
``torch.utils.data.DataLoader`` whose workers return skip markers instead of raising.
"""
from __future__ import annotations

import codecs
import csv
import difflib
import json
import os
import re
import tarfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from PIL import Image

from extract.data.images import BadCaption, BadImage, DecodedImage, Unusual, decode_image, validate_caption
from extract.data.report import Note, Skip, SkipReport
from extract.data.toyworld import is_toyworld

__all__ = [
    "COCOSource",
    "CSVSource",
    "Caption",
    "DataSource",
    "ImageFolderSource",
    "ImageRecord",
    "IndexedSource",
    "Item",
    "Note",
    "Sample",
    "SampleDataset",
    "Skip",
    "SkipReport",
    "ToyWorldSource",
    "WebDatasetSource",
    "collate_skipping",
    "expand_shards",
    "open_source",
]

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


# --------------------------------------------------------------------------- records and samples


@dataclass(frozen=True)
class Caption:
    """One valid caption; ``id`` is unique within its source (see each source for the scheme)."""

    id: str
    text: str


@dataclass(frozen=True)
class ImageRecord:
    """An image and all of its valid captions, before decoding.

    ``source`` is what to decode (a file path); ``location`` is where the image was declared
    (``file:line`` or ``file:image <id>``), for reports.
    """

    image_id: str
    source: str
    captions: tuple[Caption, ...]
    location: str = ""


@dataclass(frozen=True)
class Sample:
    """A decoded RGB image with its captions; ``note`` says how its pixels were converted, if at all.

    ``location`` is where the image was declared (as in :class:`ImageRecord` and the report), so a
    caller that records the note again (``SkipReport.add_batch``) records the same entry, not a second.
    """

    image_id: str
    image: Image.Image
    captions: tuple[Caption, ...]
    note: str | None = None
    location: str = ""


def _checked_caption(report: SkipReport, caption_id: str, raw: object, location: str) -> Caption | None:
    """The caption if valid; otherwise None, with the refusal recorded in ``report``."""
    try:
        return Caption(caption_id, validate_caption(raw))
    except BadCaption as e:
        report.add(Skip.from_error("caption", caption_id, location, e))
        return None


# --------------------------------------------------------------------------- the interface


class DataSource(ABC):
    """Iterate good samples; everything refused is recorded in ``report``, nothing raises per item.

    ``max_pixels`` and ``unusual`` are passed to :func:`extract.data.images.decode_image`. ``has_captions`` is False
    for a source of images alone (:class:`ImageFolderSource`), whose samples have no captions.
    """

    has_captions = True

    def __init__(self, name: str, max_pixels: int | None = None, unusual: Unusual = "convert"):
        self.name = name
        self.max_pixels = max_pixels
        self.unusual = unusual
        self.report = SkipReport()

    @abstractmethod
    def __iter__(self) -> Iterator[Sample]:
        """Yield every good sample, in source order."""

    def _decode(self, src: str | bytes) -> DecodedImage:
        return decode_image(src, max_pixels=self.max_pixels, unusual=self.unusual)


class IndexedSource(DataSource):
    """A source whose images and captions are listed up front (from a CSV or a JSON file).

    ``records()`` is built once; building it validates every caption and reports the bad ones, and
    reports images left without any valid caption ("no valid caption"). ``load`` decodes one record.
    """

    def __init__(self, name: str, image_root: Path, max_pixels: int | None, unusual: Unusual):
        super().__init__(name, max_pixels, unusual)
        self.image_root = image_root
        self._records: list[ImageRecord] | None = None

    @abstractmethod
    def _index(self, builder: _RecordBuilder) -> None:
        """Declare every image and caption of the source to ``builder``."""

    def records(self) -> list[ImageRecord]:
        """Every image with at least one valid caption, in source order (a fresh list each call)."""
        if self._records is None:
            builder = _RecordBuilder(self.report, self.image_root)
            self._index(builder)
            self._records = builder.build()
        return list(self._records)

    def load(self, record: ImageRecord) -> Sample:
        """Decode ``record``'s image; raises :class:`BadImage` (missing file included)."""
        decoded = self._decode(record.source)
        return Sample(record.image_id, decoded.image, record.captions, decoded.note, record.location)

    def __len__(self) -> int:
        return len(self.records())

    def __iter__(self) -> Iterator[Sample]:
        for record in self.records():
            try:
                sample = self.load(record)
            except BadImage as e:
                self.report.add(Skip.from_error("image", record.image_id, record.location, e))
                continue
            if sample.note is not None:
                self.report.note(record.image_id, record.location, sample.note)
            yield sample


@dataclass
class _PendingImage:
    source: str
    location: str
    captions: list[Caption] = field(default_factory=list)
    rejected: int = 0


class _RecordBuilder:
    """Gathers captions under their image id, validating each caption as it arrives."""

    def __init__(self, report: SkipReport, image_root: Path):
        self.report = report
        self.image_root = image_root
        self._images: dict[str, _PendingImage] = {}

    def __contains__(self, image_id: str) -> bool:
        return image_id in self._images

    def add_image(self, image_id: str, path: str, location: str) -> None:
        """Declare an image; a relative ``path`` is taken from ``image_root``."""
        self._images[image_id] = _PendingImage(str(self.image_root / path), location)

    def reject_caption(self, image_id: str, skip: Skip) -> None:
        """Record a caption of ``image_id`` refused by the source itself (counts towards "no valid caption")."""
        self.report.add(skip)
        self._images[image_id].rejected += 1

    def add_caption(self, image_id: str, caption_id: str, raw: object, location: str) -> None:
        pending = self._images[image_id]
        caption = _checked_caption(self.report, caption_id, raw, location)
        if caption is None:
            pending.rejected += 1
        else:
            pending.captions.append(caption)

    def build(self) -> list[ImageRecord]:
        records = []
        for image_id, pending in self._images.items():
            if pending.captions:
                records.append(
                    ImageRecord(image_id, pending.source, tuple(pending.captions), pending.location)
                )
                continue
            detail = f"{pending.rejected} rejected" if pending.rejected else "no caption given"
            self.report.add(Skip("image", image_id, pending.location, "no valid caption", detail))
        return records


# --------------------------------------------------------------------------- CSV / TSV


class CSVSource(IndexedSource):
    """A CSV/TSV file with a header row, one image path and one caption per row (open_clip layout).

    Image id: the path as written (rows with the same path are one image, captions in file order).
    Caption id: ``"{file name}:{line}"`` (1-based, header is line 1). Relative paths are taken from
    ``image_root``, else from the file's folder. The separator follows the extension (``.tsv``: tab,
    otherwise comma) unless ``sep`` is given; ``encoding`` is the file's text encoding (a UTF-8
    byte-order mark is dropped). Rows whose field count differs from the header's (an unquoted
    separator inside a caption, a cut line) are reported, never guessed at.

    An unterminated quote makes a CSV reader take every following line, up to the next quote or the
    end of the file, as part of one caption. The rule that catches it: a record that spans several
    lines, one of whose continuation lines reads on its own as a complete record (the header's
    number of fields, no open quote, an image column that names an image already listed, a file
    under the image root or a name with an image extension), is reported at its first line as
    "unterminated quote", and reading starts again at that continuation line, so the rows after it
    are kept. A last record that ends inside a quote at the end of the file is reported the same
    way. A legitimate multi-line caption is kept unless one of its lines looks like such a record.

    A file that cannot be read as a table at all (missing columns, empty, another separator or
    encoding) raises ValueError naming the command-line flags that fix it (``--csv-img-key``,
    ``--csv-caption-key``, ``--csv-separator``, ``--csv-encoding``; the keyword arguments
    ``img_key``, ``caption_key``, ``sep``, ``encoding`` in Python).
    """

    def __init__(
        self,
        path: str | Path,
        image_root: str | Path | None = None,
        img_key: str = "filepath",
        caption_key: str = "title",
        sep: str | None = None,
        max_pixels: int | None = None,
        unusual: Unusual = "convert",
        encoding: str = "utf-8",
    ):
        self.path = _existing_file(path, "caption table")
        root = Path(image_root) if image_root is not None else self.path.parent
        super().__init__(self.path.name, root, max_pixels, unusual)
        self.img_key = img_key
        self.caption_key = caption_key
        self.sep = sep if sep is not None else ("\t" if self.path.suffix.lower() == ".tsv" else ",")
        if len(self.sep) != 1:
            raise ValueError(f"separator {self.sep!r} of {self.path} must be one character (--csv-separator, sep=)")
        try:
            self.encoding = codecs.lookup(encoding).name
        except LookupError:
            raise ValueError(f"unknown text encoding {encoding!r} for {self.path} (--csv-encoding, "
                             f"encoding=)") from None

    def _index(self, builder: _RecordBuilder) -> None:
        self._check_encoding()
        # utf-8-sig drops a byte-order mark. surrogateescape: bytes that are not valid in the encoding
        # survive into the caption, where they are reported as binary data instead of aborting the file.
        codec = "utf-8-sig" if self.encoding == "utf-8" else self.encoding
        try:
            with open(self.path, newline="", encoding=codec, errors="surrogateescape") as f:
                feed = _LineFeed(f)
                reader = csv.reader(feed, delimiter=self.sep)
                header = self._header(reader)
                img_col, cap_col = self._columns(header)
                for line, row, lines in _records(reader, feed):
                    again = self._record_inside(lines, len(header), img_col, builder) if len(lines) > 1 else None
                    if again is not None:
                        self._report_row(line, "unterminated quote", f"the quote opened on line {line} runs into "
                                         f"line {line + again}, which reads as a record; reading resumed there")
                        feed.reread(lines[again:], line + again)
                    elif isinstance(row, csv.Error):
                        self._report_row(line, "malformed CSV row", str(row))
                    elif _ends_inside_quote(lines, self.sep):
                        self._report_row(line, "unterminated quote", "the quote is still open at the end of the file")
                    elif row:  # blank lines carry nothing
                        self._index_row(builder, row, len(header), img_col, cap_col, line)
        except UnicodeError as e:  # a codec without surrogateescape support, e.g. odd bytes in UTF-16
            raise ValueError(f"{self.path} is not valid {self.encoding} text ({e}); pass --csv-encoding with the "
                             f"file's encoding (encoding= in Python)") from None

    def _check_encoding(self) -> None:
        """Refuse, with the flag that fixes it, a file whose first bytes show another encoding than the one given."""
        if self.encoding != "utf-8":
            return
        with open(self.path, "rb") as f:
            head = f.read(4096)
        if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            raise ValueError(f"{self.path} is UTF-16 text (it starts with a UTF-16 byte-order mark): pass "
                             f"--csv-encoding utf-16 (encoding='utf-16' in Python), or save it as UTF-8")
        first_line = head.split(b"\n", 1)[0]
        if b"\x00" in first_line:
            order = "le" if first_line.index(b"\x00") % 2 else "be"
            raise ValueError(f"{self.path} has NUL bytes in its header, as UTF-16 text without a byte-order mark "
                             f"has: pass --csv-encoding utf-16-{order} (encoding= in Python), or save it as UTF-8")

    def _header(self, reader: Any) -> list[str]:
        try:
            header = next(reader, None)
        except csv.Error as e:
            raise ValueError(f"{self.path}: the header row cannot be read ({e}); check --csv-separator and "
                             f"--csv-encoding") from None
        if not header or not any(cell.strip() for cell in header):
            raise ValueError(
                f"{self.path} is empty: expected a header row naming the columns {self.img_key!r} and "
                f"{self.caption_key!r} (--csv-img-key / --csv-caption-key)"
            )
        if any(_is_undecoded(cell) for cell in header):
            raise ValueError(f"{self.path}: the header is not valid {self.encoding} text; pass --csv-encoding with "
                             f"the file's encoding (e.g. latin-1 or cp1252; encoding= in Python)")
        return header

    def _columns(self, header: list[str]) -> tuple[int, int]:
        missing = [key for key in (self.img_key, self.caption_key) if key not in header]
        if not missing:
            return header.index(self.img_key), header.index(self.caption_key)
        if len(header) == 1:
            for sep, name, flag in _SEPARATORS:
                if sep != self.sep and sep in header[0]:
                    raise ValueError(
                        f"{self.path} looks {name}-separated: pass --csv-separator {flag} (sep= in Python); "
                        f"its header is one column {header[0]!r} with separator {self.sep!r}"
                    )
        close = difflib.get_close_matches(missing[0], header, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{self.path} has no column {missing[0]!r}{hint} (header: {header}, separator {self.sep!r}); "
            f"pass --csv-img-key / --csv-caption-key to name the image-path and caption columns, or "
            f"--csv-separator if the file uses another separator (img_key= / caption_key= / sep= in Python)"
        )

    def _record_inside(self, lines: list[str], width: int, img_col: int, builder: _RecordBuilder) -> int | None:
        """Index of the first continuation line of a multi-line record that reads as a record of its own."""
        for index in range(1, len(lines)):
            try:
                rows = list(csv.reader([lines[index]], delimiter=self.sep, strict=True))
            except csv.Error:  # an open quote, or text after a closing one: not a record on its own
                continue
            if len(rows) == 1 and len(rows[0]) == width and self._looks_like_image(rows[0][img_col], builder):
                return index
        return None

    def _looks_like_image(self, value: str, builder: _RecordBuilder) -> bool:
        if not value.strip() or value != value.strip() or "\n" in value:
            return False
        return (value in builder or Path(value).suffix.lower() in IMAGE_SUFFIXES
                or (self.image_root / value).is_file())

    def _index_row(
        self, builder: _RecordBuilder, row: list[str], width: int, img_col: int, cap_col: int, line: int
    ) -> None:
        if len(row) != width:
            self._report_row(line, "malformed CSV row", f"{len(row)} fields, header has {width}")
            return
        image_id = row[img_col]
        if not image_id.strip():
            self._report_row(line, "no image path")
            return
        location = f"{self.path}:{line}"
        if image_id not in builder:
            builder.add_image(image_id, image_id, location)
        caption = row[cap_col]
        if _is_undecoded(caption):
            # validate_caption would call it binary data; the likelier cause is the wrong encoding
            builder.reject_caption(image_id, Skip("caption", self._caption_id(line), location, "binary data in caption",
                                                  f"bytes that are not {self.encoding} text; check --csv-encoding"))
            return
        builder.add_caption(image_id, self._caption_id(line), caption, location)

    def _caption_id(self, line: int) -> str:
        return f"{self.path.name}:{line}"

    def _report_row(self, line: int, reason: str, detail: str = "") -> None:
        self.report.add(Skip("caption", self._caption_id(line), f"{self.path}:{line}", reason, detail))


IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})

# (separator, its name, how to pass it) for "this file looks X-separated"
_SEPARATORS = (("\t", "tab", "'\\t'"), (",", "comma", "','"), (";", "semicolon", "';'"), ("|", "pipe", "'|'"))


def _is_undecoded(text: str) -> bool:
    # errors="surrogateescape" turns each byte that is not valid text into a lone surrogate U+DC80-U+DCFF
    return any("\udc80" <= c <= "\udcff" for c in text)


class _LineFeed:
    """The physical lines a ``csv.reader`` reads, kept per record so that reading can restart at one of them.

    ``taken``: the lines of the record being read; ``next_line``: the number of the next line handed out.
    """

    def __init__(self, lines: Iterator[str]):
        self._lines = iter(lines)
        self._again: list[str] = []  # lines to hand out again, last first
        self.taken: list[str] = []
        self.next_line = 1

    def __iter__(self) -> _LineFeed:
        return self

    def __next__(self) -> str:
        line = self._again.pop() if self._again else next(self._lines)
        self.taken.append(line)
        self.next_line += 1
        return line

    def reread(self, lines: list[str], first_line: int) -> None:
        """Hand ``lines`` out again, the first of them numbered ``first_line``."""
        self._again.extend(reversed(lines))
        self.next_line = first_line


def _records(reader: Any, feed: _LineFeed) -> Iterator[tuple[int, list[str] | csv.Error, list[str]]]:
    """``(first line of the record, row, its physical lines)``; a malformed record gives its ``csv.Error``
    instead, and reading goes on after it (the reader has consumed the bad record)."""
    while True:
        feed.taken = []
        line = feed.next_line
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            row = e
        yield line, row, feed.taken


def _ends_inside_quote(lines: list[str], sep: str) -> bool:
    """Whether the record made of ``lines`` ends with a quoted field still open, which only the file's last
    record can (the reader ended every other one at a line end outside quotes)."""
    if not any('"' in line for line in lines):  # the common case, without a second parse
        return False
    try:
        list(csv.reader(lines, delimiter=sep, strict=True))
    except csv.Error as e:
        return "unexpected end of data" in str(e)
    return False


# --------------------------------------------------------------------------- COCO captions


class COCOSource(IndexedSource):
    """A COCO captions JSON: ``images[{id, file_name}]`` and ``annotations[{id, image_id, caption}]``.

    Image id: ``str(image id)``; caption id: ``str(annotation id)``. ``file_name`` is taken from
    ``image_root``, else from the JSON file's folder. Annotations naming an unknown image, malformed
    entries and repeated image ids are reported; images keep the order of ``images``.
    """

    def __init__(
        self,
        path: str | Path,
        image_root: str | Path | None = None,
        max_pixels: int | None = None,
        unusual: Unusual = "convert",
    ):
        self.path = _existing_file(path, "COCO captions file")
        root = Path(image_root) if image_root is not None else self.path.parent
        super().__init__(self.path.name, root, max_pixels, unusual)

    def _index(self, builder: _RecordBuilder) -> None:
        coco = self._read()
        for position, entry in enumerate(coco["images"]):
            self._index_image(builder, position, entry)
        for position, annotation in enumerate(coco["annotations"]):
            self._index_annotation(builder, position, annotation)

    def _read(self) -> dict[str, list]:
        try:
            coco = json.loads(self.path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path} is not valid JSON ({e}); expected a COCO captions file") from None
        if not (isinstance(coco, dict) and all(isinstance(coco.get(k), list) for k in ("images", "annotations"))):
            raise ValueError(
                f"{self.path} is not a COCO captions file: it needs top-level 'images' and "
                f"'annotations' lists (as in captions_train2017.json)"
            )
        return coco

    def _index_image(self, builder: _RecordBuilder, position: int, entry: object) -> None:
        valid = isinstance(entry, dict) and "id" in entry and isinstance(entry.get("file_name"), str)
        image_id = str(entry["id"]) if valid else f"images[{position}]"
        location = f"{self.path}:image {image_id}"
        if not valid:
            self.report.add(Skip("image", image_id, location, "malformed image entry", "needs id and file_name"))
        elif image_id in builder:
            self.report.add(Skip("image", image_id, location, "duplicate image id", f"images[{position}]"))
        else:
            builder.add_image(image_id, entry["file_name"], location)

    def _index_annotation(self, builder: _RecordBuilder, position: int, annotation: object) -> None:
        if not isinstance(annotation, dict):
            annotation = {}
        caption_id = str(annotation.get("id", f"annotations[{position}]"))
        location = f"{self.path}:annotation {caption_id}"
        image_id = str(annotation.get("image_id"))
        if image_id not in builder:
            self.report.add(Skip("caption", caption_id, location, "unknown image id", image_id))
            return
        builder.add_caption(image_id, caption_id, annotation.get("caption"), location)


class ToyWorldSource(COCOSource):
    """One split of a generated toy world directory, read through its ``{split}_coco.json``.

    ``file_name`` entries are taken from the toy world directory (as its ``{split}.csv`` paths are).
    ``annotations`` maps image id (``str``, as in :class:`Sample`) to the scene dict of
    ``annotations.json`` (objects, relations, captions) for the scenes of this split (the truth of its captions);
    :meth:`boxes` reads the world's boxes as every other box file is read.
    """

    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        max_pixels: int | None = None,
        unusual: Unusual = "convert",
    ):
        root = Path(root)
        coco = root / f"{split}_coco.json"
        if not coco.is_file():
            found = sorted(p.name[: -len("_coco.json")] for p in root.glob("*_coco.json"))
            raise FileNotFoundError(f"toy world {root} has no split {split!r} ({coco} missing); splits found: {found}")
        super().__init__(coco, image_root=root, max_pixels=max_pixels, unusual=unusual)
        self.name = f"{root.name}:{split}"
        self.split = split
        self.root = root
        self.annotations = _scenes(root / "annotations.json", split)

    def boxes(self, max_missing: float | None = None):
        """The world's boxes (:func:`extract.data.boxes.read_boxes` of its folder: every split's scenes)."""
        from extract.data.boxes import read_boxes

        return read_boxes(self.root, max_missing=max_missing)


def _scenes(path: Path, split: str) -> dict[str, dict]:
    from extract.common.json_memo import read_json

    scenes = read_json(_existing_file(path, "toy world annotations"))["scenes"]
    return {str(scene["image_id"]): scene for scene in scenes if scene.get("split") == split}


def _existing_file(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} not found (check the path, or the current directory)")
    return path


# --------------------------------------------------------------------------- a folder of images


class ImageFolderSource(IndexedSource):
    """Every image under a folder, recursively, without captions: what people index first for search.

    Images are the files with an :data:`IMAGE_SUFFIXES` extension (any case), in sorted path order; files and
    folders whose name starts with a dot (``.thumbnails``, ``.ipynb_checkpoints``) are passed over. Image id:
    the path relative to the folder, with ``/`` separators (``cats/001.jpg``); location: the file's path.
    Every sample has ``captions == ()``; an image that fails to decode is reported and skipped as in the other
    sources. A folder without any image raises ValueError.
    """

    has_captions = False

    def __init__(self, root: str | Path, max_pixels: int | None = None, unusual: Unusual = "convert"):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder {self.root} not found (check the path, or the current directory)")
        # the folder's own name, not the spelling of the path (the cache fingerprint covers the resolved paths)
        super().__init__(self.root.resolve().name or str(self.root), self.root, max_pixels, unusual)

    def _index(self, builder: _RecordBuilder) -> None:  # records() is overridden: nothing to declare
        raise NotImplementedError

    def records(self) -> list[ImageRecord]:
        if self._records is None:
            found = [ImageRecord(rel, str(self.root / rel), (), str(self.root / rel)) for rel in image_files(self.root)]
            if not found:
                raise ValueError(f"{self.root} holds no image ({', '.join(sorted(IMAGE_SUFFIXES))}, searched "
                                 "recursively)")
            self._records = found
        return list(self._records)


def image_files(root: str | Path, first_only: bool = False) -> list[str]:
    """Relative ``/``-separated paths of the image files under ``root`` (see :class:`ImageFolderSource`), sorted;
    with ``first_only`` at most one (a cheap "has images?" probe of a large folder)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = os.path.relpath(folder, root)
        for name in sorted(files):
            if not name.startswith(".") and Path(name).suffix.lower() in IMAGE_SUFFIXES:
                found.append(name if rel == "." else f"{Path(rel).as_posix()}/{name}")
                if first_only:
                    return found
    return sorted(found)


# --------------------------------------------------------------------------- webdataset shards


class WebDatasetSource(DataSource):
    """Local webdataset shards, read in order with ``tarfile`` in streaming mode.

    Members are grouped by key (path up to the first dot of the file name; consecutive members
    only, as webdataset does). A sample needs an image (``jpg``, ``jpeg``, ``png`` or ``webp``, first
    found in that order) and captions: the ``.json`` ``"captions"`` list if present, else the
    ``.txt`` text, else the ``.json`` ``"caption"`` or ``"text"`` field -- one of them, never both,
    because img2dataset writes the same caption to ``.txt`` and ``.json``.

    Image id: the key; caption id: ``"{key}#{k}"`` (k counts the sample's captions, bad ones
    included); location: ``"{shard}::{key}"``. A damaged shard is reported (with the sample that
    was being read) and reading goes on with the next shard. Tarfile's stream reader ends silently
    at a bad header, so where it stopped is checked: anything but a clean end-of-archive marker is
    reported as a damaged shard.
    """

    IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")

    def __init__(
        self,
        shards: str | Path | Sequence[str | Path],
        max_pixels: int | None = None,
        unusual: Unusual = "convert",
    ):
        self.shards = expand_shards(shards)
        if not self.shards:
            raise ValueError(f"no shards found for {shards!r}: give .tar files, a folder of them or a pattern")
        name = str(shards) if isinstance(shards, (str, Path)) else f"{self.shards[0]} and {len(self.shards) - 1} more"
        super().__init__(name, max_pixels, unusual)

    def __iter__(self) -> Iterator[Sample]:
        for shard in self.shards:
            for key, files in self.raw_samples(shard):
                sample = self.to_sample(shard, key, files)
                if sample is not None:
                    yield sample

    def raw_samples(self, shard: str, skip: int = 0) -> Iterator[tuple[str, dict[str, bytes]]]:
        """The shard's samples, undecoded and unchecked, in order: ``(key, {extension: bytes})``.

        The first ``skip`` samples are passed over without reading their data (the bytes still stream
        past). A missing or damaged shard is recorded in ``report`` (with the sample that was being
        read, unless it was among the skipped) and ends the shard; the samples before the damage are
        given. ``count_samples`` counts exactly these samples.
        """
        key, files, index = None, {}, 0
        try:
            for member_key, ext, read in _members(shard):
                if member_key != key:
                    # A new key's header was read, so every member of the previous key was too.
                    if key is not None:
                        if index >= skip:
                            yield key, files
                        index += 1
                    key, files = member_key, {}
                if index >= skip:
                    files.setdefault(ext, read())
        except FileNotFoundError:
            self.report.add(Skip("shard", shard, shard, "file not found"))
            return
        except (tarfile.TarError, OSError, EOFError) as e:  # gzip/zlib/lzma errors included
            self.report.add(Skip("shard", shard, shard, "corrupt or truncated shard", f"{type(e).__name__}: {e}"))
            if key is not None and index >= skip:  # some of its members may be lost
                self.report.add(Skip("image", key, f"{shard}::{key}", "incomplete sample in damaged shard"))
            return
        if key is not None and index >= skip:
            yield key, files

    @staticmethod
    def count_samples(shard: str) -> int:
        """How many samples ``raw_samples(shard)`` gives, read from the member headers without keeping any
        data; 0 for a missing or unreadable shard. Records nothing."""
        key, complete = None, 0
        try:
            for member_key, _, _ in _members(shard):
                if member_key != key:
                    complete += key is not None
                    key = member_key
        except (tarfile.TarError, OSError, EOFError):  # the sample being read is lost, as in raw_samples
            return complete
        return complete + (key is not None)

    def to_sample(self, shard: str, key: str, files: dict[str, bytes]) -> Sample | None:
        """Check and decode one raw sample (see ``raw_samples``): the Sample, or None with every refusal (and
        a conversion note) recorded in ``report``."""
        location = f"{shard}::{key}"
        image_ext = next((ext for ext in self.IMAGE_EXTENSIONS if ext in files), None)
        if image_ext is None:
            self.report.add(Skip("image", key, location, "no image in sample", f"files: {sorted(files)}"))
            return None
        raws = self._raw_captions(key, location, files)
        captions = [
            c for k, raw in enumerate(raws) if (c := _checked_caption(self.report, f"{key}#{k}", raw, location))
        ]
        if not captions:
            detail = f"{len(raws)} rejected" if raws else "no caption given"
            self.report.add(Skip("image", key, location, "no valid caption", detail))
            return None
        try:
            decoded = self._decode(files[image_ext])
        except BadImage as e:
            self.report.add(Skip.from_error("image", key, location, e))
            return None
        if decoded.note is not None:
            self.report.note(key, location, decoded.note)
        return Sample(key, decoded.image, tuple(captions), decoded.note, location)

    def _raw_captions(self, key: str, location: str, files: dict[str, bytes]) -> list[object]:
        meta = self._json(key, location, files["json"]) if "json" in files else {}
        if "captions" in meta:
            captions = meta["captions"]
            return list(captions) if isinstance(captions, list) else [captions]
        if "txt" in files:
            return [files["txt"].decode("utf-8-sig", errors="surrogateescape")]
        for field_name in ("caption", "text"):
            if field_name in meta:
                return [meta[field_name]]
        return []

    def _json(self, key: str, location: str, data: bytes) -> dict:
        try:
            meta = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.report.add(Skip("caption", f"{key}.json", location, "unreadable caption JSON", str(e)))
            return {}
        return meta if isinstance(meta, dict) else {}


# webdataset's rule: the key is the path up to the first dot of the file name.
_KEY_AND_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


class _StopProbe(tarfile.TarInfo):
    """Records, on its ``_ProbedTarFile``, the header error that ended a stream listing."""

    @classmethod
    def fromtarfile(cls, tf: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tf)
        except tarfile.HeaderError as e:
            tf.stop_error = e
            raise


class _ProbedTarFile(tarfile.TarFile):
    stop_error: tarfile.HeaderError | None = None


def _members(shard: str) -> Iterator[tuple[str, str, Callable[[], bytes]]]:
    """Yield ``(key, lower-case extension, read)`` for a shard's files, in order; ``read()`` returns
    the member's bytes and must be called before the next item is requested. Raises
    ``tarfile.ReadError`` if the listing did not end at an end-of-archive marker (a cut file, a
    corrupt header)."""
    with _ProbedTarFile.open(shard, mode="r|*", tarinfo=_StopProbe) as tf:
        for member in tf:
            match = _KEY_AND_EXT.match(member.name) if member.isfile() else None
            if match:
                yield match.group(1), match.group(2).lower(), tf.extractfile(member).read
        stop = tf.stop_error
    # EOFHeaderError is the all-zero block that ends an intact archive.
    if stop is not None and not isinstance(stop, tarfile.EOFHeaderError):
        raise tarfile.ReadError(f"reading stopped early at a bad header ({stop})")


def expand_shards(shards: str | Path | Sequence[str | Path]) -> list[str]:
    """Shard paths for a list (each item expanded), a folder (its shard files, sorted), a brace
    pattern like ``shards/{000..009}.tar``, or one path. Paths are not checked for existence."""
    if isinstance(shards, (list, tuple)):
        return [path for item in shards for path in expand_shards(item)]
    text = str(shards)
    if Path(text).is_dir():
        return sorted(str(p) for p in Path(text).iterdir() if p.name.endswith(SHARD_SUFFIXES))
    if _is_brace_pattern(text):
        try:
            from braceexpand import braceexpand
        except ImportError:
            raise ImportError("shard patterns need braceexpand: pip install braceexpand (webdataset installs it)") from None
        return list(braceexpand(text))
    return [text]


def _is_brace_pattern(text: str) -> bool:
    return "{" in text and "}" in text


# --------------------------------------------------------------------------- choosing a source


# CSVSource's own options: the other sources ignore them (see open_source)
CSV_OPTIONS = ("img_key", "caption_key", "sep", "encoding")


def open_source(spec: str | Path, **options: Any) -> DataSource:
    """The data source for ``spec``; ``options`` go to its constructor.

    ``.csv`` / ``.tsv`` -> :class:`CSVSource`; ``.json`` -> :class:`COCOSource`; a folder with
    ``meta.json`` and ``annotations.json`` -> :class:`ToyWorldSource` (option ``split``); a shard
    file (``.tar``, ``.tar.gz``, ``.tgz``), a brace pattern or a folder of shards ->
    :class:`WebDatasetSource`; any other folder holding images (at any depth) ->
    :class:`ImageFolderSource` (images without captions; options other than ``max_pixels`` and
    ``unusual`` do not apply to it and are ignored). The CSV options (``CSV_OPTIONS``: ``img_key``, ``caption_key``,
    ``sep``, ``encoding``, i.e. :func:`extract.common.source_args.source_options`) reach CSV/TSV tables
    only, so a command can pass its ``--csv-*`` flags whatever the spec (as open_clip does).
    """
    text = str(spec)
    path = Path(text)
    if path.suffix.lower() not in (".csv", ".tsv") or path.is_dir():
        options = {k: v for k, v in options.items() if k not in CSV_OPTIONS}
    if path.is_dir():
        if is_toyworld(path):
            return ToyWorldSource(path, **options)
        if expand_shards(path):
            return WebDatasetSource(path, **options)
        if image_files(path, first_only=True):
            return ImageFolderSource(path, **{k: v for k, v in options.items() if k in ("max_pixels", "unusual")})
    elif _is_brace_pattern(text) or text.lower().endswith(SHARD_SUFFIXES):
        return WebDatasetSource(text, **options)
    elif path.suffix.lower() in (".csv", ".tsv"):
        return CSVSource(path, **options)
    elif path.suffix.lower() == ".json":
        return COCOSource(path, **options)
    problem = "does not exist" if not path.exists() else "is no data source this toolkit reads"
    raise ValueError(
        f"{text!r} {problem}. Give a .csv/.tsv caption table (columns "
        f"filepath,title), a COCO captions .json, a toy world folder (with meta.json and "
        f"annotations.json), webdataset shards (a .tar file, a folder of .tar files or a pattern "
        f"like 'shards/{{000..009}}.tar') or a folder of images (no captions: for search indices)"
    )


# --------------------------------------------------------------------------- torch DataLoader


@dataclass(frozen=True)
class Item:
    """A good dataset item: ``image`` is the transformed image (a tensor for the usual transforms)."""

    image_id: str
    image: Any
    captions: tuple[Caption, ...]
    location: str
    note: str | None = None


class SampleDataset(torch.utils.data.Dataset):
    """Map-style dataset over an indexed source whose items are :class:`Item` or :class:`Skip`.

    A bad image becomes a ``Skip`` marker instead of an exception, so DataLoader workers (separate
    processes with their own copy of the source and its report) hand every refusal back to the
    main process through :func:`collate_skipping`. Index-time refusals (captions, "no valid
    caption") are in ``source.report`` already, built when this dataset is created.
    """

    def __init__(self, source: IndexedSource, transform: Callable[[Image.Image], Any] | None = None,
                 records: Sequence[ImageRecord] | None = None):
        """``records``: a subset of ``source.records()`` (e.g. one cache shard); default all of them."""
        self.source = source
        self.transform = transform
        self.records = list(records) if records is not None else source.records()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Item | Skip:
        record = self.records[index]
        try:
            sample = self.source.load(record)
        except BadImage as e:
            return Skip.from_error("image", record.image_id, record.location, e)
        image = sample.image if self.transform is None else self.transform(sample.image)
        return Item(record.image_id, image, record.captions, record.location, sample.note)


def collate_skipping(batch: Sequence[Item | Skip]) -> tuple[dict[str, Any], list[Skip]]:
    """Split a batch into ``(good, skips)``.

    ``good`` has ``images`` (stacked when every image is a tensor, a list otherwise, None when the
    batch has no good item), and lists ``image_ids``, ``captions`` (tuples of :class:`Caption`),
    ``locations`` and ``notes``. Pass both to ``SkipReport.add_batch`` to keep the report whole.
    """
    items = [x for x in batch if isinstance(x, Item)]
    skips = [x for x in batch if isinstance(x, Skip)]
    images: Any = [item.image for item in items]
    if not images:
        images = None
    elif all(isinstance(image, torch.Tensor) for image in images):
        images = torch.stack(images)
    good = {
        "images": images,
        "image_ids": [item.image_id for item in items],
        "captions": [item.captions for item in items],
        "locations": [item.location for item in items],
        "notes": [item.note for item in items],
    }
    return good, skips
