"""What people say about a 3D scene (issue 82, its first part): the widened language's rules, each decided on the
3D scene alone, never on a caption. Nothing here draws or writes a world yet; the captions, negatives and controlled
sets that use these rules come next, and the rules are tested first on scenes built by hand.

- **Object phrases** name any subset of CLEVR's four attributes, as CLEVR's referring expressions do (Johnson et al.
  2017, section 3: size, colour, material, shape; CLEVR-Ref+ refers by any subset): "the small metal cube", "a red
  thing", "the matte object". Material has two words a side ("metal" / "shiny", "rubber" / "matte"); a phrase
  without a shape says "thing" or "object". A phrase matches an object when every attribute it names is the
  object's (:meth:`Phrase.matches`).
- **Counts** ("two red cubes", one to four): the number of the scene's objects the phrase matches. Partly hidden
  objects count: a scene's count is of its objects, not of what shows (the worlds keep every object at least a
  quarter visible, ``world3d.MAX_HIDDEN``).
- **"between"** (A between B and C): where the objects stand on the floor (a stacked object where its base
  stands): A's foot falls inside the middle of the segment from B to C (:data:`BETWEEN_T` from either end) and at
  most :data:`BETWEEN_OFF` of its length off it. Betweenness does not change with the viewpoint the way left and
  right do, so the floor, not the image, decides it; B and C leave room for A (their footprints apart by at least
  A's). ``lenient``: the wider bounds a hard negative must fail as well, as ``world3d.relations`` does for the
  other predicates.
- **"next to"** (A next to B): both on the same level (the floor, or one top), their footprints at most
  :data:`NEAR_GAP` apart, and no third object between them; never a stacked pair (that is "on").
- **Phrasings**: each predicate in several surface forms; the last form of each is held out of the training
  captions and used only at test (:func:`forms`): a base may have seen it in pre-training, as a web-trained CLIP has
  seen every word a user's small training set lacks.
- **Statements** (:class:`Count`, :class:`Related` with a chain or a conjunction, :class:`Between`): what a caption
  claims, decided by :func:`holds`; a hard negative is a statement false even leniently (:func:`is_negative`).
  ``world3d.relations`` gives a stacked object no direction (its levels say no more than its base), so "A on B and
  right of C" holds only where A's base is right of C: the widened world must decide that before it says so.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from extract.worlds import world3d as w3

ATTRIBUTES = ("size", "colour", "material", "shape")  # the order a phrase says them in, as CLEVR's templates do
MATERIAL_WORDS = {"metal": ("metal", "shiny"), "rubber": ("rubber", "matte")}
NO_SHAPE = ("thing", "object")
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
#: surface forms per predicate; the last of each is the held-out one (test captions only)
PHRASINGS = {"on": ("on", "on top of", "sitting on", "resting on"),
             "under": ("under", "beneath", "underneath"),
             "left of": ("to the left of", "left of", "on the left side of"),
             "right of": ("to the right of", "right of", "on the right side of"),
             "in front of": ("in front of", "closer to the camera than"),
             "behind": ("behind", "in back of"),
             "next to": ("next to", "beside"),
             "between": ("between",)}  # one form: nothing held out
# "between" on the floor (module docstring): A's foot inside the segment's middle, near the line
BETWEEN_T, BETWEEN_OFF = 0.2, 0.2
LENIENT_BETWEEN_T, LENIENT_BETWEEN_OFF = 0.05, 0.4
# "next to": footprints at most this far apart (world units; a small sphere is 0.7 across, the arena 5)
NEAR_GAP, LENIENT_NEAR_GAP = 1.2, 2.0


@dataclass(frozen=True)
class Phrase:
    """An object phrase: any subset of the four attributes (None: not said)."""

    size: str | None = None
    colour: str | None = None
    material: str | None = None
    shape: str | None = None

    def __post_init__(self):
        known = {"size": w3.SIZES, "colour": w3.WIDE, "material": w3.MATERIALS, "shape": w3.SHAPES}
        for name in ATTRIBUTES:
            value = getattr(self, name)
            if value is not None and value not in known[name]:
                raise ValueError(f"{value!r} is not a {name} of the 3D world ({', '.join(known[name])})")

    @classmethod
    def of(cls, obj: w3.Object3D, said: Sequence[str] = ATTRIBUTES) -> Phrase:
        """The phrase naming ``obj`` by the attributes in ``said``."""
        unknown = set(said) - set(ATTRIBUTES)
        if unknown:
            raise ValueError(f"no attribute {sorted(unknown)}: say any of {', '.join(ATTRIBUTES)}")
        return cls(**{name: getattr(obj, name) for name in said})

    def said(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name) is not None)

    def matches(self, obj: w3.Object3D) -> bool:
        return all(getattr(obj, name) == getattr(self, name) for name in self.said())

    def words(self, plural: bool = False, material_word: int = 0, no_shape_word: int = 0) -> str:
        """The phrase in words, without an article or a number: "small red metal cube", "shiny things"
        (``material_word`` / ``no_shape_word`` pick among the synonyms)."""
        parts = [self.size, self.colour]
        if self.material is not None:
            parts.append(MATERIAL_WORDS[self.material][material_word])
        noun = self.shape if self.shape is not None else NO_SHAPE[no_shape_word]
        parts.append(noun + "s" if plural else noun)
        return " ".join(p for p in parts if p is not None)


def count(scene: w3.Scene3D, phrase: Phrase) -> int:
    """How many of the scene's objects the phrase matches, partly hidden ones included."""
    return len(_matching(scene, phrase))


def referent(scene: w3.Scene3D, phrase: Phrase) -> int | None:
    """The index of the one object the phrase picks out ("the small metal cube"), None when it matches none or
    several: a definite phrase must refer."""
    found = _matching(scene, phrase)
    return found[0] if len(found) == 1 else None


def _matching(scene: w3.Scene3D, phrase: Phrase) -> list[int]:
    """The indices of the objects ``phrase`` matches, in scene order."""
    return [k for k, o in enumerate(scene.objects) if phrase.matches(o)]


def counted(n: int, phrase: Phrase, **word_choice) -> str:
    """ "two red cubes", "one small thing" (one to four)."""
    if n not in NUMBERS:
        raise ValueError(f"counts are said from one to four, not {n}")
    return f"{NUMBERS[n]} {phrase.words(plural=n > 1, **word_choice)}"


def _base(scene: w3.Scene3D, k: int) -> int:
    """The object at the bottom of ``k``'s stack (``k`` itself on the floor)."""
    while scene.objects[k].support is not None:
        k = scene.objects[k].support
    return k


def _foot(scene: w3.Scene3D, k: int) -> np.ndarray:
    """Where object ``k`` stands on the floor: its own base, or its stack's."""
    base = scene.objects[_base(scene, k)]
    return np.array([base.x, base.y])


def between(scene: w3.Scene3D, a: int, b: int, c: int, lenient: bool = False) -> bool:
    """Object ``a`` between ``b`` and ``c`` (module docstring); three distinct objects."""
    if len({a, b, c}) < 3:
        raise ValueError("between takes three different objects")
    t_min, off_max = (LENIENT_BETWEEN_T, LENIENT_BETWEEN_OFF) if lenient else (BETWEEN_T, BETWEEN_OFF)
    pa, pb, pc = _foot(scene, a), _foot(scene, b), _foot(scene, c)
    line = pc - pb
    length = float(np.hypot(*line))
    objs = scene.objects
    if length == 0.0 or (not lenient and length < objs[b].reach + objs[c].reach + 2 * objs[a].reach):
        return False  # one stack, or no room for a between them
    t = float(np.dot(pa - pb, line)) / length ** 2
    off = abs(float(line[0] * (pa - pb)[1] - line[1] * (pa - pb)[0])) / length
    return t_min <= t <= 1 - t_min and off <= off_max * length


def gap(scene: w3.Scene3D, a: int, b: int) -> float:
    """The floor distance between two objects' footprints (negative where they overlap, as a stack's levels do)."""
    oa, ob = scene.objects[a], scene.objects[b]
    return math.hypot(oa.x - ob.x, oa.y - ob.y) - oa.reach - ob.reach


def next_to(scene: w3.Scene3D, a: int, b: int, lenient: bool = False) -> bool:
    """Object ``a`` next to ``b`` (module docstring). ``lenient``: near by the wider bound, whatever stands between
    (what a hard negative must not be even so)."""
    if a == b:
        raise ValueError("next to takes two different objects")
    oa, ob = scene.objects[a], scene.objects[b]
    if oa.support == b or ob.support == a:
        return False  # a stack: "on" / "under"
    if lenient:
        return gap(scene, a, b) <= LENIENT_NEAR_GAP
    if abs(oa.z - ob.z) > 1e-6 or gap(scene, a, b) > NEAR_GAP:
        return False
    others = (k for k in range(len(scene.objects)) if k not in (a, b))
    return not any(between(scene, k, a, b, lenient=True) for k in others)


def forms(predicate: str, split: str) -> tuple[str, ...]:
    """The surface forms of ``predicate`` a caption of ``split`` may use: every form but the held-out one in the
    training split, every form at test (the held-out phrasing row reads the held-out one alone), all of them where a
    predicate has only one."""
    if predicate not in PHRASINGS:
        raise ValueError(f"no predicate {predicate!r}: {', '.join(PHRASINGS)}")
    if split not in ("train", "val", "test"):
        raise ValueError(f"split is train, val or test, not {split!r}")
    every = PHRASINGS[predicate]
    return every[:-1] if split == "train" and len(every) > 1 else every


def held_out(predicate: str) -> str | None:
    """The form of ``predicate`` no training caption uses (None: it has one form)."""
    every = PHRASINGS[predicate]
    return every[-1] if len(every) > 1 else None


# ------------------------------------------------------------------------------------------------- tables
WIDE_PREDICATES = (*w3.PREDICATES, "next to")  # two-place predicates of the wide language ("between" takes three)
DIRECTIONS = ("left of", "right of", "in front of", "behind")


def relation_table(scene: w3.Scene3D, lenient: bool = False) -> list[list]:
    """Every two-place ``[i, predicate, j]`` of :data:`WIDE_PREDICATES` the scene makes true: ``world3d.relations``
    with "next to", and (strict) a stacked object given its stack's directions: a stack stands where its base
    stands, so "A on B and right of C" holds where B is right of C (the lenient table already gives every pair the
    directions its offsets lean to). Sorted, so a scene's record has one set of bytes."""
    found = {tuple(r) for r in w3.relations(scene, lenient)}
    n = len(scene.objects)
    if not lenient:
        base = [_base(scene, k) for k in range(n)]
        found |= {(i, p, j) for i in range(n) for j in range(n) for p in DIRECTIONS
                  if base[i] != base[j] and (base[i], p, base[j]) in found}
    found |= {(i, "next to", j) for i in range(n) for j in range(n) if i != j and next_to(scene, i, j, lenient)}
    order = {p: k for k, p in enumerate(WIDE_PREDICATES)}
    return [list(r) for r in sorted(found, key=lambda r: (r[0], r[2], order[r[1]]))]


def between_table(scene: w3.Scene3D, lenient: bool = False) -> list[list[int]]:
    """Every ``[a, b, c]`` (``b < c``) with object ``a`` between ``b`` and ``c``."""
    n = len(scene.objects)
    return [[a, b, c] for a in range(n) for b in range(n) for c in range(b + 1, n)
            if a not in (b, c) and between(scene, a, b, c, lenient)]


def tables(scene: w3.Scene3D) -> dict:
    """What a scene's record carries for the wide language's captions to be judged by
    (``hardworld.satisfies``): its objects' attributes and the four tables, strict and lenient."""
    return {"objects": [o.to_dict() for o in scene.objects], "relations": relation_table(scene),
            "lenient": relation_table(scene, lenient=True), "between": between_table(scene),
            "lenient_between": between_table(scene, lenient=True)}


# ------------------------------------------------------------------------------------------------- statements
# A caption is a small program over the scene, as CLEVR's questions are: each statement says what it claims as a
# struct (the worlds' caption form: phrases, relations, counts) and is decided by ``hardworld.satisfies`` on the
# tables above, the one place any caption of any world is judged. Each phrase maps to a different object; a phrase
# that matches several reads "some": "a red cube left of a blue sphere" holds when some red cube is left of some blue
# sphere. ``lenient``: what a hard negative must fail even so (the lenient tables).
def _said(phrase: Phrase) -> dict:
    return {name: getattr(phrase, name) for name in phrase.said()}


@dataclass(frozen=True)
class Count:
    """ "two red cubes": exactly ``n`` objects match."""

    n: int
    phrase: Phrase

    def struct(self) -> dict:
        return {"objects": [_said(self.phrase)], "relations": [], "counts": [[0, self.n]]}


@dataclass(frozen=True)
class Related:
    """ "A PREDICATE B", and with ``then`` a chain ("A left of B, which is behind C": B's own relation) or with
    ``also`` a conjunction ("A on B and right of C": A's second one)."""

    subject: Phrase
    predicate: str
    object: Phrase
    then: tuple[str, Phrase] | None = None
    also: tuple[str, Phrase] | None = None

    def struct(self) -> dict:
        for predicate in (self.predicate, *(x[0] for x in (self.then, self.also) if x is not None)):
            if predicate not in WIDE_PREDICATES:
                raise ValueError(f"no 3D rule for {predicate!r}: {', '.join((*WIDE_PREDICATES, 'between'))}")
        objects, relations = [_said(self.subject), _said(self.object)], [[0, self.predicate, 1]]
        for second, start in ((self.then, 1), (self.also, 0)):
            if second is not None:
                relations.append([start, second[0], len(objects)])
                objects.append(_said(second[1]))
        return {"objects": objects, "relations": relations}


@dataclass(frozen=True)
class Between:
    """ "A between B and C"."""

    subject: Phrase
    first: Phrase
    second: Phrase

    def struct(self) -> dict:
        return {"objects": [_said(p) for p in (self.subject, self.first, self.second)],
                "relations": [[0, "between", 1, 2]]}


def holds(scene: w3.Scene3D, statement: Count | Related | Between, lenient: bool = False) -> bool:
    """Whether the scene makes ``statement`` true (strict), or could be read so (``lenient``)."""
    from extract.worlds.hardworld import satisfies

    return satisfies(tables(scene), statement.struct(), lenient=lenient)


def is_negative(scene: w3.Scene3D, statement: Count | Related | Between) -> bool:
    """A hard negative's test: false of the scene even leniently (a count is exact either way)."""
    return not holds(scene, statement, lenient=True)
