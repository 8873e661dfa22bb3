"""CSV / TSV image-caption files (open_clip's ``filepath`` / ``title`` columns): rows naming the same path are one
image with several captions; malformed rows, undecodable text and unreadable images are skipped and reported."""
from __future__ import annotations

import codecs
import csv
import difflib
from pathlib import Path
from typing import Any, Iterator


from extract.data.images import Unusual
from extract.data.report import Skip
from extract.data.records import IMAGE_SUFFIXES, IndexedSource, RecordBuilder, existing_file


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
        self.path = existing_file(path, "caption table")
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

    def _index(self, builder: RecordBuilder) -> None:
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

    def _record_inside(self, lines: list[str], width: int, img_col: int, builder: RecordBuilder) -> int | None:
        """Index of the first continuation line of a multi-line record that reads as a record of its own."""
        for index in range(1, len(lines)):
            try:
                rows = list(csv.reader([lines[index]], delimiter=self.sep, strict=True))
            except csv.Error:  # an open quote, or text after a closing one: not a record on its own
                continue
            if len(rows) == 1 and len(rows[0]) == width and self._looks_like_image(rows[0][img_col], builder):
                return index
        return None

    def _looks_like_image(self, value: str, builder: RecordBuilder) -> bool:
        if not value.strip() or value != value.strip() or "\n" in value:
            return False
        return (value in builder or Path(value).suffix.lower() in IMAGE_SUFFIXES
                or (self.image_root / value).is_file())

    def _index_row(
        self, builder: RecordBuilder, row: list[str], width: int, img_col: int, cap_col: int, line: int
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
