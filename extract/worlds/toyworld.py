"""Toy world: procedurally drawn scenes of coloured shapes, the project's embedded default dataset.

``python -m extract.worlds.toyworld --out DIR --n N --seed S [--size 64] [--holdout "red circle,blue square"]
[--splits 0.8,0.1,0.1] [--workers W] [--long-captions] [--phrases "left of=above,..."] [--config file.yaml]`` or
:func:`generate` writes N scenes with boxes, relations, captions and SugarCrepe/ARO-style hard negatives, and a
What'sUp-style controlled test.

Scenes
    A ``size`` x ``size`` RGB image on a black background holding 1-4 objects. Each object has a
    shape (:data:`SHAPES`), a colour (:data:`COLOURS`) and a size: ``small`` / ``large`` objects fill
    a square box whose side is 20% / 35% of the image side (13 / 22 px at 64 px). Within a scene each
    (colour, shape) pair is unique, so "red circle" names one object. Positions are uniform, by
    rejection: boxes are placed largest first, each redrawn (up to PLACEMENT_TRIES) until it keeps
    at least ``GAP`` x size (3 px at 64 px) of background from every box already placed; a failed
    layout is restarted (up to LAYOUT_TRIES) and only then are the boxes that found no room dropped
    (about 1 scene in 7,000 at 64 px). ``objects`` keep their random draw order, not placement order.

Coordinates
    Pixels, origin top left, x right, y down. ``box = [x0, y0, x1, y1]`` is half-open: the object
    covers columns x0 <= x < x1 and rows y0 <= y < y1 and touches all four sides of the box
    (circle: inscribed disc; triangle: apex up; diamond; 5-point star; hexagon with flat top and
    bottom). Drawing is not anti-aliased, so every pixel in a box is the object's colour or black.

Relations (``scene["relations"]``: every ordered pair (i, j) with each predicate that holds)
    With centres c = ((x0 + x1) / 2, (y0 + y1) / 2) and side = image side in px:
    ``i left of j``  iff c_j.x - c_i.x > DIRECTION_MARGIN * side (9.6 px at 64 px);
    ``i right of j`` iff c_i.x - c_j.x > that margin; ``above`` / ``below`` likewise on y (y down,
    so "above" means a smaller y). ``i next to j`` iff the Euclidean gap between the two boxes (0
    when they touch) is <= NEAR * side. Centres differing by less than the margin are in neither
    direction, so a positive relation is never a judgement call.
    :func:`satisfies` with ``lenient=True`` relaxes the thresholds (direction margin
    LENIENT_DIRECTION_MARGIN, next-to gap LENIENT_NEAR). Hard negatives must fail even the lenient
    test, which keeps a perceptual gap between every positive and its negatives.

Captions (``struct`` is the truth, ``text`` is rendered from it by :func:`render`)
    struct = ``{"objects": [{"colour", "shape"[, "size"]}], "relations": [[i, predicate, j]],
    ["count": int]}``. It is true for a scene iff the caption objects map injectively onto scene
    objects with matching attributes (those present), every relation holds between the mapped
    objects, and the scene has exactly ``count`` objects when ``count`` is given.
    - ``one-object``, one per object: "a small red circle".
    - ``relation``, one when a scene has >= 2 objects: a random ordered pair and one of its
      directions (``CAPTION_PREDICATES``: no caption says "next to", see there), without sizes:
      "a red circle to the left of a blue square".
    - ``long``, always: "three objects: a small red circle, a large blue square and a small green
      star; the red circle is to the left of the blue square, the green star is below the blue
      square" (objects in scene order; one clause per consecutive pair whose dominant-axis direction
      holds, said from either end with even odds, so clause order tells nothing).
    Replace-rel negatives draw from the four directions too: with them a text-only model sits at chance on
    replace-rel, swap-obj and swap-att (``train.eval.text_only``; before VERSION 2 it read replace-rel at 61%).
    Caption ids are ``image_id * CAPTION_SLOTS + k`` (k = position in the scene's caption list), so
    they are unique and do not depend on chunking.

Long-caption mode (``--long-captions``; off by default, and then nothing above changes)
    For SmartCLIP's and Long-CLIP's claim (long, multi-concept captions; SmartCLIP paper §6.1 fine-tunes on
    ShareGPT4V captions of up to 248 tokens): each scene holds LONG_OBJECTS = 4-8 objects, smaller so that 8
    fit (LONG_SIZES: 16% / 22% of the side, 10 / 14 px at 64 px; same gap, thresholds and relation rules),
    and its ``long`` caption is a dense description: "six objects: a small red circle, ... and a large gray
    star. the small red circle is to the left of the large blue square and above the small green star. the
    large blue square is ..." -- every object with its attributes, then for each object (scene order) its
    nearest others (centre distance; 3 of them in scenes of <= 5 objects, 2 above) with the clearest
    predicate that holds, every mention naming size, colour and shape (struct: ``"dense": true``, one
    sentence per run of relations with the same subject). That is 122-226 tokens of CLIP's tokenizer
    (median 169; 4 objects: 122-152, 8 objects: 196-226; every one past 77, so a 77-token text encoder sees
    the object list and the first relation sentences only). One-object and relation captions are as above.
    Caption ids are ``image_id * LONG_CAPTION_SLOTS + k`` (16 slots), ``meta`` records
    ``"long_captions": true`` and ``objects_per_scene``; negatives and ``satisfies`` work unchanged (every
    dense caption is true of its scene, every negative false under the lenient rules, both tested).

Hard negatives (at most one per type per caption, each a mutated struct)
    ``replace-att`` change one object's colour (or size where sizes are named); ``replace-obj``
    change one shape; ``replace-rel`` change one predicate; ``swap-att`` exchange the colours (or
    sizes) of two objects; ``swap-obj`` exchange subject and object of one relation; ``add-obj`` add
    an object that the scene lacks (not for long captions: they claim to name every object). A
    candidate is kept only if it fails ``satisfies(scene, struct, lenient=True)``, names no
    (colour, shape) twice and, in the train split, mentions no held-out combination.

Controlled test (``controlled.json``, ``images/controlled/``; What'sUp, Kamath et al. EMNLP 2023)
    N / 20 sets (at least one), each two objects of any colour-shape combinations (held-out ones included and
    marked ``heldout``) drawn in four images: the first left of, right of, above and below the second, the
    centres aligned on the other axis so that no other of the four holds even under the lenient rules; each
    image's caption is a relation caption ("a red circle to the left of a blue square"). Only who is where
    differs between a set's images and between its captions: four-way caption choice per image, four-way image
    choice per caption, chance 25 (``train.eval.datasets.read_toyworld_controlled``). Seeded by the world's seed.

Predicate words (``--phrases``)
    ``--phrases "left of=above,above=to the left of"`` says other words for some predicates in every caption and
    negative of the world; structs, relations and their truth keep the predicate's meaning. The default world's
    files are unchanged (``meta.json`` records ``phrases`` only when given).

Splits and hold-out
    Scene i goes to a split by the golden-ratio sequence frac(i * 0.618...) against the cumulative
    split fractions: a fixed function of i that is close to the requested proportions at every n.
    Train scenes never contain a held-out (colour, shape); val/test scenes are sampled freely.

Determinism
    Scene i draws everything from ``numpy.random.default_rng(SeedSequence([seed, i]))``, so the
    output is independent of worker count and chunking; JSON is written with sorted keys and
    compact, pixels are ints, PNGs are re-encoded identically.

Code: the rules above (constants, relations, truth, captions, negatives) are ``extract.worlds.toyrules``; this module
lays scenes out, draws and writes them, and holds the controlled test and the command line.

Output layout in DIR
    ``images/{i:06d}.png``; ``{split}.csv`` (header ``filepath,title``, paths relative to DIR, one
    row per caption, an image's rows consecutive); ``{split}_coco.json`` (COCO captions, image id =
    scene index); ``annotations.json`` ({"meta", "scenes"}); ``negatives.json`` ({"items": [{
    "image_id", "caption_id", "split", "positive", "negatives": [{"type", "text", "struct"}]}]});
    ``meta.json`` (resolved settings + counts). Existing files are overwritten; other files in DIR
    are left alone.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from PIL import Image, ImageDraw

from extract.common.cli import Parser, from_namespace, option, run_job
from extract.common.cli import build_parser as build_cli
from extract.common.config import nonnegative_int, parse_with_config, positive_int
# the shared pieces (extract/worlds/shared.py), also this module's public names as before
from extract.worlds import hardworld, world3d_layout
from extract.worlds.shared import (COLOURS, CONTROLLED_FILE, CONTROLLED_FILES, COUNT_WORDS, NEGATIVE_TYPES, SHAPES,
                                   SPLITS, article, combos, count_files, describe, draw_shape, dump_json, heldout_of,
                                   is_toyworld, join_words, mutations, noun, parse_holdout, parse_splits, render_struct,
                                   split_of, write_split)
from extract.worlds.world3d import PALETTES as PALETTES_3D
from extract.worlds.world3d_layout import parse_holdout3d

# the rules (extract/worlds/toyrules.py), also this module's public names as before
from extract.worlds.toyrules import (BACKGROUND, CAPTION_PREDICATES, CAPTION_SLOTS, DIRECTION_MARGIN, GAP, LAYOUT_TRIES,
                                     LENIENT_DIRECTION_MARGIN, LENIENT_NEAR, LONG_CAPTION_SLOTS, LONG_OBJECTS,
                                     LONG_SIZES, MAX_OBJECTS, MIN_IMAGE_SIZE, NEAR, PLACEMENT_TRIES, PREDICATES, SIZES,
                                     VERSION, box_gap, caption_negatives, negative_candidates, parse_phrases,
                                     relation_holds, render, satisfies, scene_captions)

@dataclass(frozen=True)
class _Settings:
    """What defines the dataset (worker count excluded: it never changes the output)."""

    n: int
    seed: int
    size: int
    holdout: frozenset  # of (colour, shape)
    splits: tuple[float, float, float]
    long_captions: bool = False
    phrases: tuple = ()  # (predicate, phrase) pairs that replace _DEFAULT_PHRASES' wording (--phrases)

    @property
    def sizes(self) -> dict[str, float]:
        return LONG_SIZES if self.long_captions else SIZES

    @property
    def caption_slots(self) -> int:
        return LONG_CAPTION_SLOTS if self.long_captions else CAPTION_SLOTS


# --------------------------------------------------------------------------- scenes and drawing


def _box_side(size_name: str, image_size: int, sizes: dict[str, float] = SIZES) -> int:
    return round(sizes[size_name] * image_size)


def _place(side: int, boxes: list[list[int]], image_size: int, rng: np.random.Generator) -> list[int] | None:
    clearance = max(1, round(GAP * image_size))
    for _ in range(PLACEMENT_TRIES):
        x0, y0 = (int(v) for v in rng.integers(0, image_size - side + 1, size=2))
        box = [x0, y0, x0 + side, y0 + side]
        if all(box_gap(box, other) >= clearance for other in boxes):
            return box
    return None


def _pack(sides: list[int], image_size: int, rng: np.random.Generator) -> list[list[int] | None]:
    """Boxes for objects of the given sides, placed in order; None where one found no room."""
    boxes: list[list[int] | None] = []
    for side in sides:
        boxes.append(_place(side, [b for b in boxes if b is not None], image_size, rng))
    return boxes


def _layout(rng: np.random.Generator, settings: _Settings, split: str) -> list[dict]:
    combos = [(c, s) for c in COLOURS for s in SHAPES
              if split != "train" or (c, s) not in settings.holdout]
    low, high = LONG_OBJECTS if settings.long_captions else (1, MAX_OBJECTS)
    count = int(rng.integers(low, high + 1))
    picks = [(*combos[k], tuple(SIZES)[rng.integers(len(SIZES))])
             for k in rng.choice(len(combos), size=min(count, len(combos)), replace=False)]
    sides = [_box_side(size_name, settings.size, settings.sizes) for _, _, size_name in picks]
    # Large boxes first, and fresh layouts on failure: a late large box is what fails to fit.
    order = sorted(range(len(picks)), key=lambda k: -sides[k])
    for _ in range(LAYOUT_TRIES):
        packed = _pack([sides[k] for k in order], settings.size, rng)
        if None not in packed:
            break
    boxes = dict(zip(order, packed))
    return [{"shape": shape, "colour": colour, "size": size_name, "box": boxes[k]}
            for k, (colour, shape, size_name) in enumerate(picks) if boxes[k] is not None]


def _relations(objects: list[dict], side: int) -> list[list]:
    return [[i, predicate, j]
            for i, a in enumerate(objects) for j, b in enumerate(objects) if i != j
            for predicate in PREDICATES if relation_holds(a["box"], predicate, b["box"], side)]


def draw(scene: dict) -> Image.Image:
    """Render ``scene`` as a ``width`` x ``height`` RGB image (black background, no anti-aliasing)."""
    image = Image.new("RGB", (scene["width"], scene["height"]), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for obj in scene["objects"]:
        draw_shape(pen, obj["shape"], obj["box"], COLOURS[obj["colour"]])
    return image


def _build_scene(index: int, settings: _Settings, out_dir: str) -> tuple[dict, list[dict]]:
    """Generate, draw and save scene ``index``; returns (scene annotation, negatives items)."""
    rng = np.random.default_rng(np.random.SeedSequence([settings.seed, index]))
    split = split_of(index, settings.splits)
    objects = _layout(rng, settings, split)
    scene = {"image_id": index, "file_name": f"images/{index:06d}.png", "split": split,
             "width": settings.size, "height": settings.size, "objects": objects,
             "relations": _relations(objects, settings.size)}
    phrases = dict(settings.phrases)
    scene["captions"] = scene_captions(scene, rng, settings.long_captions, phrases)
    items = []
    for caption in scene["captions"]:
        negatives = caption_negatives(scene, caption, rng, settings.holdout, phrases)
        if negatives:
            items.append({"image_id": index, "caption_id": caption["id"], "split": split,
                          "positive": caption["text"], "negatives": negatives})
    draw(scene).save(os.path.join(out_dir, scene["file_name"]))
    return scene, items


def _build_chunk(job: tuple[int, int, _Settings, str]) -> list[tuple[dict, list[dict]]]:
    start, stop, settings, out_dir = job
    return [_build_scene(i, settings, out_dir) for i in range(start, stop)]


# --------------------------------------------------------------------------- the controlled test
# What'sUp (Kamath et al., EMNLP 2023, §3: the same two objects photographed in each of four arrangements, four
# captions per image) in the toy world: who is where is all that differs between a set's four images and between
# its four captions, so a model that reads the words but not the positions sits at chance (25).
CONTROLLED_DIRECTIONS = ("left of", "right of", "above", "below")
CONTROLLED_VERSION = 2  # 2: captions name directions only, long-caption clauses in either order (no caption prior)


def controlled_count(n: int) -> int:
    """Sets of the controlled test of an ``n``-scene world: one per 20 scenes (100 sets, 400 images at 2,000)."""
    return max(1, n // 20)


def _controlled_boxes(rng: np.random.Generator, sides: tuple[int, int], predicate: str, size: int) -> list[list[int]]:
    """Boxes of two objects in ``size`` px where ``first <predicate> second`` holds and, the two centres aligned on
    the other axis, no other direction holds even under the lenient rules."""
    horizontal = predicate in ("left of", "right of")
    clearance = max(1, round(GAP * size))
    big = max(sides)
    for _ in range(PLACEMENT_TRIES * 20):
        along = [int(rng.integers(0, size - side + 1)) for side in sides]
        start = int(rng.integers(0, size - big + 1))  # the cross axis: both centred on the bigger box's centre
        across = [start + (big - side) // 2 for side in sides]
        boxes = []
        for a, c, side in zip(along, across, sides):
            boxes.append([a, c, a + side, c + side] if horizontal else [c, a, c + side, a + side])
        if box_gap(*boxes) < clearance or not relation_holds(boxes[0], predicate, boxes[1], size):
            continue
        if not any(relation_holds(boxes[0], other, boxes[1], size, lenient=True)
                   for other in CONTROLLED_DIRECTIONS if other != predicate):
            return boxes
    raise RuntimeError(f"no placement of sides {sides} for {predicate!r} in {size} px")  # never at size >= 32


def _controlled_set(index: int, settings: _Settings) -> dict:
    rng = np.random.default_rng(np.random.SeedSequence([settings.seed, index, CONTROLLED_VERSION]))
    combos = [(c, sh) for c in COLOURS for sh in SHAPES]
    picks = [combos[k] for k in rng.choice(len(combos), size=2, replace=False)]
    objects = [{"colour": c, "shape": sh, "size": tuple(SIZES)[rng.integers(len(SIZES))]} for c, sh in picks]
    sides = tuple(_box_side(o["size"], settings.size, settings.sizes) for o in objects)
    scenes = []
    for predicate in CONTROLLED_DIRECTIONS:
        boxes = _controlled_boxes(rng, sides, predicate, settings.size)
        struct = {"objects": [describe(o, False) for o in objects], "relations": [[0, predicate, 1]]}
        scenes.append({"predicate": predicate, "width": settings.size, "height": settings.size,
                       "file_name": f"images/controlled/{index:04d}-{predicate.replace(' ', '-')}.png",
                       "objects": [{**o, "box": b} for o, b in zip(objects, boxes)],
                       "caption": render(struct, dict(settings.phrases)), "struct": struct})
    return {"id": index, "objects": objects, "scenes": scenes,
            "heldout": bool(settings.holdout.intersection(picks))}


def generate_controlled(out_dir: str | os.PathLike, settings: _Settings) -> dict:
    """Write the controlled test of a world with ``settings`` into ``out_dir``: :func:`controlled_count` sets, each
    two objects (any colour-shape combinations, held-out ones included and marked) drawn in the four arrangements of
    :data:`CONTROLLED_DIRECTIONS` with their four captions, ``images/controlled/*.png`` and ``controlled.json``
    (``{"version", "sets": [{"id", "objects", "heldout", "scenes": [{"predicate", "file_name", "objects" (with
    boxes), "caption", "struct", "width", "height"}]}]}``). Scene k of a set satisfies its own caption and no other
    of the set's (tested with :func:`relation_holds`). Seeded by the world's seed alone: the same bytes every time."""
    out = Path(out_dir)
    (out / "images" / "controlled").mkdir(parents=True, exist_ok=True)
    sets = [_controlled_set(k, settings) for k in range(controlled_count(settings.n))]
    for entry in sets:
        for scene in entry["scenes"]:
            draw(scene).save(out / scene["file_name"])
    data = {"version": CONTROLLED_VERSION, "sets": sets}
    dump_json(out / CONTROLLED_FILE, data)
    return data


def controlled_tests(world: str | os.PathLike) -> list[tuple[str, Path]]:
    """The controlled tests of a toy world as (benchmark name, file): a version-2 world's four-way direction test
    (``toyworld-controlled``, written now if the world predates it: :func:`ensure_controlled`), a hard world's
    Controlled-A and -B analogues (``toyworld-controlled-A`` / ``-B``, :mod:`extract.worlds.hardworld`)."""
    if hardworld.is_hard(world):
        return [(f"toyworld-controlled-{test}", Path(world) / file)
                for test, file in CONTROLLED_FILES.items()]
    return [("toyworld-controlled", ensure_controlled(world))]


def ensure_controlled(world: str | os.PathLike) -> Path:
    """The controlled test of an existing toy world (``controlled.json``), written now from its ``meta.json`` when a
    world made before the test existed lacks it (nothing else in the folder changes)."""
    world = Path(world)
    path = world / CONTROLLED_FILE
    if path.is_file():
        try:
            if json.loads(path.read_text()).get("version") == CONTROLLED_VERSION:
                return path
        except (OSError, ValueError):
            pass
    meta = json.loads((world / "meta.json").read_text())
    settings = _Settings(n=int(meta["n"]), seed=int(meta["seed"]), size=int(meta["size"]),
                         holdout=parse_holdout(meta.get("holdout", [])), splits=parse_splits(meta["splits"]),
                         long_captions=bool(meta.get("long_captions")), phrases=parse_phrases(meta.get("phrases")))
    generate_controlled(world, settings)
    return path


# --------------------------------------------------------------------------- writing


def _settings_dict(settings: _Settings) -> dict:
    out = {"version": VERSION, "n": settings.n, "seed": settings.seed, "size": settings.size,
           "holdout": sorted(f"{c} {s}" for c, s in settings.holdout),
           "splits": list(settings.splits)}
    if settings.long_captions:  # absent when off: a default world's files stay byte-identical
        out["long_captions"] = True
    if settings.phrases:  # likewise
        out["phrases"] = dict(settings.phrases)
    return out


def _vocabulary(settings: _Settings) -> dict:
    size = settings.size
    extra = {"objects_per_scene": list(LONG_OBJECTS)} if settings.long_captions else {}
    return {**extra, "shapes": list(SHAPES), "colours": {k: list(v) for k, v in COLOURS.items()},
            "sizes_px": {k: _box_side(k, size, settings.sizes) for k in SIZES}, "predicates": list(PREDICATES),
            "negative_types": list(NEGATIVE_TYPES), "background": list(BACKGROUND),
            "thresholds": {"gap": GAP, "direction_margin": DIRECTION_MARGIN, "near": NEAR,
                           "lenient_direction_margin": LENIENT_DIRECTION_MARGIN,
                           "lenient_near": LENIENT_NEAR, "unit": "fraction of image side"},
            "caption_id": f"image_id * {settings.caption_slots} + k"}


def _run(settings: _Settings, out: Path, workers: int) -> list[tuple[dict, list[dict]]]:
    chunk = max(1, min(250, math.ceil(settings.n / (4 * workers))))
    jobs = [(start, min(start + chunk, settings.n), settings, str(out))
            for start in range(0, settings.n, chunk)]
    if workers == 1 or len(jobs) == 1:
        return [r for job in jobs for r in _build_chunk(job)]
    with Pool(min(workers, len(jobs))) as pool:
        return [r for results in pool.imap(_build_chunk, jobs) for r in results]


def generate(out_dir: str | os.PathLike, n: int, seed: int, size: int = 64,
             holdout: str | Iterable = (), splits: str | Sequence[float] = (0.8, 0.1, 0.1),
             workers: int | None = None, long_captions: bool = False, phrases=None) -> dict:
    """Write ``n`` toy-world scenes to ``out_dir`` (layout: module docstring) and return a summary.

    ``size`` is the image side in px (>= 32); ``holdout`` holds (colour, shape) combinations out of
    the train split (``"red circle,blue square"`` or an iterable); ``splits`` are train/val/test
    fractions; ``workers`` processes (default ``os.cpu_count()``) never change the output;
    ``long_captions``: the long-caption mode (module docstring), 4-8 objects and a dense description
    of 100-250 CLIP tokens per scene (off: the default world, unchanged); ``phrases``: other words for some
    predicates (:func:`parse_phrases`), in captions and negatives alike.
    It also writes the controlled test (:func:`generate_controlled`).
    The summary holds the settings, ``counts`` (per split: images, captions, negatives,
    heldout_objects; negatives_by_type; objects), ``workers`` and ``seconds``.
    Raises ValueError on invalid settings.
    """
    started = time.perf_counter()
    if n < 1 or seed < 0 or size < MIN_IMAGE_SIZE:
        raise ValueError(f"need n >= 1, seed >= 0 and size >= {MIN_IMAGE_SIZE}; "
                         f"got n={n}, seed={seed}, size={size}")
    settings = _Settings(n=int(n), seed=int(seed), size=int(size), holdout=parse_holdout(holdout),
                         splits=parse_splits(splits), long_captions=bool(long_captions),
                         phrases=parse_phrases(phrases))
    workers = max(1, int(workers or os.cpu_count() or 1))
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)

    results = _run(settings, out, workers)
    scenes = [scene for scene, _ in results]
    items = [item for _, scene_items in results for item in scene_items]
    core = _settings_dict(settings)
    dump_json(out / "annotations.json", {"meta": {**core, **_vocabulary(settings)},
                                          "scenes": scenes})
    dump_json(out / "negatives.json", {"items": items})
    for split in SPLITS:
        write_split(out, split, [s for s in scenes if s["split"] == split], settings.seed, VERSION)
    counts = count_files(scenes, items, settings.holdout)
    counts["controlled_sets"] = len(generate_controlled(out, settings)["sets"])
    dump_json(out / "meta.json", {**core, "workers": workers, "counts": counts})
    return {**core, "out": str(out), "workers": workers, "counts": counts,
            "seconds": time.perf_counter() - started}


def load(out_dir: str | os.PathLike) -> dict:
    """The ``annotations.json`` of a generated toy world: ``{"meta": {...}, "scenes": [...]}``."""
    return json.loads((Path(out_dir) / "annotations.json").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- command line


# The embedded default: what a command that reads data uses when none is named (train.adapter.engine, train.pretrain.engine,
# python -m serve), generated on first use and shared by them.
DEFAULT_PATH = Path("runs") / "toy"
DEFAULT_SEED = 0


def _default_scenes() -> int:
    """2,000 scenes, or ``PLUGVLM_TOY_N`` (a whole number >= 20): a smaller embedded world for a quick check of the
    commands (the README's own blocks run on 320 in the tests; the README's figures are the 2,000's)."""
    text = os.environ.get("PLUGVLM_TOY_N", "2000")
    if not text.isdigit() or int(text) < 20:
        raise SystemExit(f"error: PLUGVLM_TOY_N={text!r}: the embedded toy world's scenes, a whole number >= 20 "
                         "(unset it for the default 2000)")
    return int(text)


DEFAULT_N = _default_scenes()


def ensure(out_dir: str | os.PathLike = DEFAULT_PATH, n: int = DEFAULT_N, seed: int = DEFAULT_SEED,
           say=print, replace: bool = False, long_captions: bool = False, holdout: str | Iterable = (),
           hard: bool = False) -> Path:
    """The toy world at ``out_dir`` with ``n`` scenes and ``seed`` (``long_captions``: the long-caption mode;
    ``hard``: the hard world, :mod:`extract.worlds.hardworld`, its own generator and version; ``holdout``:
    combinations kept out of its train split, as ``generate``): reused when it is already there (same
    n, seed, mode, holdout and generator version; regenerating would give the same bytes but new mtimes, which a
    feature cache's fingerprint sees), generated when the folder is absent. A toy world with other settings there
    is replaced only with ``replace`` (else ValueError: someone made it on purpose), one with the same settings from
    an earlier generator version always. ``say`` gets one line saying which."""
    out = Path(out_dir)
    meta = {}
    if (out / "meta.json").is_file():
        try:
            meta = json.loads((out / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
    if hard and long_captions:
        raise ValueError("the hard world has its own scenes: no long-caption mode")
    held = parse_holdout(holdout)
    version = hardworld.HARD_VERSION if hard else VERSION
    mode = (", long captions" if long_captions else "") + (", hard" if hard else "") + (
        f", holding out {', '.join(sorted(f'{c} {s}' for c, s in held))}" if held else "")
    try:
        had = parse_holdout(meta.get("holdout", []))
    except ValueError:
        had = None
    if (meta.get("n"), meta.get("seed"), meta.get("version"), bool(meta.get("long_captions")), had,
            bool(meta.get("hard"))) == (n, seed, version, bool(long_captions), held, hard):
        say(f"toy world: {out} ({n} scenes, seed {seed}{mode}; reused)")
        return out
    # a world of the other kind (version 2 or hard, each its own generator and version) is never an older one
    same = (meta.get("n"), meta.get("seed"), bool(meta.get("long_captions")), had, bool(meta.get("hard"))) == (
        n, seed, bool(long_captions), held, hard)
    older = meta.get("version") != version and same
    if older:  # our own world, written by an earlier generator: the same settings give other files now
        say(f"toy world: {out} was generated by an earlier version of the generator ({meta.get('version')}, now "
            f"{version}); generating it again")
    if out.exists() and any(out.iterdir()) and not replace and not older:
        there = (f"a toy world of {meta.get('n')} scenes, seed {meta.get('seed')}"
                 f"{', long captions' if meta.get('long_captions') else ''}"
                 f"{', holding out ' + ', '.join(meta['holdout']) if meta.get('holdout') else ''}") if meta \
            else "other files"
        raise ValueError(f"{out} holds {there}, not the toy world asked for ({n} scenes, seed {seed}{mode}): pass "
                         f"--data {out} to use it, or move it away to have the asked one generated there")
    t0 = time.perf_counter()
    if hard:
        hardworld.generate(out, n, seed, holdout=holdout)
    else:
        generate(out, n, seed, long_captions=long_captions, holdout=held)
    say(f"toy world: {out} ({n} scenes, seed {seed}{mode}; generated in {time.perf_counter() - t0:.0f} s)")
    return out


def format_summary(summary: dict) -> str:
    """A short human-readable report of a :func:`generate` summary."""
    counts = summary["counts"]
    mode = ", long captions" if summary.get("long_captions") else ""
    lines = [f"toyworld: {summary['n']} scenes ({summary['size']}x{summary['size']} px, seed "
             f"{summary['seed']}{mode}, {counts['objects']} objects) -> {summary['out']} in "
             f"{summary['seconds']:.1f} s with {summary['workers']} worker(s)",
             f"  {'split':<6}{'images':>8}{'captions':>10}{'negatives':>11}{'held-out objs':>15}"]
    for name, c in counts["splits"].items():
        lines.append(f"  {name:<6}{c['images']:>8}{c['captions']:>10}{c['negatives']:>11}"
                     f"{c['heldout_objects']:>15}")
    lines.append("  negatives by type: "
                 + ", ".join(f"{k}={v}" for k, v in counts["negatives_by_type"].items()))
    if summary["holdout"]:
        lines.append(f"  held out of train: {', '.join(summary['holdout'])}")
    return "\n".join(lines)


@dataclass
class ToyWorldOptions:
    """The command line of ``python -m extract.worlds.toyworld`` as data; :func:`generate` is the job
    (``generate(o.out, o.n, o.seed, size=o.size, holdout=o.holdout, splits=o.splits, workers=o.workers,
    long_captions=o.long_captions)``).
    ``holdout`` and ``splits`` may be given as strings or parsed values; they are kept parsed (a frozenset of
    (colour, shape) and three floats), and a bad one raises ValueError naming the vocabulary."""

    out: str | None = option(None, metavar="DIR", help="output folder (created; files there are overwritten)")
    n: int = option(1000, type=positive_int, help="number of scenes")
    seed: int = option(0, type=nonnegative_int, help="random seed: the same seed gives byte-identical files")
    size: int | None = option(None, type=positive_int,
                              help=f"image side in px (>= {MIN_IMAGE_SIZE}; default 64, with --hard "
                                   f"{hardworld.DEFAULT_SIZE})")
    holdout: Any = option("", metavar="COMBOS", help='(colour, shape) combinations held out of the train split, '
                                                     'e.g. "red circle,blue square" (default: none)')
    splits: Any = option("0.8,0.1,0.1", metavar="TRAIN,VAL,TEST", help="split fractions, summing to 1")
    workers: int | None = option(None, type=positive_int,
                                 help="processes (default: every CPU core; the output never depends on it)")
    long_captions: bool = option(False, action="store_true",
                                 help=f"long-caption mode: {LONG_OBJECTS[0]}-{LONG_OBJECTS[1]} smaller objects per "
                                      "scene and a dense description of each (100-250 CLIP tokens: a 77-token text "
                                      "encoder truncates it; Long-CLIP's 248 tokens read it whole)")

    hard: bool = option(False, action="store_true",
                        help="the hard world (extract/worlds/hardworld.py): objects that overlap (the later-drawn one in "
                             "front) or rest on one another, 2-8 objects with distractors, backgrounds that are not "
                             "black, captions with on / under / in front of / behind too, and What'sUp's Controlled-A "
                             "and -B analogues")
    world: str = option("version2", choices=("version2", "hard", "3d"),
                        help="which world: version2 (flat shapes on black, the default), hard (as --hard) or 3d "
                             "(CLEVR's objects path-traced by Mitsuba 3, extract/worlds/world3d.py; the render3d "
                             "extra)")
    spp: int | None = option(None, type=positive_int, help="--world 3d: path-tracing samples a pixel (default 32)")
    palette: str = option("clevr", choices=tuple(PALETTES_3D),
                          help="--world 3d: the scenes' colours, CLEVR's eight (the default) or 24 (wide: sixteen "
                               "more, for pre-training a base; mixed: the same 24, CLEVR's drawn twice as often; "
                               "the controlled tests keep CLEVR's)")
    language: str = option("whatsup", choices=world3d_layout.LANGUAGES,
                           help="--world 3d: the captions, What'sUp's one shape (the default: one relation, six "
                                "predicates each said one way, colour and shape) or wide (as people write them: any of "
                                "size / colour / material / shape, counts, chains and conjunctions, between, next to, "
                                "several phrasings with one per predicate held out of training; "
                                "extract/worlds/captions3d.py)")
    every_phrasing: bool = option(False, action="store_true",
                                  help="--language wide: every phrasing in every split, none held out of training (a "
                                       "world to pre-train a base on, which may meet every word as a web-trained CLIP "
                                       "has; a head's world keeps one phrasing per predicate for its test)")
    phrases: Any = option("", metavar="PREDICATE=WORDS,...",
                          help='other words for predicates in every caption and negative, e.g. "left of=above,'
                               'above=to the left of" (the meaning stays the predicate\'s: a test that a model learns '
                               'what predicate words mean from captions; default: none)')

    def __post_init__(self):
        if self.hard and self.world == "3d":
            raise ValueError("--hard is --world hard: drop one of --hard and --world 3d")
        self.hard = self.hard or self.world == "hard"
        self.world = "hard" if self.hard else self.world
        if self.size is None:
            self.size = hardworld.DEFAULT_SIZE if self.world != "version2" else 64
        self.holdout = parse_holdout3d(self.holdout) if self.world == "3d" else parse_holdout(self.holdout)
        self.splits = parse_splits(self.splits)
        self.phrases = parse_phrases(self.phrases)


def build_parser() -> Parser:
    return build_cli(ToyWorldOptions, "python -m extract.worlds.toyworld",
                     "Generate the toy world: procedurally drawn scenes of coloured shapes with boxes, relations, "
                     "captions and hard negatives (the project's embedded default dataset).")


def parse_args(argv: Sequence[str] | None = None) -> ToyWorldOptions:
    """Parse the CLI; ``--config file.yaml`` sets defaults for the other options, flags override.

    Returns a :class:`ToyWorldOptions` (holdout a frozenset of (colour, shape), splits a tuple of three
    floats). Exits with a one-line usage error (status 2) when invalid.
    """
    parser = build_parser()
    ns = parse_with_config(parser, argv)
    if not ns.out:
        parser.error("--out is required (on the command line or as 'out' in --config), e.g. --out runs/toy")
    try:
        opts = from_namespace(ToyWorldOptions, ns)
    except ValueError as err:
        parser.error(str(err))
    if opts.spp is not None and opts.world != "3d":
        parser.error("--spp sets the 3D world's path tracing: add --world 3d, or drop --spp")
    if opts.palette != "clevr" and opts.world != "3d":
        parser.error("--palette sets the 3D world's colours: add --world 3d, or drop --palette")
    if opts.language != "whatsup" and opts.world != "3d":
        parser.error("--language sets the 3D world's captions: add --world 3d, or drop --language")
    if opts.every_phrasing and opts.language != "wide":
        parser.error("--every-phrasing sets the wide language's phrasings: add --world 3d --language wide")
    if opts.world != "version2" and (opts.long_captions or opts.phrases):
        which = "--hard" if opts.world == "hard" else "--world 3d"
        parser.error(f"{which} has its own scenes and predicate words: drop --long-captions / --phrases")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: generate, print the summary; 0, or 2 with one ``error:`` line."""
    def job(opts: ToyWorldOptions) -> None:
        if opts.world == "3d":
            print(world3d_layout.format_summary(world3d_layout.generate(
                opts.out, opts.n, opts.seed, size=opts.size, spp=opts.spp or 32, holdout=opts.holdout,
                splits=opts.splits, workers=opts.workers, palette=opts.palette, language=opts.language,
                every_phrasing=opts.every_phrasing)))
            return
        if opts.hard:
            print(hardworld.format_summary(hardworld.generate(
                opts.out, opts.n, opts.seed, size=opts.size, holdout=opts.holdout,
                splits=opts.splits, workers=opts.workers)))
            return
        print(format_summary(generate(opts.out, opts.n, opts.seed, size=opts.size, holdout=opts.holdout,
                                      splits=opts.splits, workers=opts.workers, long_captions=opts.long_captions,
                                      phrases=opts.phrases)))

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
