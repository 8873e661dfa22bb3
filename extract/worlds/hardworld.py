"""The hard toy world: who is in front, what stands on what, in clutter (``python -m extract.worlds.toyworld --hard``).

Why a second world. In the version-2 world (:mod:`extract.worlds.toyworld`) every relation is a direction between two
box centres and no two objects touch, so a head that reads boxes has solved it. What'sUp's real subsets (Kamath et
al., EMNLP 2023, §3) ask what box centres cannot tell: Controlled-A **on / under** (support, contact), Controlled-B
**in front of / behind** (occlusion, depth), in images with clutter and partly hidden objects. This world asks the
same, and keeps the version-2 world's habits: scenes drawn by rule, truth decided by rule, no caption prior.

Scenes
    A ``size`` x ``size`` image (96 px by default) on a background that is not black (:func:`background`: noise,
    a gradient, stripes or a checker board, all in muted dark tones below every object colour's brightest
    channel), holding 2-8 objects of the version-2 vocabulary (shapes, colours, sizes ``small`` / ``large``: boxes
    of 18% / 26% of the side). Within a scene each (colour, shape) is unique. ``objects`` are listed in **drawing
    order**: a later object is drawn over an earlier one, so where two overlap the later one is in front.

    Each scene is built around one **named pair** (its relation caption's two objects): a predicate is drawn
    uniformly from :data:`PREDICATES` and the pair placed so that it holds and no other predicate of the eight holds
    between the two even under the lenient rules (:func:`place_pair`). The other objects are **distractors**,
    most of them sharing the colour or the shape of a named one; a distractor keeps a clearance from the named
    pair and is placed free, overlapping another distractor (one of them partly hidden) or resting on one.
    No object is hidden beyond :data:`MAX_HIDDEN` of its pixels (``visible`` in each object: its visible share).

Relations (the world's own rules, :func:`pair_relations`; side = image side in px)
    ``left of`` / ``right of``: the centres differ by more than DIRECTION_MARGIN x side in x (as version 2).
    ``above`` / ``below``: the centres differ by more than that margin in y **and** the boxes leave a vertical gap
    of at least SUPPORT_GAP x side, the two not overlapping (a touching pair is "on", not "above").
    ``on`` / ``under``: ``a on b`` iff a's bottom edge is b's top edge (the boxes touch: a.y1 == b.y0), their
    x-extents overlap by at least CONTACT_OVERLAP of the narrower box, and their pixels do not overlap.
    ``in front of`` / ``behind``: ``a in front of b`` iff a is drawn after b and a's pixels cover at least
    OCCLUSION of b's pixels (the front object owns the overlap).
    Lenient rules (:func:`pair_relations` with ``lenient=True``): margin LENIENT_DIRECTION_MARGIN; above / below
    with any gap (>= 1 px); on / under with the edges within 1 px and any x-overlap; in front of / behind with one
    shared pixel. Every hard negative must fail the lenient rules, every positive hold the strict ones, so a
    perceptual gap separates them. ``scene["relations"]`` lists what holds strictly, ``scene["lenient"]`` what
    holds leniently, each ``[i, predicate, j]``; :func:`satisfies` reads those.

Captions (``struct`` as in version 2; predicate words :data:`WORDS`, What'sUp's own)
    ``one-object`` per object ("a small red circle"); ``relation``, the named pair said from either side with even
    odds ("a red circle behind a blue square" or "a blue square in front of a red circle", What'sUp's form "a X on a
    Y"); ``long``: "five objects: a small red circle, ...; the red circle is on the blue square". Caption ids:
    ``image_id * CAPTION_SLOTS + k``.

No caption prior. The named predicate is uniform over the eight, said from either side, and the named pair holds
no other predicate even leniently, so each replace-rel negative is uniform over the other seven and a (caption
predicate, negative predicate) pair is as likely as its reverse; a swap-obj negative ("B on A") always fails. A
text-only model sits at chance (``train.eval.text_only``, measured in train/adapter/README).

Controlled tests (What'sUp's Controlled-A and -B analogues, :func:`generate_controlled`)
    ``controlled_a.json``: sets of two objects (different colours) in four images, the first **on**, **under**, **to
    the left of** and **to the right of** the second; ``controlled_b.json``: **in front of**, **behind**, left of,
    right of, the in-front and behind images holding the same two boxes (only the drawing order differs: no box
    tells them apart). One background per set, and one clutter pair (two other objects, drawn first, clear of the
    named pair) related the other way from the named pair in each image: one on the other in A, one overlapping the
    other in B (:data:`CLUTTER_STACKED`) where the named pair is side by side, side by side where it touches or
    overlaps. Every image holds one touching / overlapping pair and one side-by-side pair, so whether, or how often,
    two things touch or overlap tells no image from another. Each image satisfies its caption and, under the lenient
    rules, none of the other three (tested). Schema as the version-2 ``controlled.json``; the same tests are also
    written in What'sUp's published layout under ``whatsup/`` (:func:`write_whatsup`:
    ``controlled_images_dataset.json`` + ``controlled_images/``, ``controlled_clevr_dataset.json`` +
    ``controlled_clevr/``, JPEG, file names ``<object>_<preposition>_<object>.jpeg`` as the authors', and
    ``objects.json``, the boxes in Visual Genome's layout keyed by file name), so ``python -m train.eval
    --benchmark whatsup=DIR/whatsup --annotations DIR/whatsup/objects.json`` scores the toy copy with the reader of
    the real benchmark.

Zero-shot set: every val / test object's crop (:func:`zero_shot_crop`: its box on a black square CROP_SCALE times its
side, as the grounded head's entity crops; partly hidden objects included) in ``objects/<image_id>-<k>.png``,
named in the object's ``crop``; ``python -m train.eval`` classifies them by "colour shape".

Layout, splits, hold-out and determinism as version 2 (``meta.json`` says ``"hard": true``).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from PIL import Image, ImageDraw

from extract.worlds.shared import (COLOURS, CONTROLLED_A, CONTROLLED_B, CONTROLLED_FILES, NEGATIVE_TYPES, SHAPES,
                                   SPLITS, WHATSUP_DIR, combos, count_files, describe, draw_shape, dump_json, matches,
                                   mutations, parse_holdout, parse_splits, render_struct, split_of, write_split,
                                   write_whatsup)

HARD_VERSION = 1
PREDICATES = ("left of", "right of", "above", "below", "on", "under", "in front of", "behind")
CONVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above", "on": "under",
            "under": "on", "in front of": "behind", "behind": "in front of"}
WORDS = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below",
         "on": "on", "under": "under", "in front of": "in front of", "behind": "behind"}
SIZES = {"small": 0.18, "large": 0.26}  # box side as a fraction of the image side: 17 / 25 px at 96 px
DEFAULT_SIZE = 96
MIN_IMAGE_SIZE = 64
OBJECTS = (2, 8)  # per scene, inclusive
CAPTION_SLOTS = 12  # >= 8 one-object captions + 1 relation + 1 long
# Thresholds, fractions of the image side unless said.
GAP = 0.05  # clearance between boxes not placed to touch or overlap
DIRECTION_MARGIN = 0.15
LENIENT_DIRECTION_MARGIN = 0.05
SUPPORT_GAP = 0.08  # above / below: at least this much background between the boxes (8 px at 96)
CONTACT_OVERLAP = 0.5  # on / under: x-overlap, share of the narrower box
OCCLUSION = 0.15  # in front of: share of the back object's pixels the front one covers, at least
MAX_HIDDEN = 0.5  # no object hidden beyond this share of its pixels
PLACEMENT_TRIES = 200
CROP_SCALE = 3  # the zero-shot crop: the object's tight box centred on a black square this many times its side, what
# the grounded head's entity crops are for the toy bases (regions.crop_regions, backbones.json crop_scale 3); the
# object then fills a third of the input, as objects do in the scenes a base trained on (toy-clip fine-tuned on this
# world, after 5 epochs: 88% from these, 25% from tight crops blown up to the whole input, 52% from 3x crops with
# their surroundings)
# each controlled set's clutter: two distractors related the other way from the named pair in every image: one on /
# overlapping the other (CLUTTER_STACKED) where the named pair is side by side, side by side (CLUTTER_APART) where the
# named pair touches or overlaps. Every image then holds one stacked pair and one side-by-side pair, and only which
# pair is which tells the four apart. Measured on toy-negclip-hard's Controlled-B (extract/README, the hard world):
# with one overlapping clutter pair in all four images, how many pairs overlap (two in the in-front / behind images,
# one in the others) told them apart: over 1,000 sets caption / image choice 36.55 / 29.3 (chance 25); with the
# clutter related the other way, 34.8 / 25.9.
CLUTTER_STACKED = {"A": "on", "B": "in front of"}
CLUTTER_APART = "left of"


@dataclass(frozen=True)
class HardSettings:
    """What defines a hard world (worker count excluded: it never changes the output)."""

    n: int
    seed: int
    size: int = DEFAULT_SIZE
    holdout: frozenset = frozenset()
    splits: tuple[float, float, float] = (0.8, 0.1, 0.1)


# --------------------------------------------------------------------------- rules


def _side(name: str, size: int) -> int:
    return round(SIZES[name] * size)


def mask_of(shape: str, box: Sequence[int], size: int) -> np.ndarray:
    """The pixels ``shape`` covers in its box, as a boolean ``size`` x ``size`` array (drawn as :func:`draw` does)."""
    image = Image.new("L", (size, size), 0)
    draw_shape(ImageDraw.Draw(image), shape, box, 255)
    return np.asarray(image) > 0


def visible_masks(objects: Sequence[dict], size: int) -> list[np.ndarray]:
    """Each object's visible pixels (boolean ``size`` x ``size``): its own, less those of the objects drawn after it."""
    covered = np.zeros((size, size), dtype=bool)
    out = [covered] * len(objects)
    for k in range(len(objects) - 1, -1, -1):  # front to back
        mask = mask_of(objects[k]["shape"], objects[k]["box"], size)
        out[k] = mask & ~covered
        covered = covered | mask
    return out


def _centre(box: Sequence[int]) -> tuple[float, float]:
    return (box[0] + box[2]) / 2.0, (box[1] + box[3]) / 2.0


def pair_relations(a: dict, b: dict, a_first: bool, shared: int, pixels: tuple[int, int], size: int,
                   lenient: bool = False) -> set[str]:
    """The predicates of :data:`PREDICATES` that hold for ``a ? b`` (rules: module docstring). ``a`` and ``b`` are
    objects with a ``box``; ``a_first``: a is drawn before b; ``shared``: pixels their shapes share; ``pixels``:
    each one's own pixel count."""
    out = set()
    margin = (LENIENT_DIRECTION_MARGIN if lenient else DIRECTION_MARGIN) * size
    (ax, ay), (bx, by) = _centre(a["box"]), _centre(b["box"])
    if bx - ax > margin:
        out.add("left of")
    if ax - bx > margin:
        out.add("right of")
    ab, ba = b["box"][1] - a["box"][3], a["box"][1] - b["box"][3]  # vertical gaps: a over b, b over a
    if not shared:
        min_gap = 1 if lenient else SUPPORT_GAP * size
        if by - ay > margin and ab >= min_gap:
            out.add("above")
        if ay - by > margin and ba >= min_gap:
            out.add("below")
        x_overlap = min(a["box"][2], b["box"][2]) - max(a["box"][0], b["box"][0])
        narrow = min(a["box"][2] - a["box"][0], b["box"][2] - b["box"][0])
        need = 1 if lenient else CONTACT_OVERLAP * narrow
        if x_overlap >= need:
            if (abs(ab) <= 1) if lenient else ab == 0:
                out.add("on")
            if (abs(ba) <= 1) if lenient else ba == 0:
                out.add("under")
    elif lenient:
        out.add("behind" if a_first else "in front of")
    else:
        hidden = shared / (pixels[0] if a_first else pixels[1])  # share of the one drawn first
        if hidden >= OCCLUSION:
            out.add("behind" if a_first else "in front of")
    return out


def relation_tables(objects: list[dict], size: int) -> tuple[list[list], list[list], list[float]]:
    """(strict relations, lenient relations, visible share of each object) of ``objects`` in drawing order."""
    masks = [mask_of(o["shape"], o["box"], size) for o in objects]
    pixels = [int(m.sum()) for m in masks]
    strict, lenient = [], []
    for i, a in enumerate(objects):
        for j, b in enumerate(objects):
            if i == j:
                continue
            shared = int((masks[i] & masks[j]).sum())
            for rules, lenient_rules in ((strict, False), (lenient, True)):
                held = pair_relations(a, b, i < j, shared, (pixels[i], pixels[j]), size, lenient_rules)
                rules += [[i, p, j] for p in PREDICATES if p in held]
    covered = np.zeros((size, size), dtype=bool)
    visible = [0.0] * len(objects)
    for k in range(len(objects) - 1, -1, -1):  # front to back
        visible[k] = float((masks[k] & ~covered).sum()) / max(1, pixels[k])
        covered |= masks[k]
    return strict, lenient, visible


def satisfies(scene: dict, struct: dict, *, lenient: bool = False) -> bool:
    """Whether caption ``struct`` is true of hard-world ``scene``: its objects map injectively onto scene objects with
    the attributes named, every ``[i, predicate, j]`` is in the scene's ``relations`` (``lenient``: its ``lenient``
    table) for the mapped objects, and ``count``, when given, is the scene's number of objects. The 3D world's wide
    language (``extract.worlds.language3d``) adds ``[i, "between", j, k]`` (read from the scene's ``between`` /
    ``lenient_between`` tables, ``[a, b, c]`` with ``b < c``: between is symmetric in its ends) and ``counts``
    (``[k, n]``: exactly ``n`` scene objects have object ``k``'s attributes, lenient or not)."""
    objects = scene["objects"]
    if "count" in struct and struct["count"] != len(objects):
        return False
    if any(sum(matches(o, struct["objects"][k]) for o in objects) != n for k, n in struct.get("counts", ())):
        return False
    table = {tuple(r) for r in scene["lenient" if lenient else "relations"]}
    threes = {tuple(r) for r in scene.get("lenient_between" if lenient else "between", ())}
    options = [[k for k, obj in enumerate(objects) if matches(obj, w)] for w in struct["objects"]]

    def holds(used: tuple, relation: list) -> bool:
        if len(relation) == 4:  # [i, "between", j, k]
            i, _, j, k = relation
            return (used[i], min(used[j], used[k]), max(used[j], used[k])) in threes
        i, p, j = relation
        return (used[i], p, used[j]) in table

    def search(k: int, used: tuple) -> bool:
        if k == len(options):
            return all(holds(used, r) for r in struct["relations"])
        return any(search(k + 1, used + (c,)) for c in options[k] if c not in used)

    return search(0, ())


# --------------------------------------------------------------------------- backgrounds and drawing


def background(rng: np.random.Generator, size: int) -> dict:
    """A background's recipe (drawn by :func:`paint_background`): ``kind`` noise / gradient / stripes / checker and
    its parameters, in muted dark tones (every channel <= 95, below the brightest channel of every object colour)."""
    grey = int(rng.integers(20, 70))
    tint = [int(v) for v in rng.integers(-10, 11, size=3)]
    base = [min(95, max(0, grey + t)) for t in tint]
    other = [min(95, max(0, v + int(d))) for v, d in zip(base, rng.integers(-25, 26, size=3))]
    kind = ("noise", "gradient", "stripes", "checker")[int(rng.integers(4))]
    return {"kind": kind, "base": base, "other": other, "period": int(rng.integers(4, 11)),
            "angle": int(rng.integers(0, 4)) * 45, "noise_seed": int(rng.integers(2 ** 31))}


def paint_background(recipe: dict, size: int) -> np.ndarray:
    """``size`` x ``size`` x 3 uint8 pixels of a :func:`background` recipe."""
    base, other = np.array(recipe["base"], float), np.array(recipe["other"], float)
    y, x = np.mgrid[0:size, 0:size].astype(float)
    angle = math.radians(recipe["angle"])
    along = x * math.cos(angle) + y * math.sin(angle)
    kind = recipe["kind"]
    if kind == "noise":
        rng = np.random.default_rng(recipe["noise_seed"])
        pixels = base + rng.normal(0.0, 10.0, size=(size, size, 1)) + rng.normal(0.0, 3.0, size=(size, size, 3))
    elif kind == "gradient":
        t = (along - along.min()) / max(1e-9, float(along.max() - along.min()))
        pixels = base + t[..., None] * (other - base)
    elif kind == "stripes":
        band = (np.floor(along / recipe["period"]).astype(int) % 2)[..., None]
        pixels = np.where(band == 1, other, base)
    else:
        cell = ((np.floor(x / recipe["period"]) + np.floor(y / recipe["period"])).astype(int) % 2)[..., None]
        pixels = np.where(cell == 1, other, base)
    return np.clip(np.rint(pixels), 0, 95).astype(np.uint8)


def draw(scene: dict) -> Image.Image:
    """Render a hard-world scene: its background, then its objects in order (later ones in front)."""
    image = Image.fromarray(paint_background(scene["background"], scene["width"]), "RGB")
    pen = ImageDraw.Draw(image)
    for obj in scene["objects"]:
        draw_shape(pen, obj["shape"], obj["box"], COLOURS[obj["colour"]])
    return image


# --------------------------------------------------------------------------- placing the named pair


def _gap(a: Sequence[int], b: Sequence[int]) -> float:
    gx = max(0, b[0] - a[2], a[0] - b[2])
    gy = max(0, b[1] - a[3], a[1] - b[3])
    return math.hypot(gx, gy)


def _inside(box: Sequence[int], size: int) -> bool:
    return box[0] >= 0 and box[1] >= 0 and box[2] <= size and box[3] <= size


def _box(x0: int, y0: int, side: int) -> list[int]:
    return [int(x0), int(y0), int(x0) + side, int(y0) + side]


def _candidate(rng: np.random.Generator, predicate: str, sides: tuple[int, int], size: int) -> list[list[int]]:
    """Boxes of subject and object for ``predicate`` in the subject's frame (one random try)."""
    sa, sb = sides
    clear = max(1, round(GAP * size))
    bx, by = (int(v) for v in rng.integers(0, size - sb + 1, size=2))
    b = _box(bx, by, sb)
    cbx, cby = _centre(b)
    jitter = int(rng.integers(-2, 3))
    if predicate in ("left of", "right of"):
        gap = int(rng.integers(clear, max(clear + 1, size // 3)))
        x0 = bx - gap - sa if predicate == "left of" else bx + sb + gap
        return [_box(x0, round(cby - sa / 2) + jitter, sa), b]
    if predicate in ("above", "below"):
        gap = int(rng.integers(math.ceil(SUPPORT_GAP * size), max(math.ceil(SUPPORT_GAP * size) + 1, size // 3)))
        y0 = by - gap - sa if predicate == "above" else by + sb + gap
        return [_box(round(cbx - sa / 2) + jitter, y0, sa), b]
    if predicate in ("on", "under"):
        y0 = by - sa if predicate == "on" else by + sb
        return [_box(round(cbx - sa / 2) + jitter, y0, sa), b]
    # in front of / behind: overlapping, centres within the lenient margin in x (no left / right), offset in y
    reach = math.floor(LENIENT_DIRECTION_MARGIN * size)
    dx = int(rng.integers(-reach, reach + 1))
    dy = int(rng.integers(-(sa + sb) // 2, (sa + sb) // 2 + 1))
    return [_box(round(cbx - sa / 2) + dx, round(cby - sa / 2) + dy, sa), b]


def _order(predicate: str) -> tuple[int, int]:
    """Drawing order of (subject, object): "in front of" draws the subject last."""
    return (1, 0) if predicate == "in front of" else (0, 1)


def _exactly(objects: list[dict], predicate: str, size: int, both_orders: bool = False) -> bool:
    """Whether objects[0] ``predicate`` objects[1] holds strictly, no other predicate leniently (either way round),
    and each keeps more than 1 - MAX_HIDDEN of its pixels (``both_orders``: also with the drawing order swapped, the
    controlled test's in-front / behind images sharing their boxes)."""
    orders = [_order(predicate)] + ([(1 - _order(predicate)[0], 1 - _order(predicate)[1])] if both_orders else [])
    for order in orders:
        drawn = [objects[k] for k in sorted((0, 1), key=lambda k: order[k])]
        strict, lenient, visible = relation_tables(drawn, size)
        subject = drawn.index(objects[0])
        expected = predicate if order == _order(predicate) else CONVERSE[predicate]
        want = [[subject, expected, 1 - subject]]
        if [r for r in strict if r[0] == subject] != want:
            return False
        if sorted(r for r in lenient if r[0] == subject) != want:
            return False
        if min(visible) < 1 - MAX_HIDDEN:
            return False
    return True


def place_pair(rng: np.random.Generator, objects: list[dict], predicate: str, size: int,
               both_orders: bool = False) -> list[list[int]]:
    """Boxes for two objects (with ``size`` names) such that ``objects[0] predicate objects[1]`` holds and no other
    of :data:`PREDICATES` holds between them even leniently (:func:`_exactly`). RuntimeError after PLACEMENT_TRIES x
    20 tries (never seen at size >= 64)."""
    sides = (_side(objects[0]["size"], size), _side(objects[1]["size"], size))
    for _ in range(PLACEMENT_TRIES * 20):
        boxes = _candidate(rng, predicate, sides, size)
        if not all(_inside(b, size) for b in boxes):
            continue
        placed = [{**o, "box": b} for o, b in zip(objects, boxes)]
        if _exactly(placed, predicate, size, both_orders):
            return boxes
    raise RuntimeError(f"no placement of {predicate!r} for sides {sides} in {size} px")


# --------------------------------------------------------------------------- scenes


def _pick_objects(rng: np.random.Generator, count: int, allowed: list[tuple[str, str]]) -> list[dict]:
    """The named pair (different colours) and ``count - 2`` distractors, most sharing a named one's colour or shape;
    every (colour, shape) once."""
    first = allowed[int(rng.integers(len(allowed)))]
    second_options = [c for c in allowed if c[0] != first[0] and c != first]
    second = second_options[int(rng.integers(len(second_options)))]
    chosen = [first, second]
    for _ in range(count - 2):
        left = [c for c in allowed if c not in chosen]
        related = [c for c in left if c[0] in (first[0], second[0]) or c[1] in (first[1], second[1])]
        pool = related if related and rng.random() < 0.7 else left
        if not pool:
            break
        chosen.append(pool[int(rng.integers(len(pool)))])
    return [{"colour": c, "shape": s, "size": tuple(SIZES)[int(rng.integers(len(SIZES)))]} for c, s in chosen]


def _place_distractor(rng: np.random.Generator, obj: dict, placed: list[dict], distractors: list[int],
                      size: int) -> tuple[list[int], int | None, str] | None:
    """A box for a distractor, clear of every placed box, or overlapping / resting on one placed distractor:
    (box, partner index or None, mode) or None where it found no room."""
    side = _side(obj["size"], size)
    clear = max(1, round(GAP * size))
    mode = ("free", "overlap", "stacked")[int(rng.choice(3, p=(0.5, 0.3, 0.2)))] if distractors else "free"
    for _ in range(PLACEMENT_TRIES):
        partner = None
        if mode == "free":
            x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        else:
            partner = distractors[int(rng.integers(len(distractors)))]
            px0, py0, px1, py1 = placed[partner]["box"]
            cx = (px0 + px1) / 2 + int(rng.integers(-side // 3, side // 3 + 1))
            x0 = round(cx - side / 2)
            if mode == "stacked":
                y0 = py0 - side if rng.random() < 0.5 else py1
            else:
                y0 = int(rng.integers(py0 - side + 3, py1 - 2))
        box = _box(x0, y0, side)
        if not _inside(box, size):
            continue
        if all(_gap(box, other["box"]) >= clear for k, other in enumerate(placed) if k != partner):
            return box, partner, mode
    return None


def _layout(rng: np.random.Generator, settings: HardSettings, split: str) -> tuple[list[dict], dict]:
    """Objects in drawing order and the named pair ``{"subject", "predicate", "object"}`` (indices into them)."""
    allowed = [(c, s) for c in COLOURS for s in SHAPES if split != "train" or (c, s) not in settings.holdout]
    count = int(rng.integers(OBJECTS[0], OBJECTS[1] + 1))
    objects = _pick_objects(rng, count, allowed)
    predicate = PREDICATES[int(rng.integers(len(PREDICATES)))]
    overlapping = predicate in ("in front of", "behind")
    if overlapping:
        # one size and boxes valid in either drawing order: the pair's geometry then says nothing of which one is in
        # front (with free sizes, which one could hide the other enough and not too much told it 89% of the time)
        objects[1]["size"] = objects[0]["size"]
    boxes = place_pair(rng, objects[:2], predicate, settings.size, both_orders=overlapping)
    placed = [{**o, "box": b} for o, b in zip(objects[:2], boxes)]
    depth = [float(_order(predicate)[0]), float(_order(predicate)[1])]  # the pair drawn in its order
    distractors: list[int] = []
    for obj in objects[2:]:
        found = _place_distractor(rng, obj, placed, distractors, settings.size)
        if found is None:
            continue  # no room: the scene holds fewer objects
        box, partner, mode = found
        placed.append({**obj, "box": box})
        if partner is None:
            depth.append(float(rng.uniform(-1, 2)))
        else:  # over or under its partner, by a coin
            depth.append(depth[partner] + (0.001 if rng.random() < 0.5 else -0.001) * (len(placed)))
        trial = sorted(range(len(placed)), key=lambda k: depth[k])
        _, _, visible = relation_tables([placed[k] for k in trial], settings.size)
        if min(visible) < 1 - MAX_HIDDEN or (mode == "overlap" and _hides_nothing(placed, partner, settings.size)):
            placed.pop(), depth.pop()  # hides too much, or an overlap that covers no pixel: drop it
            continue
        distractors.append(len(placed) - 1)
    order = sorted(range(len(placed)), key=lambda k: depth[k])
    drawn = [placed[k] for k in order]
    named = {"subject": order.index(0), "predicate": predicate, "object": order.index(1)}
    return drawn, named


def _hides_nothing(placed: list[dict], partner: int, size: int) -> bool:
    new, other = placed[-1], placed[partner]
    return not (mask_of(new["shape"], new["box"], size) & mask_of(other["shape"], other["box"], size)).any()


def scene_captions(scene: dict, named: dict, rng: np.random.Generator) -> list[dict]:
    """A scene's captions: one per object, the named relation said from either side, a long one (every object,
    one relation)."""
    objects = scene["objects"]
    structs = [("one-object", {"objects": [describe(o, True)], "relations": []}) for o in objects]
    s, p, o = named["subject"], named["predicate"], named["object"]
    pair = (s, p, o) if rng.random() < 0.5 else (o, CONVERSE[p], s)  # said from either side
    structs.append(("relation", {"objects": [describe(objects[pair[0]], False), describe(objects[pair[2]], False)],
                                 "relations": [[0, pair[1], 1]]}))
    long_pair = (s, p, o) if rng.random() < 0.5 else (o, CONVERSE[p], s)
    structs.append(("long", {"objects": [describe(x, True) for x in objects],
                             "relations": [[long_pair[0], long_pair[1], long_pair[2]]], "count": len(objects)}))
    return [{"id": scene["image_id"] * CAPTION_SLOTS + k, "kind": kind, "text": render(struct), "struct": struct}
            for k, (kind, struct) in enumerate(structs)]


def render(struct: dict) -> str:
    """The caption text of a hard-world ``struct`` (:data:`WORDS`)."""
    return render_struct(struct, WORDS)


def acceptable(scene: dict, struct: dict, holdout: frozenset) -> bool:
    """Whether ``struct`` may serve as a hard negative of ``scene``: no combination twice, none held out in train,
    and false of the scene even by its lenient table."""
    named = combos(struct)
    if len(set(named)) < len(named):
        return False
    if scene["split"] == "train" and holdout.intersection(named):
        return False
    return not satisfies(scene, struct, lenient=True)


def negative_candidates(scene: dict, struct: dict, neg_type: str,
                        holdout: frozenset = frozenset()) -> list[tuple[dict, bool]]:
    """Every candidate of ``neg_type`` for ``struct`` with whether it is acceptable (as version 2's)."""
    return [(c, acceptable(scene, c, holdout)) for c in mutations(struct, neg_type, PREDICATES)]


def scene_negatives(scene: dict, caption: dict, rng: np.random.Generator, holdout: frozenset,
                    predicates: Sequence[str] = PREDICATES, colours: Iterable[str] = COLOURS,
                    shapes: Sequence[str] = SHAPES) -> list[dict]:
    """One acceptable hard negative of each type for ``caption`` (drawn in a random order), from a world's
    predicates and vocabulary (default: this world's)."""
    out = []
    for neg_type in NEGATIVE_TYPES:
        candidates = mutations(caption["struct"], neg_type, predicates, colours, shapes)
        for k in rng.permutation(len(candidates)):
            if acceptable(scene, candidates[k], holdout):
                out.append({"type": neg_type, "text": render(candidates[k]), "struct": candidates[k]})
                break
    return out


def build_scene(index: int, settings: HardSettings, out_dir: str | None) -> tuple[dict, list[dict]]:
    """Scene ``index`` (and its negatives' items), drawn and saved under ``out_dir`` when given."""
    rng = np.random.default_rng(np.random.SeedSequence([settings.seed, index, HARD_VERSION]))
    split = split_of(index, settings.splits)
    objects, named = _layout(rng, settings, split)
    strict, lenient, visible = relation_tables(objects, settings.size)
    for obj, share in zip(objects, visible):
        obj["visible"] = round(share, 3)
    scene = {"image_id": index, "file_name": f"images/{index:06d}.png", "split": split, "width": settings.size,
             "height": settings.size, "objects": objects, "relations": strict, "lenient": lenient,
             "named": named, "background": background(rng, settings.size)}
    scene["captions"] = scene_captions(scene, named, rng)
    items = []
    for caption in scene["captions"]:
        negatives = scene_negatives(scene, caption, rng, settings.holdout)
        if negatives:
            items.append({"image_id": index, "caption_id": caption["id"], "split": split,
                          "positive": caption["text"], "negatives": negatives})
    if split != "train":  # the zero-shot set of its objects (occluded ones included): each one's crop
        for k, obj in enumerate(objects):
            obj["crop"] = f"objects/{index:06d}-{k}.png"
    if out_dir is not None:
        image = draw(scene)
        image.save(os.path.join(out_dir, scene["file_name"]))
        for obj in objects:
            if "crop" in obj:
                zero_shot_crop(image, obj["box"]).save(os.path.join(out_dir, obj["crop"]))
    return scene, items


def zero_shot_crop(image: Image.Image, box: Sequence[int]) -> Image.Image:
    """An object's zero-shot image: its box's pixels centred on a black square CROP_SCALE times the box's side."""
    tight = image.crop(tuple(box))
    side = CROP_SCALE * max(tight.size)
    canvas = Image.new("RGB", (side, side), (0, 0, 0))
    canvas.paste(tight, ((side - tight.width) // 2, (side - tight.height) // 2))
    return canvas


def crop_entry(obj: dict) -> dict:
    """A box entry for an object's crop file (``obj["crop"]``): the crop's size and the object's box where
    :func:`zero_shot_crop` pasted it, so a head that reads boxes scores the zero-shot crops too."""
    x0, y0, x1, y1 = (int(v) for v in obj["box"])
    side = CROP_SCALE * max(x1 - x0, y1 - y0)
    left, top = (side - (x1 - x0)) // 2, (side - (y1 - y0)) // 2
    return {"file_name": obj["crop"], "width": side, "height": side,
            "objects": [{**obj, "box": [left, top, left + x1 - x0, top + y1 - y0]}]}


def _build_chunk(job: tuple[int, int, HardSettings, str]) -> list[tuple[dict, list[dict]]]:
    start, stop, settings, out_dir = job
    return [build_scene(i, settings, out_dir) for i in range(start, stop)]


# --------------------------------------------------------------------------- the controlled tests


def controlled_count(n: int) -> int:
    """Sets of each controlled test of an ``n``-scene world: one per 20 scenes."""
    return max(1, n // 20)


def _clutter_pair(rng: np.random.Generator, pair: list[dict], test: str) -> list[dict]:
    """The set's two distractors: (colour, shape) unlike both named objects', one size (placed as a B pair)."""
    named = {(o["colour"], o["shape"]) for o in pair}
    pool = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in named]
    first, second = (pool[k] for k in rng.choice(len(pool), size=2, replace=False))
    size = tuple(SIZES)[int(rng.integers(len(SIZES)))] if test == "B" else "small"
    return [{"colour": c, "shape": s, "size": size} for c, s in (first, second)]


def _stacked(predicate: str) -> bool:
    """Whether a controlled predicate puts its pair in touch or overlap (on, under, in front of, behind)."""
    return predicate not in ("left of", "right of")


def _arrangements(rng: np.random.Generator, pair: list[dict], clutter: list[dict], test: str,
                  size: int) -> tuple[dict, dict[bool, list[list[int]]]]:
    """Boxes of the named pair per predicate (the in-front / behind images sharing theirs) and of the clutter pair
    for each kind of image (keyed by whether the named pair is stacked there: the clutter then side by side, else
    stacked), each clear by GAP of the named boxes of the images it is drawn in; redrawn until such a placement
    exists."""
    clear = max(1, round(GAP * size))
    stacked = CLUTTER_STACKED[test]
    for _ in range(PLACEMENT_TRIES * 20):
        shared, boxes = None, {}
        for predicate in (CONTROLLED_A if test == "A" else CONTROLLED_B):
            if predicate in ("in front of", "behind"):
                shared = shared or place_pair(rng, pair, "in front of", size, both_orders=True)
                boxes[predicate] = shared
            else:
                boxes[predicate] = place_pair(rng, pair, predicate, size)
        extra = {}
        for named_stacked, predicate in ((True, CLUTTER_APART), (False, stacked)):
            named = [box for p, both in boxes.items() if _stacked(p) == named_stacked for box in both]
            for _ in range(20):
                found = place_pair(rng, clutter, predicate, size, both_orders=predicate == "in front of")
                if all(_gap(box, other) >= clear for box in found for other in named):
                    extra[named_stacked] = found
                    break
        if len(extra) == 2:
            return boxes, extra
    raise RuntimeError(f"no room for controlled-{test}'s clutter in {size} px")


def _controlled_set(index: int, settings: HardSettings, test: str) -> dict:
    predicates = CONTROLLED_A if test == "A" else CONTROLLED_B
    rng = np.random.default_rng(np.random.SeedSequence([settings.seed, index, HARD_VERSION, ord(test)]))
    every = [(c, s) for c in COLOURS for s in SHAPES]
    first = every[int(rng.integers(len(every)))]
    rest = [c for c in every if c[0] != first[0]]
    second = rest[int(rng.integers(len(rest)))]
    sizes = [tuple(SIZES)[int(rng.integers(len(SIZES)))] for _ in range(2)]
    if test == "B":  # one size: each of the two must hide enough of the other, and not too much, in either order
        sizes[1] = sizes[0]
    pair = [{"colour": c, "shape": s, "size": z} for (c, s), z in zip((first, second), sizes)]
    recipe = background(rng, settings.size)
    clutter = _clutter_pair(rng, pair, test)
    boxes, clutter_boxes = _arrangements(rng, pair, clutter, test, settings.size)
    scenes = []
    for predicate in predicates:
        # the clutter drawn first, in the order its predicate asks (the front one of an overlapping pair last)
        behind = [{**o, "box": b} for o, b in zip(clutter, clutter_boxes[_stacked(predicate)])]
        behind = behind[::-1] if not _stacked(predicate) and CLUTTER_STACKED[test] == "in front of" else behind
        placed = [{**o, "box": b} for o, b in zip(pair, boxes[predicate])]
        drawn = [dict(o) for o in behind] + (placed[::-1] if predicate == "in front of" else placed)
        strict, lenient, visible = relation_tables(drawn, settings.size)
        for obj, share in zip(drawn, visible):
            obj["visible"] = round(share, 3)
        struct = {"objects": [describe(o, False) for o in pair], "relations": [[0, predicate, 1]]}
        slug = predicate.replace(" ", "-")
        scenes.append({"predicate": predicate, "width": settings.size, "height": settings.size,
                       "file_name": f"images/controlled_{test.lower()}/{test.lower()}{index:04d}-{slug}.png",
                       "objects": drawn, "relations": strict, "lenient": lenient, "background": recipe,
                       "caption": render(struct), "struct": struct})
    return {"id": index, "objects": pair, "clutter": clutter, "scenes": scenes,
            "heldout": bool(settings.holdout.intersection([first, second]))}


def generate_controlled(out_dir: str | os.PathLike, settings: HardSettings) -> dict[str, dict]:
    """Write both controlled tests (``controlled_a.json``, ``controlled_b.json`` and their images; schema as version
    2's ``controlled.json``, each scene with its relation tables) and their What'sUp-layout copy; returns
    ``{"A": data, "B": data}``."""
    out = Path(out_dir)
    written = {}
    for test, file in CONTROLLED_FILES.items():
        (out / "images" / f"controlled_{test.lower()}").mkdir(parents=True, exist_ok=True)
        sets = [_controlled_set(k, settings, test) for k in range(controlled_count(settings.n))]
        for entry in sets:
            for scene in entry["scenes"]:
                draw(scene).save(out / scene["file_name"])
        written[test] = {"version": HARD_VERSION, "test": f"controlled-{test}",
                         "predicates": list(CONTROLLED_A if test == "A" else CONTROLLED_B), "sets": sets}
        dump_json(out / file, written[test])
    write_whatsup(out, written, out / WHATSUP_DIR)
    return written


# --------------------------------------------------------------------------- the world


def _counts(scenes: list[dict], items: list[dict], holdout: frozenset) -> dict:
    out = count_files(scenes, items, holdout)
    named = dict.fromkeys(PREDICATES, 0)
    for scene in scenes:
        named[scene["named"]["predicate"]] += 1
    hidden = sum(o["visible"] < 0.999 for s in scenes for o in s["objects"])
    return {**out, "named_predicates": named, "partly_hidden_objects": hidden}


def _settings_dict(settings: HardSettings) -> dict:
    return {"version": HARD_VERSION, "hard": True, "n": settings.n, "seed": settings.seed, "size": settings.size,
            "holdout": sorted(f"{c} {s}" for c, s in settings.holdout), "splits": list(settings.splits)}


def _vocabulary(settings: HardSettings) -> dict:
    return {"shapes": list(SHAPES), "colours": {k: list(v) for k, v in COLOURS.items()},
            "sizes_px": {k: _side(k, settings.size) for k in SIZES}, "predicates": list(PREDICATES),
            "words": WORDS, "negative_types": list(NEGATIVE_TYPES), "objects_per_scene": list(OBJECTS),
            "thresholds": {"gap": GAP, "direction_margin": DIRECTION_MARGIN, "support_gap": SUPPORT_GAP,
                           "lenient_direction_margin": LENIENT_DIRECTION_MARGIN, "contact_overlap": CONTACT_OVERLAP,
                           "occlusion": OCCLUSION, "max_hidden": MAX_HIDDEN,
                           "unit": "fraction of image side (contact_overlap: of the narrower box; occlusion, "
                                   "max_hidden: of an object's pixels)"},
            "caption_id": f"image_id * {CAPTION_SLOTS} + k"}


def generate(out_dir: str | os.PathLike, n: int, seed: int, size: int = DEFAULT_SIZE, holdout: str | Iterable = (),
             splits: str | Sequence[float] = (0.8, 0.1, 0.1), workers: int | None = None) -> dict:
    """Write ``n`` hard-world scenes and both controlled tests to ``out_dir`` (layout as the version-2 world's, plus
    ``controlled_a.json``, ``controlled_b.json`` and ``whatsup/``) and return a summary (settings, ``counts``,
    ``workers``, ``seconds``). ``workers`` never changes the output. Raises ValueError on invalid settings."""
    started = time.perf_counter()
    if n < 1 or seed < 0 or size < MIN_IMAGE_SIZE:
        raise ValueError(f"--hard needs n >= 1, seed >= 0 and size >= {MIN_IMAGE_SIZE}; got n={n}, seed={seed}, "
                         f"size={size}")
    settings = HardSettings(n=int(n), seed=int(seed), size=int(size), holdout=parse_holdout(holdout),
                            splits=parse_splits(splits))
    workers = max(1, int(workers or os.cpu_count() or 1))
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "objects").mkdir(exist_ok=True)
    chunk = max(1, min(250, math.ceil(settings.n / (4 * workers))))
    jobs = [(start, min(start + chunk, settings.n), settings, str(out)) for start in range(0, settings.n, chunk)]
    if workers == 1 or len(jobs) == 1:
        results = [r for job in jobs for r in _build_chunk(job)]
    else:
        with Pool(min(workers, len(jobs))) as pool:
            results = [r for part in pool.imap(_build_chunk, jobs) for r in part]
    scenes = [scene for scene, _ in results]
    items = [item for _, scene_items in results for item in scene_items]
    core = _settings_dict(settings)
    dump_json(out / "annotations.json", {"meta": {**core, **_vocabulary(settings)}, "scenes": scenes})
    dump_json(out / "negatives.json", {"items": items})
    for split in SPLITS:
        write_split(out, split, [s for s in scenes if s["split"] == split], settings.seed, HARD_VERSION)
    counts = _counts(scenes, items, settings.holdout)
    tests = generate_controlled(out, settings)
    counts["controlled_sets"] = {f"controlled-{k}": len(v["sets"]) for k, v in tests.items()}
    dump_json(out / "meta.json", {**core, "workers": workers, "counts": counts})
    return {**core, "out": str(out), "workers": workers, "counts": counts, "seconds": time.perf_counter() - started}


def is_hard(world: str | os.PathLike) -> bool:
    """Whether the toy world at ``world`` is a hard one (its ``meta.json`` says ``"hard": true``)."""
    try:
        return bool(json.loads((Path(world) / "meta.json").read_text()).get("hard"))
    except (OSError, ValueError):
        return False


def format_summary(summary: dict, headline: str | None = None) -> str:
    """A short human-readable report of a :func:`generate` summary (``headline``: another world's first line)."""
    counts = summary["counts"]
    lines = [headline or
             f"toyworld (hard): {summary['n']} scenes ({summary['size']}x{summary['size']} px, seed {summary['seed']},"
             f" {counts['objects']} objects, {counts['partly_hidden_objects']} partly hidden) -> {summary['out']} in "
             f"{summary['seconds']:.1f} s with {summary['workers']} worker(s)",
             f"  {'split':<6}{'images':>8}{'captions':>10}{'negatives':>11}{'held-out objs':>15}"]
    for name, c in counts["splits"].items():
        lines.append(f"  {name:<6}{c['images']:>8}{c['captions']:>10}{c['negatives']:>11}{c['heldout_objects']:>15}")
    lines.append("  named relations: " + ", ".join(f"{k}={v}" for k, v in counts["named_predicates"].items()))
    lines.append("  negatives by type: " + ", ".join(f"{k}={v}" for k, v in counts["negatives_by_type"].items()))
    lines.append("  controlled tests: " + ", ".join(f"{k} {v} sets" for k, v in counts["controlled_sets"].items())
                 + f" (What'sUp layout: {Path(summary['out']) / WHATSUP_DIR})")
    if summary["holdout"]:
        lines.append(f"  held out of train: {', '.join(summary['holdout'])}")
    return "\n".join(lines)
