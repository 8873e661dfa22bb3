"""Ground-truth boxes of images: the one reader of box files, and what a run does about images a file leaves out.

Formats, told apart by their content and named in every message and log line about them (a run over a
collection: ``boxes: captions_val2017.json: all 5,000 images have an entry in instances_val2017.json (COCO
instances)``; on reading, at ``--verbose``: ``boxes: objects.json read as Visual Genome objects.json: 2 images, 3
objects``):

- **COCO instances** (``instances_*.json``): ``{"images": [{id, file_name, width, height}], "annotations":
  [{image_id, bbox: [x, y, w, h], category_id}], "categories": [{id, name}]}``. Every image listed in ``images``
  has an entry; one without annotations holds zero objects. Boxes become Visual-Genome-like objects ``{x, y, w,
  h, names: [category name]}`` at load time, so :func:`extract.components.regions.gt_boxes` reads every format.
- **Visual Genome** ``objects.json``: a list of ``{"image_id", "objects": [{x, y, w, h, names | name}]}``, or
  ``{"images": [...]}`` of those.
- **a toy world**: its folder or its ``annotations.json`` (every split's scenes; the scenes of its controlled tests,
  ``controlled.json`` or the hard world's ``controlled_a.json`` / ``controlled_b.json``, by file name).
- **a dict** ``{image id: {"objects": [...]}}`` (the Python API), objects in either of the forms above.

Refused with a sentence saying what file is expected: a COCO captions file (annotations without ``bbox``) and
JSON of any other shape. An entry is found by the image's id (``str(id)``: ints and strings alike) or, for an
image known by its path, by the file's base name where the entry names its file (``file_name``, ``url``,
``image``, ``image_url``). An entry with an empty object list is a legitimate "zero objects"; no entry at all is
:class:`MissingBoxes`, an error naming the file and the image, never a silent "no boxes".

A run over a collection (extraction, evaluation, an index build) counts the images without an entry first
(:meth:`BoxAnnotations.check`, or :class:`Coverage` for a stream whose images are known only as they come): the
count goes to the log, and the run stops once their share passes ``--max-missing-boxes``; a file that matches no
image of the collection is refused whatever the share.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable

from extract.common.cli import say
from extract.worlds.shared import CONTROLLED_FILE, CONTROLLED_FILES

__all__ = ["BoxAnnotations", "Coverage", "DEFAULT_MAX_MISSING", "MAX_MISSING_HELP", "MissingBoxes", "judge", "read_boxes"]

#: the share of a collection's images a box file may leave out (their components are then empty) before a run
#: stops. 0: a box file meant for a collection covers all of it (COCO instances list images without objects, Visual
#: Genome gives them an empty list, a toy world has every scene), so an image missing from it is far more often a
#: sign of the wrong file (another split, another dataset) than of a real gap, and a model scoring it without its
#: boxes is wrong in silence; a user who knows the file has gaps says how many are fine.
DEFAULT_MAX_MISSING = 0.0
MAX_MISSING_HELP = ("share of the images, in [0, 1), a box file may leave out: they are counted in the log and get no "
                    "boxes; past it the run stops (0: every image needs an entry; an entry with no objects counts)")
EXPECTED = ("a box file: COCO instances (instances_*.json: images, annotations with bbox [x, y, w, h] and "
            "category_id, categories), Visual Genome objects.json, or a toy-world folder")
_NAME_FIELDS = ("file_name", "url", "image", "image_url")
_NO_OBJECTS: dict = {"objects": []}


class MissingBoxes(ValueError):
    """An image the box file holds no entry for (the message names the file and the image)."""


class BoxAnnotations:
    """Entries (``{"objects": [...]}``) of one box file by image id and by file name (module docstring).

    ``source``: the file as named in messages; ``format``: what it was read as; ``max_missing``: the share a
    collection's check tolerates.
    """

    def __init__(self, source: str, format: str, max_missing: float = DEFAULT_MAX_MISSING):
        self.source, self.format, self.max_missing = source, format, max_missing
        self._by_id: dict[str, dict] = {}
        self._by_name: dict[str, dict] = {}
        self._id_of_name: dict[str, str] = {}
        self.entries: list[dict] = []  # each image's entry once, in file order

    def add(self, image_id: Any, entry: dict) -> None:
        """Enter ``entry`` under ``str(image_id)`` (None: by its file name only) and under its file's base name."""
        self.entries.append(entry)
        if image_id is not None:
            self._by_id.setdefault(str(image_id), entry)
        for field in _NAME_FIELDS:
            if isinstance(entry.get(field), str) and entry[field]:
                name = os.path.basename(entry[field])
                self._by_name.setdefault(name, entry)
                if image_id is not None:
                    self._id_of_name.setdefault(name, str(image_id))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def described(self) -> str:
        """``FILE (FORMAT)``, as messages name it."""
        return f"{self.source} ({self.format})"

    def find(self, key: Any) -> dict | None:
        """The entry of an image known by ``key`` (its id, or a path matched by base name); None without one."""
        key = str(key)
        found = self._by_id.get(key)
        return found if found is not None else self._by_name.get(os.path.basename(key))

    def has(self, key: Any) -> bool:
        return self.find(key) is not None

    def image_id(self, key: Any) -> str:
        """The id of the entry that names ``key``'s file (a path -> the annotated image's id, which seeds its random
        regions as in the cache), else ``str(key)``."""
        key = str(key)
        if key in self._by_id:
            return key
        return self._id_of_name.get(os.path.basename(key), key)

    def entry(self, key: Any, missing: str = "error") -> dict:
        """The entry of ``key``; with no entry, :class:`MissingBoxes` (``missing="error"``) or no objects
        (``missing="empty"``: for callers that counted and reported such images themselves)."""
        found = self.find(key)
        if found is not None:
            return found
        if missing == "empty":
            return _NO_OBJECTS
        if missing != "error":
            raise ValueError(f"missing must be 'error' or 'empty', got {missing!r}")
        raise self.missing(key)

    def missing(self, key: Any) -> MissingBoxes:
        """The error for an image without an entry."""
        return MissingBoxes(f"{self.described} holds no boxes for image {str(key)!r}: a model that reads "
                            "ground-truth boxes needs an entry for every image it scores (by image id, or by file "
                            "name where entries name their files; an entry with no objects is a legitimate zero). "
                            "Give the box file of these images (--annotations FILE / annotations=FILE), or detect "
                            "the boxes instead (--detector WEIGHTS.pt / detector=WEIGHTS.pt)")

    def examples(self, n: int = 3) -> list[str]:
        """A few of the file's image ids (or file names), for messages."""
        return list(self._by_id)[:n] or list(self._by_name)[:n]

    def check(self, keys: Iterable[Any], collection: str) -> list[str]:
        """Count the images of ``collection`` (known by ``keys``) without an entry, log the count and raise
        ValueError when none has one or their share passes :attr:`max_missing`. Returns the missing keys."""
        coverage = Coverage(self, collection)
        coverage.add(keys)
        coverage.close()
        return coverage.missing

    def coverage(self, collection: str) -> "Coverage":
        """A :class:`Coverage` of ``collection``: for images that come one batch at a time (a stream)."""
        return Coverage(self, collection)


class Coverage:
    """Which images of one collection a box file covers: :meth:`add` the images' keys as they come (before they are
    extracted), :meth:`close` when all have come: it logs the count and raises as :meth:`BoxAnnotations.check`."""

    def __init__(self, boxes: BoxAnnotations, collection: str):
        self.boxes, self.collection = boxes, collection
        self.total, self.missing = 0, []

    def add(self, keys: Iterable[Any]) -> None:
        for key in keys:
            self.total += 1
            if not self.boxes.has(key):
                self.missing.append(str(key))

    def close(self) -> None:
        judge(self.boxes, self.collection, self.total, len(self.missing), self.missing[:3])


def judge(boxes: BoxAnnotations, collection: str, total: int, missing: int, examples: list[str]) -> None:
    """The verdict of a collection's coverage (:class:`Coverage`; shard counts merged by the extraction)."""
    if total == 0:
        return
    share, limit = missing / total, boxes.max_missing
    if missing == 0:
        say(f"boxes: {collection}: all {total:,} images have an entry in {boxes.described}")
        return
    shown = ", ".join(repr(e) for e in examples)
    if missing == total:
        raise ValueError(
            f"{collection}: none of the {total:,} images has an entry in {boxes.described} (its images are "
            f"e.g. {', '.join(repr(e) for e in boxes.examples()) or 'none'}; the collection's e.g. {shown}): expected "
            f"the box file of this collection, {EXPECTED}, whose image ids or file names are the collection's")
    counted = (f"{collection}: {missing:,} of {total:,} images ({share:.2%}) have no entry in {boxes.described}, "
               f"e.g. {shown}")
    if share > limit:
        raise ValueError(f"{counted}: more than --max-missing-boxes {limit:g} allows. Give the box file of this "
                         "collection, or raise --max-missing-boxes to go on with those images boxless")
    print(f"boxes: {counted}; within --max-missing-boxes {limit:g}: they get no boxes")


# --------------------------------------------------------------------------------------------- reading
def read_boxes(spec, max_missing: float | None = None) -> BoxAnnotations | None:
    """The boxes ``spec`` names: a file or toy-world folder (path), a dict keyed by image id, a
    :class:`BoxAnnotations` (returned as is, its ``max_missing`` set when given) or None (None). Raises
    FileNotFoundError for a path that does not exist and ValueError, saying what is expected, for anything that is
    no box file."""
    if spec is None:
        return None
    if isinstance(spec, BoxAnnotations):
        out = spec
    elif isinstance(spec, dict):
        out = _from_dict(spec)
    else:
        out = _from_path(Path(spec))
        objects = sum(len(e.get("objects") or ()) for e in out.entries)
        # the library log (--verbose): a scorer loaded for one query must not print into serve.query's output
        logging.getLogger(__name__).info("boxes: %s read as %s: %s images, %s objects", out.source, out.format,
                                         f"{len(out):,}", f"{objects:,}")
    if max_missing is not None:
        out.max_missing = max_missing
    return out


def _from_dict(spec: dict) -> BoxAnnotations:
    out = BoxAnnotations("the boxes given as a dict", "dict keyed by image id")
    for key, entry in spec.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("objects", []), list):
            raise ValueError(f"boxes given as a dict: the entry of {key!r} is not {{'objects': [...]}} (a dict of "
                             "boxes maps image ids to entries such as a toy-world scene or a Visual Genome image)")
        out.add(key, entry)
    return out


def _from_path(path: Path) -> BoxAnnotations:
    from extract.common.json_memo import read_json

    if path.is_dir():
        if not (path / "annotations.json").is_file():
            raise ValueError(f"{path} is a folder without annotations.json: a folder of boxes is a toy world; "
                             f"otherwise give the file itself ({EXPECTED})")
        path = path / "annotations.json"
    if not path.is_file():
        raise FileNotFoundError(f"box annotations {path}: no such file or toy-world folder")
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"box annotations {path}: cannot read JSON ({e}); expected {EXPECTED}") from e
    if isinstance(data, dict) and isinstance(data.get("scenes"), list):
        return _toy_world(path, data)
    if isinstance(data, dict) and isinstance(data.get("annotations"), list) and isinstance(data.get("images"), list):
        return _coco(path, data)
    entries = data.get("images") if isinstance(data, dict) else data
    if isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("objects"), list) for e in entries):
        return _visual_genome(path, entries)
    raise ValueError(f"{path} is not a box file plugvlm reads: expected {EXPECTED}")


def _toy_world(path: Path, data: dict) -> BoxAnnotations:
    from extract.common.json_memo import read_json
    from extract.worlds.hardworld import crop_entry

    out = BoxAnnotations(str(path.parent if path.name == "annotations.json" else path), "toy world")
    for scene in data["scenes"]:
        out.add(scene["image_id"], scene)
        for obj in scene.get("objects", []):
            if isinstance(obj, dict) and isinstance(obj.get("crop"), str):  # a hard / 3D world's zero-shot crops
                out.add(None, crop_entry(obj))
    for name in (CONTROLLED_FILE, *CONTROLLED_FILES.values()):  # version 2's test, the hard world's two
        controlled = path.parent / name
        if controlled.is_file():  # the controlled tests' scenes have no id: found by file name
            for entry in read_json(controlled).get("sets", []):
                for scene in entry.get("scenes", []):
                    out.add(None, scene)
    return out


def _visual_genome(path: Path, entries: list) -> BoxAnnotations:
    out = BoxAnnotations(str(path), "Visual Genome objects.json")
    for k, entry in enumerate(entries):
        for j, obj in enumerate(entry["objects"]):
            if not isinstance(obj, dict) or not all(isinstance(obj.get(c), (int, float)) for c in "xywh") or not (
                    obj.get("names") or obj.get("name")):
                raise ValueError(f"{path}: entry {k}, object {j} is not {{x, y, w, h, names | name}} (Visual Genome "
                                 "objects.json)")
        out.add(entry.get("image_id", entry.get("id")), entry)
    return out


def _coco(path: Path, data: dict) -> BoxAnnotations:
    annotations = data["annotations"]
    boxed = sum(1 for a in annotations if isinstance(a, dict) and "bbox" in a)
    if not boxed and "categories" not in data:
        what = ("a COCO captions file (its annotations have captions, no bbox)"
                if any(isinstance(a, dict) and "caption" in a for a in annotations) else
                "a COCO file without boxes (no annotation has a bbox)")
        raise ValueError(f"{path} is {what}: boxes come from {EXPECTED}, e.g. instances_val2017.json next to "
                         "captions_val2017.json")
    names = {c.get("id"): str(c.get("name", c.get("id"))) for c in data.get("categories") or [] if isinstance(c, dict)}
    out = BoxAnnotations(str(path), "COCO instances")
    by_id: dict[str, dict] = {}
    for k, image in enumerate(data["images"]):
        if not isinstance(image, dict) or "id" not in image:
            raise ValueError(f"{path}: images[{k}] has no id (COCO instances: images [{{id, file_name, width, "
                             "height}]")
        entry = {"image_id": image["id"], "file_name": image.get("file_name"), "width": image.get("width"),
                 "height": image.get("height"), "objects": []}
        by_id.setdefault(str(image["id"]), entry)
    for k, a in enumerate(annotations):
        box = a.get("bbox") if isinstance(a, dict) else None
        if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
            raise ValueError(f"{path}: annotations[{k}] has no bbox [x, y, w, h] (COCO instances)")
        entry = by_id.get(str(a.get("image_id")))
        if entry is None:
            raise ValueError(f"{path}: annotations[{k}] names image {a.get('image_id')!r}, which images does not "
                             "list (COCO instances list every image they annotate)")
        x, y, w, h = box
        entry["objects"].append({"x": x, "y": y, "w": w, "h": h,
                                 "names": [names.get(a.get("category_id"), str(a.get("category_id", "object")))]})
    for key, entry in by_id.items():
        out.add(key, {k: v for k, v in entry.items() if v is not None})
    return out
