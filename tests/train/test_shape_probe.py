"""train/eval/shape_probe.py: linear probes of shape and colour from a frozen base, and the text tower's shape collapse."""
from __future__ import annotations

import json

import pytest

from extract.worlds import toyworld
from train.eval.shape_probe import main, text_collapse


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "world"
    toyworld.generate(out, 400, seed=2, workers=1)
    return out


@pytest.mark.slow
def test_probe_prints_a_row_per_weights(world, tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert main(["--data", str(world), "--pretrained", "none", "--n-train", "60", "--n-test", "30",
                 "--json-out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| none |" in printed and "image probe: shape %" in printed
    row = json.loads(out.read_text())["none"]
    # random features already separate colours (pixels' mean colour survives); the numbers are percentages
    assert 0 <= row["image probe: shape %"] <= 100 and row["image probe: colour %"] > 30
    assert -1 <= row["text cosine, colour differs"] <= 1 and -1 <= row["text cosine, shape differs"] <= 1


def test_collapsed_words_read_as_cosine_one():
    import torch

    class Same:  # a text tower that ignores every word
        def encode_texts(self, texts):
            return type("T", (), {"embedding": torch.ones(len(texts), 4)})()

    assert text_collapse(Same()) == {"text cosine, shape differs": pytest.approx(1.0),
                                     "text cosine, colour differs": pytest.approx(1.0),
                                     "text cosine, predicate converse": pytest.approx(1.0),
                                     "text cosine, objects swapped": pytest.approx(1.0),
                                     "text cosine, attributes swapped": pytest.approx(1.0)}


def test_relation_cosines_pair_each_caption_with_its_converse_and_its_swap():
    import torch

    seen = []

    class Words:  # one dimension per word: the cosine counts shared words, so a swap keeps every word
        vocab: dict = {}

        def encode_texts(self, texts):
            seen.append(list(texts))
            rows = torch.zeros(len(texts), 64)
            for i, t in enumerate(texts):
                for w in t.split():
                    rows[i, self.vocab.setdefault(w, len(self.vocab))] += 1
            return type("T", (), {"embedding": rows})()

    from train.eval.shape_probe import relation_cosines

    out = relation_cosines(Words())
    base, converse, swapped, attributes = seen
    assert len(base) == 96 and base[0] == "a red circle to the left of a green square"
    assert converse[0] == "a red circle to the right of a green square"
    assert swapped[0] == "a green square to the left of a red circle"
    assert attributes[0] == "a green circle to the left of a red square"  # swap-att: the colours change places
    assert out["text cosine, objects swapped"] == pytest.approx(1.0) and out["text cosine, predicate converse"] < 1
    assert out["text cosine, attributes swapped"] == pytest.approx(1.0)  # a bag of words cannot bind


def test_a_world_without_enough_single_object_scenes_is_refused(tmp_path, capsys):
    toyworld.generate(tmp_path / "w", 12, seed=0, workers=1)
    assert main(["--data", str(tmp_path / "w")]) == 2
    assert "generate a larger toy world" in capsys.readouterr().err


def test_the_left_right_probe_reads_position_where_features_hold_it():
    """Features holding each colour's horizontal centre give "is the red one left of the other" linearly (~100%);
    features without position stay near chance (50%). Labels follow the toy world's own rule (boxes are
    [x0, y0, x1, y1]; centres too close to call are left out)."""
    import numpy as np

    from extract.worlds.toyworld import COLOURS as PALETTE
    from extract.worlds.toyworld import relation_holds
    from train.eval.shape_probe import left_labels, left_right_probe

    COLOURS = list(PALETTE)
    rng = np.random.default_rng(0)
    scenes, feats = [], []
    for i in range(600):
        a, b = rng.choice(len(COLOURS), 2, replace=False)
        xs = rng.uniform(0, 56, 2)
        scenes.append({"objects": [{"colour": COLOURS[c], "box": [float(x), 10.0, float(x) + 8, 18.0]} for c, x in
                                   zip((a, b), xs)]})
        row = np.zeros(len(COLOURS))
        row[[a, b]] = xs + 4
        feats.append(row)
    feats = np.asarray(feats)
    idx, left = left_labels(scenes, COLOURS[0], 64)
    assert len(idx) > 20 and set(left.tolist()) == {0, 1}
    for i, y in zip(idx, left):  # the label is the scene's own geometry, by the toy world's rule
        mine, other = sorted(scenes[i]["objects"], key=lambda o: o["colour"] != COLOURS[0])
        assert y == int(relation_holds(mine["box"], "left of", other["box"], 64))
        assert relation_holds(mine["box"], "left of" if y else "right of", other["box"], 64)
    close = [i for i, s in enumerate(scenes) if COLOURS[0] in {o["colour"] for o in s["objects"]} and i not in idx]
    assert close and all(abs(scenes[i]["objects"][0]["box"][0] - scenes[i]["objects"][1]["box"][0]) < 9.6
                         for i in close)  # too close to call: no label
    with_position = left_right_probe(feats[:400], scenes[:400], feats[400:], scenes[400:], 64)
    without = left_right_probe(rng.normal(size=feats.shape)[:400], scenes[:400], rng.normal(size=feats.shape)[400:],
                               scenes[400:], 64)
    assert with_position > 95 and 30 < without < 70
    assert left_right_probe(feats[:4], scenes[:4], feats[4:8], scenes[4:8], 64) is None  # too few: no figure


def test_the_binding_probe_reads_which_colour_has_which_shape_only_where_features_bind():
    """Features holding each (colour, shape) pair present read "which of the two shapes is the red one" (~100%);
    features holding the same colours and shapes as two separate bags cannot (~50%): the probe's chance is the
    pair's, not the 6 shapes'."""
    import numpy as np

    from extract.worlds.toyworld import COLOURS as PALETTE
    from extract.worlds.toyworld import SHAPES
    from train.eval.shape_probe import binding_probe, binding_scene

    colours = list(PALETTE)
    rng = np.random.default_rng(0)
    scenes, bound, bags = [], [], []
    for _ in range(1600):
        cs, ss = rng.choice(len(colours), 2, replace=False), rng.choice(len(SHAPES), 2, replace=False)
        scenes.append({"objects": [{"colour": colours[c], "shape": SHAPES[k]} for c, k in zip(cs, ss)]})
        pair, bag = np.zeros(len(colours) * len(SHAPES)), np.zeros(len(colours) + len(SHAPES))
        pair[cs * len(SHAPES) + ss] = 1
        bag[cs], bag[len(colours) + ss] = 1, 1
        bound.append(pair)
        bags.append(bag)
    assert all(binding_scene(s) for s in scenes)
    assert not binding_scene({"objects": [{"colour": "red", "shape": "star"}, {"colour": "blue", "shape": "star"}]})
    bound, bags = np.asarray(bound), np.asarray(bags)
    assert binding_probe(bound[:1200], scenes[:1200], bound[1200:], scenes[1200:]) > 95
    assert 40 < binding_probe(bags[:1200], scenes[:1200], bags[1200:], scenes[1200:]) < 60
    assert binding_probe(bound[:8], scenes[:8], bound[8:16], scenes[8:16]) is None  # too few: no figure
