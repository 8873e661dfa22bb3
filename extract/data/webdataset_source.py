"""Local webdataset ``.tar`` shards, read in streaming mode: samples as the shards hold them, truncated or
malformed members skipped and reported, brace patterns expanded."""
from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path
from typing import Callable, Iterator, Sequence


from extract.data.images import BadImage, Unusual
from extract.data.report import Skip
from extract.data.records import checked_caption, DataSource, Sample


SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


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
            c for k, raw in enumerate(raws) if (c := checked_caption(self.report, f"{key}#{k}", raw, location))
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
    if is_brace_pattern(text):
        try:
            from braceexpand import braceexpand
        except ImportError:
            raise ImportError("shard patterns need braceexpand: pip install braceexpand (webdataset installs it)") from None
        return list(braceexpand(text))
    return [text]


def is_brace_pattern(text: str) -> bool:
    return "{" in text and "}" in text
