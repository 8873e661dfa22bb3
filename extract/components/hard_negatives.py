"""Hard negatives from a caption's parse: the training-time counterpart of the toy world's evaluation negatives.

``python -m extract.components.hard_negatives --captions FILE.csv|txt [--n 20] [--types all]`` prints captions with their
negatives, one line per type.

NegCLIP (Yuksekgonul et al., ICLR 2023, §4) trains CLIP with, for every caption, a text that names the same
things in a different structure, as an extra column of the image->text softmax: the model can no longer tell
its caption from the batch by the bag of words alone. The toy world builds such texts from its ground-truth
structs for evaluation (:mod:`extract.worlds.toyworld`); this module builds them from the spaCy parse that ComAlign
already extracts (:mod:`extract.components.text`), so they exist for any caption (COCO, CC, the toy world).

A caption's structure, as read from its parse
    Mentions: every occurrence of an entity phrase (its modifiers, then its head noun) that lies inside no
    longer one. Referents: mentions grouped in caption order; a mention joins the one earlier referent with
    the same head whose attribute words contain its own or are contained in them ("a small red circle ...
    the red circle"), else it starts a referent of its own. Attribute words are the modifiers that
    :data:`ATTRIBUTES` puts in a category (colour, size, material, ...); other modifiers are kept but never
    edited. Relations: ComAlign's (subject, predicate, object) triplets whose predicate is one contiguous
    phrase ("to the left of", "on", "riding").

Types (the toy world's names and meanings, :data:`extract.worlds.toyworld.NEGATIVE_TYPES` without add-obj)
    ``replace-att``  one referent's attribute replaced, in every mention naming it, by another attribute of
                     the same category from the training vocabulary;
    ``replace-obj``  one referent's head noun replaced by another training noun of the same number (never
                     a generic one, :data:`GENERIC_NOUNS`: "a photo of ...", "three objects: ...");
    ``replace-rel``  one relation's predicate replaced by another training predicate; its converse
                     (:data:`CONVERSES`: left/right, above/below, on/under, ...) is drawn half the time when
                     the vocabulary has it, being the one replacement certain to be false of the image;
    ``swap-att``     two referents exchange their attributes of one category (in every mention);
    ``swap-obj``     one relation's subject and object exchanged ("a red circle to the left of a blue square"
                     -> "a blue square to the left of a red circle").
    "a"/"an" before an edited mention follows its new first word.

Dropped candidates
    - the same structure as the positive: a swap of equal words, a swap across a symmetric predicate
      (:data:`SYMMETRIC`: "next to", "near", ...), a subject and object of the same text;
    - the same meaning in other words: a replacement or a swap within one :data:`SYNONYMS` group ("shiny" /
      "metal", "on" / "on top of");
    - ambiguous ones: two referents with the same full name, or a mention that now fits two referents
      ("the red circle" when the caption names a small and a large red circle);
    - any naming a forbidden (attribute, noun) pair (``forbid``: the held-out combinations of a toy world).
    A text-only generator cannot see the image: "above" for a pair that is also above is proposed (the toy
    world, which sees the scene, drops it). :func:`candidates` lists every candidate; :meth:`HardNegatives.draw`
    picks at most one per type (``TYPE*N`` in the types: up to N, distinct; :func:`parse_types`).

Vocabulary
    :meth:`Vocabulary.build` collects head nouns, attribute words per category and predicates from the
    *training* captions only (words seen at least ``min_count`` times), so a negative never names a word the
    model cannot have seen and never borrows from an evaluation split.
"""
from __future__ import annotations

import argparse
import itertools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from extract.common.cli import Parser, option, run_job
from extract.common.config import nonnegative_float, positive_int

NEGATIVE_TYPES = ("replace-att", "replace-obj", "replace-rel", "swap-att", "swap-obj")

#: attribute categories; replace-att and swap-att only exchange words of one category
ATTRIBUTES = {
    "colour": ("red", "green", "blue", "yellow", "purple", "orange", "white", "gray", "grey", "black", "brown",
               "pink", "silver", "gold", "golden", "beige", "tan", "violet", "cyan", "teal", "maroon", "navy"),
    "size": ("small", "large", "big", "little", "tiny", "huge", "giant", "short", "tall", "long", "wide",
             "narrow", "thick", "thin"),
    "material": ("wooden", "metal", "metallic", "plastic", "glass", "stone", "brick", "leather", "paper",
                 "ceramic", "concrete", "steel", "cotton", "wool", "rubber", "shiny", "matte"),  # CLEVR's two, 2 ways
    "age": ("old", "young", "new", "ancient", "modern"),
    "state": ("open", "closed", "empty", "full", "wet", "dry", "clean", "dirty", "broken", "lit"),
    "pattern": ("striped", "spotted", "checkered", "plaid", "dotted", "floral"),
}
_CATEGORY = {word: name for name, words in ATTRIBUTES.items() for word in words}
#: words and predicates that say the same thing, or nothing certainly different: a replacement or a swap within one
#: group is dropped, as it may be true of the image ("a shiny cube" -> "a metal cube" is not a negative; the wide 3D
#: world says each material two ways and each predicate in several phrasings, and before these groups a third of
#: its material negatives and a share of its replace-rel ones named the caption's own meaning in other words)
SYNONYMS = (
    ("gray", "grey"), ("gold", "golden"), ("small", "little", "tiny"), ("large", "big", "huge", "giant"),
    ("metal", "metallic", "steel", "shiny"), ("rubber", "matte"),
    ("on", "on top of", "sitting on", "resting on", "atop"), ("under", "beneath", "underneath"),
    ("left of", "to the left of", "on the left of", "on the left side of"),
    ("right of", "to the right of", "on the right of", "on the right side of"),
    ("in front of", "closer to the camera than"), ("behind", "in back of"),
    ("next to", "beside", "near", "close to", "by", "adjacent to"),
)
_GROUP = {word: k for k, group in enumerate(SYNONYMS) for word in group}


def synonyms(a: str, b: str) -> bool:
    """True where ``a`` and ``b`` are one word or in one :data:`SYNONYMS` group (case-insensitive)."""
    a, b = a.lower(), b.lower()
    return a == b or (a in _GROUP and _GROUP.get(a) == _GROUP.get(b))

#: predicates whose converse is certainly false when they hold (replace-rel draws it half the time)
CONVERSES = {
    "to the left of": "to the right of", "left of": "right of", "on the left of": "on the right of",
    "on the left side of": "on the right side of", "above": "below", "over": "under", "on": "under",
    "on top of": "under", "sitting on": "beneath", "resting on": "underneath", "in front of": "behind",
    "closer to the camera than": "in back of", "inside": "outside", "in": "outside",
}
CONVERSES.update({v: k for k, v in list(CONVERSES.items()) if v not in CONVERSES})
#: predicates for which swapping subject and object says the same thing
SYMMETRIC = frozenset({"next to", "near", "beside", "by", "with", "close to", "adjacent to", "and", "touching"})
CONVERSE_SHARE = 0.5
STRUCTURE_CACHE = 500_000  # parsed captions kept per process
#: nouns that name no kind of thing ("a photo of a dog", "three objects: ..."): never replaced, never replacements
GENERIC_NOUNS = frozenset({"object", "objects", "thing", "things", "item", "items", "photo", "photos", "picture",
                           "pictures", "image", "images", "view", "scene", "shot", "closeup", "close-up"})


@dataclass
class HardNegativeOptions:
    """The two options every trainer takes, as dataclass fields (``train.pretrain``, ``train.adapter`` inherit
    them, as they do ``extract.common.source_args.SourceOptions``); :func:`parse_types` reads the first."""

    hard_negatives: object = option("none", group="hard negatives",
                                    help="NegCLIP's hard negatives as extra image->text columns, drawn per training "
                                         "caption from its parse: none, all, or a comma list from replace-att, "
                                         "replace-obj, replace-rel, swap-att, swap-obj, each TYPE*N for N of it "
                                         "per caption ('all,replace-rel*3'; extract/components/hard_negatives.py)")
    hard_negative_weight: float = option(1.0, type=nonnegative_float, group="hard negatives",
                                         help="weight of the hard-negative term added to the loss")


# --------------------------------------------------------------------------------------------- vocabulary
@dataclass
class Vocabulary:
    """What replacements may draw from: head nouns, attribute words per category and predicates, each sorted."""

    nouns: list[str] = field(default_factory=list)
    attributes: dict[str, list[str]] = field(default_factory=dict)
    predicates: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, structures: Iterable["Structure"], min_count: int = 1) -> "Vocabulary":
        """From the structures of the *training* captions (:func:`structure`); words seen >= min_count times."""
        nouns, attributes, predicates = Counter(), Counter(), Counter()
        for s in structures:
            for r in s.referents:
                nouns[r.head] += 1
                attributes.update(r.attributes.values())
            predicates.update(rel.predicate for rel in s.relations)
        keep = lambda counts: sorted(w for w, n in counts.items() if n >= min_count)  # noqa: E731
        by_category: dict[str, list[str]] = {}
        for word in keep(attributes):
            by_category.setdefault(_CATEGORY[word], []).append(word)
        return cls(keep(nouns), by_category, keep(predicates))


# --------------------------------------------------------------------------------------------- structure
@dataclass(frozen=True)
class Word:
    start: int
    end: int
    text: str


@dataclass
class Mention:
    """One occurrence of an entity phrase: its words in order, the last one the head noun."""

    words: list[Word]

    @property
    def start(self) -> int:
        return self.words[0].start

    @property
    def end(self) -> int:
        return self.words[-1].end

    @property
    def head(self) -> str:
        return self.words[-1].text.lower()

    def attributes(self) -> dict[str, str]:
        """category -> word (the first word of each category among the modifiers)."""
        out: dict[str, str] = {}
        for w in self.words[:-1]:
            cat = _CATEGORY.get(w.text.lower())
            if cat and cat not in out:
                out[cat] = w.text.lower()
        return out


@dataclass
class Referent:
    head: str
    attributes: dict[str, str]  # category -> word, the union over its mentions
    mentions: list[int]  # indices into Structure.mentions


@dataclass(frozen=True)
class RelationSpan:
    subject: int  # mention index
    predicate: str
    start: int  # character span of the predicate
    end: int
    object: int


@dataclass
class Structure:
    text: str
    mentions: list[Mention]
    referents: list[Referent]
    relations: list[RelationSpan]

    def referent_of(self, mention: int) -> int:
        return next(k for k, r in enumerate(self.referents) if mention in r.mentions)


_WORD = re.compile(r"\S+")


def plural(noun: str) -> bool:
    """English number by spelling, good enough to keep "three objects" from becoming "three cat": a final s that
    is not -ss, -us or -is ("dogs", "glasses" plural; "glass", "bus", "tennis" singular)."""
    noun = noun.lower()
    return noun.endswith("s") and not noun.endswith(("ss", "us", "is"))


def _words(text: str, start: int, end: int) -> list[Word]:
    return [Word(start + m.start(), start + m.end(), m.group()) for m in _WORD.finditer(text[start:end])]


def _occurrences(text: str, phrase: str) -> list[tuple[int, int]]:
    pattern = re.compile(r"(?<![\w-])" + r"\s+".join(map(re.escape, phrase.split())) + r"(?![\w-])", re.I)
    return [(m.start(), m.end()) for m in pattern.finditer(text)]


def structure(components) -> Structure:
    """The caption's mentions, referents and relations from its :class:`extract.components.text.TextComponents`
    (module docstring). Entity phrases are searched for in the text, so a phrase the extractor deduplicated
    ("the blue square" twice) yields every occurrence."""
    text = components.caption
    spans = {span for e in components.entities if e.text.strip() for span in _occurrences(text, e.text)}
    for rel in components.relations:
        spans.update({(rel.subject.start, rel.subject.end), (rel.object.start, rel.object.end)})
    spans = {s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)}
    mentions = [Mention(_words(text, a, b)) for a, b in sorted(spans)]
    mentions = [m for m in mentions if m.words]
    referents: list[Referent] = []
    for k, m in enumerate(mentions):
        attrs = m.attributes()
        fits = [r for r in referents if r.head == m.head and _consistent(r.attributes, attrs)]
        if len(fits) == 1:
            fits[0].attributes.update(attrs)
            fits[0].mentions.append(k)
        else:
            referents.append(Referent(m.head, dict(attrs), [k]))
    index = {(m.start, m.end): k for k, m in enumerate(mentions)}
    relations = []
    for rel in components.relations:
        p = rel.predicate
        s, o = index.get((rel.subject.start, rel.subject.end)), index.get((rel.object.start, rel.object.end))
        if s is None or o is None or text[p.start:p.end] != p.text:
            continue  # a predicate that leaves words out ("throwing ... in") is not edited
        relations.append(RelationSpan(s, p.text.lower(), p.start, p.end, o))
    return Structure(text, mentions, referents, relations)


def _consistent(a: dict[str, str], b: dict[str, str]) -> bool:
    """One attribute set names the other's referent: no category with two different words, one within the other."""
    shared = a.keys() & b.keys()
    return all(a[c] == b[c] for c in shared) and (a.keys() <= b.keys() or b.keys() <= a.keys())


# --------------------------------------------------------------------------------------------- candidates
@dataclass(frozen=True)
class Edit:
    """A candidate negative as text replacements: ((start, end, new text), ...) on the positive caption."""

    type: str
    replacements: tuple[tuple[int, int, str], ...]
    converse: bool = False  # replace-rel to the predicate's converse (CONVERSES)


def _retarget(word: Word, new: str) -> str:
    return new.capitalize() if word.text[:1].isupper() else new


def _names(attrs: list[dict], heads: list[str]) -> list[tuple]:
    """Each referent's full name: its head noun and its attribute words by category."""
    return [(head, tuple(sorted(a.items()))) for head, a in zip(heads, attrs)]


def _signature(attrs: list[dict], heads: list[str], rels: list[tuple[int, str, int]]) -> tuple:
    """The structure as data: the referents' names, and the relations between names (symmetric ones unordered)."""
    names = _names(attrs, heads)
    out = []
    for subj, predicate, obj in rels:
        pair = (names[subj], names[obj])
        out.append((predicate,) + (tuple(sorted(pair)) if predicate in SYMMETRIC else pair))
    return tuple(sorted(names)), tuple(sorted(out))


def _ambiguous(s: Structure, attrs: list[dict], heads: list[str]) -> bool:
    """Two referents with one full name, or a mention whose words now fit a referent other than its own."""
    names = _names(attrs, heads)
    if len(set(names)) < len(names):
        return True
    for k, r in enumerate(s.referents):
        for m in r.mentions:
            said = set(s.mentions[m].attributes())
            wanted = {c: attrs[k][c] for c in said if c in attrs[k]}
            if any(j != k and heads[j] == heads[k] and all(attrs[j].get(c) == w for c, w in wanted.items())
                   for j in range(len(heads))):
                return True
    return False


def _forbidden(attrs: list[dict], heads: list[str], forbid: frozenset) -> bool:
    return bool(forbid) and any((word, heads[k]) in forbid for k, a in enumerate(attrs) for word in a.values())


def _attr_edits(s: Structure, changes: dict[int, dict[str, str]]) -> list[tuple[int, int, str]]:
    """Replacements putting each referent's new attribute words into every mention that names the category."""
    out = []
    for k, new in changes.items():
        for m in s.referents[k].mentions:
            for w in s.mentions[m].words[:-1]:
                cat = _CATEGORY.get(w.text.lower())
                if cat in new:
                    out.append((w.start, w.end, _retarget(w, new[cat])))
    return out


class _Candidates:
    """The candidate edits of one structure. Each type lists cheap *proposals* (tuples); :meth:`make` turns one
    into an :class:`Edit`, or None when it leaves the structure unchanged, is ambiguous or names something
    forbidden. Listing and making apart let :meth:`HardNegatives.draw` take the first acceptable proposal in a
    random order (uniform over the acceptable ones) without making every candidate of a large vocabulary."""

    def __init__(self, s: Structure, vocab: Vocabulary, forbid: frozenset):
        self.s, self.vocab, self.forbid = s, vocab, forbid
        self.attrs = [dict(r.attributes) for r in s.referents]
        self.heads = [r.head for r in s.referents]
        self.rels = [(s.referent_of(r.subject), r.predicate, s.referent_of(r.object)) for r in s.relations]
        self.original = _signature(self.attrs, self.heads, self.rels)

    def proposals(self, kind: str) -> list[tuple]:
        s, v = self.s, self.vocab
        if kind == "replace-att":
            return [(k, cat, new) for k, r in enumerate(s.referents) for cat, word in sorted(r.attributes.items())
                    for new in v.attributes.get(cat, []) if not synonyms(new, word)]
        if kind == "replace-obj":  # a noun replaces one of the same number (no "three cat")
            return [(k, new) for k, r in enumerate(s.referents) if r.head not in GENERIC_NOUNS for new in v.nouns
                    if new != r.head and plural(new) == plural(r.head) and new not in GENERIC_NOUNS]
        if kind == "replace-rel":
            return [(n, new) for n, rel in enumerate(s.relations) for new in v.predicates
                    if not synonyms(new, rel.predicate)]
        if kind == "swap-att":
            return [(i, j, cat) for i, j in itertools.combinations(range(len(self.attrs)), 2)
                    for cat in sorted(self.attrs[i].keys() & self.attrs[j].keys())
                    if not synonyms(self.attrs[i][cat], self.attrs[j][cat])]
        if kind == "swap-obj":
            return [(n,) for n in range(len(s.relations))]
        raise ValueError(f"unknown hard-negative type {kind!r}; expected one of {', '.join(NEGATIVE_TYPES)}")

    def make(self, kind: str, proposal: tuple) -> Edit | None:
        s = self.s
        attrs, heads, rels, converse = self.attrs, self.heads, self.rels, False
        if kind == "replace-att":
            k, cat, new = proposal
            attrs = [dict(a) for a in attrs]
            attrs[k][cat] = new
            repl = _attr_edits(s, {k: {cat: new}})
        elif kind == "replace-obj":
            k, new = proposal
            heads = list(heads)
            heads[k] = new
            words = [s.mentions[m].words[-1] for m in s.referents[k].mentions]
            repl = [(w.start, w.end, _retarget(w, new)) for w in words]
        elif kind == "replace-rel":
            n, new = proposal
            rel = s.relations[n]
            rels = list(rels)
            rels[n] = (rels[n][0], new, rels[n][2])
            repl, converse = [(rel.start, rel.end, new)], CONVERSES.get(rel.predicate) == new
        elif kind == "swap-att":
            i, j, cat = proposal
            a, b = attrs[i][cat], attrs[j][cat]
            attrs = [dict(x) for x in attrs]
            attrs[i][cat], attrs[j][cat] = b, a
            repl = _attr_edits(s, {i: {cat: b}, j: {cat: a}})
        else:  # swap-obj
            n, = proposal
            rel = s.relations[n]
            subj, obj = s.mentions[rel.subject], s.mentions[rel.object]
            rels = list(rels)
            rels[n] = (rels[n][2], rels[n][1], rels[n][0])
            repl = [(subj.start, subj.end, s.text[obj.start:obj.end]),
                    (obj.start, obj.end, s.text[subj.start:subj.end])]
        if not repl or _signature(attrs, heads, rels) == self.original or _ambiguous(s, attrs, heads) or \
                _forbidden(attrs, heads, self.forbid):
            return None
        return Edit(kind, tuple(sorted(repl)), converse)


def parse_types(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """The negatives' slots, a type once per negative of it drawn for each caption, in :data:`NEGATIVE_TYPES` order:
    ``"none"`` / ``""`` -> (); ``"all"`` -> every type once; else a comma list (or sequence) of known types, each
    ``TYPE`` (one) or ``TYPE*N`` (N distinct negatives of it per caption, where the caption has that many), with
    ``all`` giving one of every type not listed: ``"all,replace-rel*3"``. A type listed twice is an error, except
    as :func:`format_types` writes the slots back (``"replace-rel,replace-rel"``: two)."""
    if spec is None:
        return ()
    items = [t.strip() for t in spec.split(",")] if isinstance(spec, str) else [str(t).strip() for t in spec]
    items = [t for t in items if t]
    if items in ([], ["none"]):
        return ()
    counts: dict[str, int] = {}
    starred: set[str] = set()
    for item in items:
        if item == "all":
            continue
        kind, star, n = item.partition("*")
        kind = kind.strip()
        if kind not in NEGATIVE_TYPES:
            raise ValueError(f"unknown hard-negative type {kind!r}: use none, all or a comma list from "
                             f"{', '.join(NEGATIVE_TYPES)} (each TYPE or TYPE*N)")
        if star and not (n.strip().isdigit() and int(n) >= 1):
            raise ValueError(f"hard negatives {item!r}: the count after '*' must be a whole number >= 1")
        if kind in starred or (star and kind in counts):
            raise ValueError(f"hard negatives: {kind} is listed twice; give its count once ({kind}*N)")
        if star:
            starred.add(kind)
        counts[kind] = int(n) if star else counts.get(kind, 0) + 1
    if "all" in items:
        counts = {kind: counts.get(kind, 1) for kind in NEGATIVE_TYPES}
    return tuple(kind for kind in NEGATIVE_TYPES for _ in range(counts.get(kind, 0)))


def format_types(types: Sequence[str]) -> str:
    """The slots of :func:`parse_types` as the flag writes them: ``"replace-att,replace-rel*3"``, ``"none"``."""
    counts = Counter(types)
    return ",".join(kind if counts[kind] == 1 else f"{kind}*{counts[kind]}"
                    for kind in NEGATIVE_TYPES if counts[kind]) or "none"


def fill_slots(types: Sequence[str], found: Iterable[tuple[str, str]]) -> dict[int, str]:
    """{slot: text} for one caption's drawn (type, text) pairs: the k-th negative of a type in that type's k-th slot
    of ``types`` (the slots of :func:`parse_types`); slots left empty are absent."""
    free: dict[str, list[int]] = {}
    for slot, kind in enumerate(types):
        free.setdefault(kind, []).append(slot)
    out = {}
    for kind, text in found:
        if free.get(kind):
            out[free[kind].pop(0)] = text
    return out


def candidates(s: Structure, vocab: Vocabulary, types: Sequence[str] = NEGATIVE_TYPES,
               forbid: frozenset = frozenset()) -> list[Edit]:
    """Every acceptable candidate of the given types (module docstring), in a fixed order: the reference that
    :meth:`HardNegatives.draw` samples from."""
    c = _Candidates(s, vocab, forbid)
    return [e for kind in parse_types(list(types)) for p in c.proposals(kind) if (e := c.make(kind, p))]


_ARTICLE = re.compile(r"(?<![\w-])(a|an)(\s+)$", re.I)


def render(text: str, edit: Edit) -> str:
    """The negative's text: the replacements applied right to left, each "a"/"an" before one fitted to it."""
    for start, end, new in sorted(edit.replacements, reverse=True):
        before = text[:start]
        m = _ARTICLE.search(before)
        if m:
            article = "an" if new[:1].lower() in "aeiou" else "a"
            article = article.capitalize() if m.group(1)[0].isupper() else article
            before = before[:m.start()] + article + m.group(2)
        text = before + new + text[end:]
    return text


# --------------------------------------------------------------------------------------------- drawing
def first_acceptable(c: _Candidates, kind: str, rng: np.random.Generator, count: int = 1) -> list[Edit]:
    """Up to ``count`` candidates of ``kind`` with distinct texts, uniform over the acceptable ones: proposals in a
    random order, the first that make an :class:`Edit` (replace-rel: the converse ones first, CONVERSE_SHARE of the
    time). One draw takes the same random numbers whatever ``count``: a run asking one per type draws what it did."""
    proposals = c.proposals(kind)
    converse = [p for p in proposals if kind == "replace-rel" and CONVERSES.get(c.s.relations[p[0]].predicate) == p[1]]
    if converse and rng.random() < CONVERSE_SHARE:
        rest = [p for p in proposals if p not in converse]
        proposals = converse + rest
        order = list(rng.permutation(len(converse))) + [len(converse) + k for k in rng.permutation(len(rest))]
    else:
        order = rng.permutation(len(proposals))
    found: list[Edit] = []
    for k in order:
        edit = c.make(kind, proposals[k])
        if edit is not None and all(edit.replacements != e.replacements for e in found):
            found.append(edit)
            if len(found) == count:
                break
    return found


@dataclass
class HardNegatives:
    """Draws hard negatives for training captions: ``HardNegatives(vocab, types).draw(captions, rng)``.

    types: the slots, each type of :data:`NEGATIVE_TYPES` once per negative of it drawn (``parse_types`` reads the
    flag); forbid: (attribute, noun) pairs no negative may name (a toy world's held-out combinations). The spaCy
    extractor is loaded on first use, so an instance pickles into data-loader workers without it (the parsed
    structures go along).
    """

    vocab: Vocabulary
    types: tuple[str, ...] = NEGATIVE_TYPES
    forbid: frozenset = frozenset()
    _extractor: object = field(default=None, repr=False, compare=False)

    def __getstate__(self):  # the parses made for the vocabulary travel along: no caption is parsed twice
        return {**self.__dict__, "_extractor": None}

    @property
    def extractor(self):
        if self._extractor is None:
            from extract.components.text import TextComponentExtractor

            # generous caps: every mention of a long caption counts
            self._extractor = TextComponentExtractor(max_entities=64, max_relations=32)
        return self._extractor

    def structures(self, captions: Sequence[str]) -> list[Structure]:
        """Each caption's structure; parsed once per process (a training run sees its captions every epoch)."""
        cache = self.__dict__.setdefault("_structures", {})
        todo = list(dict.fromkeys(c for c in captions if c not in cache))
        if todo:
            if len(cache) + len(todo) > STRUCTURE_CACHE:
                cache.clear()
            cache.update(zip(todo, (structure(c) for c in self.extractor.extract(todo))))
        return [cache[c] for c in captions]

    def draw(self, captions: Sequence[str], rng: np.random.Generator) -> list[list[tuple[str, str]]]:
        """For each caption, at most as many (type, text) of a type as :attr:`types` has slots of it (distinct
        texts), in :attr:`types` order; :func:`fill_slots` puts them in their slots."""
        counts = Counter(self.types)
        out = []
        for s in self.structures(captions):
            c = _Candidates(s, self.vocab, self.forbid)
            found = []
            for kind in dict.fromkeys(self.types):
                texts = dict.fromkeys(render(s.text, edit) for edit in first_acceptable(c, kind, rng, counts[kind]))
                found += [(kind, text) for text in texts if text.lower() != s.text.lower()]
            out.append(found)
        return out

    @classmethod
    def for_captions(cls, captions: Sequence[str], types: Sequence[str] = NEGATIVE_TYPES,
                     forbid: Iterable = (), min_count: int = 1) -> "HardNegatives":
        """A generator whose vocabulary comes from ``captions`` (the training captions: never an evaluation
        split's)."""
        gen = cls(Vocabulary(), tuple(types), frozenset(tuple(p) for p in forbid))
        gen.vocab = Vocabulary.build(gen.structures(captions), min_count=min_count)
        return gen


# --------------------------------------------------------------------------------------------- command line
def build_parser() -> Parser:
    p = Parser(prog="python -m extract.components.hard_negatives", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--captions", required=True, help="captions: a CSV with a 'title' column, or a text file, one a "
                                                     "line (the vocabulary is built from all of them)")
    p.add_argument("--n", type=positive_int, default=10, help="captions to show")
    p.add_argument("--types", default="all", help=f"none, all or a comma list from {', '.join(NEGATIVE_TYPES)}")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    def job(args: argparse.Namespace) -> None:
        from extract.components.text import read_captions

        captions = read_captions(args.captions)
        gen = HardNegatives.for_captions(captions, parse_types(args.types))
        v = gen.vocab
        print(f"vocabulary of {len(captions)} captions: {len(v.nouns)} nouns, "
              + ", ".join(f"{len(w)} {c}" for c, w in sorted(v.attributes.items()))
              + f", {len(v.predicates)} predicates")
        for caption, negs in zip(captions[:args.n], gen.draw(captions[:args.n], np.random.default_rng(args.seed))):
            print(f"\n{caption}")
            for kind, text in negs:
                print(f"  {kind:<12} {text}")

    try:
        args = build_parser().parse_args(argv)
        parse_types(args.types)
    except ValueError as e:
        build_parser().error(str(e))
    return run_job(job, args)


if __name__ == "__main__":
    raise SystemExit(main())
