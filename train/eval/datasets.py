"""Readers for compositional image-text benchmarks, each from its published file format, into one structure.

Every reader returns a :class:`Benchmark` of :class:`Item` objects; the scorer (``train.eval``) turns an
item into a score matrix ``s [len(images), len(texts)]`` and decides correctness from ``Benchmark.kind``:

- ``"text"``  -- one image; ``texts[0]`` is the true caption, ``texts[1:]`` false ones. Correct iff the true
  caption outscores every false one (ARO VG-Relation / VG-Attribution, SugarCrepe, What'sUp, the toy world).
- ``"image"`` -- one text ``texts[0]``; ``images[0]`` is the true image, ``images[1:]`` false ones. Correct
  iff the true image outscores every false one (SVO-Probes).
- ``"group"`` -- Winoground's 2x2: images ``(i0, i1)``, texts ``(c0, c1)``; c0 matches i0, c1 matches i1.
- ``"set"``   -- n images and n texts, text k true of image k alone (the toy world's What'sUp-style controlled
  sets): the share of images that pick their own text of the n, of texts that pick their own image, and whether
  all of both do (``train.eval.evaluate.item_correct``).
  Text score: each image prefers its own caption; image score: each caption prefers its own image; group
  score: both (Thrush et al. 2022, sec. 3.3).

Sources of the formats (read from the benchmarks' own loaders and data cards):

- SugarCrepe (Hsieh et al., NeurIPS 2023 D&B; github.com/RAIVNLab/sugar-crepe): ``data/{replace_obj,
  replace_att,replace_rel,swap_obj,swap_att,add_obj,add_att}.json``, each ``{"0": {"filename",
  "caption", "negative_caption"}, ...}``; images are COCO val2017 files under ``image_root``.
- ARO (Yuksekgonul et al., ICLR 2023, "When and why vision-language models behave like bags-of-words";
  github.com/mertyg/vision-language-models-are-bows, ``dataset_zoo/aro_datasets.py``):
  ``visual_genome_relation.json`` / ``visual_genome_attribution.json``, JSON lists of test cases with
  ``image_path``, ``true_caption``, ``false_caption`` and a box ``bbox_x/y/w/h`` that the images are
  cropped to before scoring (``Item.crop``); relation cases carry ``relation_name``, attribution cases
  ``attributes`` (two strings). ARO's loader joins ``image_path`` onto ``<root>/images``.
- Winoground (Thrush et al., CVPR 2022; huggingface.co/datasets/facebook/winoground): ``data/examples.jsonl``
  (``id, image_0, image_1, caption_0, caption_1, tag, secondary_tag, num_main_preds, collapsed_tag``) and
  ``data/images/<image_k>.png``.
- SVO-Probes (Hendricks & Nematzadeh, Findings of ACL 2021, "Probing Image-Language Transformers for Verb
  Understanding"; github.com/google-deepmind/svo_probes): ``svo_probes.csv`` with ``sentence, pos_triplet,
  neg_triplet, subj_neg, verb_neg, obj_neg, pos_url, neg_url, pos_image_id, neg_image_id``. Images are
  published only as URLs; we read local copies named by image id.
- What'sUp (Kamath, Hessel & Chang, EMNLP 2023, "What's 'up' with vision-language models? Investigating their
  struggle with spatial reasoning"; github.com/amitakamath/whatsup_vlms, ``dataset_zoo/aro_datasets.py``):
  Controlled-A ``controlled_images_dataset.json`` and Controlled-B ``controlled_clevr_dataset.json``, JSON lists
  of ``{"image_path", "caption_options": [4 strings]}`` (the first option true; images in ``controlled_images/``
  / ``controlled_clevr/``, ``image_path`` written relative to the authors' working directory, e.g.
  ``data/controlled_images/mug_on_table.jpeg``); COCO-spatial ``coco_qa_{one,two}_obj.json`` and GQA-spatial
  ``vg_qa_{one,two}_obj.json``, JSON lists of ``[image_id, true caption, false caption]`` (images
  ``val2017/<image_id zero-padded to 12>.jpg`` / ``vg_images/<image_id>.jpg``).
- The toy world (``extract.data.toyworld``): ``negatives.json`` and ``{split}_coco.json``.

Bad input contract
    Every reader parses and validates its whole file(s) before it looks at any image: a malformed file (bad
    JSON / JSONL / CSV, undecodable text, wrong top-level type, a missing key or column, a value of the wrong
    type, an empty caption) raises :class:`BenchmarkFormatError` naming the file and the place -- ``line N``
    (1-based physical line) for JSONL, CSV and JSON syntax errors, ``entry K`` (the list index, or the dict
    key for SugarCrepe) for a bad JSON entry. Only then are images checked: an item whose image file does
    not exist is left out of ``items`` and recorded in ``skipped`` as ``{"item_id", "reason": "missing
    image", "location", "image"}``; every other item still loads. A missing benchmark file raises
    FileNotFoundError. Extra keys and columns are ignored.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

__all__ = [
    "ARO_ATTRIBUTION_KEYS",
    "ARO_RELATION_KEYS",
    "Benchmark",
    "BenchmarkFormatError",
    "Item",
    "READERS",
    "SUGARCREPE_FILES",
    "SVO_COLUMNS",
    "WHATSUP_FILES",
    "WINOGROUND_KEYS",
    "read_aro_vg_attribution",
    "read_aro_vg_relation",
    "read_benchmark",
    "read_sugarcrepe",
    "read_svo_probes",
    "read_toyworld",
    "read_toyworld_controlled",
    "read_whatsup",
    "read_winoground",
    "whatsup_pair_and_set",
]

# SugarCrepe's seven files, in the order of the paper's table.
SUGARCREPE_FILES = ("replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att", "add_obj", "add_att")
ARO_RELATION_KEYS = ("image_id", "image_path", "relation_name", "true_caption", "false_caption",
                     "bbox_x", "bbox_y", "bbox_w", "bbox_h")
ARO_ATTRIBUTION_KEYS = ("image_id", "image_path", "true_caption", "false_caption",
                        "bbox_x", "bbox_y", "bbox_w", "bbox_h", "attributes")
# Keys the reader uses; the informational ones (tag, secondary_tag, num_main_preds) may be absent.
WINOGROUND_KEYS = ("id", "image_0", "image_1", "caption_0", "caption_1", "collapsed_tag")
SVO_COLUMNS = ("sentence", "pos_triplet", "neg_triplet", "subj_neg", "verb_neg", "obj_neg",
               "pos_url", "neg_url", "pos_image_id", "neg_image_id")
SVO_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
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
def _fail(path: Path, where: str, message: str) -> BenchmarkFormatError:
    return BenchmarkFormatError(f"{path}: {where}: {message}" if where else f"{path}: {message}")


def _read_text(path: Path) -> str:
    """The file's text (UTF-8, BOM dropped); undecodable bytes are a format error naming the line."""
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file not found: {path}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise _fail(path, f"line {line}", f"not UTF-8 text ({e.reason})") from None


def _load_json(path: Path) -> Any:
    """The parsed file (shared while unchanged: extract.common.json_memo; the readers never edit it); a file that
    does not read or parse plainly is read again here, to say where and why."""
    from extract.common.json_memo import read_json

    try:
        return read_json(path)
    except (OSError, ValueError):  # missing, not UTF-8, a byte-order mark, invalid: the careful path says which
        pass
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise _fail(path, f"line {e.lineno}", f"invalid JSON ({e.msg}, column {e.colno})") from None


def _text(path: Path, where: str, record: dict, key: str) -> str:
    """A required, non-empty string value (an empty caption or id is malformed, not skippable)."""
    if key not in record:
        raise _fail(path, where, f"missing key {key!r}")
    value = record[key]
    if not isinstance(value, str):
        raise _fail(path, where, f"{key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _fail(path, where, f"{key!r} is empty")
    return value


def _number(path: Path, where: str, record: dict, key: str) -> float:
    if key not in record:
        raise _fail(path, where, f"missing key {key!r}")
    value = record[key]
    # bool is an int subclass in Python; a true/false box coordinate is a broken file, not 0/1.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(path, where, f"{key!r} must be a finite number, got {value!r}")
    return float(value)


def _identifier(path: Path, where: str, record: dict, key: str) -> str:
    """An id that may be a number or a string (ARO image ids, Winoground ids)."""
    if key not in record:
        raise _fail(path, where, f"missing key {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, str) and not value.strip()):
        raise _fail(path, where, f"{key!r} must be an integer or a non-empty string, got {value!r}")
    return str(value)


def _object(path: Path, where: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise _fail(path, where, f"expected a JSON object, got {type(value).__name__}")
    return value


def _abspath(path: str | os.PathLike) -> str:
    # abspath, not resolve(): keep the user's symlinked dataset folders as they named them.
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


@dataclass(frozen=True)
class _Pending:
    """A validated item whose images are not checked yet (validation of the whole file comes first)."""

    item: Item
    location: str


def _finish(name: str, kind: str, pending: Iterable[_Pending], degenerate: Iterable[dict] = ()) -> Benchmark:
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


# --------------------------------------------------------------------------------------------- SugarCrepe
def _published_files(path: Path, stems: Iterable[str], name: str) -> list[Path]:
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


def _sugarcrepe_files(path: Path) -> list[Path]:
    return _published_files(path, SUGARCREPE_FILES, "SugarCrepe")


def read_sugarcrepe(path_or_dir: str | os.PathLike, image_root: str | os.PathLike | None = None) -> Benchmark:
    """SugarCrepe from one of its JSON files, or from a folder holding any of :data:`SUGARCREPE_FILES`.

    One "text" item per entry: ``texts = (caption, negative_caption)``, ``images = (image_root /
    filename,)``, ``subtype`` = the file stem (``replace_att`` ...), ``item_id`` = ``"<stem>/<key>"``.
    ``image_root`` is the COCO val2017 folder; without it filenames resolve against the JSON's folder.
    All files are validated before any image is checked (module docstring).
    """
    root = Path(path_or_dir).expanduser()
    pending = []
    for file in _sugarcrepe_files(root):
        data = _load_json(file)
        if not isinstance(data, dict):
            raise _fail(file, "", f"expected a JSON object keyed by entry id, got {type(data).__name__}")
        images = Path(image_root).expanduser() if image_root is not None else file.parent
        for key, raw in data.items():
            where = f"entry {key}"
            entry = _object(file, where, raw)
            filename = _text(file, where, entry, "filename")
            texts = (_text(file, where, entry, "caption"), _text(file, where, entry, "negative_caption"))
            item = Item(f"{file.stem}/{key}", (_abspath(images / filename),), texts, file.stem)
            pending.append(_Pending(item, f"{file}: {where}"))
    return _finish("sugarcrepe", "text", pending)


# --------------------------------------------------------------------------------------------- ARO
def _aro_image(file: Path, image_path: str, image_root: str | os.PathLike | None) -> str:
    if image_root is not None:
        # ARO's own layout is <root>/images/<image_path>; a flat folder of VG images is the common copy.
        return _abspath(Path(image_root).expanduser() / os.path.basename(image_path))
    candidate = Path(image_path).expanduser()
    if candidate.is_absolute():
        return _abspath(candidate)
    # Relative paths resolve against the JSON's folder (the project's rule for data files), else against
    # <folder>/images, which is where ARO's loader puts them.
    for base in (file.parent, file.parent / "images"):
        if (base / candidate).is_file():
            return _abspath(base / candidate)
    return _abspath(file.parent / candidate)


def _read_aro(path: str | os.PathLike, image_root, name: str, keys: tuple[str, ...],
              subtype_of: Callable[[Path, str, dict], str]) -> Benchmark:
    file = Path(path).expanduser()
    data = _load_json(file)
    if not isinstance(data, list):
        raise _fail(file, "", f"expected a JSON list of test cases, got {type(data).__name__}")
    parsed = []
    for index, raw in enumerate(data):
        where = f"entry {index}"
        entry = _object(file, where, raw)
        missing = [k for k in keys if k not in entry]
        if missing:
            raise _fail(file, where, f"missing key(s) {', '.join(map(repr, missing))}")
        _identifier(file, where, entry, "image_id")
        image_path = _text(file, where, entry, "image_path")
        texts = (_text(file, where, entry, "true_caption"), _text(file, where, entry, "false_caption"))
        crop = tuple(_number(file, where, entry, f"bbox_{k}") for k in "xywh")
        parsed.append((index, where, image_path, texts, crop, subtype_of(file, where, entry)))
    pending, degenerate = [], []
    for index, where, image_path, texts, crop, subtype in parsed:
        if crop[2] <= 0 or crop[3] <= 0:
            # A value problem in one case, not a broken file: exclude it (PIL would crop to nothing).
            degenerate.append({"item_id": str(index), "reason": "empty crop box", "location": f"{file}: {where}",
                               "image": image_path})
            continue
        item = Item(str(index), (_aro_image(file, image_path, image_root),), texts, subtype, crop)
        pending.append(_Pending(item, f"{file}: {where}"))
    return _finish(name, "text", pending, degenerate)


def _relation_subtype(file: Path, where: str, entry: dict) -> str:
    return _text(file, where, entry, "relation_name")


def _attribution_subtype(file: Path, where: str, entry: dict) -> str:
    attributes = entry["attributes"]
    if not isinstance(attributes, list) or not all(isinstance(a, str) for a in attributes):
        raise _fail(file, where, f"'attributes' must be a list of strings, got {attributes!r}")
    return "-".join(attributes) or "attribution"


def read_aro_vg_relation(path: str | os.PathLike, image_root: str | os.PathLike | None = None) -> Benchmark:
    """ARO VG-Relation (``visual_genome_relation.json``): one "text" item per list entry.

    ``texts = (true_caption, false_caption)``, ``subtype = relation_name``, ``crop = (bbox_x, bbox_y,
    bbox_w, bbox_h)``, ``item_id`` = the entry index. Image: ``image_root / basename(image_path)`` when
    ``image_root`` is given; else ``image_path`` itself if absolute, or relative to the JSON's folder
    (falling back to ``<folder>/images``, ARO's layout). A case with a non-positive box width or height
    is skipped with reason "empty crop box".
    """
    return _read_aro(path, image_root, "aro-vg-relation", ARO_RELATION_KEYS, _relation_subtype)


def read_aro_vg_attribution(path: str | os.PathLike, image_root: str | os.PathLike | None = None) -> Benchmark:
    """ARO VG-Attribution (``visual_genome_attribution.json``): as :func:`read_aro_vg_relation`, but
    ``subtype = "-".join(attributes)`` (``"attribution"`` when the list is empty)."""
    return _read_aro(path, image_root, "aro-vg-attribution", ARO_ATTRIBUTION_KEYS, _attribution_subtype)


# --------------------------------------------------------------------------------------------- Winoground
def read_winoground(path: str | os.PathLike, image_root: str | os.PathLike | None = None) -> Benchmark:
    """Winoground (``examples.jsonl``): one "group" item per line.

    ``images = (root / f"{image_0}.png", root / f"{image_1}.png")`` with root = ``image_root`` or the
    JSONL's folder / ``images``; ``texts = (caption_0, caption_1)``; ``subtype = collapsed_tag``;
    ``item_id = str(id)``. Blank lines are ignored; any other line that is not a JSON object holding
    :data:`WINOGROUND_KEYS` is a format error naming its line.
    """
    file = Path(path).expanduser()
    root = Path(image_root).expanduser() if image_root is not None else file.parent / "images"
    pending = []
    # split('\n'), not splitlines(): JSON strings may hold U+2028 and friends, which splitlines() breaks on.
    for number, line in enumerate(_read_text(file).split("\n"), start=1):
        if not line.strip():
            continue  # a trailing newline or blank separator is not an example
        where = f"line {number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise _fail(file, where, f"invalid JSON ({e.msg}, column {e.colno})") from None
        entry = _object(file, where, entry)
        missing = [k for k in WINOGROUND_KEYS if k not in entry]
        if missing:
            raise _fail(file, where, f"missing key(s) {', '.join(map(repr, missing))}")
        item_id = _identifier(file, where, entry, "id")
        names = (_text(file, where, entry, "image_0"), _text(file, where, entry, "image_1"))
        texts = (_text(file, where, entry, "caption_0"), _text(file, where, entry, "caption_1"))
        subtype = _text(file, where, entry, "collapsed_tag")
        item = Item(item_id, tuple(_abspath(root / f"{n}.png") for n in names), texts, subtype)
        pending.append(_Pending(item, f"{file}: {where}"))
    return _finish("winoground", "group", pending)


# --------------------------------------------------------------------------------------------- SVO-Probes
_TRUE, _FALSE = {"true", "1"}, {"false", "0", ""}


def _flag(file: Path, where: str, row: dict, column: str) -> bool:
    value = row[column].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _fail(file, where, f"column {column!r} must be True or False, got {row[column]!r}")


def _svo_image(root: Path, image_id: str) -> str:
    """The first existing ``root/<id><suffix>`` (:data:`SVO_IMAGE_SUFFIXES`), else the ``.jpg`` path."""
    for suffix in SVO_IMAGE_SUFFIXES:
        candidate = root / f"{image_id}{suffix}"
        if candidate.is_file():
            return _abspath(candidate)
    return _abspath(root / f"{image_id}{SVO_IMAGE_SUFFIXES[0]}")


def read_svo_probes(path: str | os.PathLike, image_root: str | os.PathLike | None = None) -> Benchmark:
    """SVO-Probes (``svo_probes.csv``): one "image" item per data row.

    ``texts = (sentence,)``, ``images = (positive, negative)`` found by ``pos_image_id`` / ``neg_image_id``
    as ``image_root/<id>.jpg`` (or ``.jpeg`` / ``.png``; default root: the CSV's folder / ``images``),
    ``subtype`` = ``"subj"`` / ``"verb"`` / ``"obj"`` from whichever ``*_neg`` column is True (several
    True ones are joined with ``+``; none is a format error), ``item_id`` = the 0-based data row index.
    Every column of :data:`SVO_COLUMNS` must be in the header; extra columns are ignored.
    """
    file = Path(path).expanduser()
    root = Path(image_root).expanduser() if image_root is not None else file.parent / "images"
    text = _read_text(file)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
    except csv.Error as e:
        raise _fail(file, "line 1", f"invalid CSV ({e})") from None
    if header is None:
        raise _fail(file, "line 1", f"empty file; expected a header with {', '.join(SVO_COLUMNS)}")
    header = [h.strip() for h in header]
    missing = [c for c in SVO_COLUMNS if c not in header]
    if missing:
        raise _fail(file, "line 1", f"missing column(s) {', '.join(missing)}")
    rows = []
    index = 0
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raise _fail(file, f"line {reader.line_num}", f"invalid CSV ({e})") from None
        where = f"line {reader.line_num}"  # physical line where the record ends (quoted newlines count)
        if not any(f.strip() for f in fields):
            continue
        if len(fields) != len(header):
            raise _fail(file, where, f"{len(fields)} fields, the header has {len(header)}")
        row = dict(zip(header, fields))
        sentence = _text(file, where, row, "sentence")
        ids = (_text(file, where, row, "pos_image_id").strip(), _text(file, where, row, "neg_image_id").strip())
        kinds = [k for k in ("subj", "verb", "obj") if _flag(file, where, row, f"{k}_neg")]
        if not kinds:
            raise _fail(file, where, "none of subj_neg, verb_neg, obj_neg is True")
        rows.append((index, where, sentence, ids, "+".join(kinds)))
        index += 1
    # An image found under no suffix keeps its .jpg name, so _finish records it as missing.
    pending = [_Pending(Item(str(index), tuple(_svo_image(root, i) for i in ids), (sentence,), subtype),
                        f"{file}: {where}")
               for index, where, sentence, ids, subtype in rows]
    return _finish("svo-probes", "image", pending)


# --------------------------------------------------------------------------------------------- What'sUp
#: What'sUp's six files (stem -> subset name), in the order of the paper's tables; Controlled-A / -B hold four
#: captions per image, the four QA files two (the authors' loader, ``dataset_zoo/aro_datasets.py``).
WHATSUP_FILES = {
    "controlled_images_dataset": "controlled-A",
    "controlled_clevr_dataset": "controlled-B",
    "coco_qa_one_obj": "coco-spatial one-object",
    "coco_qa_two_obj": "coco-spatial two-object",
    "vg_qa_one_obj": "gqa-spatial one-object",
    "vg_qa_two_obj": "gqa-spatial two-object",
}
# The image folder of each subset in the published download (the loader's image_dir).
_WHATSUP_IMAGE_DIRS = {
    "controlled-A": "controlled_images",
    "controlled-B": "controlled_clevr",
    "coco-spatial one-object": "val2017",
    "coco-spatial two-object": "val2017",
    "gqa-spatial one-object": "vg_images",
    "gqa-spatial two-object": "vg_images",
}
_WHATSUP_CONTROLLED_OPTIONS = 4
_WHATSUP_QA_ROW = "[image_id, true caption, false caption]"
# Controlled-A / -B: the two pairs of opposite prepositions (the second word of an image's file name) whose
# both images must be right for a pair to count (the loader's evaluate_scores).
_WHATSUP_PAIRS = {
    "controlled-A": (("left", "right"), ("on", "under")),
    "controlled-B": (("left", "right"), ("in-front", "behind")),
}


def _whatsup_files(path: Path) -> list[Path]:
    files = _published_files(path, WHATSUP_FILES, "What'sUp")
    if not path.is_dir() and path.stem not in WHATSUP_FILES:
        # The name is what tells the layout (4 captions or 2) and the image folder, as in the authors' loader.
        raise _fail(path, "", f"not one of What'sUp's files ({', '.join(s + '.json' for s in WHATSUP_FILES)}); "
                              "its name says which subset and layout it holds")
    return files


def _whatsup_controlled_preposition(subset: str, name: str) -> str:
    """The loader's preposition of a Controlled image, from its file name (first match wins, as there)."""
    if "left_of" in name:
        return "left_of"
    if "right_of" in name:
        return "right_of"
    if subset == "controlled-A":
        return "on" if "_on_" in name else "under"
    return "in-front_of" if "_in-front_of_" in name else "behind"


def _whatsup_qa_preposition(subset: str, caption: str) -> str:
    """The loader's preposition of a COCO_QA / VG_QA row, from its true caption (substring tests, first match
    wins, as there): one-object, the caption's last word; two-object, left / right / above / else below (COCO),
    left / right / front / behind / else top (GQA)."""
    if subset.endswith("one-object"):
        return caption.split()[-1]
    if "left of" in caption:
        return "left"
    if "right of" in caption:
        return "right"
    if subset.startswith("coco"):
        return "above" if "above" in caption else "below"
    if "front of" in caption:
        return "front"
    return "behind" if "behind" in caption else "top"


def _whatsup_controlled_entry(file: Path, where: str, raw: Any) -> tuple[str, str, tuple[str, ...]]:
    entry = _object(file, where, raw)
    image_path = _text(file, where, entry, "image_path")
    if "caption_options" not in entry:
        raise _fail(file, where, "missing key 'caption_options'")
    options = entry["caption_options"]
    if not isinstance(options, list) or len(options) != _WHATSUP_CONTROLLED_OPTIONS:
        got = f"{len(options)} values" if isinstance(options, list) else type(options).__name__
        raise _fail(file, where, f"'caption_options' must be a list of {_WHATSUP_CONTROLLED_OPTIONS} strings "
                                 f"(the true caption first), got {got}")
    for k, option in enumerate(options):
        if not isinstance(option, str):
            raise _fail(file, where, f"'caption_options' option {k} must be a string, got {type(option).__name__}")
        if not option.strip():
            raise _fail(file, where, f"'caption_options' option {k} is empty")
    name = image_path.split("/")[-1]  # the loader's own split: the names carry the prepositions and the groups
    if not name.strip():
        raise _fail(file, where, f"'image_path' names no file: {image_path!r}")
    return image_path, name, tuple(options)


def _whatsup_qa_row(file: Path, where: str, raw: Any, subset: str) -> tuple[str, tuple[str, str]]:
    if not isinstance(raw, list) or len(raw) != 3:
        got = f"{len(raw)} values" if isinstance(raw, list) else type(raw).__name__
        raise _fail(file, where, f"expected a {_WHATSUP_QA_ROW} list, got {got}")
    image_id, *captions = raw
    if isinstance(image_id, bool) or not isinstance(image_id, (int, str)) or (
            isinstance(image_id, str) and not image_id.strip()):
        raise _fail(file, where, f"image_id (value 0) must be an integer or a non-empty string, got {image_id!r}")
    for k, (role, caption) in enumerate(zip(("true", "false"), captions), start=1):
        if not isinstance(caption, str):
            raise _fail(file, where, f"the {role} caption (value {k}) must be a string, got {type(caption).__name__}")
        if not caption.strip():
            raise _fail(file, where, f"the {role} caption (value {k}) is empty")
    # The loader's file names: COCO ids zero-padded to 12 digits (COCO's own names), Visual Genome ids as they are.
    name = f"{str(image_id).zfill(12)}.jpg" if subset.startswith("coco") else f"{image_id}.jpg"
    return name, (captions[0], captions[1])


def _whatsup_image(file: Path, subset: str, name: str, written: str | None,
                   image_root: str | os.PathLike | None) -> str:
    """The first existing candidate; none existing, the one to report (``image_root / name``, else the
    published layout ``<JSON folder>/<image folder>/name``)."""
    folder = _WHATSUP_IMAGE_DIRS[subset]
    published = file.parent / folder / name
    candidates = []
    if image_root is not None:
        root = Path(image_root).expanduser()
        candidates += [root / name, root / folder / name]
    if written is not None:  # Controlled: the loader opens image_path as written, from its working directory
        path = Path(written).expanduser()
        candidates.append(path if path.is_absolute() else file.parent / path)
    candidates.append(published)
    for candidate in candidates:
        if candidate.is_file():
            return _abspath(candidate)
    return _abspath(candidates[0] if image_root is not None else published)


def read_whatsup(path_or_dir: str | os.PathLike, image_root: str | os.PathLike | None = None) -> Benchmark:
    """What'sUp from one of its JSON files, or from a folder holding any of :data:`WHATSUP_FILES`.

    One "text" item per entry, ``texts[0]`` the true caption (Controlled-A / -B: the four ``caption_options``
    as written; COCO-/GQA-spatial: ``(true caption, false caption)``), so the accuracy is the paper's per-image
    ("individual") accuracy; :func:`whatsup_pair_and_set` gives Controlled's pair and set accuracies.
    ``subtype`` = the subset (a value of :data:`WHATSUP_FILES`), ``tags = ("<subset> <preposition>",)`` with the
    authors' loader's preposition labels (Controlled-A ``left_of / right_of / on / under``, from the image's
    file name; Controlled-B ``left_of / right_of / in-front_of / behind``; one-object QA: the true caption's last
    word; two-object COCO ``left / right / above / below``, two-object GQA ``left / right / front / behind /
    top``), ``item_id`` = ``"<file stem>/<entry index>"``.

    Image: the first that exists of ``image_root / name`` and ``image_root / <image folder> / name`` (when
    ``image_root`` is given), then, for Controlled, ``image_path`` as written (absolute, or relative to the JSON's
    folder), then the published layout ``<JSON folder>/<image folder>/name``; where none exists the item is
    skipped as a missing image naming ``image_root / name`` (or the published path). ``name`` is
    ``basename(image_path)`` (Controlled), ``<image_id zero-padded to 12>.jpg`` (COCO-spatial) or
    ``<image_id>.jpg`` (GQA-spatial); the image folders are ``controlled_images``, ``controlled_clevr``,
    ``val2017`` and ``vg_images``. So the published download works without ``image_root``, and with the one
    ``--image-root`` that ``train.eval`` shares among all benchmarks of a run. All files are validated before
    any image is checked (module docstring).
    """
    root = Path(path_or_dir).expanduser()
    parsed = []  # (file, subset, index, name, image_path as written or None, texts, preposition)
    for file in _whatsup_files(root):
        subset = WHATSUP_FILES[file.stem]
        data = _load_json(file)
        if not isinstance(data, list):
            raise _fail(file, "", f"expected a JSON list of test cases, got {type(data).__name__}")
        for index, raw in enumerate(data):
            where = f"entry {index}"
            if subset.startswith("controlled"):
                written, name, texts = _whatsup_controlled_entry(file, where, raw)
                preposition = _whatsup_controlled_preposition(subset, name)
            else:
                written = None
                name, texts = _whatsup_qa_row(file, where, raw, subset)
                preposition = _whatsup_qa_preposition(subset, texts[0])
            parsed.append((file, subset, index, name, written, texts, preposition))
    pending = []
    for file, subset, index, name, written, texts, preposition in parsed:
        image = _whatsup_image(file, subset, name, written, image_root)
        item = Item(f"{file.stem}/{index}", (image,), texts, subset, tags=(f"{subset} {preposition}",))
        pending.append(_Pending(item, f"{file}: entry {index}"))
    return dataclasses.replace(_finish("whatsup", "text", pending), summarize=whatsup_pair_and_set)


def whatsup_pair_and_set(items: Iterable[Item], correct: Iterable[bool]) -> dict[str, dict[str, float]]:
    """Controlled-A / -B's pair and set accuracies, computed as the authors' ``Controlled_Images.evaluate_scores``
    does, from :func:`read_whatsup`'s items and whether each was right (a parallel sequence of bools).

    Each subset's images are grouped by (the first ``_``-separated word of the image's file name, the last word
    without its extension): ``mug_left_of_table.jpeg`` -> ``("mug", "table")``, its slot the second word
    (``left``; Controlled-A's slots ``left, right, on, under``, Controlled-B's ``left, right, in-front, behind``),
    later items overwriting earlier ones of the same slot, as their dict does. A group scores one pair for
    ``left`` and ``right`` both right and one for ``on`` and ``under`` (A) / ``in-front`` and ``behind`` (B) both
    right, and one set when all four are right. Their denominators: ``pair = 100 * pairs / (n / 2)``, ``set = 100 *
    sets / (n / 4)``, n the subset's items given (on the full subsets, 412 and 408 images, every group holds four;
    items skipped as missing images lower n and can leave groups short). ``individual`` is the plain per-image
    accuracy (what :func:`read_whatsup`'s rows show). Items of other subsets are ignored.

    Returns ``{subset: {"individual", "pair", "set", "n"}}`` for each Controlled subset among the items. Raises
    ValueError when the two lengths differ or a file name has fewer than three ``_``-separated words.
    """
    items, correct = list(items), list(correct)
    if len(items) != len(correct):
        raise ValueError(f"{len(items)} items but {len(correct)} correctness values")
    groups: dict[str, dict[tuple[str, str], dict[str, bool]]] = {}
    right: dict[str, list[bool]] = {}
    for item, ok in zip(items, correct):
        pairs = _WHATSUP_PAIRS.get(item.subtype)
        if pairs is None:
            continue
        name = os.path.basename(item.images[0])
        words = name.split("_")
        if len(words) < 3:
            raise ValueError(f"{item.item_id}: image file name {name!r} is not <object>_<preposition>_<object>.<ext>")
        key = (words[0], os.path.splitext(words[-1])[0])  # their [:-5] drops the published names' ".jpeg"
        slots = groups.setdefault(item.subtype, {}).setdefault(key, {s: False for pair in pairs for s in pair})
        slots[words[1]] = bool(ok)
        right.setdefault(item.subtype, []).append(bool(ok))
    out = {}
    for subset, by_key in groups.items():
        n = len(right[subset])
        pairs = sum(all(slots[s] for s in pair) for slots in by_key.values() for pair in _WHATSUP_PAIRS[subset])
        sets = sum(sum(slots.values()) == 4 for slots in by_key.values())
        out[subset] = {"individual": 100 * sum(right[subset]) / n, "pair": 100 * pairs / (n / 2),
                       "set": 100 * sets / (n / 4), "n": n}
    return out


# --------------------------------------------------------------------------------------------- toy world
def _listed(file: Path, key: str, label: str) -> Iterator[tuple[str, dict]]:
    """(where, entry) for each entry of the list ``key`` of the JSON object in ``file`` ("<label> <index>")."""
    data = _load_json(file)
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise _fail(file, "", f"expected an object with an {key!r} list" if key[0] in "aeiou" else
                    f"expected an object with a {key!r} list")
    for index, raw in enumerate(data[key]):
        where = f"{label} {index}"
        yield where, _object(file, where, raw)


def _names_any(caption: str, combinations: list[str]) -> bool:
    """Whether ``caption`` names one of the "colour shape" combinations (toy captions put size before colour)."""
    words = caption.lower().replace(",", " ").replace(";", " ").replace(".", " ").split()
    pairs = {f"{a} {b}" for a, b in zip(words, words[1:])}
    return any(c in pairs for c in combinations)


def read_toyworld(world_dir: str | os.PathLike, split: str = "test",
                  image_root: str | os.PathLike | None = None) -> Benchmark:
    """The toy world's hard negatives of one split (``negatives.json`` + ``{split}_coco.json``).

    One "text" item per (caption, hard negative) pair: ``texts = (positive, negative text)``, ``subtype``
    = the negative's type (``replace-att``, ``swap-obj`` ...), ``item_id = "<caption_id>/<type>"``; an item whose
    positive names a combination the world held out of training (``meta.json``'s ``holdout``) is also tagged
    ``held-out <type>`` and ``held-out all`` (composition, not memory: its own rows in every table); a swap-att
    item between two objects of one shape is also tagged :data:`SAME_SHAPE_SWAP` (there the colours swap sides, so
    telling it apart needs position as much as binding: its own row); image
    = the COCO file's ``file_name`` under ``image_root`` (default ``world_dir``). One pair per item keeps
    the per-type accuracy a two-way choice like SugarCrepe's. An image id of the split that the COCO
    file does not list is a format error.
    """
    world = Path(world_dir).expanduser()
    root = Path(image_root).expanduser() if image_root is not None else world
    coco_file = world / f"{split}_coco.json"
    coco = _load_json(coco_file)
    if not isinstance(coco, dict) or not isinstance(coco.get("images"), list):
        raise _fail(coco_file, "", "expected a COCO captions object with an 'images' list")
    files = {}
    for index, raw in enumerate(coco["images"]):
        where = f"images entry {index}"
        entry = _object(coco_file, where, raw)
        files[_identifier(coco_file, where, entry, "id")] = _text(coco_file, where, entry, "file_name")
    meta_file = world / "meta.json"
    heldout = _load_json(meta_file).get("holdout", []) if meta_file.is_file() else []
    neg_file = world / "negatives.json"
    pending = []
    for where, entry in _listed(neg_file, "items", "entry"):
        if _text(neg_file, where, entry, "split") != split:
            continue
        image_id = _identifier(neg_file, where, entry, "image_id")
        caption_id = _identifier(neg_file, where, entry, "caption_id")
        positive = _text(neg_file, where, entry, "positive")
        if image_id not in files:
            raise _fail(neg_file, where, f"image_id {image_id} is not in {coco_file.name}")
        negatives = entry.get("negatives")
        if not isinstance(negatives, list):
            raise _fail(neg_file, where, "'negatives' must be a list")
        image = _abspath(root / files[image_id])
        for k, raw_neg in enumerate(negatives):
            neg_where = f"{where}, negative {k}"
            neg = _object(neg_file, neg_where, raw_neg)
            neg_type, text = _text(neg_file, neg_where, neg, "type"), _text(neg_file, neg_where, neg, "text")
            tags = (f"held-out {neg_type}", "held-out all") if _names_any(positive, heldout) else ()
            if neg_type == "swap-att" and _one_shape_pair(neg.get("struct")):
                tags += (SAME_SHAPE_SWAP,)
            pending.append(_Pending(Item(f"{caption_id}/{neg_type}", (image,), (positive, text), neg_type, tags=tags),
                                    f"{neg_file}: {neg_where}"))
    return _finish("toyworld", "text", pending)


def read_toyworld_controlled(world_dir: str | os.PathLike, split: str | None = None,
                             image_root: str | os.PathLike | None = None, file: str = "controlled.json",
                             name: str = "toyworld-controlled") -> Benchmark:
    """The toy world's controlled test (``controlled.json``, :func:`extract.data.toyworld.generate_controlled`): one
    "set" item per set, ``images`` its four scenes and ``texts`` their four captions in the same order (caption k
    true of image k alone), ``subtype`` ``four-way``, tagged ``held-out four-way`` when it names a combination the
    world held out of training. ``split`` is accepted for symmetry with :func:`read_toyworld` and ignored: the sets
    are an evaluation set of their own, drawn from every combination. ``file`` / ``name``: another test in the same
    schema and the benchmark's name (the hard world's ``controlled_a.json`` as ``toyworld-controlled-A`` ...,
    ``extract.data.toyworld.controlled_tests``)."""
    world = Path(world_dir).expanduser()
    root = Path(image_root).expanduser() if image_root is not None else world
    file = world / file
    pending = []
    for index, (where, entry) in enumerate(_listed(file, "sets", "set")):
        scenes = entry.get("scenes")
        if not isinstance(scenes, list) or len(scenes) < 2:
            raise _fail(file, where, "'scenes' must be a list of at least two scenes")
        images, texts = [], []
        for k, scene_raw in enumerate(scenes):
            scene = _object(file, f"{where}, scene {k}", scene_raw)
            images.append(_abspath(root / _text(file, f"{where}, scene {k}", scene, "file_name")))
            texts.append(_text(file, f"{where}, scene {k}", scene, "caption"))
        if len(set(texts)) != len(texts):
            raise _fail(file, where, "two scenes of a set share a caption")
        tags = ("held-out four-way",) if entry.get("heldout") else ()
        pending.append(_Pending(Item(f"controlled/{entry.get('id', index)}", tuple(images), tuple(texts), "four-way",
                                     tags=tags), f"{file}: {where}"))
    return _finish(name, "set", pending)


#: the toy world's row of swap-att items between two objects of the same shape ("a red circle left of a blue
#: circle" / "a blue circle left of a red circle"): only colour and side tell them apart
SAME_SHAPE_SWAP = "swap-att [same shape]"


def _one_shape_pair(struct) -> bool:
    """A negative's structure of exactly two objects sharing their shape."""
    objects = struct.get("objects") if isinstance(struct, dict) else None
    return (isinstance(objects, list) and len(objects) == 2 and all(isinstance(o, dict) for o in objects)
            and objects[0].get("shape") is not None and objects[0].get("shape") == objects[1].get("shape"))


# --------------------------------------------------------------------------------------------- dispatch
# Every reader takes (path, image_root=None, **options); read_benchmark only looks the name up here.
READERS: dict[str, Callable[..., Benchmark]] = {
    "sugarcrepe": read_sugarcrepe,
    "aro-vg-relation": read_aro_vg_relation,
    "aro-vg-attribution": read_aro_vg_attribution,
    "winoground": read_winoground,
    "svo-probes": read_svo_probes,
    "toyworld": read_toyworld,
    "toyworld-controlled": read_toyworld_controlled,
    "whatsup": read_whatsup,
}


def read_benchmark(name: str, path: str | os.PathLike, image_root: str | os.PathLike | None = None,
                   **kw) -> Benchmark:
    """Read benchmark ``name`` (a key of :data:`READERS`) from ``path``; ``kw`` goes to the reader
    (``split=`` for the toy world). Raises ValueError listing the known names for an unknown one."""
    reader = READERS.get(name)
    if reader is None:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(READERS)}")
    return reader(path, image_root=image_root, **kw)
