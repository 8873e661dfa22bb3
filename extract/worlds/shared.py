"""What the generated worlds share: the vocabulary, splits and hold-out, caption text, hard-negative mutations,
drawing one shape, the files every reader of a world expects, and the controlled tests' layout.

The version-2 world (:mod:`extract.worlds.toyworld`, the default), the hard world (:mod:`extract.worlds.hardworld`,
``--hard``) and the path-traced 3D world (:mod:`extract.worlds.world3d_layout`, ``--world 3d``) differ in their
scenes, their relation rules and their predicates; everything here is the same for all three, so a reader of one
world reads the others (``annotations.json``, ``negatives.json``, ``{split}.csv``, ``{split}_coco.json``,
``meta.json``, the controlled tests: ``controlled.json``, or ``controlled_a.json`` / ``controlled_b.json`` and
What'sUp's own layout under ``whatsup/``).
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import os
from pathlib import Path
from typing import Iterable, Sequence

from PIL import Image

SHAPES = ("circle", "square", "triangle", "diamond", "star", "hexagon")
COLOURS = {
    "red": (230, 25, 25),
    "green": (30, 190, 50),
    "blue": (40, 90, 255),
    "yellow": (250, 225, 30),
    "purple": (150, 50, 220),
    "orange": (255, 135, 0),
    "white": (245, 245, 245),
    "gray": (128, 128, 128),
}
SIZE_NAMES = ("small", "large")
NEGATIVE_TYPES = ("replace-att", "replace-obj", "replace-rel", "swap-att", "swap-obj", "add-obj")
SPLITS = ("train", "val", "test")

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
_UNIT_POLYGONS = {  # vertices in the unit box, each touching all four sides
    "triangle": ((0.5, 0.0), (1.0, 1.0), (0.0, 1.0)),
    "diamond": ((0.5, 0.0), (1.0, 0.5), (0.5, 1.0), (0.0, 0.5)),
    "hexagon": ((0.25, 0.0), (0.75, 0.0), (1.0, 0.5), (0.75, 1.0), (0.25, 1.0), (0.0, 0.5)),
}


def _unit_star(points: int = 5, inner: float = 0.45) -> tuple[tuple[float, float], ...]:
    raw = []
    for k in range(2 * points):
        radius = inner if k % 2 else 1.0
        angle = -math.pi / 2 + k * math.pi / points
        raw.append((radius * math.cos(angle), radius * math.sin(angle)))
    xs, ys = [p[0] for p in raw], [p[1] for p in raw]
    # Stretch to the unit box so the star touches its box like every other shape.
    return tuple(((x - min(xs)) / (max(xs) - min(xs)), (y - min(ys)) / (max(ys) - min(ys)))
                 for x, y in raw)


_UNIT_POLYGONS["star"] = _unit_star()


# --------------------------------------------------------------------------- options


def parse_holdout(spec: str | Iterable, colours: Iterable[str] = COLOURS, shapes: Sequence[str] = SHAPES) -> frozenset:
    """Parse ``"red circle,blue square"`` (or an iterable of such strings / (colour, shape) pairs) against a world's
    vocabulary (default: the drawn worlds').

    Returns a frozenset of (colour, shape). Raises ValueError naming the vocabulary on a bad entry.
    """
    colours = tuple(colours)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    combos = set()
    for item in items:
        words = item.split() if isinstance(item, str) else list(item)
        if not words:
            continue
        if len(words) != 2 or words[0].lower() not in colours or words[1].lower() not in shapes:
            raise ValueError(
                f"invalid holdout combination {item!r}: expected '<colour> <shape>' with colour in "
                f"{', '.join(colours)} and shape in {', '.join(shapes)}")
        combos.add((words[0].lower(), words[1].lower()))
    if len(combos) == len(colours) * len(shapes):
        raise ValueError("holdout names every (colour, shape) combination: nothing left for train")
    return frozenset(combos)


def parse_splits(spec: str | Sequence[float]) -> tuple[float, float, float]:
    """Parse ``"0.8,0.1,0.1"`` (or three numbers): train/val/test fractions, >= 0, summing to 1."""
    try:
        values = tuple(float(v) for v in (spec.split(",") if isinstance(spec, str) else spec))
    except ValueError as err:
        raise ValueError(f"invalid splits {spec!r}: expected three numbers like 0.8,0.1,0.1") from err
    if len(values) != 3 or min(values) < 0 or abs(sum(values) - 1.0) > 1e-6:
        raise ValueError(f"invalid splits {spec!r}: need three fractions >= 0 that sum to 1")
    return values


def split_of(index: int, splits: Sequence[float] = (0.8, 0.1, 0.1)) -> str:
    """The split of scene ``index``: the golden-ratio sequence frac(i * 0.618...) against the cumulative split
    fractions, a fixed function of the index close to the requested proportions at every n."""
    u = (index * _GOLDEN) % 1.0
    cumulative = 0.0
    for name, fraction in zip(SPLITS, splits):
        cumulative += fraction
        if u < cumulative:
            return name
    # u sits within rounding of 1 with a zero-width last split: take the last non-empty one.
    return [name for name, fraction in zip(SPLITS, splits) if fraction > 0][-1]


def is_toyworld(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a generated toy world, either kind (a folder with ``meta.json`` and ``annotations.json``):
    the one test every command uses to decide that a ``--data`` is one."""
    folder = Path(str(path)) if path else None
    return folder is not None and (folder / "meta.json").is_file() and (folder / "annotations.json").is_file()


def heldout_of(world: str | os.PathLike) -> frozenset:
    """The (colour, shape) combinations a generated toy world held out of its train split (``meta.json``)."""
    meta = json.loads((Path(world) / "meta.json").read_text())
    vocabulary = meta.get("vocabulary") or {}  # a world of its own vocabulary (the 3D world's) names it
    return parse_holdout(meta.get("holdout", []), vocabulary.get("colours", COLOURS), vocabulary.get("shapes", SHAPES))


# --------------------------------------------------------------------------- caption text


def article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def noun(obj: dict, with_size: bool = True) -> str:
    words = [obj["size"]] if with_size and "size" in obj else []
    return " ".join(words + [obj["colour"], obj["shape"]])


def join_words(phrases: list[str]) -> str:
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


def describe(obj: dict, with_size: bool) -> dict:
    keys = ("size", "colour", "shape") if with_size else ("colour", "shape")
    return {key: obj[key] for key in keys}


def render_struct(struct: dict, words: dict) -> str:
    """The text of a one-object, relation or counted ``struct`` with ``words[predicate]`` for each predicate:
    "a small red circle"; "a red circle on a blue square[, and a ...]"; "three objects: a small red circle, ...;
    the red circle is behind the blue square"."""
    objects = struct["objects"]
    if "count" in struct:
        count = struct["count"]
        text = (f"{COUNT_WORDS[count]} object{'s' if count > 1 else ''}: "
                + join_words([article(noun(o)) for o in objects]))
        clauses = [f"the {noun(objects[i], False)} is {words[p]} the {noun(objects[j], False)}"
                   for i, p, j in struct["relations"]]
        return text + ("; " + ", ".join(clauses) if clauses else "")
    if not struct["relations"]:
        return " and ".join(article(noun(o)) for o in objects)
    (i, predicate, j), = struct["relations"]
    text = f"{article(noun(objects[i]))} {words[predicate]} {article(noun(objects[j]))}"
    extras = [article(noun(o)) for k, o in enumerate(objects) if k not in (i, j)]
    return ", and ".join([text] + extras)


# --------------------------------------------------------------------------- hard-negative mutations


def with_changes(struct: dict, obj_index: int | None = None, relation_index: int | None = None,
                 relation: list | None = None, **attributes) -> dict:
    """A copy of ``struct`` with one object's attributes and/or one relation replaced."""
    objects = [dict(o) for o in struct["objects"]]
    relations = [list(r) for r in struct["relations"]]
    if obj_index is not None:
        objects[obj_index].update(attributes)
    if relation_index is not None:
        relations[relation_index] = relation
    return {**struct, "objects": objects, "relations": relations}


def _replace_att(struct: dict, predicates: Sequence[str], colours=COLOURS, shapes=SHAPES) -> list[dict]:
    out = []
    for i, obj in enumerate(struct["objects"]):
        out += [with_changes(struct, i, colour=c) for c in colours if c != obj["colour"]]
        out += [with_changes(struct, i, size=s) for s in SIZE_NAMES if "size" in obj and s != obj["size"]]
    return out


def _replace_obj(struct: dict, predicates: Sequence[str], colours=COLOURS, shapes=SHAPES) -> list[dict]:
    return [with_changes(struct, i, shape=s)
            for i, obj in enumerate(struct["objects"]) for s in shapes if s != obj["shape"]]


def _replace_rel(struct: dict, predicates: Sequence[str], colours=COLOURS, shapes=SHAPES) -> list[dict]:
    return [with_changes(struct, relation_index=r, relation=[i, q, j])
            for r, (i, p, j) in enumerate(struct["relations"]) for q in predicates if q != p]


def _swap_att(struct: dict, predicates: Sequence[str], colours=COLOURS, shapes=SHAPES) -> list[dict]:
    out = []
    objects = struct["objects"]
    for i, j in itertools.combinations(range(len(objects)), 2):
        for key in ("colour", "size"):
            if key in objects[i] and objects[i][key] != objects[j][key]:
                swapped = with_changes(struct, i, **{key: objects[j][key]})
                swapped["objects"][j][key] = objects[i][key]
                out.append(swapped)
    return out


def _swap_obj(struct: dict, predicates: Sequence[str], colours=COLOURS, shapes=SHAPES) -> list[dict]:
    return [with_changes(struct, relation_index=r, relation=[j, p, i])
            for r, (i, p, j) in enumerate(struct["relations"])]


def _add_obj(struct: dict, predicates: Sequence[str], colours=COLOURS, shapes=SHAPES) -> list[dict]:
    if "count" in struct:
        return []
    sizes = list(SIZE_NAMES) if "size" in struct["objects"][0] else [None]
    return [{**struct, "objects": struct["objects"] + [
                {"colour": c, "shape": s} if z is None else {"size": z, "colour": c, "shape": s}]}
            for c in colours for s in shapes for z in sizes]


_MUTATORS = {"replace-att": _replace_att, "replace-obj": _replace_obj, "replace-rel": _replace_rel,
             "swap-att": _swap_att, "swap-obj": _swap_obj, "add-obj": _add_obj}


def mutations(struct: dict, neg_type: str, predicates: Sequence[str], colours: Iterable[str] = COLOURS,
              shapes: Sequence[str] = SHAPES) -> list[dict]:
    """Every candidate of hard-negative type ``neg_type`` (:data:`NEGATIVE_TYPES`) for caption ``struct``, in a
    fixed order; ``predicates``: what a replace-rel candidate may say instead (the world's caption predicates);
    ``colours``, ``shapes``: the world's vocabulary (default: the drawn worlds')."""
    return _MUTATORS[neg_type](struct, predicates, tuple(colours), tuple(shapes))


def matches(obj: dict, wanted: dict) -> bool:
    """Whether a scene object has every attribute a caption's phrase names (any subset of its keys): the one rule
    every world's judge and caption writer reads."""
    return all(obj[key] == value for key, value in wanted.items())


def combos(struct: dict) -> list[tuple[str, str]]:
    return [(o["colour"], o["shape"]) for o in struct["objects"]]


# --------------------------------------------------------------------------- drawing


def draw_shape(pen, shape: str, box: Sequence[int], fill) -> None:
    """Draw ``shape`` filling the half-open ``box`` [x0, y0, x1, y1] (touching its four sides; no anti-aliasing)
    with ``pen`` (a ``PIL.ImageDraw.Draw``) in ``fill``."""
    x0, y0, x1, y1 = box
    # PIL's coordinates are inclusive: the last covered pixel is x1 - 1.
    if shape == "circle":
        pen.ellipse([x0, y0, x1 - 1, y1 - 1], fill=fill)
    elif shape == "square":
        pen.rectangle([x0, y0, x1 - 1, y1 - 1], fill=fill)
    else:
        w, h = x1 - 1 - x0, y1 - 1 - y0
        pen.polygon([(x0 + u * w, y0 + v * h) for u, v in _UNIT_POLYGONS[shape]], fill=fill)


# --------------------------------------------------------------------------- files


def dump_json(path: Path, obj) -> None:
    # compact: indent makes json fall back to its pure-Python encoder (3x slower, 40% larger on disk)
    path.write_text(json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8")


def write_split(out: Path, split: str, scenes: list[dict], seed: int, version: int) -> None:
    """``{split}.csv`` (``filepath,title``, one row per caption) and ``{split}_coco.json`` (COCO captions) of the
    split's scenes."""
    with open(out / f"{split}.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["filepath", "title"])
        writer.writerows([s["file_name"], c["text"]] for s in scenes for c in s["captions"])
    coco = {"info": {"description": "plugvlm toy world", "version": version, "split": split, "seed": seed},
            "images": [{"id": s["image_id"], "file_name": s["file_name"], "width": s["width"],
                        "height": s["height"]} for s in scenes],
            "annotations": [{"id": c["id"], "image_id": s["image_id"], "caption": c["text"]}
                            for s in scenes for c in s["captions"]]}
    dump_json(out / f"{split}_coco.json", coco)


def count_files(scenes: list[dict], items: list[dict], holdout: frozenset,
                types: Sequence[str] = NEGATIVE_TYPES) -> dict:
    """Per split: images, captions, negatives, held-out objects; negatives by type (``types``: the world's); objects
    (``meta.json``)."""
    per_split = {name: {"images": 0, "captions": 0, "negatives": 0, "heldout_objects": 0}
                 for name in SPLITS}
    for scene in scenes:
        entry = per_split[scene["split"]]
        entry["images"] += 1
        entry["captions"] += len(scene["captions"])
        entry["heldout_objects"] += sum((o["colour"], o["shape"]) in holdout for o in scene["objects"])
    by_type = dict.fromkeys(types, 0)
    for item in items:
        per_split[item["split"]]["negatives"] += len(item["negatives"])
        for negative in item["negatives"]:
            by_type[negative["type"]] += 1
    return {"splits": per_split, "negatives_by_type": by_type,
            "objects": sum(len(s["objects"]) for s in scenes)}


# --------------------------------------------------------------------------- the controlled tests' layout
#: the version-2 world's four-way test (four arrangements of one pair by direction): one file
CONTROLLED_FILE = "controlled.json"
#: the hard and 3D worlds' What'sUp analogues: Controlled-A (support) and -B (depth), each the same two objects in four
#: images, one file per test
CONTROLLED_A = ("on", "under", "left of", "right of")
CONTROLLED_B = ("in front of", "behind", "left of", "right of")
CONTROLLED_FILES = {"A": "controlled_a.json", "B": "controlled_b.json"}
#: those tests again in What'sUp's own published layout, for What'sUp's own evaluation code (:func:`write_whatsup`)
WHATSUP_DIR = "whatsup"
_WHATSUP_SUBSETS = {"A": ("controlled_images_dataset", "controlled_images"),
                    "B": ("controlled_clevr_dataset", "controlled_clevr")}
_WHATSUP_PREPOSITION = {"on": "on", "under": "under", "left of": "left_of", "right of": "right_of",
                        "in front of": "in-front_of", "behind": "behind"}


def _whatsup_name(set_id: int, pair: list[dict], predicate: str) -> str:
    first, second = (f"{o['colour']}-{o['shape']}" for o in pair)
    # <object>_<preposition>_<object>.jpeg as the authors' files; the set id keeps two sets of one pair apart
    return f"s{set_id:04d}-{first}_{_WHATSUP_PREPOSITION[predicate]}_{second}.jpeg"


def write_whatsup(world: Path, tests: dict[str, dict], out: Path) -> None:
    """The controlled tests in What'sUp's published layout under ``out``: per test its JSON list of ``{"image_path":
    "data/<folder>/<name>.jpeg", "caption_options": [the true caption, the other three]}`` and its images (JPEG,
    quality 95), and ``objects.json``: each image's boxes as Visual Genome objects (``image_id`` its name, ``image``
    its file name)."""
    out.mkdir(parents=True, exist_ok=True)
    boxes = []
    for test, data in tests.items():
        stem, folder = _WHATSUP_SUBSETS[test]
        (out / folder).mkdir(exist_ok=True)
        entries = []
        for entry in data["sets"]:
            captions = [scene["caption"] for scene in entry["scenes"]]
            for scene, caption in zip(entry["scenes"], captions):
                name = _whatsup_name(entry["id"], entry["objects"], scene["predicate"])
                Image.open(world / scene["file_name"]).convert("RGB").save(out / folder / name, quality=95)
                entries.append({"image_path": f"data/{folder}/{name}",
                                "caption_options": [caption] + [c for c in captions if c != caption]})
                boxes.append({"image_id": name.rsplit(".", 1)[0], "image": f"{folder}/{name}", "objects": [
                    {"x": o["box"][0], "y": o["box"][1], "w": o["box"][2] - o["box"][0],
                     "h": o["box"][3] - o["box"][1], "names": [f"{o['colour']} {o['shape']}"]}
                    for o in scene["objects"]]})
        dump_json(out / f"{stem}.json", entries)
    dump_json(out / "objects.json", boxes)
