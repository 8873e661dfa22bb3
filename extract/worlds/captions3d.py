"""The 3D world's captions as people write them (issue 82, ``--language wide``): what each scene is said to show,
and the hard negatives of each caption, from the rules of :mod:`extract.worlds.language3d`.

A scene of the wide language gets up to twelve captions (``hardworld.CAPTION_SLOTS``), each a struct (phrases,
relations, counts; judged by ``hardworld.satisfies`` on the scene's tables) and its text:

- **object** (one per object): the object by a random non-empty subset of size, colour, material and shape, "a
  small shiny cube", "a red thing";
- **relation**: one pair the scene relates, the predicate drawn first, uniformly among those the scene holds (the
  six of ``world3d`` and "next to"), in one of its surface forms (``language3d.PHRASINGS``); in test, half the
  relation captions say their predicate in its held-out form, which no training or validation caption or negative
  uses (validation chooses the checkpoint, so a held-out form there would choose it partly on the forms it tests);
- **count**: "two red cubes" (and sometimes "and one gray sphere", a second phrase matching other objects), the
  attributes said drawn first, then the number among those phrases of that kind count in the scene, so a caption's
  number and its negative's are equally plausible for the phrase (:func:`_counted`);
- **chain** ("A left of B, which is behind C") or **conjunction** ("A on B and to the right of C"), the kind and the
  two predicates drawn first;
- **between** ("A between B and C") where the scene has such a triple.

A phrase in a relation, chain or between caption names attributes until it picks its object out (all four where
two objects look alike), starting from a random subset, as CLEVR-Ref+'s referring expressions do; the article is
always "a" (a "the" would have to change between a caption and its negative, a cue a text-only model reads).

Hard negatives, each false of the scene even by its lenient tables and, in the train split, naming no held-out
(colour, shape): ``replace-size`` / ``-colour`` / ``-material`` / ``-shape`` (one attribute of one phrase),
``replace-obj`` (a related phrase replaced by the phrase of another object of the scene, one the relation does not
reach even leniently: "A next to B" -> "A next to C", where C stands far from A),
``swap-att`` (one kind of attribute swapped between two phrases), ``swap-obj`` (two phrases swapped: a relation's
sides, a chain's objects, the middle of "between" with an end), ``replace-rel`` (one relation's predicate by its
converse, :data:`CONVERSE`, said in a form of the same family: a held-out caption's negative in the held-out form
too), ``count`` (the number changed).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from extract.worlds import language3d as lang
from extract.worlds import world3d as w3
from extract.worlds.hardworld import CAPTION_SLOTS, satisfies
from extract.worlds.shared import article, join_words, matches

KINDS = ("object", "relation", "count", "chain", "conjunction", "between")
NEGATIVE_TYPES = ("replace-size", "replace-colour", "replace-material", "replace-shape", "replace-obj", "swap-att",
                  "swap-obj", "replace-rel", "count")
#: the benchmark's rows beyond the negative types (train.eval reads them as tags): which caption and which change
ROWS = {"chain": (("chain", "conjunction"), ("replace-rel", "swap-obj")), "between": (("between",), ("swap-obj",)),
        "next to": (("relation",), ("replace-obj",)),
        "held-out phrasing": (("relation",), ("replace-rel", "swap-obj"))}
#: what replace-rel says instead: the converse, false of the pair whenever the predicate holds, and as likely in a
#: caption as the predicate itself (the world is as often seen from either side), so the word that changes tells a
#: blind model nothing. Any other replacement leaks: "on" / "under" hold only for stacks but are false of nearly every
#: pair, so with a free choice they were twice as common in negatives as in captions, and "next to" (false only far
#: apart) half as common (a text-only model on the 2,000-scene world: "next to" rows 66-90 where chance is 50).
#: "next to" has no converse: its row reads replace-obj (another object, far from the first).
CONVERSE = {"left of": "right of", "right of": "left of", "on": "under", "under": "on", "in front of": "behind",
            "behind": "in front of"}
HELD_OUT_SHARE = 0.5  # of test relation captions, said in their predicate's held-out form
SUBSETS = [s for r in range(1, 5) for s in itertools.combinations(lang.ATTRIBUTES, r)]


# ------------------------------------------------------------------------------------------------- words
def phrase_words(said: dict, style: dict, plural: bool = False) -> str:
    return lang.Phrase(**said).words(plural, style["material"], style["thing"])


def render(struct: dict) -> str:
    """The text of a wide-language struct, in its ``style`` (material and no-shape word, each relation's form)."""
    objects, relations, style = struct["objects"], struct["relations"], struct["style"]

    def a(k: int) -> str:
        return article(phrase_words(objects[k], style))

    if "counts" in struct:
        return join_words([lang.counted(n, lang.Phrase(**objects[k]), material_word=style["material"],
                                        no_shape_word=style["thing"]) for k, n in struct["counts"]])
    if not relations:
        return a(0)
    first = relations[0]
    if first[1] == "between":
        return f"{a(0)} between {a(first[2])} and {a(first[3])}"
    forms = style["forms"]
    text = f"{a(first[0])} {forms[0]} {a(first[2])}"
    if len(relations) == 2:
        second = relations[1]
        joint = ", which is" if second[0] == first[2] else " and"
        text += f"{joint} {forms[1]} {a(second[2])}"
    return text


def _form(rng: np.random.Generator, predicate: str, held: bool, every: bool = False) -> str:
    """A surface form of ``predicate``: its held-out one for a held-out caption (its first where it has none),
    else one of the training forms (``language3d.forms``), whatever the split; ``every``: any of its forms (a world
    for pre-training a base, which may meet every word, as a web-trained CLIP has)."""
    if held:
        return lang.held_out(predicate) or lang.PHRASINGS[predicate][0]
    choices = lang.PHRASINGS[predicate] if every else lang.forms(predicate, "train")
    return choices[int(rng.integers(len(choices)))]


def _style(rng: np.random.Generator, forms: Sequence[str] = (), held: bool = False) -> dict:
    return {"material": int(rng.integers(2)), "thing": int(rng.integers(2)), "forms": list(forms), "held_out": held}


# ------------------------------------------------------------------------------------------------- phrases
def _matching(record: dict, said: dict) -> list[int]:
    return [k for k, o in enumerate(record["objects"]) if matches(o, said)]


def _referring(rng: np.random.Generator, record: dict, k: int) -> dict:
    """Object ``k`` by a random subset of its attributes, grown in a random order until the phrase picks it out."""
    obj = record["objects"][k]
    order = [lang.ATTRIBUTES[i] for i in rng.permutation(len(lang.ATTRIBUTES))]
    said = order[:int(rng.integers(1, 5))]
    for extra in order[len(said):]:
        if _matching(record, {a: obj[a] for a in said}) == [k]:
            break
        said.append(extra)
    return {a: obj[a] for a in lang.ATTRIBUTES if a in said}


def _nameable(record: dict) -> set[int]:
    """The objects some phrase picks out: all but look-alikes (the same four attributes), whose relation captions
    would name one phrase twice."""
    keys = [tuple(o[a] for a in lang.ATTRIBUTES) for o in record["objects"]]
    return {k for k, key in enumerate(keys) if keys.count(key) == 1}


def _any_phrase(rng: np.random.Generator, obj: dict) -> dict:
    said = SUBSETS[int(rng.integers(len(SUBSETS)))]
    return {a: obj[a] for a in said}


# ------------------------------------------------------------------------------------------------- captions
def _relation(rng: np.random.Generator, record: dict, split: str, every: bool) -> tuple[dict, dict] | None:
    ok = _nameable(record)
    table = [(i, p, j) for i, p, j in record["relations"] if i in ok and j in ok]
    predicates = sorted({p for _, p, _ in table}, key=lang.WIDE_PREDICATES.index)
    if not predicates:
        return None
    predicate = predicates[int(rng.integers(len(predicates)))]
    pairs = [(i, j) for i, p, j in table if p == predicate]
    i, j = pairs[int(rng.integers(len(pairs)))]
    # val draws as test does (its other draws stay where they were) but says the training forms: the checkpoint is
    # chosen on val, and a choice made on held-out forms would be a choice made on what they test
    drawn = not every and split != "train" and lang.held_out(predicate) is not None and rng.random() < HELD_OUT_SHARE
    held = drawn and split == "test"
    struct = {"objects": [_referring(rng, record, i), _referring(rng, record, j)], "relations": [[0, predicate, 1]],
              "style": _style(rng, [_form(rng, predicate, held, every)], held)}
    return struct, {"subject": i, "predicate": predicate, "object": j}


def _counted(rng: np.random.Generator, record: dict, taken: frozenset = frozenset()) -> tuple | None:
    """(phrase, its count, the counts its template could say) for a count caption, or None. The template (which
    attributes a phrase says) is drawn first, among those whose phrases in this scene count at least two different
    numbers from one to four; then the number, uniformly among those; then a phrase of that template and count. A
    count negative says another of the template's numbers (:func:`candidates`), so a caption's number and its
    negative's are drawn from one set: a blind model cannot tell them apart by how plausible a number is for a phrase
    (within a template the values are exchangeable: no colour is likelier than another). Drawn freely (the number
    first, the negative any other), "one cylinder" was nearly always false and "four small things" true, and a
    bag-of-words model on pairs chose the true count 80% of the time. ``taken``: objects a phrase must not match."""
    found: dict[tuple, dict[int, dict[tuple, dict]]] = {}
    for obj in record["objects"]:
        for said in SUBSETS:
            phrase = {a: obj[a] for a in said}
            matches = _matching(record, phrase)
            if len(matches) <= 4 and not taken.intersection(matches):
                found.setdefault(said, {}).setdefault(len(matches), {})[tuple(sorted(phrase.items()))] = phrase
    templates = [t for t in SUBSETS if len(found.get(t, {})) >= 2]
    if not templates:
        return None
    by_count = found[templates[int(rng.integers(len(templates)))]]
    numbers = sorted(by_count)
    n = numbers[int(rng.integers(len(numbers)))]
    keys = sorted(by_count[n])
    return by_count[n][keys[int(rng.integers(len(keys)))]], n, numbers


def _count(rng: np.random.Generator, record: dict) -> dict | None:
    first = _counted(rng, record)
    if first is None:
        return None
    objects, counts, options = [first[0]], [[0, first[1]]], [first[2]]
    if rng.random() < 0.5:  # a second phrase, about other objects
        second = _counted(rng, record, frozenset(_matching(record, first[0])))
        if second is not None:
            objects.append(second[0])
            counts.append([1, second[1]])
            options.append(second[2])
    return {"objects": objects, "relations": [], "counts": counts, "count_options": options, "style": _style(rng)}


def _two_relations(rng: np.random.Generator, record: dict, every: bool) -> tuple[str, dict] | None:
    ok = _nameable(record)
    table = [(i, p, j) for i, p, j in record["relations"] if i in ok and j in ok]
    options = {"chain": [(i, p, j, q, k) for i, p, j in table for j2, q, k in table if j2 == j and k != i],
               "conjunction": [(i, p, j, q, k) for i, p, j in table for i2, q, k in table if i2 == i and k != j]}
    kinds = [kind for kind in options if options[kind]]
    if not kinds:
        return None
    kind = kinds[int(rng.integers(len(kinds)))]
    pairs = sorted({(p, q) for _, p, _, q, _ in options[kind]}, key=lambda pq: tuple(map(lang.WIDE_PREDICATES.index,
                                                                                          pq)))
    p, q = pairs[int(rng.integers(len(pairs)))]
    triples = [(i, j, k) for i, p2, j, q2, k in options[kind] if (p2, q2) == (p, q)]
    i, j, k = triples[int(rng.integers(len(triples)))]
    second = [1, q, 2] if kind == "chain" else [0, q, 2]
    return kind, {"objects": [_referring(rng, record, x) for x in (i, j, k)], "relations": [[0, p, 1], second],
                  "style": _style(rng, [_form(rng, p, False, every), _form(rng, q, False, every)])}


def _between(rng: np.random.Generator, record: dict) -> dict | None:
    ok = _nameable(record)
    triples = [t for t in record["between"] if ok.issuperset(t)]
    if not triples:
        return None
    a, b, c = triples[int(rng.integers(len(triples)))]
    ends = (b, c) if rng.random() < 0.5 else (c, b)
    return {"objects": [_referring(rng, record, x) for x in (a, *ends)], "relations": [[0, "between", 1, 2]],
            "style": _style(rng)}


def scene_captions(record: dict, rng: np.random.Generator, split: str,
                   every: bool = False) -> tuple[list[dict], dict | None]:
    """The scene's captions (module docstring) as ``{"id", "kind", "text", "struct"}``, each checked true of the
    scene, and the relation caption's pair (``named``; None where the scene relates nothing). ``every``: any
    phrasing in any split, none held out (:func:`_form`)."""
    structs = [("object", {"objects": [_any_phrase(rng, o)], "relations": [], "style": _style(rng)})
               for o in record["objects"]]
    named = None
    relation = _relation(rng, record, split, every)
    if relation is not None:
        structs.append(("relation", relation[0]))
        named = relation[1]
    count = _count(rng, record)
    if count is not None:
        structs.append(("count", count))
    two = _two_relations(rng, record, every)
    if two is not None:
        structs.append(two)
    between = _between(rng, record)
    if between is not None:
        structs.append(("between", between))
    captions = []
    for k, (kind, struct) in enumerate(structs):
        if not satisfies(record, struct):
            raise AssertionError(f"scene {record['image_id']}: its {kind} caption {render(struct)!r} is false of it")
        captions.append({"id": record["image_id"] * CAPTION_SLOTS + k, "kind": kind, "text": render(struct),
                         "struct": struct})
    return captions, named


# ------------------------------------------------------------------------------------------------- negatives
def _changed(struct: dict, k: int | None = None, relation: tuple[int, list] | None = None, form: str | None = None,
             **said) -> dict:
    objects = [dict(o) for o in struct["objects"]]
    relations = [list(r) for r in struct["relations"]]
    style = {**struct["style"], "forms": list(struct["style"]["forms"])}
    if k is not None:
        objects[k].update(said)
    if relation is not None:
        relations[relation[0]] = relation[1]
        style["forms"][relation[0]] = form
    return {**struct, "objects": objects, "relations": relations, "style": style}


def _values(attribute: str, colours: Sequence[str]) -> Sequence[str]:
    return {"size": tuple(w3.SIZES), "colour": tuple(colours), "material": w3.MATERIALS,
            "shape": w3.SHAPES}[attribute]


def candidates(struct: dict, neg_type: str, rng: np.random.Generator, colours: Sequence[str] = tuple(w3.COLOURS),
               record: dict | None = None, every: bool = False) -> list[dict]:
    """Every candidate of ``neg_type`` for caption ``struct`` in a fixed order (a replaced relation's form and
    another object's phrase drawn from ``rng``; ``replace-obj`` needs the scene's ``record``)."""
    objects = struct["objects"]
    if neg_type not in NEGATIVE_TYPES:
        raise ValueError(f"no negative type {neg_type!r}: {', '.join(NEGATIVE_TYPES)}")
    attribute = neg_type.removeprefix("replace-")
    if attribute in lang.ATTRIBUTES:
        return [_changed(struct, k, **{attribute: v}) for k, o in enumerate(objects) if attribute in o
                for v in _values(attribute, colours) if v != o[attribute]]
    if neg_type == "replace-obj":
        if not struct["relations"] or record is None:
            return []
        out = []
        for k in range(len(objects)):
            for other in sorted(_nameable(record)):
                changed = _changed(struct)
                changed["objects"][k] = _referring(rng, record, other)
                out.append(changed)
        return out
    if neg_type == "swap-att":
        out = []
        for i, j in itertools.combinations(range(len(objects)), 2):
            for a in lang.ATTRIBUTES:
                if a in objects[i] and a in objects[j] and objects[i][a] != objects[j][a]:
                    swapped = _changed(struct, i, **{a: objects[j][a]})
                    swapped["objects"][j][a] = objects[i][a]
                    out.append(swapped)
        return out
    if neg_type == "swap-obj":
        if not struct["relations"]:
            return []
        out = []
        for i, j in itertools.combinations(range(len(objects)), 2):
            swapped = _changed(struct)
            swapped["objects"][i], swapped["objects"][j] = dict(objects[j]), dict(objects[i])
            out.append(swapped)
        return out
    if neg_type == "replace-rel":  # the converse, in the caption's phrasing family
        held = struct["style"]["held_out"]
        return [_changed(struct, relation=(r, [rel[0], CONVERSE[rel[1]], rel[2]]),
                         form=_form(rng, CONVERSE[rel[1]], held, every))
                for r, rel in enumerate(struct["relations"]) if rel[1] in CONVERSE]  # not "next to", "between"
    out = []  # "count": one number changed, to another its template could say (_counted)
    for r, (_, n) in enumerate(struct.get("counts", ())):
        for m in struct["count_options"][r]:
            if m != n:
                counts = [list(c) for c in struct["counts"]]
                counts[r][1] = m
                out.append({**struct, "counts": counts})
    return out


def acceptable(record: dict, struct: dict, split: str, holdout: frozenset) -> bool:
    """A hard negative: no phrase twice, no held-out (colour, shape) named in the train split, false of the scene
    even leniently."""
    keys = [tuple(sorted(o.items())) for o in struct["objects"]]
    if len(set(keys)) < len(keys):
        return False
    if split == "train" and any((o.get("colour"), o.get("shape")) in holdout for o in struct["objects"]):
        return False
    return not satisfies(record, struct, lenient=True)


def rows(caption: dict, neg_type: str) -> list[str]:
    """The benchmark rows a negative of ``neg_type`` for ``caption`` counts in besides its type (:data:`ROWS`): a
    chain's relations changed, the middle of "between" swapped, a "next to" caption's object replaced by one far
    from the other, a held-out phrasing's relation changed."""
    struct = caption["struct"]
    found = [row for row, (kinds, types) in ROWS.items() if caption["kind"] in kinds and neg_type in types]
    if "next to" in found and struct["relations"][0][1] != "next to":
        found.remove("next to")
    if "held-out phrasing" in found and not struct["style"]["held_out"]:
        found.remove("held-out phrasing")
    return found


def scene_negatives(record: dict, caption: dict, rng: np.random.Generator, split: str, holdout: frozenset,
                    colours: Sequence[str] = tuple(w3.COLOURS), every: bool = False) -> list[dict]:
    """One acceptable hard negative of each type for ``caption`` (drawn in a random order), none saying what the
    caption says (``every``: :func:`scene_captions`')."""
    out = []
    for neg_type in NEGATIVE_TYPES:
        found = candidates(caption["struct"], neg_type, rng, colours, record, every)
        for k in rng.permutation(len(found)):
            text = render(found[k])
            if text != caption["text"] and acceptable(record, found[k], split, holdout):
                out.append({"type": neg_type, "text": text, "struct": found[k], "rows": rows(caption, neg_type)})
                break
    return out
