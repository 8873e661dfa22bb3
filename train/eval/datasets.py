"""Readers for compositional image-text benchmarks, each from its published file format, into one structure
(the structure and the shared field readers: ``train.eval.bench_items``; What'sUp's reader: ``train.eval.whatsup``).

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
- The toy world (``extract.worlds.toyworld``): ``negatives.json`` and ``{split}_coco.json``.

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
import io
import json
import os
from pathlib import Path
from typing import Callable, Iterator

from train.eval.bench_items import (Benchmark, BenchmarkFormatError, Item, Pending, abspath, finish, format_error,
                                    id_field, load_json, number_field, object_field, published_files, read_text_file,
                                    text_field)
from train.eval.whatsup import WHATSUP_FILES, read_whatsup, whatsup_pair_and_set

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


# --------------------------------------------------------------------------------------------- SugarCrepe
def _sugarcrepe_files(path: Path) -> list[Path]:
    return published_files(path, SUGARCREPE_FILES, "SugarCrepe")


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
        data = load_json(file)
        if not isinstance(data, dict):
            raise format_error(file, "", f"expected a JSON object keyed by entry id, got {type(data).__name__}")
        images = Path(image_root).expanduser() if image_root is not None else file.parent
        for key, raw in data.items():
            where = f"entry {key}"
            entry = object_field(file, where, raw)
            filename = text_field(file, where, entry, "filename")
            texts = (text_field(file, where, entry, "caption"), text_field(file, where, entry, "negative_caption"))
            item = Item(f"{file.stem}/{key}", (abspath(images / filename),), texts, file.stem)
            pending.append(Pending(item, f"{file}: {where}"))
    return finish("sugarcrepe", "text", pending)


# --------------------------------------------------------------------------------------------- ARO
def _aro_image(file: Path, image_path: str, image_root: str | os.PathLike | None) -> str:
    if image_root is not None:
        # ARO's own layout is <root>/images/<image_path>; a flat folder of VG images is the common copy.
        return abspath(Path(image_root).expanduser() / os.path.basename(image_path))
    candidate = Path(image_path).expanduser()
    if candidate.is_absolute():
        return abspath(candidate)
    # Relative paths resolve against the JSON's folder (the project's rule for data files), else against
    # <folder>/images, which is where ARO's loader puts them.
    for base in (file.parent, file.parent / "images"):
        if (base / candidate).is_file():
            return abspath(base / candidate)
    return abspath(file.parent / candidate)


def _read_aro(path: str | os.PathLike, image_root, name: str, keys: tuple[str, ...],
              subtype_of: Callable[[Path, str, dict], str]) -> Benchmark:
    file = Path(path).expanduser()
    data = load_json(file)
    if not isinstance(data, list):
        raise format_error(file, "", f"expected a JSON list of test cases, got {type(data).__name__}")
    parsed = []
    for index, raw in enumerate(data):
        where = f"entry {index}"
        entry = object_field(file, where, raw)
        missing = [k for k in keys if k not in entry]
        if missing:
            raise format_error(file, where, f"missing key(s) {', '.join(map(repr, missing))}")
        id_field(file, where, entry, "image_id")
        image_path = text_field(file, where, entry, "image_path")
        texts = (text_field(file, where, entry, "true_caption"), text_field(file, where, entry, "false_caption"))
        crop = tuple(number_field(file, where, entry, f"bbox_{k}") for k in "xywh")
        parsed.append((index, where, image_path, texts, crop, subtype_of(file, where, entry)))
    pending, degenerate = [], []
    for index, where, image_path, texts, crop, subtype in parsed:
        if crop[2] <= 0 or crop[3] <= 0:
            # A value problem in one case, not a broken file: exclude it (PIL would crop to nothing).
            degenerate.append({"item_id": str(index), "reason": "empty crop box", "location": f"{file}: {where}",
                               "image": image_path})
            continue
        item = Item(str(index), (_aro_image(file, image_path, image_root),), texts, subtype, crop)
        pending.append(Pending(item, f"{file}: {where}"))
    return finish(name, "text", pending, degenerate)


def _relation_subtype(file: Path, where: str, entry: dict) -> str:
    return text_field(file, where, entry, "relation_name")


def _attribution_subtype(file: Path, where: str, entry: dict) -> str:
    attributes = entry["attributes"]
    if not isinstance(attributes, list) or not all(isinstance(a, str) for a in attributes):
        raise format_error(file, where, f"'attributes' must be a list of strings, got {attributes!r}")
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
    for number, line in enumerate(read_text_file(file).split("\n"), start=1):
        if not line.strip():
            continue  # a trailing newline or blank separator is not an example
        where = f"line {number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise format_error(file, where, f"invalid JSON ({e.msg}, column {e.colno})") from None
        entry = object_field(file, where, entry)
        missing = [k for k in WINOGROUND_KEYS if k not in entry]
        if missing:
            raise format_error(file, where, f"missing key(s) {', '.join(map(repr, missing))}")
        item_id = id_field(file, where, entry, "id")
        names = (text_field(file, where, entry, "image_0"), text_field(file, where, entry, "image_1"))
        texts = (text_field(file, where, entry, "caption_0"), text_field(file, where, entry, "caption_1"))
        subtype = text_field(file, where, entry, "collapsed_tag")
        item = Item(item_id, tuple(abspath(root / f"{n}.png") for n in names), texts, subtype)
        pending.append(Pending(item, f"{file}: {where}"))
    return finish("winoground", "group", pending)


# --------------------------------------------------------------------------------------------- SVO-Probes
_TRUE, _FALSE = {"true", "1"}, {"false", "0", ""}


def _flag(file: Path, where: str, row: dict, column: str) -> bool:
    value = row[column].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise format_error(file, where, f"column {column!r} must be True or False, got {row[column]!r}")


def _svo_image(root: Path, image_id: str) -> str:
    """The first existing ``root/<id><suffix>`` (:data:`SVO_IMAGE_SUFFIXES`), else the ``.jpg`` path."""
    for suffix in SVO_IMAGE_SUFFIXES:
        candidate = root / f"{image_id}{suffix}"
        if candidate.is_file():
            return abspath(candidate)
    return abspath(root / f"{image_id}{SVO_IMAGE_SUFFIXES[0]}")


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
    text = read_text_file(file)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
    except csv.Error as e:
        raise format_error(file, "line 1", f"invalid CSV ({e})") from None
    if header is None:
        raise format_error(file, "line 1", f"empty file; expected a header with {', '.join(SVO_COLUMNS)}")
    header = [h.strip() for h in header]
    missing = [c for c in SVO_COLUMNS if c not in header]
    if missing:
        raise format_error(file, "line 1", f"missing column(s) {', '.join(missing)}")
    rows = []
    index = 0
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raise format_error(file, f"line {reader.line_num}", f"invalid CSV ({e})") from None
        where = f"line {reader.line_num}"  # physical line where the record ends (quoted newlines count)
        if not any(f.strip() for f in fields):
            continue
        if len(fields) != len(header):
            raise format_error(file, where, f"{len(fields)} fields, the header has {len(header)}")
        row = dict(zip(header, fields))
        sentence = text_field(file, where, row, "sentence")
        ids = (text_field(file, where, row, "pos_image_id").strip(), text_field(file, where, row, "neg_image_id").strip())
        kinds = [k for k in ("subj", "verb", "obj") if _flag(file, where, row, f"{k}_neg")]
        if not kinds:
            raise format_error(file, where, "none of subj_neg, verb_neg, obj_neg is True")
        rows.append((index, where, sentence, ids, "+".join(kinds)))
        index += 1
    # An image found under no suffix keeps its .jpg name, so finish records it as missing.
    pending = [Pending(Item(str(index), tuple(_svo_image(root, i) for i in ids), (sentence,), subtype),
                        f"{file}: {where}")
               for index, where, sentence, ids, subtype in rows]
    return finish("svo-probes", "image", pending)


# --------------------------------------------------------------------------------------------- toy world
def _listed(file: Path, key: str, label: str) -> Iterator[tuple[str, dict]]:
    """(where, entry) for each entry of the list ``key`` of the JSON object in ``file`` ("<label> <index>")."""
    data = load_json(file)
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise format_error(file, "", f"expected an object with an {key!r} list" if key[0] in "aeiou" else
                    f"expected an object with a {key!r} list")
    for index, raw in enumerate(data[key]):
        where = f"{label} {index}"
        yield where, object_field(file, where, raw)


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
    coco = load_json(coco_file)
    if not isinstance(coco, dict) or not isinstance(coco.get("images"), list):
        raise format_error(coco_file, "", "expected a COCO captions object with an 'images' list")
    files = {}
    for index, raw in enumerate(coco["images"]):
        where = f"images entry {index}"
        entry = object_field(coco_file, where, raw)
        files[id_field(coco_file, where, entry, "id")] = text_field(coco_file, where, entry, "file_name")
    meta_file = world / "meta.json"
    heldout = load_json(meta_file).get("holdout", []) if meta_file.is_file() else []
    neg_file = world / "negatives.json"
    pending = []
    for where, entry in _listed(neg_file, "items", "entry"):
        if text_field(neg_file, where, entry, "split") != split:
            continue
        image_id = id_field(neg_file, where, entry, "image_id")
        caption_id = id_field(neg_file, where, entry, "caption_id")
        positive = text_field(neg_file, where, entry, "positive")
        if image_id not in files:
            raise format_error(neg_file, where, f"image_id {image_id} is not in {coco_file.name}")
        negatives = entry.get("negatives")
        if not isinstance(negatives, list):
            raise format_error(neg_file, where, "'negatives' must be a list")
        image = abspath(root / files[image_id])
        for k, raw_neg in enumerate(negatives):
            neg_where = f"{where}, negative {k}"
            neg = object_field(neg_file, neg_where, raw_neg)
            neg_type, text = text_field(neg_file, neg_where, neg, "type"), text_field(neg_file, neg_where, neg, "text")
            tags = (f"held-out {neg_type}", "held-out all") if _names_any(positive, heldout) else ()
            if neg_type == "swap-att" and _one_shape_pair(neg.get("struct")):
                tags += (SAME_SHAPE_SWAP,)
            rows = neg.get("rows", [])  # the 3D wide language's rows beyond the type (extract.worlds.captions3d.ROWS)
            if not isinstance(rows, list) or not all(isinstance(r, str) and r for r in rows):
                raise format_error(neg_file, neg_where, "'rows' must be a list of row names")
            tags += tuple(rows)
            pending.append(Pending(Item(f"{caption_id}/{neg_type}", (image,), (positive, text), neg_type, tags=tags),
                                    f"{neg_file}: {neg_where}"))
    return finish("toyworld", "text", pending)


def read_toyworld_controlled(world_dir: str | os.PathLike, split: str | None = None,
                             image_root: str | os.PathLike | None = None, file: str = "controlled.json",
                             name: str = "toyworld-controlled") -> Benchmark:
    """The toy world's controlled test (``controlled.json``, :func:`extract.worlds.toyworld.generate_controlled`): one
    "set" item per set, ``images`` its four scenes and ``texts`` their four captions in the same order (caption k
    true of image k alone), ``subtype`` ``four-way``, tagged ``held-out four-way`` when it names a combination the
    world held out of training. ``split`` is accepted for symmetry with :func:`read_toyworld` and ignored: the sets
    are an evaluation set of their own, drawn from every combination. ``file`` / ``name``: another test in the same
    schema and the benchmark's name (the hard world's ``controlled_a.json`` as ``toyworld-controlled-A`` ...,
    ``extract.worlds.toyworld.controlled_tests``)."""
    world = Path(world_dir).expanduser()
    root = Path(image_root).expanduser() if image_root is not None else world
    file = world / file
    pending = []
    for index, (where, entry) in enumerate(_listed(file, "sets", "set")):
        scenes = entry.get("scenes")
        if not isinstance(scenes, list) or len(scenes) < 2:
            raise format_error(file, where, "'scenes' must be a list of at least two scenes")
        images, texts = [], []
        for k, scene_raw in enumerate(scenes):
            scene = object_field(file, f"{where}, scene {k}", scene_raw)
            images.append(abspath(root / text_field(file, f"{where}, scene {k}", scene, "file_name")))
            texts.append(text_field(file, f"{where}, scene {k}", scene, "caption"))
        if len(set(texts)) != len(texts):
            raise format_error(file, where, "two scenes of a set share a caption")
        tags = ("held-out four-way",) if entry.get("heldout") else ()
        pending.append(Pending(Item(f"controlled/{entry.get('id', index)}", tuple(images), tuple(texts), "four-way",
                                     tags=tags), f"{file}: {where}"))
    return finish(name, "set", pending)


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
