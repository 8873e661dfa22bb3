"""What a caption's parse gives (:class:`Phrase`, :class:`Relation`, :class:`PhraseTree`, :class:`TextComponents`;
``extract.components.text`` makes them) and how a batch of them is packed into the feature cache's fixed-shape
arrays (:func:`pack`), the phrase tree's nodes ordered and capped on the way (:func:`order_nodes`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

@dataclass(frozen=True)
class Phrase:
    """A phrase of a caption.

    text: the phrase's words, runs of adjacent words joined by one space: ``caption[start:end]`` unless the
        phrase leaves words out (a verb and its preposition, "throwing ... in" -> "throwing in") or the caption
        has extra whitespace (spaCy makes it a word of its own).
    start, end: [start, end) character range in the original caption covering all the phrase's words.
    tokens: sorted backbone token positions overlapping the phrase's words (empty when no TokenizedText
        was given, or when truncation cut every one of them).
    count: the number a numeral on the phrase's head noun says ("two red cubes": 2; the entity's text stays "red
        cubes"), None without one. Read by the parse only so far: nothing packs it into the cache (issue 82).
    """

    text: str
    start: int
    end: int
    tokens: tuple[int, ...] = ()
    count: int | None = None


@dataclass(frozen=True)
class Relation:
    """A (subject, predicate, object) triplet; subject and object are entity phrases."""

    subject: Phrase
    predicate: Phrase
    object: Phrase

    @property
    def text(self) -> str:
        """"subject predicate object", the string that is embedded ("red circle to the left of blue square")."""
        return f"{self.subject.text} {self.predicate.text} {self.object.text}"


@dataclass
class PhraseTree:
    """leaves: base phrases in caption order; nodes: each a sorted tuple of leaf indices (see module doc
    for the order and the caps). Empty (no leaves, no nodes) only for a caption without words."""

    leaves: list[Phrase]
    nodes: list[tuple[int, ...]]


@dataclass
class TextComponents:
    """Everything extracted from one caption (``caption`` is the string as given)."""

    caption: str
    entities: list[Phrase]
    relations: list[Relation]
    tree: PhraseTree


def order_nodes(n_leaves: int, candidates, max_nodes: int) -> list[tuple[int, ...]]:
    """Deduplicated, ordered, capped node list over leaves 0..n_leaves-1 from candidate leaf sets.

    Always contains the root (all leaves) and the singletons; ``candidates`` add inner nodes (empty,
    singleton and full sets among them are ignored). Order: singletons, inner nodes by (size, leaves),
    root. Over ``max_nodes`` the root is kept first; then up to half of the remaining budget goes to
    inner nodes (smallest first), the rest to singletons in caption order, and what singletons leave
    to further inner nodes -- so a long caption keeps some of its constituents (relation clauses,
    prepositional phrases) instead of spending every slot on single phrases. A tree over P leaves has
    at most 2P - 1 nodes (a laminar family), so ``max_nodes >= 2 * P - 1`` never drops one.
    """
    if n_leaves == 0:
        return []
    root = tuple(range(n_leaves))
    if n_leaves == 1:
        return [root]
    inner = sorted({tuple(sorted(set(s))) for s in candidates if 1 < len(set(s)) < n_leaves},
                   key=lambda t: (len(t), t))
    budget = max(0, max_nodes - 1)
    n_single = min(n_leaves, budget - min(len(inner), budget // 2))
    n_inner = min(len(inner), budget - n_single)
    return [(k,) for k in range(n_single)] + inner[:n_inner] + [root]


def pack(components: Sequence[TextComponents], context_length: int, max_entities: int, max_relations: int,
         max_leaves: int, max_nodes: int) -> dict:
    """Fixed-shape arrays for the feature cache, C = len(components), L = context_length.

    Components must come from :meth:`TextComponentExtractor.extract` *with* a TokenizedText of this
    context length. A leaf with no tokens (cut by truncation) is dropped from the packed tree and
    counted in ``phrases_cut``; the remaining leaves are renumbered and the nodes restricted to them,
    deduplicated and capped again (:func:`order_nodes`). Entities and relations are packed as text
    (they are embedded on their own), so truncation does not affect them.

    Returns: ``entity_text`` / ``relation_text``: list (C) of lists of str, at most max_entities /
    max_relations each; ``role_text``: list (C) of lists of (subject, predicate, object) strings, one per
    relation of ``relation_text``; ``entity_count``: int16 [C, max_entities], the number a numeral on each entity
    says (:attr:`Phrase.count`; 0: none); ``n_entities``, ``n_relations``, ``n_leaves``, ``n_nodes``, ``phrases_cut``:
    int32 [C]; ``leaf_tokens``: bool [C, max_leaves, L], row k = tokens of leaf k; ``node_leaves``:
    bool [C, max_nodes, max_leaves], row j = leaves of node j. Rows past n_leaves / n_nodes are all False.

    Raises ValueError when no leaf in the batch has tokens (components extracted without tokenized)
    or when a token index does not fit in L.
    """
    c_n = len(components)
    leaf_tokens = np.zeros((c_n, max_leaves, context_length), bool)
    node_leaves = np.zeros((c_n, max_nodes, max_leaves), bool)
    counts = {k: np.zeros(c_n, np.int32) for k in ("n_entities", "n_relations", "n_leaves", "n_nodes", "phrases_cut")}
    entity_text, relation_text, role_text = [], [], []
    entity_count = np.zeros((c_n, max_entities), np.int16)
    any_leaf = any_tokens = False
    for i, comp in enumerate(components):
        entity_text.append([p.text for p in comp.entities[:max_entities]])
        entity_count[i, :len(entity_text[-1])] = [min(p.count or 0, np.iinfo(np.int16).max)
                                                  for p in comp.entities[:max_entities]]
        relation_text.append([r.text for r in comp.relations[:max_relations]])
        role_text.append([(r.subject.text, r.predicate.text, r.object.text) for r in comp.relations[:max_relations]])
        leaves = comp.tree.leaves
        any_leaf |= bool(leaves)
        keep = [k for k, leaf in enumerate(leaves) if leaf.tokens][:max_leaves]
        any_tokens |= bool(keep)
        renumber = {old: new for new, old in enumerate(keep)}
        nodes = order_nodes(len(keep), ([renumber[k] for k in node if k in renumber] for node in comp.tree.nodes),
                            max_nodes)
        for new, old in enumerate(keep):
            toks = leaves[old].tokens
            if toks[-1] >= context_length:
                raise ValueError(f"caption {i}: token {toks[-1]} does not fit in context_length={context_length}")
            leaf_tokens[i, new, list(toks)] = True
        for j, node in enumerate(nodes):
            node_leaves[i, j, list(node)] = True
        counts["n_entities"][i], counts["n_relations"][i] = len(entity_text[-1]), len(relation_text[-1])
        counts["n_leaves"][i], counts["n_nodes"][i] = len(keep), len(nodes)
        counts["phrases_cut"][i] = sum(not leaf.tokens for leaf in leaves)
    if any_leaf and not any_tokens:
        raise ValueError("no phrase carries token indices: extract the components with "
                         "tokenized=backbone.tokenize(captions) before packing them")
    return {"entity_text": entity_text, "relation_text": relation_text, "role_text": role_text,
            "entity_count": entity_count, "leaf_tokens": leaf_tokens,
            "node_leaves": node_leaves, **counts}
