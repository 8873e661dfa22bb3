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

The records and the interface are in ``extract.data.records``; the CSV reader ``extract.data.csv_source``, the
shard reader ``extract.data.webdataset_source``. All but the webdataset source are *indexed*: ``records()`` lists the images and their captions without decoding
anything, and ``load(record)`` decodes one, which :class:`SampleDataset` uses to feed a multi-worker
``torch.utils.data.DataLoader`` whose workers return skip markers instead of raising.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from PIL import Image

from extract.data.images import BadImage, Unusual
from extract.data.report import Note, Skip, SkipReport
from extract.worlds.toyworld import is_toyworld
from extract.data.csv_source import CSVSource
from extract.data.records import (IMAGE_SUFFIXES, Caption, DataSource, ImageRecord, IndexedSource, RecordBuilder, Sample,
                                  existing_file)
from extract.data.webdataset_source import expand_shards, is_brace_pattern, SHARD_SUFFIXES, WebDatasetSource


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
        self.path = existing_file(path, "COCO captions file")
        root = Path(image_root) if image_root is not None else self.path.parent
        super().__init__(self.path.name, root, max_pixels, unusual)

    def _index(self, builder: RecordBuilder) -> None:
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

    def _index_image(self, builder: RecordBuilder, position: int, entry: object) -> None:
        valid = isinstance(entry, dict) and "id" in entry and isinstance(entry.get("file_name"), str)
        image_id = str(entry["id"]) if valid else f"images[{position}]"
        location = f"{self.path}:image {image_id}"
        if not valid:
            self.report.add(Skip("image", image_id, location, "malformed image entry", "needs id and file_name"))
        elif image_id in builder:
            self.report.add(Skip("image", image_id, location, "duplicate image id", f"images[{position}]"))
        else:
            builder.add_image(image_id, entry["file_name"], location)

    def _index_annotation(self, builder: RecordBuilder, position: int, annotation: object) -> None:
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

    scenes = read_json(existing_file(path, "toy world annotations"))["scenes"]
    return {str(scene["image_id"]): scene for scene in scenes if scene.get("split") == split}


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

    def _index(self, builder: RecordBuilder) -> None:  # records() is overridden: nothing to declare
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
    elif is_brace_pattern(text) or text.lower().endswith(SHARD_SUFFIXES):
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
