"""The small English model's tagging slips that the parse's rules would inherit, corrected where the tree itself says
the tag is wrong, on one caption's plain lists (``extract.components.text._Caption``) before any rule reads them.

The captions that need it are the ones people write about objects with several attributes: ``en_core_web_sm`` tags
"sphere" in "a large brown rubber sphere right of ..." as an adverb, and in "a green matte sphere" takes "matte" for
the noun and hangs "sphere" elsewhere as an adverb. Every rule after it then loses the phrase's head noun: the entity
"green matte" without its shape, the relation without its subject. Of the wide 3D world's 2,073 relation, chain,
conjunction and "between" captions, rules version 4 parsed 1,700 into their struct's pairs of objects, version 6
(these repairs and two rules in text.py) 2,017 (extract/README.md, the 3D world).

- A word with a determiner is a noun ("a/DT ... sphere/RB"): a determiner's head is nominal.
- An adverb, or a noun hung as an apposition or an adverb, right after a noun that heads a noun phrase (it has a
  determiner or modifiers), with no dependents before it, is that phrase's real head noun ("a green matte sphere":
  matte/NN, sphere/RB): the phrase's words move under it and the word before it becomes its compound. Not for the
  adverbs that do follow a noun phrase ("a dog outside", "two cups together"): spaCy's stop words, words in -ly and
  :data:`AFTER_NOUN`.
- A noun phrase right after "and" that the parser hung elsewhere as an apposition is the conjunct of the noun that
  owns the "and" ("a sphere between a cube and a gray matte sphere": the second end of "between").
"""
from __future__ import annotations

#: adverbs that follow a noun phrase in captions and are no noun ("a dog outside"); spaCy's stop words add "here",
#: "there", "together", "again", "too", "behind", "above" ...
AFTER_NOUN = frozenset({"outside", "inside", "indoors", "outdoors", "nearby", "away", "apart", "alone", "ahead",
                        "home", "overhead", "underneath", "beneath", "ago", "later", "today", "tonight", "upstairs",
                        "downstairs", "abroad", "aside", "aboard", "forward", "forwards", "backward", "backwards",
                        "sideways", "upside", "outward", "inward", "aloft", "afar", "instead", "tomorrow", "yesterday"})


def repair(c, ids, never: frozenset = frozenset()) -> None:
    """Correct ``c``'s ``pos``, ``dep``, ``head`` and ``children`` in place (module docstring); a word in ``never``
    (the spatial words a multi-word preposition starts with: "right" in "a sphere right of a cube") is left alone."""
    from spacy.lang.en.stop_words import STOP_WORDS

    for i in range(c.n):
        if c.pos[i] in (ids.ADV, ids.X) and any(c.dep[k] == ids.DET_DEP for k in c.children[i]):
            c.pos[i] = ids.NOUN
    nominal = (ids.NOUN, ids.PROPN)
    for i in range(1, c.n):
        noun, word = i - 1, c.lower[i]
        split = c.pos[i] == ids.ADV or (c.pos[i] in nominal and c.dep[i] in (ids.APPOS, ids.ADVMOD))
        if (not split or any(k < i for k in c.children[i]) or c.pos[noun] not in nominal
                or not any(c.dep[k] == ids.DET_DEP or c.dep[k] in ids.NOUN_MODS for k in c.children[noun])
                or word in STOP_WORDS or word in AFTER_NOUN or word in never or word.endswith("ly")):
            continue
        # it takes the noun's place in the tree (the root's where the noun was the root; the noun is not under it:
        # it has no dependents before it)
        c.head[i], c.dep[i] = (i if c.head[noun] == noun else c.head[noun]), c.dep[noun]
        for k in c.children[noun]:
            if k != i:
                c.head[k] = i
        c.head[noun], c.dep[noun], c.pos[i] = i, ids.COMPOUND, ids.NOUN
        _rebuild(c)
    for i in range(c.n):  # "between a cube and a gray matte sphere": the second hung on the root as an apposition
        if c.dep[i] != ids.APPOS or c.pos[i] not in nominal:
            continue
        first = left_edge(c, i)
        if first == 0 or c.lower[first - 1] != "and" or c.dep[first - 1] != ids.CC:
            continue
        owner = c.head[first - 1]
        if owner != i and c.pos[owner] in nominal and c.head[i] != owner:
            c.head[i], c.dep[i] = owner, ids.CONJ
            _rebuild(c)


def left_edge(c, w: int) -> int:
    """First word of word w's dependency subtree (``c.children``)."""
    edge, stack = w, [w]
    while stack:
        x = stack.pop()
        edge = min(edge, x)
        stack.extend(c.children[x])
    return edge


def _rebuild(c) -> None:
    c.children = [[] for _ in range(c.n)]
    for k, h in enumerate(c.head):
        if h != k:
            c.children[h].append(k)
