"""The version-2 toy world's rules, apart from drawing and writing (``extract.worlds.toyworld``): its constants, which
relations hold between two boxes (strict and lenient), whether a caption's struct is true of a scene, how a struct is
said in words (the predicate words, ``--phrases``), which captions a scene gets and which hard negatives each caption
gets. The module docstring of ``extract.worlds.toyworld`` states the rules; this is their code."""
from __future__ import annotations

import itertools
import math
from typing import Iterable, Sequence

import numpy as np

from extract.worlds import hardworld
from extract.worlds.shared import (COUNT_WORDS, NEGATIVE_TYPES, article, combos, describe, join_words, matches,
                                   mutations, noun, render_struct)


VERSION = 2  # 2: captions name directions only, long-caption clauses in either order (no caption prior)
SIZES = {"small": 0.20, "large": 0.35}  # box side as a fraction of the image side
PREDICATES = ("left of", "right of", "above", "below", "next to")
# What captions (and replace-rel negatives) say. "next to" holds in scenes (``relations``) but no caption names it:
# every flip of the image maps the four directions onto each other and leaves "next to" alone, so with it a caption
# and its replace-rel negative would differ in how often each predicate appears, a prior that a model reads from
# the words alone (measured before VERSION 2: 61% on replace-rel without the image). With directions only, each
# (caption predicate, negative predicate) pair is as likely as the reverse one.
CAPTION_PREDICATES = ("left of", "right of", "above", "below")
CONVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
BACKGROUND = (0, 0, 0)
MAX_OBJECTS = 4
CAPTION_SLOTS = 8  # >= MAX_OBJECTS one-object captions + 1 relation + 1 long
# Long-caption mode (--long-captions): more, smaller objects and a dense description of each scene.
LONG_OBJECTS = (4, 8)  # objects per scene, inclusive
LONG_SIZES = {"small": 0.16, "large": 0.22}  # box sides: 10 / 14 px at 64 px; 8 objects fit (0 of 3,000 failed)
LONG_CAPTION_SLOTS = 16  # >= 8 one-object captions + 1 relation + 1 long
LONG_PARTNERS = {5: 3, 8: 2}  # relations per object in the dense caption, by scene size (up to the key)
MIN_IMAGE_SIZE = 32
PLACEMENT_TRIES = 50
LAYOUT_TRIES = 10
# Thresholds below are fractions of the image side.
GAP = 0.05
DIRECTION_MARGIN = 0.15
NEAR = 0.15
LENIENT_DIRECTION_MARGIN = 0.05
LENIENT_NEAR = 0.30

_DEFAULT_PHRASES = {"left of": "to the left of", "right of": "to the right of",
            "above": "above", "below": "below", "next to": "next to"}


# --------------------------------------------------------------------------- option parsing


def parse_phrases(spec: str | dict | Iterable | None) -> tuple:
    """``"left of=above,above=to the left of"`` (or a dict / pairs) -> sorted (predicate, phrase) pairs: the words
    captions use for those predicates instead of the default ones. The meaning stays the predicate's: a world where
    "above" is said for "left of" tests that a model learns what words mean from the captions. ValueError names the
    predicates on a bad entry."""
    if not spec:
        return ()
    items = spec.items() if isinstance(spec, dict) else (
        [part.split("=", 1) if "=" in part else (part, "") for part in spec.split(",")] if isinstance(spec, str)
        else list(spec))
    out = {}
    for predicate, phrase in items:
        predicate, phrase = str(predicate).strip().lower(), " ".join(str(phrase).split()).lower()
        if predicate not in PREDICATES or not phrase:
            raise ValueError(f"--phrases: expected PREDICATE=WORDS entries, PREDICATE one of {', '.join(PREDICATES)};"
                             f" got {predicate!r}={phrase!r}")
        out[predicate] = phrase
    return tuple(sorted(out.items()))


# --------------------------------------------------------------------------- geometry and truth


def _centre(box: Sequence[int]) -> tuple[float, float]:
    return (box[0] + box[2]) / 2.0, (box[1] + box[3]) / 2.0


def box_gap(a: Sequence[int], b: Sequence[int]) -> float:
    """Euclidean distance in px between two half-open boxes (0 when they touch or overlap)."""
    gx = max(0, b[0] - a[2], a[0] - b[2])
    gy = max(0, b[1] - a[3], a[1] - b[3])
    return math.hypot(gx, gy)


def relation_holds(a: Sequence[int], predicate: str, b: Sequence[int], side: int,
                   lenient: bool = False) -> bool:
    """Whether ``box a <predicate> box b`` holds in a ``side``-px image (rules: module docstring)."""
    margin = (LENIENT_DIRECTION_MARGIN if lenient else DIRECTION_MARGIN) * side
    (ax, ay), (bx, by) = _centre(a), _centre(b)
    if predicate == "left of":
        return bx - ax > margin
    if predicate == "right of":
        return ax - bx > margin
    if predicate == "above":
        return by - ay > margin
    if predicate == "below":
        return ay - by > margin
    if predicate == "next to":
        return box_gap(a, b) <= (LENIENT_NEAR if lenient else NEAR) * side
    raise ValueError(f"unknown predicate {predicate!r}; expected one of {PREDICATES}")


def satisfies(scene: dict, struct: dict, *, lenient: bool = False) -> bool:
    """Whether caption ``struct`` is true of ``scene`` (an entry of ``annotations["scenes"]``).

    True iff the struct's objects map injectively onto scene objects whose attributes match the
    ones the struct names, every ``[i, predicate, j]`` holds between the mapped boxes
    (:func:`relation_holds`, with ``lenient`` thresholds if asked) and, when ``count`` is present,
    the scene has exactly that many objects. A hard-world scene (it carries its own relation tables, ``lenient``
    among them) is judged by its world's rules (:func:`extract.worlds.hardworld.satisfies`).
    """
    if "lenient" in scene:
        return hardworld.satisfies(scene, struct, lenient=lenient)
    objects = scene["objects"]
    if "count" in struct and struct["count"] != len(objects):
        return False
    wanted = struct["objects"]
    options = [[k for k, obj in enumerate(objects) if matches(obj, w)] for w in wanted]
    for assignment in itertools.product(*options):
        if len(set(assignment)) < len(assignment):
            continue
        if all(relation_holds(objects[assignment[i]]["box"], predicate, objects[assignment[j]]["box"],
                              scene["width"], lenient)
               for i, predicate, j in struct["relations"]):
            return True
    return False


# --------------------------------------------------------------------------- captions


def render(struct: dict, phrases: dict | None = None) -> str:
    """The caption text of ``struct`` (grammar: module docstring). Non-long structs hold <= 1 relation.
    ``phrases``: the words of some predicates instead of the default ones (``--phrases``)."""
    words = {**_DEFAULT_PHRASES, **(phrases or {})}
    if struct.get("dense"):
        return _render_dense(struct, words)
    return render_struct(struct, words)


def _render_dense(struct: dict, words: dict) -> str:
    """"five objects: a small red circle, ... and a large gray star. the small red circle is to the left of the
    large blue square, above ... and below .... the large blue square is ...": every mention names size, colour
    and shape; one sentence per run of consecutive relations with the same subject."""
    objects = struct["objects"]
    sentences, run = [], []
    for k, (i, predicate, j) in enumerate(struct["relations"]):
        run.append(f"{words[predicate]} the {noun(objects[j])}")
        if k + 1 == len(struct["relations"]) or struct["relations"][k + 1][0] != i:
            sentences.append(f"the {noun(objects[i])} is {join_words(run)}.")
            run = []
    count = struct["count"]
    head = (f"{COUNT_WORDS[count]} object{'s' if count > 1 else ''}: "
            + join_words([article(noun(o)) for o in objects]) + ".")
    return " ".join([head] + sentences)


def _relation_struct(scene: dict, rng: np.random.Generator) -> dict | None:
    by_pair: dict[tuple[int, int], list[str]] = {}
    for i, predicate, j in scene["relations"]:
        if predicate in CAPTION_PREDICATES:
            by_pair.setdefault((i, j), []).append(predicate)
    if not by_pair:
        return None
    pairs = sorted(by_pair)
    i, j = pairs[rng.integers(len(pairs))]
    predicate = by_pair[(i, j)][rng.integers(len(by_pair[(i, j)]))]
    objects = scene["objects"]
    return {"objects": [describe(objects[i], False), describe(objects[j], False)],
            "relations": [[0, predicate, 1]]}


def _primary_predicate(a: Sequence[int], b: Sequence[int], side: int) -> str | None:
    """The clearest predicate for ``a ? b``: the dominant-axis direction if it holds, else None."""
    (ax, ay), (bx, by) = _centre(a), _centre(b)
    if abs(bx - ax) >= abs(by - ay):
        direction = "left of" if bx > ax else "right of"
    else:
        direction = "above" if by > ay else "below"
    return direction if relation_holds(a, direction, b, side) else None


def _long_struct(scene: dict, rng: np.random.Generator) -> dict:
    """Objects in scene order, one clause per consecutive pair whose dominant direction holds, said from either
    end with even odds ("the red circle is to the left of the blue square" or "the blue square is to the right of
    the red circle"): with the subject always the earlier object, a swap-obj negative would give itself away by
    its order alone."""
    objects = scene["objects"]
    relations = []
    for i in range(len(objects) - 1):
        predicate = _primary_predicate(objects[i]["box"], objects[i + 1]["box"], scene["width"])
        if predicate is not None:
            relations.append([i, predicate, i + 1] if rng.random() < 0.5 else [i + 1, CONVERSE[predicate], i])
    return {"objects": [describe(o, True) for o in objects], "relations": relations,
            "count": len(objects)}


def _dense_struct(scene: dict) -> dict:
    """The long-caption mode's ``long`` struct: every object with its attributes, and for each object (in scene
    order) its nearest others (centre distance, then index), as many as LONG_PARTNERS allows, each with the
    clearest predicate that holds (:func:`_primary_predicate`; a pair with none is passed over)."""
    objects = scene["objects"]
    partners = next(k for limit, k in sorted(LONG_PARTNERS.items()) if len(objects) <= limit)
    relations = []
    for i, a in enumerate(objects):
        centre = _centre(a["box"])
        others = sorted((j for j in range(len(objects)) if j != i),
                        key=lambda j: (math.dist(centre, _centre(objects[j]["box"])), j))
        picked = [[i, p, j] for j in others
                  if (p := _primary_predicate(a["box"], objects[j]["box"], scene["width"])) is not None]
        relations += picked[:partners]
    return {"objects": [describe(o, True) for o in objects], "relations": relations,
            "count": len(objects), "dense": True}


def scene_captions(scene: dict, rng: np.random.Generator, long_captions: bool = False,
              phrases: dict | None = None) -> list[dict]:
    structs = [("one-object", {"objects": [describe(o, True)], "relations": []})
               for o in scene["objects"]]
    relation = _relation_struct(scene, rng)
    if relation is not None:
        structs.append(("relation", relation))
    structs.append(("long", _dense_struct(scene) if long_captions else _long_struct(scene, rng)))
    slots = LONG_CAPTION_SLOTS if long_captions else CAPTION_SLOTS
    return [{"id": scene["image_id"] * slots + k, "kind": kind, "text": render(struct, phrases),
             "struct": struct}
            for k, (kind, struct) in enumerate(structs)]


# --------------------------------------------------------------------------- hard negatives


def _acceptable(scene: dict, struct: dict, holdout: frozenset) -> bool:
    named = combos(struct)
    if len(set(named)) < len(named):
        return False  # "the red circle" would be ambiguous within the caption itself
    if scene["split"] == "train" and holdout.intersection(named):
        return False
    return not satisfies(scene, struct, lenient=True)


def negative_candidates(scene: dict, struct: dict, neg_type: str,
                        holdout: frozenset = frozenset()) -> list[tuple[dict, bool]]:
    """Every candidate of ``neg_type`` for caption ``struct`` of ``scene``, each with whether it is acceptable
    (false of the scene even under the lenient rules, no (colour, shape) named twice, no held-out combination in
    the train split): what :func:`generate` draws one from. Text-only generators are checked against it."""
    return [(c, _acceptable(scene, c, holdout)) for c in mutations(struct, neg_type, CAPTION_PREDICATES)]


def caption_negatives(scene: dict, caption: dict, rng: np.random.Generator, holdout: frozenset,
               phrases: dict | None = None) -> list[dict]:
    out = []
    for neg_type in NEGATIVE_TYPES:
        candidates = mutations(caption["struct"], neg_type, CAPTION_PREDICATES)
        # Random order, first acceptable: one uniform pick without testing every candidate.
        for k in rng.permutation(len(candidates)):
            if _acceptable(scene, candidates[k], holdout):
                out.append({"type": neg_type, "text": render(candidates[k], phrases), "struct": candidates[k]})
                break
    return out
