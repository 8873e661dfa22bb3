"""Hard negatives from a caption's parse (extract.components.hard_negatives): each type on hand-written captions, the
dropped cases, and agreement with the toy world's own generator on its captions."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("spacy")

from extract.components import hard_negatives as hn  # noqa: E402
from extract.worlds import toyworld  # noqa: E402


@pytest.fixture(scope="module")
def gen():
    captions = ["a red circle to the left of a blue square", "a small green star", "a large white square",
                "a cup on a table", "a cup under a table", "a dog next to a cat", "two dogs and three cats",
                "a yellow circle above a purple star", "a gray hexagon below a red star"]
    return hn.HardNegatives.for_captions(captions)


def all_negatives(gen, caption, types=hn.NEGATIVE_TYPES):
    s, = gen.structures([caption])
    out: dict[str, set] = {}
    for e in hn.candidates(s, gen.vocab, types, gen.forbid):
        out.setdefault(e.type, set()).add(hn.render(s.text, e))
    return out


def test_vocabulary_is_the_training_captions_words(gen):
    v = gen.vocab
    assert {"circle", "square", "cup", "table", "dog", "dogs", "cats"} <= set(v.nouns)
    assert v.attributes["colour"] == ["blue", "gray", "green", "purple", "red", "white", "yellow"]
    assert v.attributes["size"] == ["large", "small"]
    assert {"to the left of", "on", "under", "next to", "above", "below"} <= set(v.predicates)


def test_swap_att_exchanges_attributes_between_the_right_nouns(gen):
    negs = all_negatives(gen, "a red circle to the left of a blue square")
    assert negs["swap-att"] == {"a blue circle to the left of a red square"}
    assert negs["swap-obj"] == {"a blue square to the left of a red circle"}
    assert "a red circle to the right of a blue square" not in negs["replace-rel"]  # "right of" was never seen
    assert "a red circle above a blue square" in negs["replace-rel"]
    assert "a red square to the left of a blue square" in negs["replace-obj"]
    assert "a red circle to the left of a red square" in negs["replace-att"]


def test_relation_replaced_by_its_converse(gen):
    negs = all_negatives(gen, "a cup on a table")
    assert "a cup under a table" in negs["replace-rel"]
    assert negs["swap-obj"] == {"a table on a cup"}
    s, = gen.structures(["a cup on a table"])
    edits = [e for e in hn.candidates(s, gen.vocab, ["replace-rel"]) if e.converse]
    assert [hn.render(s.text, e) for e in edits] == ["a cup under a table"]
    # drawn half the time although it is one of several candidates
    rng = np.random.default_rng(0)
    drawn = [gen.draw(["a cup on a table"], rng)[0] for _ in range(40)]
    converse = sum(dict(d)["replace-rel"] == "a cup under a table" for d in drawn)
    assert 12 <= converse <= 34


def test_same_structure_and_ambiguous_candidates_are_dropped(gen):
    negs = all_negatives(gen, "a dog next to a cat")
    assert "swap-obj" not in negs  # "next to" is symmetric: the swap says the same thing
    assert "a dog next to a dog" not in negs["replace-obj"]  # two referents with one name
    negs = all_negatives(gen, "a red circle to the left of a red square")
    assert "swap-att" not in negs  # equal words: nothing to swap
    # number agrees: "two dogs" never becomes "two cat"
    negs = all_negatives(gen, "two dogs and three cats")
    assert not negs.get("replace-obj")  # dogs <-> cats would repeat a name; no other plural in the vocabulary


def test_every_mention_of_a_referent_changes_together(gen):
    caption = ("two objects: a small red circle and a large blue square; the red circle is to the left of the "
               "blue square")
    negs = all_negatives(gen, caption)
    assert ("two objects: a small blue circle and a large red square; the blue circle is to the left of the red "
            "square") in negs["swap-att"]
    assert ("two objects: a large red circle and a small blue square; the red circle is to the left of the blue "
            "square") in negs["swap-att"]  # sizes live in the list mentions only
    assert all("two cat" not in t and "two objects" in t for t in negs["replace-obj"])


def test_articles_follow_the_new_word(gen):
    negs = all_negatives(gen, "a red circle to the left of a blue square")
    assert "a red circle to the left of a purple square" in negs["replace-att"]
    s, = gen.structures(["A red cup"])
    texts = {hn.render(s.text, e) for e in hn.candidates(s, gen.vocab, ["replace-att"])}
    assert "A yellow cup" in texts and "A white cup" in texts
    gen2 = hn.HardNegatives.for_captions(["an orange cat", "a red dog"])
    negs = all_negatives(gen2, "a red dog")
    assert "an orange dog" in negs["replace-att"]


def test_forbidden_combinations_never_appear():
    gen = hn.HardNegatives.for_captions(["a red circle", "a blue square", "a green star"],
                                        forbid=[("red", "square"), ("blue", "circle")])
    negs = all_negatives(gen, "a red circle to the left of a blue square")
    every = set().union(*negs.values())
    assert every and not any("red square" in t or "blue circle" in t for t in every)


def test_types_flag():
    assert hn.parse_types("none") == () and hn.parse_types("") == () and hn.parse_types(None) == ()
    assert hn.parse_types("all") == hn.NEGATIVE_TYPES
    assert hn.parse_types("swap-obj,replace-att") == ("replace-att", "swap-obj")
    with pytest.raises(ValueError, match="unknown hard-negative type 'add-obj'"):
        hn.parse_types("add-obj")
    # counts: TYPE*N gives a type N slots; "all" one of every type not counted; the flag's text round-trips
    rel3 = hn.parse_types("all,replace-rel*3")
    assert rel3 == ("replace-att", "replace-obj", "replace-rel", "replace-rel", "replace-rel", "swap-att", "swap-obj")
    assert hn.format_types(rel3) == "replace-att,replace-obj,replace-rel*3,swap-att,swap-obj"
    assert hn.parse_types(hn.format_types(rel3)) == rel3 == hn.parse_types(",".join(rel3))
    assert hn.format_types(()) == "none" and hn.format_types(hn.NEGATIVE_TYPES) == ",".join(hn.NEGATIVE_TYPES)
    for bad, says in (("replace-rel*0", "whole number >= 1"), ("replace-rel*x", "whole number"),
                      ("replace-rel*2,replace-rel", "listed twice"), ("swap*2", "unknown hard-negative type 'swap'")):
        with pytest.raises(ValueError, match=says):
            hn.parse_types(bad)


def test_draw_is_one_per_type_and_reproducible(gen):
    caption = "a red circle to the left of a blue square"
    one = gen.draw([caption], np.random.default_rng(3))[0]
    assert [t for t, _ in one] == list(hn.NEGATIVE_TYPES)
    assert one == gen.draw([caption], np.random.default_rng(3))[0]
    every = all_negatives(gen, caption)
    assert all(text in every[kind] for kind, text in one)


def test_draw_counts_give_distinct_negatives_and_one_draws_as_before(gen):
    """replace-rel*3: up to three distinct predicates per relation caption, each false by the parse, filling the
    type's slots in order; with one slot per type the random stream is the same as before (a run's negatives are
    those it drew before counts existed), and every caption keeps its other types."""
    caption = "a red circle to the left of a blue square"
    slots = hn.parse_types("all,replace-rel*3")
    counted = hn.HardNegatives(gen.vocab, slots)
    counted.__dict__["_structures"] = gen.__dict__["_structures"]  # the parses the fixture made
    drawn = counted.draw([caption], np.random.default_rng(3))[0]
    rels = [text for kind, text in drawn if kind == "replace-rel"]
    assert len(rels) == len(set(rels)) == 3 and set(rels) <= all_negatives(gen, caption)["replace-rel"]
    assert [k for k, _ in drawn if k != "replace-rel"] == [k for k in hn.NEGATIVE_TYPES if k != "replace-rel"]
    filled = hn.fill_slots(slots, drawn)
    assert [filled[k] for k in (2, 3, 4)] == rels and len(filled) == len(slots)
    one = gen.draw([caption], np.random.default_rng(3))[0]
    first = [text for kind, text in one if kind == "replace-rel"]
    # the first of the three is the one a single slot draws: the same order, read further
    assert rels[0] == first[0]
    assert hn.fill_slots(("replace-rel", "swap-obj"), [("swap-obj", "x")]) == {1: "x"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    toyworld.generate(out, 120, seed=5, holdout="red circle", workers=1)
    return out


def test_agrees_with_the_toy_worlds_generator(world):
    """On every train caption of a toy world: each negative the toy world would accept for the scene is proposed
    from the parse, and nothing is proposed that the toy's mutators could not produce (the parse cannot see the
    scene, so it may propose what the scene makes true, or what the toy world drops for naming a colour-shape
    pair twice)."""
    scenes = {s["image_id"]: s for s in json.loads((world / "annotations.json").read_text())["scenes"]}
    train = [(s, c) for s in scenes.values() if s["split"] == "train" for c in s["captions"]]
    holdout = frozenset({("red", "circle")})
    gen = hn.HardNegatives.for_captions([c["text"] for _, c in train], forbid=holdout)
    structures = gen.structures([c["text"] for _, c in train])
    checked = dict.fromkeys(hn.NEGATIVE_TYPES, 0)
    for (scene, caption), s in zip(train, structures):
        for kind in hn.NEGATIVE_TYPES:
            toy = toyworld.negative_candidates(scene, caption["struct"], kind, holdout)
            toy_all = {toyworld.render(c) for c, _ in toy}
            toy_ok = {toyworld.render(c) for c, ok in toy if ok}
            parsed = {hn.render(s.text, e) for e in hn.candidates(s, gen.vocab, [kind], gen.forbid)}
            assert toy_ok <= parsed, (caption["text"], kind, toy_ok - parsed)
            assert parsed <= toy_all, (caption["text"], kind, parsed - toy_all)
            checked[kind] += len(toy_ok)
    assert min(checked.values()) > 20, checked


def test_command_prints_negatives(tmp_path, capsys):
    path = tmp_path / "c.txt"
    path.write_text("a red circle to the left of a blue square\na cup on a table\n")
    assert hn.main(["--captions", str(path), "--n", "1", "--types", "swap-att,swap-obj"]) == 0
    out = capsys.readouterr().out
    assert "swap-att     a blue circle to the left of a red square" in out
    assert "swap-obj     a blue square to the left of a red circle" in out
    with pytest.raises(SystemExit):
        hn.main(["--captions", str(path), "--types", "nonsense"])


def test_a_relation_without_a_converse_draws_uniformly(gen):
    """"next to" has no converse: every draw is uniform over the other predicates (none favoured by list order)."""
    from collections import Counter

    rng = np.random.default_rng(1)
    drawn = Counter(dict(gen.draw(["a dog next to a cat"], rng)[0])["replace-rel"] for _ in range(60))
    assert len(drawn) >= 4 and max(drawn.values()) <= 24, drawn


def test_the_same_meaning_in_other_words_is_never_a_negative():
    """A replacement or a swap within one synonym group may be true of the image ("a shiny cube" for "a metal cube",
    "on top of" for "on"): dropped, while the other words of the category stay candidates; the 3D world's phrasings
    of each predicate are one group, so no phrasing of a predicate stands as its negative."""
    from extract.worlds import language3d

    gen = hn.HardNegatives.for_captions(["a small shiny cube on a large rubber sphere", "a metal cube on top of a "
                                         "sphere", "a small matte cube", "a tiny cube to the right of a big cylinder",
                                         "a gray cube under a grey sphere"])
    assert gen.vocab.attributes["material"] == ["matte", "metal", "rubber", "shiny"]
    negs = all_negatives(gen, "a small shiny cube on a large rubber sphere")
    assert "a small shiny cube on a large matte sphere" not in negs["replace-att"]
    assert "a small metal cube on a large rubber sphere" not in negs["replace-att"]
    assert "a small rubber cube on a large rubber sphere" in negs["replace-att"]
    assert "a small matte cube on a large rubber sphere" in negs["replace-att"]
    assert "a tiny shiny cube on a large rubber sphere" not in negs["replace-att"]
    assert "a small shiny cube on top of a large rubber sphere" not in negs["replace-rel"]
    assert "a small shiny cube under a large rubber sphere" in negs["replace-rel"]
    assert "a small shiny cube to the right of a large rubber sphere" in negs["replace-rel"]
    assert "a small rubber cube on a large shiny sphere" in negs["swap-att"]
    assert "swap-att" not in all_negatives(gen, "a gray cube under a grey sphere")  # one colour, two spellings
    for predicate, forms in language3d.PHRASINGS.items():
        assert all(hn.synonyms(a, b) for a in forms for b in forms), predicate
    assert not hn.synonyms("on", "under") and not hn.synonyms("left of", "right of")
