"""extract/components/tag_repair.py: the tagger's slips corrected on one caption's plain lists, each rule on a parse
written out by hand (the tags and arcs en_core_web_sm gives these captions), so the rule is tested apart from what
the model happens to say today."""
from types import SimpleNamespace

import pytest

from extract.components.text import SpacyModelNotFoundError, TextComponentExtractor, load_spacy

try:
    load_spacy()
except SpacyModelNotFoundError as e:
    pytest.skip(str(e), allow_module_level=True)

from extract.components.tag_repair import repair  # noqa: E402


@pytest.fixture(scope="module")
def ids():
    return TextComponentExtractor().ids


def caption(ids, words):
    """words: (text, pos name, dep label, head index) each -> the lists ``repair`` reads and writes."""
    pos = {"NOUN": ids.NOUN, "ADV": ids.ADV, "ADJ": ids.ADJ, "DET": ids.DET, "ADP": ids.ADP, "VERB": ids.VERB}
    strings = TextComponentExtractor().nlp.vocab.strings
    c = SimpleNamespace(n=len(words), lower=[w[0] for w in words], pos=[pos[w[1]] for w in words],
                        dep=[strings.add(w[2]) for w in words], head=[w[3] for w in words])
    c.children = [[k for k, h in enumerate(c.head) if h == i and k != i] for i in range(c.n)]
    return c


def test_an_adverb_after_a_noun_phrase_is_its_head_noun(ids):
    """ "a cube left of a green matte sphere": matte/NN the preposition's object, sphere/RB hung on the cube; after
    the repair sphere is the object, with the phrase's words under it and matte its compound."""
    c = caption(ids, [("a", "DET", "det", 1), ("cube", "NOUN", "ROOT", 1), ("left", "ADV", "advmod", 1),
                      ("of", "ADP", "prep", 2), ("a", "DET", "det", 7), ("small", "ADJ", "amod", 7),
                      ("green", "ADJ", "amod", 7), ("matte", "NOUN", "pobj", 3), ("sphere", "ADV", "advmod", 1)])
    pobj = c.dep[7]
    repair(c, ids, frozenset({"left"}))
    assert c.pos[8] == ids.NOUN and c.head[8] == 3 and c.dep[8] == pobj and c.head[7] == 8
    assert c.dep[7] == ids.COMPOUND and sorted(c.children[8]) == [4, 5, 6, 7] and c.children[1] == [0, 2]
    assert c.pos[2] == ids.ADV and c.head[2] == 1  # "left": a word a preposition starts with stays


@pytest.mark.parametrize("word", ["outside", "together", "quickly"])
def test_an_adverb_that_does_follow_a_noun_phrase_stays(ids, word):
    c = caption(ids, [("a", "DET", "det", 1), ("dog", "NOUN", "ROOT", 1), (word, "ADV", "advmod", 1)])
    before = (list(c.pos), list(c.dep), list(c.head))
    repair(c, ids)
    assert (c.pos, c.dep, c.head) == before


def test_a_word_with_a_determiner_is_a_noun(ids):
    """ "a large rubber sphere right of ...": sphere/RB the root, with its determiner: a noun."""
    c = caption(ids, [("a", "DET", "det", 3), ("large", "ADJ", "amod", 3), ("rubber", "NOUN", "compound", 3),
                      ("sphere", "ADV", "ROOT", 3)])
    repair(c, ids)
    assert c.pos[3] == ids.NOUN and c.head == [3, 3, 3, 3]


def test_a_noun_phrase_after_and_hung_elsewhere_is_the_conjunct_of_the_noun_that_owns_the_and(ids):
    """ "a sphere between a cube and a cone": the parser hangs "cone" on the root as an apposition; it joins "cube"."""
    c = caption(ids, [("a", "DET", "det", 1), ("sphere", "NOUN", "ROOT", 1), ("between", "ADP", "prep", 1),
                      ("a", "DET", "det", 4), ("cube", "NOUN", "pobj", 2), ("and", "DET", "cc", 4),
                      ("a", "DET", "det", 7), ("cone", "NOUN", "appos", 1)])
    repair(c, ids)
    assert c.head[7] == 4 and c.dep[7] == ids.CONJ and c.children[4] == [3, 5, 7] and c.children[1] == [0, 2]


def test_a_noun_hung_as_an_adverb_after_a_noun_phrase_is_its_head(ids):
    """ "... and a small matte sphere": matte/NN the conjunct, sphere/NN an adverb of the root."""
    c = caption(ids, [("a", "DET", "det", 1), ("cube", "NOUN", "ROOT", 1), ("and", "DET", "cc", 1),
                      ("a", "DET", "det", 5), ("small", "ADJ", "amod", 5), ("matte", "NOUN", "conj", 1),
                      ("sphere", "NOUN", "advmod", 1)])
    conj = c.dep[5]
    repair(c, ids)
    assert c.head[6] == 1 and c.dep[6] == conj and c.head[5] == 6 and sorted(c.children[6]) == [3, 4, 5]
