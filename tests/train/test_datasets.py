"""Benchmark readers on tiny files written in each benchmark's published format (offline, no downloads)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from PIL import Image

from extract.data import toyworld
from train.eval.datasets import (READERS, SUGARCREPE_FILES, BenchmarkFormatError, read_aro_vg_attribution,
                              read_aro_vg_relation, read_benchmark, read_sugarcrepe, read_svo_probes,
                              read_toyworld, read_winoground)


def _image(path: Path, colour=(200, 30, 30), size=(24, 16)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def _write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))
    return path


def _skipped_ids(bench) -> set[str]:
    return {s["item_id"] for s in bench.skipped}


# --------------------------------------------------------------------------------------------- SugarCrepe
def _sugarcrepe(tmp_path: Path) -> tuple[Path, Path]:
    coco = tmp_path / "val2017"
    _image(coco / "000000397133.jpg")
    _image(coco / "000000037777.jpg", (10, 200, 10))
    data = tmp_path / "sugar_crepe"
    _write_json(data / "replace_att.json", {
        "0": {"filename": "000000397133.jpg", "caption": "A man in a red shirt.",
              "negative_caption": "A man in a blue shirt."},
        "1": {"filename": "000000037777.jpg", "caption": "A small kitchen.", "negative_caption": "A large kitchen."},
        "2": {"filename": "000000000001.jpg", "caption": "Absent image.", "negative_caption": "Absent images."},
    })
    _write_json(data / "swap_obj.json", {
        "0": {"filename": "000000397133.jpg", "caption": "A dog chases a cat.",
              "negative_caption": "A cat chases a dog."},
    })
    (data / "notes.json").write_text("not a sugarcrepe file, never read")
    return data, coco


def test_sugarcrepe_folder_reads_every_known_file(tmp_path):
    data, coco = _sugarcrepe(tmp_path)
    bench = read_sugarcrepe(data, coco)
    assert (bench.name, bench.kind) == ("sugarcrepe", "text")
    assert [i.item_id for i in bench.items] == ["replace_att/0", "replace_att/1", "swap_obj/0"]
    first = bench.items[0]
    assert first.texts == ("A man in a red shirt.", "A man in a blue shirt.")  # true caption first
    assert first.images == (str(coco / "000000397133.jpg"),) and Path(first.images[0]).is_absolute()
    assert first.crop is None
    assert [i.subtype for i in bench.items] == ["replace_att", "replace_att", "swap_obj"]
    assert len(bench.skipped) == 1
    skip = bench.skipped[0]
    assert skip["item_id"] == "replace_att/2" and skip["reason"] == "missing image"
    assert "replace_att.json" in skip["location"] and "entry 2" in skip["location"]


def test_sugarcrepe_single_file_and_missing_folder(tmp_path):
    data, coco = _sugarcrepe(tmp_path)
    bench = read_sugarcrepe(data / "swap_obj.json", coco)
    assert [(i.item_id, i.subtype) for i in bench.items] == [("swap_obj/0", "swap_obj")]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="replace_obj.json"):
        read_sugarcrepe(empty, coco)
    assert "add_att" in SUGARCREPE_FILES and len(SUGARCREPE_FILES) == 7


@pytest.mark.parametrize("entry, message", [
    ({"filename": "a.jpg", "caption": "x"}, "negative_caption"),           # missing key
    ({"filename": "a.jpg", "caption": "  ", "negative_caption": "y"}, "empty"),  # empty caption
    ({"filename": 7, "caption": "x", "negative_caption": "y"}, "filename"),  # wrong type
    ("just a string", "JSON object"),
])
def test_sugarcrepe_malformed_entry_names_file_and_entry(tmp_path, entry, message):
    data, coco = _sugarcrepe(tmp_path)
    # The bad entry sits in the second file: the first, valid file must not have produced anything yet.
    _write_json(data / "swap_obj.json", {"0": {"filename": "a.jpg", "caption": "x", "negative_caption": "y"},
                                          "17": entry})
    with pytest.raises(BenchmarkFormatError, match=message) as err:
        read_sugarcrepe(data, coco)
    assert "swap_obj.json" in str(err.value) and "entry 17" in str(err.value)


def test_sugarcrepe_bad_json_names_line(tmp_path):
    data, coco = _sugarcrepe(tmp_path)
    (data / "add_obj.json").write_text('{\n "0": {"filename": "a.jpg",\n "caption": oops}\n}\n')
    with pytest.raises(BenchmarkFormatError) as err:
        read_sugarcrepe(data, coco)
    assert "add_obj.json" in str(err.value) and "line 3" in str(err.value)
    assert isinstance(err.value, ValueError)


# --------------------------------------------------------------------------------------------- ARO
def _aro_relation_case(image_path="2315375.jpg", **over):
    case = {"image_id": 2315375, "question": "Is the cup on the table?", "relation_name": "on",
            "image_path": image_path, "bbox_x": 2, "bbox_y": 3, "bbox_w": 10, "bbox_h": 8.5,
            "true_caption": "the cup is on the table", "false_caption": "the table is on the cup"}
    case.update(over)
    return case


def test_aro_relation(tmp_path):
    images = tmp_path / "vg"
    _image(images / "2315375.jpg")
    _image(images / "2340000.jpg")
    file = _write_json(tmp_path / "visual_genome_relation.json", [
        _aro_relation_case("VG_100K/2315375.jpg"),  # a folder in image_path: basename under image_root
        _aro_relation_case("2340000.jpg", relation_name="sitting on", true_caption="the man is sitting on the bench",
                           false_caption="the bench is sitting on the man", label=1),
        _aro_relation_case("2399999.jpg"),  # image absent
    ])
    bench = read_aro_vg_relation(file, images)
    assert (bench.name, bench.kind) == ("aro-vg-relation", "text")
    assert len(bench.items) == 2
    a, b = bench.items
    assert a.texts == ("the cup is on the table", "the table is on the cup")
    assert a.subtype == "on" and b.subtype == "sitting on"
    assert a.crop == (2.0, 3.0, 10.0, 8.5)
    assert a.images == (str(images / "2315375.jpg"),)
    assert [s["item_id"] for s in bench.skipped] == ["2"]
    assert bench.skipped[0]["reason"] == "missing image" and "entry 2" in bench.skipped[0]["location"]


def test_aro_relative_paths_follow_aro_layout_without_image_root(tmp_path):
    _image(tmp_path / "images" / "2315375.jpg")  # ARO's loader: <root>/images/<image_path>
    file = _write_json(tmp_path / "visual_genome_relation.json",
                       [_aro_relation_case(), _aro_relation_case(bbox_w=0)])
    bench = read_aro_vg_relation(file)
    assert bench.items[0].images == (str(tmp_path / "images" / "2315375.jpg"),)
    assert [(s["item_id"], s["reason"]) for s in bench.skipped] == [("1", "empty crop box")]


def test_aro_attribution(tmp_path):
    images = tmp_path / "images"
    _image(images / "1.jpg")
    case = {"image_id": 1, "image_path": "1.jpg", "bbox_x": 0, "bbox_y": 0, "bbox_w": 5, "bbox_h": 5,
            "true_caption": "the white plate and the brown table",
            "false_caption": "the brown plate and the white table", "attributes": ["white", "brown"]}
    file = _write_json(tmp_path / "visual_genome_attribution.json", [case, {**case, "attributes": []}])
    bench = read_aro_vg_attribution(file, images)
    assert (bench.name, bench.kind) == ("aro-vg-attribution", "text")
    assert [i.subtype for i in bench.items] == ["white-brown", "attribution"]
    assert bench.items[0].texts[0] == "the white plate and the brown table"
    assert bench.items[0].crop == (0.0, 0.0, 5.0, 5.0)


@pytest.mark.parametrize("bad, message", [
    ({"true_caption": None}, "true_caption"),
    ({"bbox_x": "12"}, "bbox_x"),
    ({"bbox_h": True}, "bbox_h"),
    ({"false_caption": ""}, "empty"),
])
def test_aro_malformed_entry_names_entry(tmp_path, bad, message):
    cases = [_aro_relation_case() for _ in range(20)]
    cases[17].update(bad)
    file = _write_json(tmp_path / "visual_genome_relation.json", cases)
    with pytest.raises(BenchmarkFormatError, match=message) as err:
        read_aro_vg_relation(file, tmp_path)
    assert "visual_genome_relation.json" in str(err.value) and "entry 17" in str(err.value)


def test_aro_missing_key_and_wrong_top_level(tmp_path):
    case = _aro_relation_case()
    del case["relation_name"]
    file = _write_json(tmp_path / "visual_genome_relation.json", [_aro_relation_case(), case])
    with pytest.raises(BenchmarkFormatError, match=r"entry 1: missing key\(s\) 'relation_name'"):
        read_aro_vg_relation(file)
    file = _write_json(tmp_path / "visual_genome_attribution.json", {"0": case})
    with pytest.raises(BenchmarkFormatError, match="visual_genome_attribution.json.*JSON list"):
        read_aro_vg_attribution(file)


# --------------------------------------------------------------------------------------------- Winoground
def _wino_line(i, **over):
    row = {"id": i, "image_0": f"ex_{i}_img_0", "image_1": f"ex_{i}_img_1",
           "caption_0": "an old person kisses a young person", "caption_1": "a young person kisses an old person",
           "tag": "Noun", "secondary_tag": "", "num_main_preds": 1, "collapsed_tag": "Object"}
    row.update(over)
    return json.dumps(row)


def test_winoground(tmp_path):
    for i in (0, 1):
        for k in (0, 1):
            _image(tmp_path / "images" / f"ex_{i}_img_{k}.png", (40 * k, 90, 10))
    _image(tmp_path / "images" / "ex_2_img_0.png")  # ex 2 lacks its second image
    lines = [_wino_line(0), _wino_line(1, collapsed_tag="Relation"), _wino_line(2, collapsed_tag="Both")]
    file = tmp_path / "examples.jsonl"
    file.write_text("\n".join(lines) + "\n\n")  # trailing blank lines are not examples
    bench = read_winoground(file)  # default image root: <folder>/images
    assert (bench.name, bench.kind) == ("winoground", "group")
    assert [i.item_id for i in bench.items] == ["0", "1"]
    first = bench.items[0]
    assert first.images == (str(tmp_path / "images" / "ex_0_img_0.png"), str(tmp_path / "images" / "ex_0_img_1.png"))
    assert first.texts == ("an old person kisses a young person", "a young person kisses an old person")
    assert [i.subtype for i in bench.items] == ["Object", "Relation"]
    assert [(s["item_id"], s["reason"]) for s in bench.skipped] == [("2", "missing image")]
    assert bench.skipped[0]["image"].endswith("ex_2_img_1.png") and "line 3" in bench.skipped[0]["location"]
    other = tmp_path / "elsewhere"
    assert len(read_winoground(file, other).skipped) == 3  # image_root overrides the default


@pytest.mark.parametrize("bad_line, message", [
    ("{broken", "invalid JSON"),
    ('["a list"]', "JSON object"),
    (json.dumps({"id": 5, "image_0": "a", "image_1": "b", "caption_0": "x", "collapsed_tag": "Object"}),
     "caption_1"),
    (_wino_line(5, caption_0=""), "empty"),
])
def test_winoground_malformed_line(tmp_path, bad_line, message):
    file = tmp_path / "examples.jsonl"
    file.write_text("\n".join([_wino_line(0), _wino_line(1), "", _wino_line(3), bad_line]) + "\n")
    with pytest.raises(BenchmarkFormatError, match=message) as err:
        read_winoground(file)
    assert "examples.jsonl" in str(err.value) and "line 5" in str(err.value)


# --------------------------------------------------------------------------------------------- SVO-Probes
SVO_HEADER = ["sentence", "pos_triplet", "neg_triplet", "subj_neg", "verb_neg", "obj_neg", "pos_url", "neg_url",
              "pos_image_id", "neg_image_id"]


def _svo_row(sentence, kind, pos, neg):
    flags = [str(kind == k) for k in ("subj", "verb", "obj")]
    return [sentence, "girl,ride,horse", "girl,feed,horse", *flags, f"http://x/{pos}", f"http://x/{neg}", pos, neg]


def _write_csv(path: Path, header, rows) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_svo_probes(tmp_path):
    images = tmp_path / "svo_images"
    _image(images / "a1.jpg")
    _image(images / "b2.png")  # another suffix is found
    _image(images / "c3.jpeg")
    rows = [_svo_row("A girl rides a horse.", "verb", "a1", "b2"),
            _svo_row("A man, riding a bike.", "subj", "c3", "a1"),  # quoted comma
            _svo_row("A dog eats food.", "obj", "a1", "zz9")]      # negative image absent
    file = _write_csv(tmp_path / "svo_probes.csv", SVO_HEADER, rows)
    bench = read_svo_probes(file, images)
    assert (bench.name, bench.kind) == ("svo-probes", "image")
    assert [i.subtype for i in bench.items] == ["verb", "subj"]
    first = bench.items[0]
    assert first.texts == ("A girl rides a horse.",)
    assert first.images == (str(images / "a1.jpg"), str(images / "b2.png"))  # true image first
    assert bench.items[1].texts == ("A man, riding a bike.",)
    assert [(s["item_id"], s["reason"]) for s in bench.skipped] == [("2", "missing image")]
    assert "line 4" in bench.skipped[0]["location"]


def test_svo_probes_missing_column_and_bad_rows(tmp_path):
    file = _write_csv(tmp_path / "svo_probes.csv", SVO_HEADER[:-1], [_svo_row("s", "verb", "a", "b")[:-1]])
    with pytest.raises(BenchmarkFormatError, match="neg_image_id") as err:
        read_svo_probes(file, tmp_path)
    assert "svo_probes.csv" in str(err.value) and "line 1" in str(err.value)

    good = [_svo_row("A girl rides a horse.", "verb", "a", "b") for _ in range(3)]
    for bad, message in [(["", *good[0][1:]], "empty"),
                         (_svo_row("s", "none", "a", "b"), "none of"),
                         ([*good[0][:3], "maybe", *good[0][4:]], "subj_neg"),
                         (good[0][:-1], "fields")]:
        file = _write_csv(tmp_path / "svo_probes.csv", SVO_HEADER, [*good, bad])
        with pytest.raises(BenchmarkFormatError, match=message) as err:
            read_svo_probes(file, tmp_path)
        assert "svo_probes.csv" in str(err.value) and "line 5" in str(err.value)


# --------------------------------------------------------------------------------------------- toy world
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("world")
    toyworld.generate(out, n=30, seed=0, workers=1)
    return out


def test_toyworld_matches_negatives_json(world):
    bench = read_toyworld(world, split="test")
    assert (bench.name, bench.kind) == ("toyworld", "text")
    wanted = [(item["positive"], neg["text"], neg["type"])
              for item in json.loads((world / "negatives.json").read_text())["items"] if item["split"] == "test"
              for neg in item["negatives"]]
    assert wanted and [(i.texts[0], i.texts[1], i.subtype) for i in bench.items] == wanted
    assert set(i.subtype for i in bench.items) <= set(toyworld.NEGATIVE_TYPES)
    assert all(len(i.texts) == 2 and Path(i.images[0]).is_file() for i in bench.items)
    assert len({i.item_id for i in bench.items}) == len(bench.items)
    assert bench.skipped == []
    assert len(read_toyworld(world, "train").items) > len(bench.items)


def test_toyworld_items_naming_a_heldout_combination_get_their_own_rows(tmp_path):
    """Composition, not memory: a caption naming a combination held out of training counts in "held-out <type>"
    rows too (and in train.eval's table), never in the train split's."""
    from adapters.load import load_scorer
    from train.eval.evaluate import run_compositional

    toyworld.generate(tmp_path / "w", n=80, seed=1, holdout="red circle,blue square", workers=1)
    bench = read_toyworld(tmp_path / "w", split="test")
    held = lambda item: tuple(t for t in item.tags if t.startswith("held-out"))  # noqa: E731
    tagged = [i for i in bench.items if held(i)]
    assert tagged and len(tagged) < len(bench.items)
    for item in bench.items:
        names = "red circle" in item.texts[0] or "blue square" in item.texts[0]
        assert (held(item) == (f"held-out {item.subtype}", "held-out all")) == names
    assert not any(held(i) for i in read_toyworld(tmp_path / "w", split="train").items)
    table = run_compositional(load_scorer("tiny", "none"), bench, batch_size=64)["per_type"]
    assert table["held-out all"]["n"] == len(tagged)
    assert sum(table[f"held-out {t}"]["n"] for t in {i.subtype for i in tagged}) == len(tagged)
    assert table["all"]["n"] == len(bench.items)


def test_toyworld_missing_image_and_bad_negatives(world, tmp_path):
    copy = tmp_path / "world"
    copy.mkdir()
    for name in ("negatives.json", "test_coco.json"):
        (copy / name).write_text((world / name).read_text())
    # No images/ folder in the copy: every test item is missing its image, none fails.
    bench = read_toyworld(copy)
    assert bench.items == [] and len(bench.skipped) == len(read_toyworld(world).items)
    assert {s["reason"] for s in bench.skipped} == {"missing image"}
    data = json.loads((copy / "negatives.json").read_text())
    k = next(i for i, item in enumerate(data["items"]) if item["split"] == "test")
    data["items"][k]["negatives"][0]["text"] = ""
    (copy / "negatives.json").write_text(json.dumps(data))
    with pytest.raises(BenchmarkFormatError, match=f"negatives.json: entry {k}, negative 0: 'text' is empty"):
        read_toyworld(copy)


# --------------------------------------------------------------------------------------------- dispatch
def test_read_benchmark_dispatches_through_the_registry(tmp_path, world):
    assert set(READERS) == {"sugarcrepe", "aro-vg-relation", "aro-vg-attribution", "winoground", "svo-probes",
                            "toyworld"}
    data, coco = _sugarcrepe(tmp_path)
    assert read_benchmark("sugarcrepe", data, image_root=coco).items == read_sugarcrepe(data, coco).items
    assert read_benchmark("toyworld", world, split="val").items == read_toyworld(world, "val").items
    for name in READERS:  # every reader takes (path, image_root=...): an absent file is the only complaint
        with pytest.raises(FileNotFoundError):
            read_benchmark(name, tmp_path / "absent", image_root=tmp_path)
    with pytest.raises(ValueError, match="unknown benchmark 'vl-checklist'.*sugarcrepe.*winoground"):
        read_benchmark("vl-checklist", tmp_path)


def test_missing_benchmark_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="examples.jsonl"):
        read_winoground(tmp_path / "examples.jsonl")
    with pytest.raises(FileNotFoundError):
        read_aro_vg_relation(tmp_path / "visual_genome_relation.json")


def test_undecodable_text_names_line(tmp_path):
    file = tmp_path / "examples.jsonl"
    file.write_bytes((_wino_line(0) + "\n").encode() + b'{"id": "\xff"}\n')
    with pytest.raises(BenchmarkFormatError, match="line 2.*UTF-8"):
        read_winoground(file)


def test_swaps_between_two_objects_of_one_shape_get_their_own_row(world):
    """"a red circle left of a blue circle" / "a blue circle left of a red circle": only colour and side tell them
    apart, so these swap-att items also count in their own row; every other item does not."""
    import json

    from train.eval.datasets import SAME_SHAPE_SWAP, read_toyworld as read

    structs = {}
    for entry in json.loads((world / "negatives.json").read_text())["items"]:
        for neg in entry["negatives"]:
            structs[(f"{entry['caption_id']}/{neg['type']}", entry["split"])] = neg["struct"]
    items = read(world, split="test").items
    same = [i for i in items if SAME_SHAPE_SWAP in i.tags]
    assert same and all(i.subtype == "swap-att" for i in same)
    for item in items:
        objects = structs[(item.item_id, "test")]["objects"]
        one_shape = item.subtype == "swap-att" and len(objects) == 2 and objects[0]["shape"] == objects[1]["shape"]
        assert (SAME_SHAPE_SWAP in item.tags) == one_shape
