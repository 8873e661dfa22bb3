"""The 3D world on disk, in the toy worlds' layout (issue 69): captions, hard negatives, splits, zero-shot crops and
What'sUp's Controlled-A / -B analogues, from :mod:`extract.worlds.world3d`'s path-traced scenes.

Every reader of a toy world reads it (``annotations.json``, ``negatives.json``, ``{split}.csv``, ``{split}_coco.json``,
``meta.json``, ``controlled_a.json``, ``controlled_b.json``, ``whatsup/``): each scene carries its own relation tables
(``relations`` strict, ``lenient``), so a caption is judged by the 3D world's rules wherever the project asks whether
it is true (``extract.worlds.toyrules.satisfies``); ``meta.json`` says ``"world": "3d"`` and ``"hard": true`` (its
tests are the hard world's two), and names its vocabulary (CLEVR's; with ``palette="wide"`` or ``"mixed"``, for
pre-training a base, 24 colours in the scenes, ``world3d.PALETTES``, and ``"palette"`` naming it).

- **Captions** as the hard world's (``hardworld.scene_captions``), in What'sUp's form: one per object (size,
  colour, shape, as the other worlds; the material is not named), one relation said from either side ("a red cube on a blue cylinder" or "a blue
  cylinder under a red cube"), and a long one listing every object with one relation. The named relation is drawn
  predicate first, uniformly among those the scene holds, so the six predicates are as even as the scenes allow.
  With ``language="wide"`` (``--language wide``) the captions are instead as people write them: any of the four
  attributes, counts, chains and conjunctions, "between", "next to", several phrasings with one per predicate held
  out of training (:mod:`extract.worlds.captions3d`), and the record carries the wide language's tables.
- **Hard negatives** of every type from the world's own vocabulary, each false of the scene even by the lenient
  table; in the train split none names a held-out combination, and no train image shows one.
- **Controlled tests**: per set, two objects of one size (Controlled-A: both flat-topped, so either can carry the
  other) in four arrangements under one camera and one light: on / under / left / right (A) and in front of /
  behind / left / right (B), nearer meaning nearer the camera; a clutter pair of other colour-shapes beside them,
  related the other way (side by side where the named pair is stacked or in depth, else stacked or in depth), so
  neither how many things touch nor how many overlap tells the images apart. Each image holds its caption strictly
  and none of the other three even leniently (tested).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from extract.worlds import captions3d, hardworld, language3d
from extract.worlds import world3d as w3
from extract.worlds.hardworld import WORDS, scene_captions, scene_negatives, zero_shot_crop
from extract.worlds.shared import (CONTROLLED_A, CONTROLLED_B, CONTROLLED_FILES, NEGATIVE_TYPES, SPLITS, WHATSUP_DIR,
                                   count_files, describe, dump_json, parse_holdout, parse_splits, render_struct,
                                   split_of, write_split, write_whatsup)

VERSION = 1
LANGUAGES = ("whatsup", "wide")  # the captions a world's scenes get (module docstring; extract.worlds.captions3d)
SETS_PER = 20  # one controlled set of each test per 20 scenes
CROP_IDS = 10_000_000  # the pretrain split's crop image ids start here (a world has fewer scenes)
CENTRE = 0.4  # the named pair's centre on the floor: within this of the world's centre, each axis
BESIDE = (1.9, 2.3)  # how far to the side of it the clutter pair stands (inside a 7.5-9 unit camera's frame)
STACKED = {"A": ("on", "under"), "B": ("in front of", "behind")}  # the named pair's non-sideways arrangements


@dataclass(frozen=True)
class Settings3D:
    n: int
    seed: int
    size: int = 96
    spp: int = 32
    holdout: frozenset = frozenset()
    splits: tuple = (0.8, 0.1, 0.1)
    palette: str = "clevr"  # the scenes' colours (world3d.PALETTES); the controlled tests keep CLEVR's
    language: str = "whatsup"  # the captions: What'sUp's one shape, or "wide" (extract.worlds.captions3d)
    every_phrasing: bool = False  # wide: every phrasing in every split, none held out (a world to pre-train a base on)

    @property
    def colours(self) -> dict:
        return w3.PALETTES[self.palette]


def parse_holdout3d(spec: str | Iterable) -> frozenset:
    """``"red cube,blue sphere"`` against the 3D world's vocabulary (CLEVR's colours and shapes)."""
    return parse_holdout(spec, w3.COLOURS, w3.SHAPES)


def render(struct: dict) -> str:
    return render_struct(struct, WORDS)


# ------------------------------------------------------------------------------------------------- scenes
def _object_records(scene: w3.Scene3D, vis: list[dict]) -> list[dict]:
    return [{**obj.to_dict(), "box": v["box"], "visible": round(1 - v["hidden"], 3)}
            for obj, v in zip(scene.objects, vis)]


def _named(rng: np.random.Generator, strict: list) -> dict:
    predicates = sorted({p for _, p, _ in strict}, key=w3.PREDICATES.index)
    predicate = predicates[int(rng.integers(len(predicates)))]
    pairs = [(i, j) for i, p, j in strict if p == predicate]
    i, j = pairs[int(rng.integers(len(pairs)))]
    return {"subject": i, "predicate": predicate, "object": j}


def allowed_pairs(settings: Settings3D, split: str) -> list[tuple[str, str]]:
    """The (colour, shape) pairs a scene of ``split`` draws its objects from, uniformly: a pair listed twice is drawn
    twice as often (``world3d.DRAWS``); the train split never draws a held-out one."""
    draws = w3.DRAWS.get(settings.palette, {})
    return [(c, s) for c in settings.colours for s in w3.SHAPES for _ in range(draws.get(c, 1))
            if split != "train" or (c, s) not in settings.holdout]


def _record(index: int, split: str, scene3d: w3.Scene3D, vis: list[dict], settings: Settings3D) -> dict:
    return {"image_id": index, "file_name": f"images/{index:06d}.png", "split": split, "width": settings.size,
            "height": settings.size, "objects": _object_records(scene3d, vis)}


def _camera(scene3d: w3.Scene3D) -> dict:
    return {"origin": list(scene3d.camera.origin), "target": list(scene3d.camera.target), "fov": scene3d.camera.fov}


def _items(index: int, split: str, captions: list[dict], negatives) -> list[dict]:
    items = []
    for caption in captions:
        found = negatives(caption)
        if found:
            items.append({"image_id": index, "caption_id": caption["id"], "split": split,
                          "positive": caption["text"], "negatives": found})
    return items


def _whatsup_scene(index: int, split: str, scene3d: w3.Scene3D, vis: list[dict],
                   settings: Settings3D) -> tuple[dict, list[dict]]:
    """Version 1's scene: What'sUp's captions (module docstring) and the hard world's negatives."""
    rng = np.random.default_rng([settings.seed, index, VERSION, 1])  # the words' own generator
    strict = [list(r) for r in w3.relations(scene3d)]
    scene = {**_record(index, split, scene3d, vis, settings), "relations": strict,
             "lenient": [list(r) for r in w3.relations(scene3d, lenient=True)], "named": _named(rng, strict),
             "camera": _camera(scene3d)}
    scene["captions"] = scene_captions(scene, scene["named"], rng)
    return scene, _items(index, split, scene["captions"], lambda caption: scene_negatives(
        scene, caption, rng, settings.holdout, w3.PREDICATES, settings.colours, w3.SHAPES))


def _wide_scene(index: int, split: str, scene3d: w3.Scene3D, vis: list[dict],
                settings: Settings3D) -> tuple[dict, list[dict]]:
    """The wide language's scene (extract.worlds.captions3d): its record carries the language's tables (next to,
    a stack's directions, between), so its captions are judged by the wide rules wherever they are read."""
    rng = np.random.default_rng([settings.seed, index, VERSION, 2])  # the wide words' own generator
    tables = language3d.tables(scene3d)
    scene = {**_record(index, split, scene3d, vis, settings),
             **{key: tables[key] for key in ("relations", "lenient", "between", "lenient_between")},
             "camera": _camera(scene3d)}
    every = settings.every_phrasing
    scene["captions"], scene["named"] = captions3d.scene_captions(scene, rng, split, every)
    return scene, _items(index, split, scene["captions"], lambda caption: captions3d.scene_negatives(
        scene, caption, rng, split, settings.holdout, tuple(settings.colours), every))


def build_scene(index: int, settings: Settings3D, out_dir: str | None) -> tuple[dict, list[dict]]:
    """Scene ``index`` (and its negatives' items), rendered and saved under ``out_dir`` when given."""
    from PIL import Image

    split = split_of(index, settings.splits)
    scene3d, vis = w3.build_scene(settings.seed, index, settings.size, allowed=allowed_pairs(settings, split),
                                  need_relation=True)
    if settings.language == "wide":
        scene, items = _wide_scene(index, split, scene3d, vis, settings)
    else:
        scene, items = _whatsup_scene(index, split, scene3d, vis, settings)
    # every object's crop (partly hidden ones included): val / test, the zero-shot set; train, the "pretrain"
    # split's (write_pretrain)
    objects = scene["objects"]
    for k, obj in enumerate(objects):
        obj["crop"] = f"objects/{index:06d}-{k}.png"
    if out_dir is not None:
        image = Image.fromarray(w3.render(scene3d, settings.size, settings.spp))
        image.save(os.path.join(out_dir, scene["file_name"]))
        for obj in objects:
            if "crop" in obj:
                zero_shot_crop(image, obj["box"]).save(os.path.join(out_dir, obj["crop"]))
    return scene, items


# ------------------------------------------------------------------------------------------------- controlled tests
def _floor_axes(camera: w3.Camera) -> tuple[np.ndarray, np.ndarray, float]:
    """The camera's right and forward directions on the floor (unit, z = 0) and the cosine of its downward tilt."""
    right, _, forward = camera.axes()
    flat = np.array([forward[0], forward[1], 0.0])
    return right * (1, 1, 0), flat / np.linalg.norm(flat), float(np.linalg.norm(flat))


def _put(obj: w3.Object3D, at: np.ndarray, on: int | None = None, base: w3.Object3D | None = None) -> w3.Object3D:
    return w3.Object3D(obj.colour, obj.shape, obj.size, obj.material, float(at[0]), float(at[1]),
                       base.top if base is not None else 0.0, obj.angle, on)


def _pair_at(pair: Sequence[w3.Object3D], predicate: str, centre: np.ndarray, right: np.ndarray,
             forward: np.ndarray, tilt: float, lateral: float, first: int = 0) -> list[w3.Object3D]:
    """The two objects (indices ``first``, ``first + 1`` in the scene) arranged so that "pair[0] predicate
    pair[1]" holds, around ``centre`` on the floor."""
    a, b = pair
    if predicate in ("on", "under"):
        top, bottom = (a, b) if predicate == "on" else (b, a)
        low = _put(bottom, centre)
        high = _put(top, centre, first + (1 if predicate == "on" else 0), low)
        return [high, low] if predicate == "on" else [low, high]
    reach = a.reach + b.reach
    if predicate in ("left of", "right of"):
        step = right * (0.6 * reach + 0.2) * (-1 if predicate == "left of" else 1)
        return [_put(a, centre + step), _put(b, centre - step)]
    step = forward * (0.65 * reach / tilt + 0.2) * (-1 if predicate == "in front of" else 1)
    return [_put(a, centre + step + right * lateral), _put(b, centre - step)]


def _controlled_set(index: int, settings: Settings3D, test: str, tries: int = 150) -> dict:
    rng = np.random.default_rng([settings.seed, index, VERSION, ord(test)])
    predicates = CONTROLLED_A if test == "A" else CONTROLLED_B
    shapes = w3.FLAT_TOPS if test == "A" else w3.SHAPES
    for _ in range(tries):
        camera = w3.random_camera(rng)
        right, forward, tilt = _floor_axes(camera)
        size = str(rng.choice(list(w3.SIZES)))
        colours = rng.choice(list(w3.COLOURS), size=4, replace=False)
        pair = [w3.Object3D(str(colours[k]), str(rng.choice(shapes)), size, str(rng.choice(w3.MATERIALS)), 0, 0)
                for k in (0, 1)]
        clutter = [w3.Object3D(str(colours[k]), str(rng.choice(w3.FLAT_TOPS if k == 3 else w3.SHAPES)), "small",
                               str(rng.choice(w3.MATERIALS)), 0, 0) for k in (2, 3)]
        centre = np.array([rng.uniform(-CENTRE, CENTRE), rng.uniform(-CENTRE, CENTRE), 0.0])
        beside = centre + right * rng.choice([-1, 1]) * rng.uniform(*BESIDE) + forward * rng.uniform(-0.5, 0.5)
        lateral = rng.uniform(-0.35, 0.35) * (pair[0].reach + pair[1].reach)
        sun_az, sun_el = rng.uniform(0, 2 * math.pi), math.radians(rng.uniform(35, 70))
        sun = (-math.cos(sun_el) * math.cos(sun_az), -math.cos(sun_el) * math.sin(sun_az), -math.sin(sun_el))
        light = (float(rng.uniform(2.5, 3.5)), float(rng.uniform(0.25, 0.4)), float(rng.uniform(0.35, 0.55)))
        seed = (settings.seed * 1_000_003 + 7 * index + ord(test)) % 2**31
        scenes = []
        for predicate in predicates:
            named_stacked = predicate in STACKED[test]
            clutter_predicate = "left of" if named_stacked else STACKED[test][0]
            if clutter_predicate == "on":  # the carrier (clutter[1], flat-topped) under the other
                placed_clutter = _pair_at([clutter[0], clutter[1]], "on", beside, right, forward, tilt, 0.0, 2)
            else:
                placed_clutter = _pair_at(clutter, clutter_predicate, beside, right, forward, tilt, 0.0, 2)
            objects = _pair_at(pair, predicate, centre, right, forward, tilt, lateral) + placed_clutter
            scenes.append((predicate, w3.Scene3D(objects, camera, sun, *light, seed=seed)))
        checked = [_check(s, p, predicates, settings.size) for p, s in scenes]
        if all(c is not None for c in checked):
            return _written_set(index, settings, test, pair, clutter, scenes, checked)
    raise RuntimeError(f"controlled-{test} set {index}: no arrangement in {tries} draws")


def _check(scene: w3.Scene3D, predicate: str, predicates: Sequence[str], size: int) -> list[dict] | None:
    """The image's visibility when it is a fair one: everything inside the frame and shown (hidden at most
    MAX_HIDDEN), nothing interpenetrating, its caption strictly true and the other three not even leniently."""
    for k, obj in enumerate(scene.objects):
        if not w3.clear_of(obj, [o for j, o in enumerate(scene.objects) if j < k], skip=obj.support, gap=0.05):
            return None
    if any(min(b) < 0 or max(b) > size for b in (w3.projected_box(scene, k, size)
                                                  for k in range(len(scene.objects)))):
        return None
    strict, lenient = set(w3.relations(scene)), set(w3.relations(scene, lenient=True))
    if (0, predicate, 1) not in strict or any((0, q, 1) in lenient for q in predicates if q != predicate):
        return None
    vis = w3.visibility(scene, size)
    return vis if all(v["visible"] and v["hidden"] <= w3.MAX_HIDDEN for v in vis) else None


def _written_set(index: int, settings: Settings3D, test: str, pair: list, clutter: list, scenes: list,
                 checked: list) -> dict:
    records = []
    struct_objects = [describe(o.to_dict(), False) for o in pair]
    for (predicate, scene), vis in zip(scenes, checked):
        struct = {"objects": struct_objects, "relations": [[0, predicate, 1]]}
        slug = predicate.replace(" ", "-")
        records.append({"predicate": predicate, "width": settings.size, "height": settings.size,
                        "file_name": f"images/controlled_{test.lower()}/{test.lower()}{index:04d}-{slug}.png",
                        "objects": _object_records(scene, vis),
                        "relations": [list(r) for r in w3.relations(scene)],
                        "lenient": [list(r) for r in w3.relations(scene, lenient=True)],
                        "camera": {"origin": list(scene.camera.origin), "target": list(scene.camera.target),
                                   "fov": scene.camera.fov},
                        "caption": render(struct), "struct": struct, "_scene": scene})
    named = [(o.colour, o.shape) for o in pair]
    return {"id": index, "objects": [describe(o.to_dict(), True) for o in pair],
            "clutter": [describe(o.to_dict(), True) for o in clutter], "scenes": records,
            "heldout": bool(settings.holdout.intersection(named))}


def _render_set(job: tuple[int, Settings3D, str, str]) -> dict:
    from PIL import Image

    index, settings, test, out = job
    entry = _controlled_set(index, settings, test)
    for record in entry["scenes"]:
        scene = record.pop("_scene")
        Image.fromarray(w3.render(scene, settings.size, settings.spp)).save(Path(out) / record["file_name"])
    return entry


def generate_controlled(out: Path, settings: Settings3D, workers: int = 1) -> dict[str, dict]:
    """Both controlled tests (``controlled_a.json``, ``controlled_b.json``, their images and the What'sUp-layout
    copy), ``max(1, n // 20)`` sets each; ``{"A": data, "B": data}``."""
    written = {}
    for test, file in CONTROLLED_FILES.items():
        (out / "images" / f"controlled_{test.lower()}").mkdir(parents=True, exist_ok=True)
        jobs = [(k, settings, test, str(out)) for k in range(max(1, settings.n // SETS_PER))]
        sets = w3.map_jobs(_render_set, jobs, workers, desc=f"controlled-{test}", unit="set")
        written[test] = {"version": VERSION, "test": f"controlled-{test}",
                         "predicates": list(CONTROLLED_A if test == "A" else CONTROLLED_B), "sets": sets}
        dump_json(out / file, written[test])
    write_whatsup(out, written, out / WHATSUP_DIR)
    return written


# ------------------------------------------------------------------------------------------------- the world
def _build(job: tuple[int, Settings3D, str]) -> tuple[dict, list[dict]]:
    index, settings, out = job
    return build_scene(index, settings, out)


def _vocabulary(settings: Settings3D) -> dict:
    common = {"colours": {k: list(v) for k, v in settings.colours.items()}, "shapes": list(w3.SHAPES),
              "sizes": {k: v for k, v in w3.SIZES.items()}, "materials": list(w3.MATERIALS)}
    if settings.language == "wide":
        return {**common, "predicates": list(language3d.WIDE_PREDICATES) + ["between"],
                "phrasings": {p: list(f) for p, f in language3d.PHRASINGS.items()},
                "held_out_phrasings": {} if settings.every_phrasing else {
                    p: language3d.held_out(p) for p in language3d.PHRASINGS if language3d.held_out(p)},
                "material_words": {k: list(v) for k, v in language3d.MATERIAL_WORDS.items()},
                "caption_kinds": list(captions3d.KINDS), "negative_types": list(captions3d.NEGATIVE_TYPES),
                "max_hidden": w3.MAX_HIDDEN, "caption_id": f"image_id * {hardworld.CAPTION_SLOTS} + k"}
    return {**common, "predicates": list(w3.PREDICATES), "words": {p: WORDS[p] for p in w3.PREDICATES},
            "negative_types": list(NEGATIVE_TYPES), "max_hidden": w3.MAX_HIDDEN,
            "caption_id": f"image_id * {hardworld.CAPTION_SLOTS} + k"}


def generate(out_dir: str | os.PathLike, n: int, seed: int, size: int = 96, spp: int = 32,
             holdout: str | Iterable = (), splits: str | Sequence[float] = (0.8, 0.1, 0.1),
             workers: int | None = None, palette: str = "clevr", language: str = "whatsup",
             every_phrasing: bool = False) -> dict:
    """Write ``n`` 3D scenes and both controlled tests to ``out_dir`` in the toy worlds' layout; a summary
    (settings, ``counts``, ``workers``, ``seconds``). ``workers`` never changes the output; ``palette``: the
    scenes' colours (``"wide"``: CLEVR's and :data:`world3d.EXTRA_COLOURS`, for pre-training a base; ``"mixed"``:
    the same, CLEVR's drawn twice as often, :func:`allowed_pairs`); ``language``: the captions (:data:`LANGUAGES`;
    ``"wide"``: :mod:`extract.worlds.captions3d`); ``every_phrasing`` (wide only): no phrasing held out of the train
    split, for a world a base is pre-trained on."""
    started = time.perf_counter()
    if n < 1 or seed < 0 or size < 32 or spp < 1:
        raise ValueError(f"--world 3d needs n >= 1, seed >= 0, size >= 32 and spp >= 1; got n={n}, seed={seed}, "
                         f"size={size}, spp={spp}")
    if palette not in w3.PALETTES:
        raise ValueError(f"--palette {palette!r}: choose one of {', '.join(w3.PALETTES)}")
    if language not in LANGUAGES:
        raise ValueError(f"--language {language!r}: choose one of {', '.join(LANGUAGES)}")
    if every_phrasing and language != "wide":
        raise ValueError("--every-phrasing sets the wide language's phrasings: add --language wide")
    settings = Settings3D(int(n), int(seed), int(size), int(spp), parse_holdout3d(holdout), parse_splits(splits),
                          palette, language, bool(every_phrasing))
    workers = max(1, int(workers or 1))
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "objects").mkdir(exist_ok=True)
    results = w3.map_jobs(_build, [(i, settings, str(out)) for i in range(settings.n)], workers)
    scenes = [scene for scene, _ in results]
    items = [item for _, scene_items in results for item in scene_items]
    core = {"version": VERSION, "world": "3d", "hard": True, "n": settings.n, "seed": settings.seed,
            "size": settings.size, "spp": settings.spp, "holdout": sorted(f"{c} {s}" for c, s in settings.holdout),
            "splits": list(settings.splits), "vocabulary": {"colours": list(settings.colours),
                                                            "shapes": list(w3.SHAPES)}}
    if palette != "clevr":  # absent for CLEVR's: the worlds made before the option keep their bytes
        core["palette"] = palette
    if language != "whatsup":  # the same
        core["language"] = language
    if every_phrasing:
        core["every_phrasing"] = True
    dump_json(out / "annotations.json", {"meta": {**core, **_vocabulary(settings)}, "scenes": scenes})
    dump_json(out / "negatives.json", {"items": items})
    for split in SPLITS:
        write_split(out, split, [s for s in scenes if s["split"] == split], settings.seed, VERSION)
    write_pretrain(out, scenes, settings)
    wide = settings.language == "wide"
    counts = count_files(scenes, items, settings.holdout, captions3d.NEGATIVE_TYPES if wide else NEGATIVE_TYPES)
    predicates = language3d.WIDE_PREDICATES if wide else w3.PREDICATES
    counts["named_predicates"] = {p: sum((s["named"] or {}).get("predicate") == p for s in scenes) for p in predicates}
    if wide:
        counts["caption_kinds"] = {k: sum(c["kind"] == k for s in scenes for c in s["captions"])
                                   for k in captions3d.KINDS}
        counts["held_out_phrasings"] = sum(c["struct"]["style"]["held_out"] for s in scenes for c in s["captions"])
    counts["partly_hidden_objects"] = sum(o["visible"] < 0.999 for s in scenes for o in s["objects"])
    tests = generate_controlled(out, settings, workers)
    counts["controlled_sets"] = {f"controlled-{k}": len(v["sets"]) for k, v in tests.items()}
    dump_json(out / "meta.json", {**core, "workers": workers, "counts": counts})
    return {**core, "out": str(out), "workers": workers, "counts": counts, "seconds": time.perf_counter() - started}


def _crop_side(box: Sequence[int]) -> int:
    return hardworld.CROP_SCALE * max(box[2] - box[0], box[3] - box[1])  # zero_shot_crop's square


def crop_records(scene: dict, material: bool = False) -> list[dict]:
    """The scene's object crops as scenes of one caption each, "a {colour} {shape}": no size (a crop is scaled
    to fill a third of its square, so it cannot show one) and no material (What'sUp's captions never name it);
    ``material`` (the wide language, which does): "a {colour} {material} {shape}", its two words in turn ("a red
    shiny cube", "a blue rubber sphere"). Ids: ``CROP_IDS + image_id * 8 + k`` (8 objects at most), caption id
    ``image id * CAPTION_SLOTS``, so neither meets a scene's."""
    records = []
    for k, obj in enumerate(scene["objects"]):
        image_id, side = CROP_IDS + scene["image_id"] * 8 + k, _crop_side(obj["box"])
        said = f" {language3d.MATERIAL_WORDS[obj['material']][(scene['image_id'] + k) % 2]}" if material else ""
        records.append({"image_id": image_id, "file_name": obj["crop"], "width": side, "height": side,
                        "captions": [{"id": image_id * hardworld.CAPTION_SLOTS,
                                      "text": f"a {obj['colour']}{said} {obj['shape']}"}]})
    return records


def write_pretrain(out: Path, scenes: list[dict], settings: Settings3D) -> None:
    """The ``pretrain`` split (``pretrain.csv``, ``pretrain_coco.json``): the train split's scenes and each of their
    objects' crops, as the grounded head and the zero-shot set see objects (``hardworld.zero_shot_crop``). A base
    trained on scenes alone names 3D objects in such crops near chance: an object is a few hundred shaded pixels
    of a scene, partly hidden, and no caption says which pixels are which (``extract/models/bases/README.md``, the
    3D bases). ``train.pretrain --split pretrain`` trains on it; every other reader uses ``train``."""
    train = [s for s in scenes if s["split"] == "train"]
    material = settings.language == "wide"
    write_split(out, "pretrain", train + [c for s in train for c in crop_records(s, material)], settings.seed, VERSION)


def format_summary(summary: dict) -> str:
    counts = summary["counts"]
    text = hardworld.format_summary(summary, headline=(
        f"toyworld (3d): {summary['n']} scenes ({summary['size']}x{summary['size']} px, {summary['spp']} samples a "
        f"pixel, seed {summary['seed']}, {counts['objects']} objects, {counts['partly_hidden_objects']} partly hidden) "
        f"-> {summary['out']} in {summary['seconds']:.1f} s with {summary['workers']} worker(s) "
        f"({summary['n'] / summary['seconds']:.1f} scenes/s, controlled images included)"))
    if "caption_kinds" in counts:  # the wide language
        text += ("\n  captions by kind: " + ", ".join(f"{k}={v}" for k, v in counts["caption_kinds"].items())
                 + f" ({counts['held_out_phrasings']} in a held-out phrasing, test only)")
    return text
