"""The hard toy world: its rules (occlusion, contact, gaps), captions true and negatives false by them, no caption
prior for relations, the Controlled-A / -B analogues, What'sUp's layout written and read back, determinism, CLI."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from extract.worlds import hardworld as hw
from extract.worlds import shared
from extract.worlds import toyworld as tw

N = 60
HOLDOUT = "red circle,blue square"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("hard")
    summary = hw.generate(out, N, seed=3, holdout=HOLDOUT, workers=1)
    return out, summary, tw.load(out), json.loads((out / "negatives.json").read_text())


def _files(out):
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != "meta.json")


# --------------------------------------------------------------------------- rules on hand-built scenes


def _pair(a_box, b_box, shapes=("square", "square"), size=96):
    objects = [{"shape": shapes[0], "colour": "red", "box": a_box}, {"shape": shapes[1], "colour": "blue",
                                                                    "box": b_box}]
    return hw.relation_tables(objects, size)


def test_touching_is_on_a_gap_is_above_and_neither_is_the_other():
    strict, lenient, _ = _pair([40, 20, 60, 40], [40, 40, 60, 60])  # a's bottom edge is b's top edge
    assert [r for r in strict if r[0] == 0] == [[0, "on", 1]] and [1, "under", 0] in strict
    assert [0, "above", 1] not in lenient  # touching: not "above", even leniently
    strict, lenient, _ = _pair([40, 10, 60, 30], [40, 40, 60, 60])  # 10 px of background between them
    assert [r for r in strict if r[0] == 0] == [[0, "above", 1]]
    assert [0, "on", 1] not in lenient


def test_the_later_drawn_of_two_overlapping_objects_is_in_front_and_boxes_alone_cannot_tell():
    a, b = [30, 30, 55, 55], [35, 40, 60, 65]
    strict, _, visible = _pair(a, b)  # a drawn first: b covers part of a
    assert [1, "in front of", 0] in strict and [0, "behind", 1] in strict
    assert visible[1] == 1.0 and visible[0] < 1.0
    swapped, _, _ = hw.relation_tables([{"shape": "square", "colour": "blue", "box": b},
                                        {"shape": "square", "colour": "red", "box": a}], 96)
    assert [1, "in front of", 0] in swapped  # the same two boxes: now the red one (drawn last) is in front


def test_the_front_object_must_hide_enough_of_the_other():
    strict, lenient, _ = _pair([30, 30, 55, 55], [54, 54, 79, 79])  # one shared pixel
    assert not [r for r in strict if r[1] in ("in front of", "behind")]
    assert [1, "in front of", 0] in lenient


# --------------------------------------------------------------------------- the generated world


def test_every_caption_is_true_and_every_negative_false_by_the_worlds_rules(world):
    out, _, annotations, negatives = world
    scenes = {s["image_id"]: s for s in annotations["scenes"]}
    for scene in scenes.values():
        for caption in scene["captions"]:
            assert hw.satisfies(scene, caption["struct"]), caption["text"]
            assert tw.satisfies(scene, caption["struct"])  # the toy world's entry point judges a hard scene too
    for item in negatives["items"]:
        for negative in item["negatives"]:
            assert not hw.satisfies(scenes[item["image_id"]], negative["struct"], lenient=True), negative["text"]


def test_the_named_pair_holds_its_predicate_and_no_other_even_leniently(world):
    _, _, annotations, _ = world
    for scene in annotations["scenes"]:
        s, p, o = scene["named"]["subject"], scene["named"]["predicate"], scene["named"]["object"]
        assert [s, p, o] in scene["relations"]
        assert sorted(r[1] for r in scene["lenient"] if r[0] == s and r[2] == o) == [p]
        assert min(obj["visible"] for obj in scene["objects"]) >= 1 - hw.MAX_HIDDEN
        assert len({(obj["colour"], obj["shape"]) for obj in scene["objects"]}) == len(scene["objects"])


def test_no_relation_prior_every_other_predicate_is_an_acceptable_replace_rel(world):
    """The named pair holds one predicate, so each of the other seven is a valid negative: a caption's predicate and
    its replace-rel negative's are drawn symmetrically (the text-only floor cannot read which is true)."""
    _, _, annotations, _ = world
    predicates = Counter()
    for scene in annotations["scenes"]:
        relation = next(c for c in scene["captions"] if c["kind"] == "relation")
        predicates[relation["struct"]["relations"][0][1]] += 1
        candidates = hw.negative_candidates(scene, relation["struct"], "replace-rel")
        assert len(candidates) == 7 and all(ok for _, ok in candidates)
        assert all(ok for _, ok in hw.negative_candidates(scene, relation["struct"], "swap-obj"))
    assert set(predicates) == set(hw.PREDICATES)  # every predicate named, from 60 scenes


def test_clutter_occlusion_and_backgrounds(world):
    out, summary, annotations, _ = world
    counts = Counter(len(s["objects"]) for s in annotations["scenes"])
    assert min(counts) >= 2 and max(counts) > 4
    assert summary["counts"]["partly_hidden_objects"] > 0
    assert {s["background"]["kind"] for s in annotations["scenes"]} == {"noise", "gradient", "stripes", "checker"}
    pixels = np.asarray(Image.open(out / annotations["scenes"][0]["file_name"]))
    assert pixels.shape == (96, 96, 3) and (pixels.reshape(-1, 3).max(1) > 0).mean() > 0.9  # not black


def test_train_split_holds_no_heldout_combination_and_test_objects_have_zero_shot_crops(world):
    out, _, annotations, _ = world
    held = {("red", "circle"), ("blue", "square")}
    for scene in annotations["scenes"]:
        if scene["split"] == "train":
            assert not held & {(o["colour"], o["shape"]) for o in scene["objects"]}
            assert not any("crop" in o for o in scene["objects"])
        else:
            assert all((out / o["crop"]).is_file() for o in scene["objects"])


def test_same_seed_gives_the_same_bytes_with_any_worker_count(world, tmp_path):
    out, _, _, _ = world
    hw.generate(tmp_path, N, seed=3, holdout=HOLDOUT, workers=2)
    assert _files(tmp_path) == _files(out)
    for name in _files(out):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name


# --------------------------------------------------------------------------- the controlled tests


@pytest.mark.parametrize("test", ["A", "B"])
def test_each_controlled_scene_satisfies_its_caption_and_violates_the_other_three(world, test):
    out, _, _, _ = world
    data = json.loads((out / shared.CONTROLLED_FILES[test]).read_text())
    assert len(data["sets"]) == hw.controlled_count(N)
    expected = shared.CONTROLLED_A if test == "A" else shared.CONTROLLED_B
    for entry in data["sets"]:
        assert [s["predicate"] for s in entry["scenes"]] == list(expected)
        for k, scene in enumerate(entry["scenes"]):
            assert (out / scene["file_name"]).is_file()
            for j, other in enumerate(entry["scenes"]):
                if j == k:
                    assert hw.satisfies(scene, other["struct"])
                else:
                    assert not hw.satisfies(scene, other["struct"], lenient=True), (scene["file_name"],
                                                                                    other["caption"])


def test_controlled_b_in_front_and_behind_share_their_boxes_only_the_drawing_order_differs(world):
    out, _, _, _ = world
    for entry in json.loads((out / shared.CONTROLLED_FILES["B"]).read_text())["sets"]:
        front, behind = entry["scenes"][0], entry["scenes"][1]
        key = lambda s: sorted((o["colour"], o["shape"], tuple(o["box"])) for o in s["objects"])  # noqa: E731
        assert key(front) == key(behind)
        shown = lambda s: [{k: v for k, v in o.items() if k != "visible"} for o in s["objects"]]  # noqa: E731
        assert shown(front)[:2] == shown(behind)[:2]  # the clutter, drawn first
        assert shown(front)[2:] == shown(behind)[2:][::-1]  # the named pair, in the other order
        assert (out / front["file_name"]).read_bytes() != (out / behind["file_name"]).read_bytes()


@pytest.mark.parametrize("test", ["A", "B"])
def test_each_controlled_set_holds_clutter_related_the_other_way_from_the_named_pair_clear_of_it(world, test):
    """Every image holds one stacked pair (on / overlapping) and one side-by-side pair: the clutter is side by side
    where the named pair is stacked and stacked where it is side by side, so neither whether nor how often two
    things touch or overlap tells the four images apart."""
    out, _, _, _ = world
    stacked = {"A": ("on", "under"), "B": ("in front of", "behind")}[test]
    for entry in json.loads((out / shared.CONTROLLED_FILES[test]).read_text())["sets"]:
        clutter = [[(o["colour"], o["shape"], o["size"]) for o in scene["objects"][:2]] for scene in entry["scenes"]]
        assert all(sorted(c) == sorted(clutter[0]) for c in clutter)
        named = {(o["colour"], o["shape"]) for o in entry["objects"]}
        assert not named & {c[:2] for c in clutter[0]}
        for scene in entry["scenes"]:
            named_stacked = scene["predicate"] in stacked
            # B's clutter drawn front last: the first drawn is behind the second
            expected = "left of" if named_stacked else {"A": "on", "B": "behind"}[test]
            assert [0, expected, 1] in scene["relations"], (scene["file_name"], scene["relations"])
            pairs = {(0, 1): named_stacked is False, (2, 3): named_stacked}
            for (a, b), is_stacked in pairs.items():
                between = {r[1] for r in scene["relations"] if {r[0], r[2]} == {a, b}}
                assert bool(between & set(stacked)) == is_stacked, (scene["file_name"], a, b, between)
            # no relation at all between the clutter and the named pair
            assert not [r for r in scene["lenient"] if (r[0] < 2) != (r[2] < 2) and r[1] not in hw.PREDICATES[:4]]


def test_whatsup_layout_is_read_back_by_the_benchmarks_reader_with_its_boxes(world):
    from extract.data.boxes import read_boxes
    from train.eval.datasets import read_whatsup, whatsup_pair_and_set

    out, _, _, _ = world
    bench = read_whatsup(out / shared.WHATSUP_DIR)
    assert not bench.skipped
    sets = hw.controlled_count(N)
    by_subset = Counter(item.subtype for item in bench.items)
    assert by_subset == {"controlled-A": 4 * sets, "controlled-B": 4 * sets}
    tags = Counter(item.tags[0] for item in bench.items)
    assert tags["controlled-A on"] == tags["controlled-A under"] == tags["controlled-B in-front_of"] == sets
    summary = whatsup_pair_and_set(bench.items, [True] * len(bench.items))
    assert summary["controlled-A"]["set"] == summary["controlled-B"]["set"] == 100.0  # every set a group of four
    boxes = read_boxes(str(out / shared.WHATSUP_DIR / "objects.json"))
    assert boxes.format == "Visual Genome objects.json"
    for item in bench.items:
        assert len(boxes.entry(item.images[0])["objects"]) == 4  # the named pair and the clutter


def test_the_toy_world_box_reader_finds_every_controlled_scene_by_file_name(world):
    from extract.data.boxes import read_boxes

    out, _, _, _ = world
    boxes = read_boxes(str(out))
    files = {test: out / shared.CONTROLLED_FILES[test] for test in "AB"}
    scenes = {test: [s for e in json.loads(files[test].read_text())["sets"] for s in e["scenes"]] for test in "AB"}
    names = [s["file_name"] for test in "AB" for s in scenes[test]]
    assert len({n.rsplit("/", 1)[1] for n in names}) == len(names)  # unique base names across both tests
    for test in "AB":  # every scene of both tests, each with its own boxes in its drawing order
        assert len(scenes[test]) == 4 * hw.controlled_count(N)
        for scene in scenes[test]:
            found = boxes.entry(str(out / scene["file_name"]))["objects"]
            assert [o["box"] for o in found] == [o["box"] for o in scene["objects"]], scene["file_name"]
            assert [(o["colour"], o["shape"]) for o in found] == [(o["colour"], o["shape"]) for o in scene["objects"]]


def test_the_box_reader_gives_each_zero_shot_crop_its_objects_box_in_the_crops_frame(world):
    from extract.data.boxes import read_boxes

    out, _, annotations, _ = world
    boxes = read_boxes(str(out))
    crops = [(s, o) for s in annotations["scenes"] for o in s["objects"] if "crop" in o]
    assert crops
    for scene, obj in crops:  # the crop's pixels inside its box are the scene's pixels inside the object's box
        found = boxes.entry(str(out / obj["crop"]))
        assert [(o["colour"], o["shape"]) for o in found["objects"]] == [(obj["colour"], obj["shape"])]
        crop = Image.open(out / obj["crop"]).convert("RGB")
        assert crop.size == (found["width"], found["height"])
        inside = np.asarray(crop.crop(tuple(found["objects"][0]["box"])))
        assert np.array_equal(inside, np.asarray(Image.open(out / scene["file_name"]).convert("RGB").crop(
            tuple(obj["box"])))), obj["crop"]


# --------------------------------------------------------------------------- command line


def test_cli_writes_a_hard_world_at_96_px_and_refuses_the_version_2_modes(tmp_path, capsys):
    assert tw.main(["--out", str(tmp_path / "w"), "--n", "20", "--hard", "--workers", "1"]) == 0
    assert "toyworld (hard): 20 scenes (96x96 px" in capsys.readouterr().out
    assert json.loads((tmp_path / "w" / "meta.json").read_text())["hard"] is True
    assert [name for name, _ in tw.controlled_tests(tmp_path / "w")] == ["toyworld-controlled-A",
                                                                         "toyworld-controlled-B"]
    with pytest.raises(SystemExit) as err:
        tw.main(["--out", str(tmp_path / "x"), "--hard", "--long-captions"])
    assert err.value.code == 2
    assert "--hard has its own scenes" in capsys.readouterr().err


def test_the_default_world_is_never_written_over_a_hard_world_of_the_same_size_and_seed(tmp_path):
    hw.generate(tmp_path / "w", 20, seed=0, workers=1)
    with pytest.raises(ValueError, match="not the toy world asked for"):
        tw.ensure(tmp_path / "w", n=20, seed=0, say=lambda line: None)
    assert json.loads((tmp_path / "w" / "meta.json").read_text())["hard"] is True


def test_ensure_makes_a_hard_world_once_and_tells_it_from_a_version_2_one(tmp_path):
    lines, out = [], tmp_path / "hw"
    tw.ensure(out, 40, 0, say=lines.append, hard=True)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["hard"] is True and meta["n"] == 40 and (out / "controlled_b.json").is_file()
    stamp = (out / "meta.json").stat().st_mtime_ns
    tw.ensure(out, 40, 0, say=lines.append, hard=True)
    assert "reused" in lines[-1] and (out / "meta.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="not the toy world asked for"):
        tw.ensure(out, 40, 0, say=lines.append)  # a version-2 world asked for: never silently the hard one
    tw.ensure(out, 40, 1, say=lines.append, hard=True, replace=True)
    assert json.loads((out / "meta.json").read_text())["seed"] == 1
