"""What every data source yields and the interface they share: :class:`Sample` (an image with all of its
valid captions), :class:`ImageRecord` (an indexed image, not yet decoded), :class:`DataSource` and
:class:`IndexedSource` (``records()`` / ``load(record)``), and the builder that pairs captions with images by
identifier (``extract.data.sources`` for the sources themselves)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from PIL import Image

from extract.data.images import BadCaption, BadImage, DecodedImage, Unusual, decode_image, validate_caption
from extract.data.report import Skip, SkipReport


IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})


def existing_file(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} not found (check the path, or the current directory)")
    return path


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


def checked_caption(report: SkipReport, caption_id: str, raw: object, location: str) -> Caption | None:
    """The caption if valid; otherwise None, with the refusal recorded in ``report``."""
    try:
        return Caption(caption_id, validate_caption(raw))
    except BadCaption as e:
        report.add(Skip.from_error("caption", caption_id, location, e))
        return None


# --------------------------------------------------------------------------- the interface


@dataclass(frozen=True)
class Entry:
    """An image of a source as evaluation reads it: ``key`` names it while it is encoded (an indexed image's path, a
    streamed one's id), ``load()`` gives its decoded pixels."""

    key: str
    image_id: str
    captions: list
    load: Callable[[], Image.Image]


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

    #: the truth of the captions by image id where the source knows it (a toy world's scenes), else None
    annotations: dict | None = None

    def entries(self) -> tuple[Iterable[Entry], int | None]:
        """Every image with its captions, its pixels decoded on demand: ``(entries, how many)``. A stream's entries
        are read as they come (how many: None); the source decodes them and reports its own skips."""
        def stream():
            for sample in self:
                yield Entry(sample.image_id, sample.image_id, sample.captions, lambda image=sample.image: image)

        return stream(), None

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
    def _index(self, builder: RecordBuilder) -> None:
        """Declare every image and caption of the source to ``builder``."""

    def records(self) -> list[ImageRecord]:
        """Every image with at least one valid caption, in source order (a fresh list each call)."""
        if self._records is None:
            builder = RecordBuilder(self.report, self.image_root)
            self._index(builder)
            self._records = builder.build()
        return list(self._records)

    def load(self, record: ImageRecord) -> Sample:
        """Decode ``record``'s image; raises :class:`BadImage` (missing file included)."""
        decoded = self._decode(record.source)
        return Sample(record.image_id, decoded.image, record.captions, decoded.note, record.location)

    def __len__(self) -> int:
        return len(self.records())

    def entries(self) -> tuple[list[Entry], int]:
        """Every record, listed before any is decoded; ``load()`` decodes one (raising :class:`BadImage`)."""
        records = self.records()
        return [Entry(r.source, r.image_id, r.captions, lambda r=r: self.load(r).image) for r in records], len(records)

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


class RecordBuilder:
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
        caption = checked_caption(self.report, caption_id, raw, location)
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
