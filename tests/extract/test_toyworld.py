"""Toy world generator: determinism, hold-out, caption/negative truth, geometry, file layout, CLI."""
from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from extract.worlds import shared
from extract.worlds import toyworld as tw

HOLDOUT = "red circle,blue square"
HELD = {("red", "circle"), ("blue", "square")}
N = 200
DATA_FILES = ["annotations.json", "negatives.json", shared.CONTROLLED_FILE] + [
    f"{split}{suffix}" for split in tw.SPLITS for suffix in (".csv", "_coco.json")]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One 200-scene world with a hold-out, built with 2 workers: (dir, summary, annotations, negatives)."""
    out = tmp_path_factory.mktemp("world")
    summary = tw.generate(out, N, seed=0, holdout=HOLDOUT, workers=2)
    negatives = json.loads((out / "negatives.json").read_text())
    return out, summary, tw.load(out), negatives


def _scenes_by_id(annotations):
    return {s["image_id"]: s for s in annotations["scenes"]}


def _all_files(out: Path) -> list[str]:
    return DATA_FILES + sorted(f"images/{p.name}" for p in (out / "images").iterdir() if p.is_file()) + sorted(
        f"images/controlled/{p.name}" for p in (out / "images" / "controlled").iterdir())


# --------------------------------------------------------------------------- determinism


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_same_seed_gives_byte_identical_files(world, tmp_path, workers):
    out, _, _, _ = world
    tw.generate(tmp_path, N, seed=0, holdout=HOLDOUT, workers=workers)
    assert _all_files(tmp_path) == _all_files(out)
    assert len(_all_files(out)) == len(DATA_FILES) + N + 4 * tw.controlled_count(N)
    for name in _all_files(out):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name
    meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (out, tmp_path))
    meta_a.pop("workers"), meta_b.pop("workers")
    assert meta_a == meta_b


def test_scene_depends_only_on_seed_and_index(world, tmp_path):
    out, _, annotations, negatives = world
    tw.generate(tmp_path, 30, seed=0, holdout=HOLDOUT, workers=1)  # other n, other chunking
    assert tw.load(tmp_path)["scenes"] == annotations["scenes"][:30]
    head = json.loads((tmp_path / "negatives.json").read_text())["items"]
    assert head == [item for item in negatives["items"] if item["image_id"] < 30]
    for i in range(30):
        assert (tmp_path / f"images/{i:06d}.png").read_bytes() == (out / f"images/{i:06d}.png").read_bytes()
    layouts = {json.dumps(s["objects"]) for s in annotations["scenes"]}
    assert len(layouts) == N  # every index draws its own scene


def test_different_seed_differs(world, tmp_path):
    out, _, annotations, _ = world
    tw.generate(tmp_path, 20, seed=1, holdout=HOLDOUT, workers=1)
    other = tw.load(tmp_path)
    assert other["scenes"] != annotations["scenes"][:20]
    differing = [i for i in range(20)
                 if (tmp_path / f"images/{i:06d}.png").read_bytes() != (out / f"images/{i:06d}.png").read_bytes()]
    assert len(differing) >= 15


# --------------------------------------------------------------------------- hold-out


def _struct_combos(struct):
    return {(o["colour"], o["shape"]) for o in struct["objects"]}


def test_holdout_keeps_combinations_out_of_train(world):
    out, summary, annotations, negatives = world
    scenes = annotations["scenes"]
    train = [s for s in scenes if s["split"] == "train"]
    assert train
    for scene in train:
        assert not HELD & {(o["colour"], o["shape"]) for o in scene["objects"]}
        for caption in scene["captions"]:
            assert not HELD & _struct_combos(caption["struct"])
            assert "red circle" not in caption["text"] and "blue square" not in caption["text"]
    for item in negatives["items"]:
        if item["split"] == "train":
            for negative in item["negatives"]:
                assert not HELD & _struct_combos(negative["struct"])
                assert "red circle" not in negative["text"] and "blue square" not in negative["text"]
    train_csv = (out / "train.csv").read_text()
    assert "red circle" not in train_csv and "blue square" not in train_csv
    # Val/test are sampled freely, and the summary counts what is there.
    for split in tw.SPLITS:
        held = sum((o["colour"], o["shape"]) in HELD
                   for s in scenes if s["split"] == split for o in s["objects"])
        assert summary["counts"]["splits"][split]["heldout_objects"] == held
    assert summary["counts"]["splits"]["train"]["heldout_objects"] == 0
    assert sum(summary["counts"]["splits"][s]["heldout_objects"] for s in ("val", "test")) > 0
    assert annotations["meta"]["holdout"] == ["blue square", "red circle"]


@pytest.mark.parametrize("bad", ["pink circle", "red", "red cube", "red circle square"])
def test_invalid_holdout_fails_with_vocabulary(tmp_path, bad):
    with pytest.raises(ValueError, match="colour in red, green.*shape in circle, square"):
        tw.generate(tmp_path, 5, seed=0, holdout=bad, workers=1)
    assert not (tmp_path / "annotations.json").exists()


def test_invalid_holdout_on_the_cli_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        tw.parse_args(["--out", str(tmp_path), "--holdout", "red circle,pink star"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'pink star'" in err and "purple" in err and "hexagon" in err


def test_invalid_splits_rejected(tmp_path):
    for bad in ("0.5,0.5", "0.8,0.1,0.2", "a,b,c", "1.2,-0.1,-0.1"):
        with pytest.raises(ValueError, match="splits"):
            tw.generate(tmp_path, 5, seed=0, splits=bad, workers=1)


# --------------------------------------------------------------------------- truth of captions


def test_every_positive_satisfies_and_every_negative_fails(world):
    _, _, annotations, negatives = world
    scenes = _scenes_by_id(annotations)
    for scene in scenes.values():
        for caption in scene["captions"]:
            assert tw.satisfies(scene, caption["struct"]), caption["text"]
            assert tw.render(caption["struct"]) == caption["text"]
    assert negatives["items"]
    for item in negatives["items"]:
        scene = scenes[item["image_id"]]
        for negative in item["negatives"]:
            assert not tw.satisfies(scene, negative["struct"]), negative["text"]
            assert not tw.satisfies(scene, negative["struct"], lenient=True), negative["text"]
            assert tw.render(negative["struct"]) == negative["text"] != item["positive"]


def _objects_differing(a, b):
    return [i for i, (x, y) in enumerate(zip(a["objects"], b["objects"])) if x != y]


def _relations_differing(a, b):
    return [r for r, (x, y) in enumerate(zip(a["relations"], b["relations"])) if x != y]


def _check_negative_shape(neg_type, pos, neg):
    """Each negative type is the edit its name says, and only that edit."""
    if neg_type == "add-obj":
        assert neg["objects"][:-1] == pos["objects"] and neg["relations"] == pos["relations"]
        assert len(neg["objects"]) == len(pos["objects"]) + 1
        return
    assert len(neg["objects"]) == len(pos["objects"]) and neg.get("count") == pos.get("count")
    changed = _objects_differing(pos, neg)
    if neg_type in ("replace-rel", "swap-obj"):
        assert not changed
        (r,) = _relations_differing(pos, neg)
        (i, p, j), (ni, q, nj) = pos["relations"][r], neg["relations"][r]
        assert (ni, q, nj) == ((i, q, j) if neg_type == "replace-rel" else (j, p, i))
        assert neg_type == "swap-obj" or q != p
        return
    assert neg["relations"] == pos["relations"]
    if neg_type == "swap-att":
        i, j = changed
        a, b = pos["objects"][i], pos["objects"][j]
        key = "colour" if a["colour"] != neg["objects"][i]["colour"] else "size"
        assert neg["objects"][i] == {**a, key: b[key]} and neg["objects"][j] == {**b, key: a[key]}
        return
    (i,) = changed
    keys = {k for k in pos["objects"][i] if pos["objects"][i][k] != neg["objects"][i][k]}
    assert len(keys) == 1 and keys <= ({"shape"} if neg_type == "replace-obj" else {"colour", "size"})


def test_negatives_are_the_edit_their_type_names(world):
    _, summary, annotations, negatives = world
    captions = {c["id"]: c for s in annotations["scenes"] for c in s["captions"]}
    seen = Counter()
    for item in negatives["items"]:
        caption = captions[item["caption_id"]]
        assert item["positive"] == caption["text"]
        types = [n["type"] for n in item["negatives"]]
        assert len(types) == len(set(types))
        for negative in item["negatives"]:
            _check_negative_shape(negative["type"], caption["struct"], negative["struct"])
            seen[(negative["type"], caption["kind"])] += 1
    by_type = Counter(t for t, _ in seen.elements())
    assert set(by_type) == set(tw.NEGATIVE_TYPES) and min(by_type.values()) > 0
    assert dict(by_type) == summary["counts"]["negatives_by_type"]
    assert seen[("add-obj", "long")] == 0  # long captions claim to name every object


def test_captions_cover_every_scene(world):
    _, _, annotations, _ = world
    for scene in annotations["scenes"]:
        kinds = Counter(c["kind"] for c in scene["captions"])
        assert len(scene["captions"]) >= 2
        assert kinds["one-object"] == len(scene["objects"]) and kinds["long"] == 1
        assert kinds["relation"] == (len(scene["objects"]) >= 2)
        long = next(c for c in scene["captions"] if c["kind"] == "long")
        for obj in scene["objects"]:
            assert f"{obj['size']} {obj['colour']} {obj['shape']}" in long["text"]
        assert [c["id"] for c in scene["captions"]] == [
            scene["image_id"] * tw.CAPTION_SLOTS + k for k in range(len(scene["captions"]))]


def test_satisfies_on_a_hand_built_scene():
    scene = {"width": 64, "height": 64, "split": "val", "objects": [
        {"shape": "circle", "colour": "red", "size": "small", "box": [2, 30, 15, 43]},
        {"shape": "square", "colour": "blue", "size": "large", "box": [20, 25, 42, 47]},
        {"shape": "star", "colour": "green", "size": "small", "box": [48, 2, 61, 15]}]}
    red, blue, green = ({"colour": c, "shape": s} for c, s in
                        [("red", "circle"), ("blue", "square"), ("green", "star")])

    def rel(a, p, b, **extra):
        return {"objects": [a, b], "relations": [[0, p, 1]], **extra}

    assert tw.satisfies(scene, rel(red, "left of", blue))
    assert tw.satisfies(scene, rel(red, "next to", blue)) and tw.satisfies(scene, rel(blue, "next to", red))
    assert not tw.satisfies(scene, rel(blue, "left of", red))
    assert not tw.satisfies(scene, rel(red, "above", blue))  # centres 1.5 px apart vertically
    assert tw.satisfies(scene, rel(green, "above", blue)) and not tw.satisfies(scene, rel(green, "next to", red))
    assert not tw.satisfies(scene, rel(blue, "next to", green))  # boxes 11.7 px apart > 9.6
    assert tw.satisfies(scene, rel(blue, "next to", green), lenient=True)  # but <= 19.2
    assert tw.satisfies(scene, {"objects": [{**red, "size": "small"}], "relations": []})
    assert not tw.satisfies(scene, {"objects": [{**red, "size": "large"}], "relations": []})
    assert tw.satisfies(scene, rel(red, "left of", blue, count=3))
    assert not tw.satisfies(scene, rel(red, "left of", blue, count=2))
    # The same object cannot play two roles.
    assert not tw.satisfies(scene, {"objects": [red, red], "relations": []})


# --------------------------------------------------------------------------- geometry and pixels


def _expected_relations(objects, side):
    """Independent restatement of the documented rules."""
    out = []
    for i, a in enumerate(objects):
        for j, b in enumerate(objects):
            if i == j:
                continue
            (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = a["box"], b["box"]
            dx, dy = (bx0 + bx1 - ax0 - ax1) / 2, (by0 + by1 - ay0 - ay1) / 2
            gap = np.hypot(max(0, bx0 - ax1, ax0 - bx1), max(0, by0 - ay1, ay0 - by1))
            margin = tw.DIRECTION_MARGIN * side
            truth = {"left of": dx > margin, "right of": -dx > margin, "above": dy > margin,
                     "below": -dy > margin, "next to": gap <= tw.NEAR * side}
            out += [[i, p, j] for p in tw.PREDICATES if truth[p]]
    return out


def test_relations_agree_with_box_geometry(world):
    _, _, annotations, _ = world
    assert annotations["meta"]["thresholds"]["direction_margin"] == tw.DIRECTION_MARGIN
    predicates = Counter()
    for scene in annotations["scenes"]:
        relations = scene["relations"]
        assert sorted(map(tuple, relations)) == sorted(map(tuple, _expected_relations(scene["objects"], 64)))
        triples = {tuple(r) for r in relations}
        inverse = {"left of": "right of", "right of": "left of", "above": "below", "below": "above",
                   "next to": "next to"}
        assert all((j, inverse[p], i) in triples for i, p, j in triples)
        assert not any((i, "left of", j) in triples and (i, "right of", j) in triples for i, _, j in triples)
        predicates.update(p for _, p, _ in relations)
    assert set(predicates) == set(tw.PREDICATES)


def test_boxes_and_pixels_match_objects(world):
    out, _, annotations, _ = world
    sides = {"small": round(0.20 * 64), "large": round(0.35 * 64)}
    assert annotations["meta"]["sizes_px"] == sides
    for scene in annotations["scenes"][:60]:
        pixels = np.asarray(Image.open(out / scene["file_name"]))
        assert pixels.shape == (64, 64, 3)
        outside = np.ones((64, 64), dtype=bool)
        combos = [(o["colour"], o["shape"]) for o in scene["objects"]]
        assert len(set(combos)) == len(combos) and 1 <= len(combos) <= tw.MAX_OBJECTS
        for obj in scene["objects"]:
            x0, y0, x1, y1 = obj["box"]
            assert all(isinstance(v, int) for v in obj["box"])
            assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64
            assert x1 - x0 == y1 - y0 == sides[obj["size"]]
            patch = pixels[y0:y1, x0:x1].reshape(-1, 3)
            is_colour = (patch == tw.COLOURS[obj["colour"]]).all(axis=1)
            is_background = (patch == tw.BACKGROUND).all(axis=1)
            assert (is_colour | is_background).all()
            assert is_colour.mean() > 0.3, (obj, is_colour.mean())
            # Every shape reaches all four sides of its box.
            mask = is_colour.reshape(y1 - y0, x1 - x0)
            assert mask[0].any() and mask[-1].any() and mask[:, 0].any() and mask[:, -1].any()
            outside[y0:y1, x0:x1] = False
        assert (pixels[outside] == tw.BACKGROUND).all()
        boxes = [o["box"] for o in scene["objects"]]
        for k, a in enumerate(boxes):
            for b in boxes[k + 1:]:
                assert max(b[0] - a[2], a[0] - b[2], b[1] - a[3], a[1] - b[3]) >= 3


def test_draw_reproduces_the_saved_image(world):
    out, _, annotations, _ = world
    scene = annotations["scenes"][7]
    assert tw.draw(scene).tobytes() == Image.open(out / scene["file_name"]).tobytes()


# --------------------------------------------------------------------------- file layout


def test_splits_are_a_function_of_the_index(world):
    _, summary, annotations, _ = world
    splits = [s["split"] for s in annotations["scenes"]]
    assert splits == [tw.split_of(i, (0.8, 0.1, 0.1)) for i in range(N)]
    counts = Counter(splits)
    assert abs(counts["train"] - 160) <= 3 and abs(counts["val"] - 20) <= 3 and abs(counts["test"] - 20) <= 3
    assert {k: v["images"] for k, v in summary["counts"]["splits"].items()} == dict(counts)
    assert {tw.split_of(i, (1.0, 0.0, 0.0)) for i in range(500)} == {"train"}


def test_csv_and_coco_agree_with_annotations(world):
    out, summary, annotations, negatives = world
    all_ids = [c["id"] for s in annotations["scenes"] for c in s["captions"]]
    assert len(all_ids) == len(set(all_ids))
    for split in tw.SPLITS:
        scenes = [s for s in annotations["scenes"] if s["split"] == split]
        with open(out / f"{split}.csv", newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["filepath", "title"]
        assert rows[1:] == [[s["file_name"], c["text"]] for s in scenes for c in s["captions"]]
        assert all((out / path).is_file() for path, _ in rows[1:])
        coco = json.loads((out / f"{split}_coco.json").read_text())
        assert coco["images"] == [{"id": s["image_id"], "file_name": f"images/{s['image_id']:06d}.png",
                                   "width": 64, "height": 64} for s in scenes]
        assert coco["annotations"] == [{"id": c["id"], "image_id": s["image_id"], "caption": c["text"]}
                                       for s in scenes for c in s["captions"]]
        assert summary["counts"]["splits"][split]["captions"] == len(rows) - 1
    split_of_image = {s["image_id"]: s["split"] for s in annotations["scenes"]}
    assert all(item["split"] == split_of_image[item["image_id"]] for item in negatives["items"])


def test_meta_records_resolved_settings(world):
    out, summary, _, _ = world
    meta = json.loads((out / "meta.json").read_text())
    assert {k: meta[k] for k in ("n", "seed", "size", "holdout", "splits", "workers")} == {
        "n": N, "seed": 0, "size": 64, "holdout": ["blue square", "red circle"],
        "splits": [0.8, 0.1, 0.1], "workers": 2}
    assert meta["counts"] == summary["counts"]


# --------------------------------------------------------------------------- command line


def test_cli_writes_files_and_prints_summary(tmp_path, capsys):
    out = tmp_path / "cli"
    assert tw.main(["--out", str(out), "--n", "12", "--seed", "3", "--size", "48", "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "12 scenes" in printed and "negatives by type" in printed and "train" in printed
    for name in DATA_FILES + ["meta.json"]:
        assert (out / name).is_file(), name
    assert len(list((out / "images").glob("*.png"))) == 12
    assert Image.open(out / "images/000011.png").size == (48, 48)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["n"], meta["seed"], meta["size"]) == (12, 3, 48)


def test_options_parse_like_the_flags_and_job_errors_are_one_line(tmp_path, capsys):
    opts = tw.ToyWorldOptions(out=str(tmp_path), holdout="red circle", splits="0.5,0.25,0.25")
    assert opts.holdout == {("red", "circle")} and opts.splits == (0.5, 0.25, 0.25)
    assert tw.ToyWorldOptions(out=str(tmp_path), holdout=opts.holdout, splits=opts.splits) == opts  # parsed: kept
    with pytest.raises(ValueError, match="invalid splits"):
        tw.ToyWorldOptions(out="x", splits="0.5,0.5")
    # a value only generate() refuses: one error line and status 2, no traceback
    assert tw.main(["--out", str(tmp_path / "small"), "--n", "2", "--size", "16", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: need n >= 1, seed >= 0 and size >= 32") and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        tw.main(["--n", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--out is required" in err and "usage:" not in err


def test_cli_config_sets_defaults_and_flags_override(tmp_path, capsys):
    config = tmp_path / "tw.yaml"
    config.write_text(f"out: {tmp_path / 'cfg'}\nn: 9\nseed: 5\nholdout: [red circle]\nsplits: [0.5, 0.25, 0.25]\n")
    args = tw.parse_args(["--config", str(config), "--seed", "7", "--workers", "1"])
    assert (args.n, args.seed, args.size, args.workers) == (9, 7, 64, 1)
    assert args.holdout == {("red", "circle")} and args.splits == (0.5, 0.25, 0.25)
    tw.main(["--config", str(config), "--workers", "1"])
    meta = json.loads((tmp_path / "cfg" / "meta.json").read_text())
    assert (meta["n"], meta["seed"], meta["holdout"], meta["splits"]) == (9, 5, ["red circle"], [0.5, 0.25, 0.25])
    config.write_text("n: 3\ncolour: red\n")
    with pytest.raises(SystemExit):
        tw.parse_args(["--config", str(config), "--out", str(tmp_path)])
    assert "unknown key(s) colour" in capsys.readouterr().err


# --------------------------------------------------------------------------- long-caption mode

LONG_N = 40


@pytest.fixture(scope="module")
def long_world(tmp_path_factory):
    """A 40-scene long-caption world: (dir, summary, annotations, negatives)."""
    out = tmp_path_factory.mktemp("long-world")
    summary = tw.generate(out, LONG_N, seed=0, holdout=HOLDOUT, workers=1, long_captions=True)
    return out, summary, tw.load(out), json.loads((out / "negatives.json").read_text())


def test_default_mode_is_unchanged_by_the_long_caption_mode(tmp_path):
    """The default world's bytes are pinned (digest of generator VERSION 2, the prior-free captions; the long-caption
    mode and --phrases leave them alone), so existing worlds, their feature-cache fingerprints and tests keep their
    meaning: a change to them must come with a VERSION bump, which makes ``ensure`` generate such worlds again."""
    assert tw.VERSION == 2
    import hashlib

    tw.generate(tmp_path, 20, seed=0, workers=1)
    digest = hashlib.sha256()
    for name in ["annotations.json", "negatives.json", "train.csv", "images/000007.png"]:
        digest.update((tmp_path / name).read_bytes())
    assert digest.hexdigest() == "aa43557fa67a37f554a4ad16ed5f3bd0a5081b1ef175956f896888deb49bfac4"
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert "long_captions" not in meta and "phrases" not in meta and "objects_per_scene" not in tw.load(tmp_path)["meta"]


def test_long_captions_exceed_77_tokens_and_fit_248(long_world):
    from open_clip.tokenizer import SimpleTokenizer

    tokenizer = SimpleTokenizer()
    _, summary, annotations, _ = long_world
    assert summary["long_captions"] and annotations["meta"]["caption_id"] == "image_id * 16 + k"
    lengths, counts = [], Counter()
    for scene in annotations["scenes"]:
        n = len(scene["objects"])
        counts[n] += 1
        long = [c for c in scene["captions"] if c["kind"] == "long"]
        assert len(long) == 1 and long[0]["struct"]["dense"] and long[0]["struct"]["count"] == n
        lengths.append(len(tokenizer.encode(long[0]["text"])) + 2)  # + start / end of text
        for obj in scene["objects"]:  # every object named with all its attributes
            assert f"{obj['size']} {obj['colour']} {obj['shape']}" in long[0]["text"]
    assert set(counts) == set(range(tw.LONG_OBJECTS[0], tw.LONG_OBJECTS[1] + 1))
    assert 100 <= min(lengths) and max(lengths) <= 248  # all of it fits Long-CLIP's context
    assert min(lengths) > 77  # a 77-token text encoder truncates every one of them
    # what a 77-token encoder drops is relation sentences: the object list always fits in 77 tokens
    for scene in annotations["scenes"]:
        text = next(c["text"] for c in scene["captions"] if c["kind"] == "long")
        head, tail = text.split(". ", 1)
        assert len(tokenizer.encode(head + ".")) + 2 <= 77 and " is " in tail


def test_long_captions_are_true_and_their_negatives_false(long_world):
    _, summary, annotations, negatives = long_world
    scenes = _scenes_by_id(annotations)
    for scene in scenes.values():
        assert [c["id"] for c in scene["captions"]] == [
            scene["image_id"] * tw.LONG_CAPTION_SLOTS + k for k in range(len(scene["captions"]))]
        for caption in scene["captions"]:
            assert tw.satisfies(scene, caption["struct"]), caption["text"]
            assert tw.render(caption["struct"]) == caption["text"]
    long_ids = {c["id"] for s in scenes.values() for c in s["captions"] if c["kind"] == "long"}
    seen = Counter()
    for item in negatives["items"]:
        scene = scenes[item["image_id"]]
        for negative in item["negatives"]:
            assert not tw.satisfies(scene, negative["struct"], lenient=True), negative["text"]
            assert tw.render(negative["struct"]) == negative["text"] != item["positive"]
            if item["caption_id"] in long_ids:
                positive = next(c["struct"] for c in scene["captions"] if c["id"] == item["caption_id"])
                _check_negative_shape(negative["type"], positive, negative["struct"])
                seen[negative["type"]] += 1
    assert set(seen) == set(tw.NEGATIVE_TYPES) - {"add-obj"}  # every edit type reaches the dense captions


def test_long_mode_geometry_and_hold_out(long_world):
    out, _, annotations, _ = long_world
    sides = {k: round(v * 64) for k, v in tw.LONG_SIZES.items()}
    assert annotations["meta"]["sizes_px"] == sides == {"small": 10, "large": 14}
    for scene in annotations["scenes"]:
        boxes = [o["box"] for o in scene["objects"]]
        assert all(b[2] - b[0] == b[3] - b[1] == sides[o["size"]] for b, o in zip(boxes, scene["objects"]))
        for k, a in enumerate(boxes):
            for b in boxes[k + 1:]:
                assert max(b[0] - a[2], a[0] - b[2], b[1] - a[3], a[1] - b[3]) >= 3
        assert sorted(map(tuple, scene["relations"])) == sorted(map(tuple, _expected_relations(scene["objects"], 64)))
        if scene["split"] == "train":
            assert not HELD & {(o["colour"], o["shape"]) for o in scene["objects"]}
    scene = annotations["scenes"][3]
    assert tw.draw(scene).tobytes() == Image.open(out / scene["file_name"]).tobytes()


def test_long_mode_is_deterministic_and_ensure_tells_the_modes_apart(long_world, tmp_path):
    out, _, _, _ = long_world
    tw.generate(tmp_path / "again", LONG_N, seed=0, holdout=HOLDOUT, workers=2, long_captions=True)
    for name in DATA_FILES + [f"images/{i:06d}.png" for i in range(LONG_N)]:
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
    lines = []
    world = tmp_path / "ensured"
    tw.ensure(world, 6, 0, say=lines.append, long_captions=True)
    assert json.loads((world / "meta.json").read_text())["long_captions"] is True
    tw.ensure(world, 6, 0, say=lines.append, long_captions=True)
    assert "long captions; generated" in lines[0] and "long captions; reused" in lines[1]
    with pytest.raises(ValueError, match="long captions"):
        tw.ensure(world, 6, 0, say=lines.append)  # a default world asked for: not silently the long one
    tw.ensure(world, 6, 0, say=lines.append, replace=True)
    assert "long_captions" not in json.loads((world / "meta.json").read_text())
    # a holdout is part of what ensure compares: the same one is reused, another one is not taken for it
    lines.clear()
    tw.ensure(world, 6, 0, say=lines.append, replace=True, holdout="red circle,blue square")
    tw.ensure(world, 6, 0, say=lines.append, holdout=["blue square", "red circle"])
    assert "holding out blue square, red circle; generated" in lines[0] and "reused" in lines[1]
    assert json.loads((world / "meta.json").read_text())["holdout"] == ["blue square", "red circle"]
    with pytest.raises(ValueError, match="holding out blue square, red circle, not the toy world asked for"):
        tw.ensure(world, 6, 0, say=lines.append)
    assert tw.parse_args(["--out", "x", "--long-captions"]).long_captions
    assert not tw.parse_args(["--out", "x"]).long_captions


def test_the_embedded_worlds_size_comes_from_plugvlm_toy_n_or_is_refused_in_one_line():
    """PLUGVLM_TOY_N sizes the embedded default (the README's blocks run on 320 in the tests); a value that is not a
    whole number >= 20 stops at import with one line saying what to set, never a traceback."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = "import extract.worlds.toyworld as t; print(t.DEFAULT_N)"

    def run(value):
        env = {**os.environ, "PYTHONPATH": str(root)}
        env.pop("PLUGVLM_TOY_N", None)
        if value is not None:
            env["PLUGVLM_TOY_N"] = value
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root)

    assert run(None).stdout.strip() == "2000" and run("400").stdout.strip() == "400"
    for bad in ("ten", "5", "-400"):
        done = run(bad)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert done.stderr.startswith(f"error: PLUGVLM_TOY_N='{bad}'") and "whole number >= 20" in done.stderr


# --------------------------------------------------------------------------- no caption prior, the controlled test


def test_captions_name_directions_only_and_long_clauses_run_both_ways(world):
    _, _, annotations, negatives = world
    predicates, forward, backward = Counter(), 0, 0
    for scene in annotations["scenes"]:
        for caption in scene["captions"]:
            for i, p, j in caption["struct"]["relations"]:
                predicates[p] += 1
                if caption["kind"] == "long":
                    forward, backward = forward + (i < j), backward + (i > j)
    assert set(predicates) == set(tw.CAPTION_PREDICATES)  # "next to" holds in scenes, no caption says it
    assert forward > 50 and backward > 50  # the subject is not always the earlier object
    replaced = Counter(n["struct"]["relations"][0][1] for item in negatives["items"] for n in item["negatives"]
                       if n["type"] == "replace-rel" and len(n["struct"]["relations"]) == 1)
    assert set(replaced) <= set(tw.CAPTION_PREDICATES)


def test_every_controlled_scene_satisfies_its_caption_and_violates_the_other_three(world):
    out, _, _, _ = world
    data = json.loads((out / shared.CONTROLLED_FILE).read_text())
    assert data["version"] == tw.CONTROLLED_VERSION and len(data["sets"]) == tw.controlled_count(N)
    for entry in data["sets"]:
        scenes = entry["scenes"]
        assert [s["predicate"] for s in scenes] == list(tw.CONTROLLED_DIRECTIONS)
        assert len({s["caption"] for s in scenes}) == 4
        for scene in scenes:
            a, b = (o["box"] for o in scene["objects"])
            assert [(o["colour"], o["shape"], o["size"]) for o in scene["objects"]] == \
                [(o["colour"], o["shape"], o["size"]) for o in entry["objects"]]  # the same two objects
            for other in scenes:
                own = other is scene
                assert tw.relation_holds(a, other["predicate"], b, scene["width"]) == own
                assert tw.relation_holds(a, other["predicate"], b, scene["width"], lenient=True) == own
                assert tw.satisfies({**scene, "split": "test"}, other["struct"]) == own
            image = np.asarray(Image.open(out / scene["file_name"]))
            assert image.shape == (scene["height"], scene["width"], 3)
        combos = {(o["colour"], o["shape"]) for o in entry["objects"]}
        assert entry["heldout"] == bool(combos & HELD)


def test_controlled_test_is_added_to_a_world_that_lacks_it(tmp_path):
    tw.generate(tmp_path, 40, seed=3, workers=1)
    before = (tmp_path / shared.CONTROLLED_FILE).read_bytes()
    (tmp_path / shared.CONTROLLED_FILE).unlink()
    annotations = (tmp_path / "annotations.json").read_bytes()
    assert tw.ensure_controlled(tmp_path) == tmp_path / shared.CONTROLLED_FILE
    assert (tmp_path / shared.CONTROLLED_FILE).read_bytes() == before  # the world's seed alone decides it
    assert (tmp_path / "annotations.json").read_bytes() == annotations


def test_phrases_change_the_words_not_the_meaning(tmp_path):
    swapped = "left of=above,above=to the left of,right of=below,below=to the right of"
    tw.generate(tmp_path / "plain", 30, seed=1, workers=1)
    tw.generate(tmp_path / "renamed", 30, seed=1, workers=1, phrases=swapped)
    plain, renamed = tw.load(tmp_path / "plain"), tw.load(tmp_path / "renamed")
    assert [c["struct"] for s in plain["scenes"] for c in s["captions"]] == \
        [c["struct"] for s in renamed["scenes"] for c in s["captions"]]
    say = {"left of": "above", "above": "to the left of", "right of": "below", "below": "to the right of"}
    for scene in renamed["scenes"]:
        for caption in scene["captions"]:
            assert caption["text"] == tw.render(caption["struct"], say)
            assert tw.satisfies(scene, caption["struct"])
    meta = json.loads((tmp_path / "renamed" / "meta.json").read_text())
    assert meta["phrases"] == say
    with pytest.raises(ValueError, match="PREDICATE one of"):
        tw.parse_phrases("leftwards=zorp")


def test_ensure_regenerates_a_world_of_an_older_generator(tmp_path, monkeypatch):
    out = tmp_path / "toy"
    tw.generate(out, 20, seed=0, workers=1)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "version": 1}))
    lines = []
    tw.ensure(out, 20, 0, say=lines.append)
    assert "earlier version" in lines[0] and json.loads((out / "meta.json").read_text())["version"] == tw.VERSION
