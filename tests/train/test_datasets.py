"""Benchmark readers on tiny files written in each benchmark's published format (offline, no downloads)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from PIL import Image

from extract.worlds import toyworld
from train.eval.datasets import (READERS, SUGARCREPE_FILES, WHATSUP_FILES, BenchmarkFormatError, Item,
                              read_aro_vg_attribution, read_aro_vg_relation, read_benchmark, read_sugarcrepe,
                              read_svo_probes, read_toyworld, read_whatsup, read_winoground, whatsup_pair_and_set)


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


# --------------------------------------------------------------------------------------------- What'sUp
# The authors' published download (github.com/amitakamath/whatsup_vlms): the six JSON files next to
# controlled_images/, controlled_clevr/, val2017/ and vg_images/; Controlled image_path values are written from
# the authors' working directory ("data/controlled_images/...").
_WHATSUP_A = [
    ("mug_left_of_table", ["A mug to the left of a table", "A mug on a table", "A mug under a table",
                           "A mug to the right of a table"]),
    ("mug_right_of_table", ["A mug to the right of a table", "A mug on a table", "A mug under a table",
                            "A mug to the left of a table"]),
    ("mug_on_table", ["A mug on a table", "A mug under a table", "A mug to the left of a table",
                      "A mug to the right of a table"]),
    ("beer-bottle_under_armchair", ["A beer bottle under a armchair", "A beer bottle on a armchair",
                                    "A beer bottle to the left of a armchair",
                                    "A beer bottle to the right of a armchair"]),
]
_WHATSUP_B = [
    ("cube_in-front_of_sphere", ["A cube in front of a sphere", "A cube behind a sphere",
                                 "A cube to the left of a sphere", "A cube to the right of a sphere"]),
    ("cube_behind_sphere", ["A cube behind a sphere", "A cube in front of a sphere",
                            "A cube to the left of a sphere", "A cube to the right of a sphere"]),
    ("cube_left_of_sphere", ["A cube to the left of a sphere", "A cube behind a sphere",
                             "A cube in front of a sphere", "A cube to the right of a sphere"]),
]
_WHATSUP_QA = {
    "coco_qa_one_obj": [[397133, "A photo of a dog on the left", "A photo of a dog on the right"],
                        [37777, "A photo of a cup on the top", "A photo of a cup on the bottom"]],
    "coco_qa_two_obj": [[397133, "A dog to the left of a cat", "A dog to the right of a cat"],
                        [37777, "A lamp above a table", "A lamp below a table"],
                        [37777, "A cup below a lamp", "A cup above a lamp"]],
    "vg_qa_one_obj": [[2315375, "A photo of a man on the right", "A photo of a man on the left"]],
    "vg_qa_two_obj": [[2315375, "A man in front of a car", "A man behind a car"],
                      [1, "A cat behind a sofa", "A cat in front of a sofa"],
                      ["2315375", "A cup on top of a table", "A cup on bottom of a table"]],
}


def _whatsup(root: Path, files=tuple(WHATSUP_FILES)) -> Path:
    """The published folder layout with tiny real images (4x4 JPEGs under the published names)."""
    tiny = dict(size=(4, 4))
    if "controlled_images_dataset" in files:
        _write_json(root / "controlled_images_dataset.json",
                    [{"image_path": f"data/controlled_images/{n}.jpeg", "caption_options": c} for n, c in _WHATSUP_A])
        for n, _ in _WHATSUP_A:
            _image(root / "controlled_images" / f"{n}.jpeg", **tiny)
    if "controlled_clevr_dataset" in files:
        _write_json(root / "controlled_clevr_dataset.json",
                    [{"image_path": f"data/controlled_clevr/{n}.jpeg", "caption_options": c} for n, c in _WHATSUP_B])
        for n, _ in _WHATSUP_B:
            _image(root / "controlled_clevr" / f"{n}.jpeg", (10, 10, 200), **tiny)
    for stem, rows in _WHATSUP_QA.items():
        if stem in files:
            _write_json(root / f"{stem}.json", rows)
    if any(f.startswith("coco") for f in files):
        for i in (397133, 37777):
            _image(root / "val2017" / f"{i:012d}.jpg", **tiny)
    if any(f.startswith("vg") for f in files):
        for i in (2315375, 1):
            _image(root / "vg_images" / f"{i}.jpg", **tiny)
    return root


def test_whatsup_controlled_a(tmp_path):
    root = _whatsup(tmp_path / "data", ["controlled_images_dataset"])
    bench = read_whatsup(root / "controlled_images_dataset.json")  # one file; no image_root
    assert (bench.name, bench.kind, bench.skipped) == ("whatsup", "text", [])
    assert [i.item_id for i in bench.items] == [f"controlled_images_dataset/{k}" for k in range(4)]
    for item, (name, captions) in zip(bench.items, _WHATSUP_A):
        assert item.texts == tuple(captions)  # four options as written, the true one first
        assert item.images == (str(root / "controlled_images" / f"{name}.jpeg"),)
        assert item.subtype == "controlled-A" and item.crop is None
    assert [i.tags for i in bench.items] == [("controlled-A left_of",), ("controlled-A right_of",),
                                            ("controlled-A on",), ("controlled-A under",)]


def test_whatsup_controlled_b(tmp_path):
    root = _whatsup(tmp_path, ["controlled_clevr_dataset"])
    bench = read_whatsup(root)  # a folder holding only this file
    assert [i.item_id for i in bench.items] == [f"controlled_clevr_dataset/{k}" for k in range(3)]
    assert bench.items[0].texts[0] == "A cube in front of a sphere" and len(bench.items[0].texts) == 4
    assert bench.items[1].images == (str(root / "controlled_clevr" / "cube_behind_sphere.jpeg"),)
    assert {i.subtype for i in bench.items} == {"controlled-B"}
    assert [i.tags for i in bench.items] == [("controlled-B in-front_of",), ("controlled-B behind",),
                                            ("controlled-B left_of",)]


def test_whatsup_coco_spatial(tmp_path):
    root = _whatsup(tmp_path, ["coco_qa_one_obj", "coco_qa_two_obj"])
    one = read_whatsup(root / "coco_qa_one_obj.json")
    assert [i.item_id for i in one.items] == ["coco_qa_one_obj/0", "coco_qa_one_obj/1"]
    assert one.items[0].texts == ("A photo of a dog on the left", "A photo of a dog on the right")
    assert one.items[0].images == (str(root / "val2017" / "000000397133.jpg"),)  # zero-padded to 12 digits
    assert one.items[1].images == (str(root / "val2017" / "000000037777.jpg"),)
    assert [(i.subtype, i.tags) for i in one.items] == [
        ("coco-spatial one-object", ("coco-spatial one-object left",)),  # the true caption's last word
        ("coco-spatial one-object", ("coco-spatial one-object top",))]
    two = read_whatsup(root / "coco_qa_two_obj.json")
    assert two.items[1].texts == ("A lamp above a table", "A lamp below a table")
    assert [i.tags[0] for i in two.items] == ["coco-spatial two-object left", "coco-spatial two-object above",
                                              "coco-spatial two-object below"]


def test_whatsup_gqa_spatial(tmp_path):
    root = _whatsup(tmp_path, ["vg_qa_one_obj", "vg_qa_two_obj"])
    bench = read_whatsup(root)
    assert [i.item_id for i in bench.items] == ["vg_qa_one_obj/0", "vg_qa_two_obj/0", "vg_qa_two_obj/1",
                                                "vg_qa_two_obj/2"]
    assert bench.items[0].texts == ("A photo of a man on the right", "A photo of a man on the left")
    assert bench.items[0].images == (str(root / "vg_images" / "2315375.jpg"),)  # no padding for GQA
    assert bench.items[2].images == (str(root / "vg_images" / "1.jpg"),)
    assert bench.items[3].images == bench.items[0].images  # a string id names the same file
    assert [(i.subtype, i.tags[0]) for i in bench.items] == [
        ("gqa-spatial one-object", "gqa-spatial one-object right"),
        ("gqa-spatial two-object", "gqa-spatial two-object front"),
        ("gqa-spatial two-object", "gqa-spatial two-object behind"),
        ("gqa-spatial two-object", "gqa-spatial two-object top")]


def test_whatsup_folder_reads_every_file_and_skips_missing_images(tmp_path):
    root = _whatsup(tmp_path)
    (root / "notes.json").write_text("not a What'sUp file, never read")
    (root / "controlled_clevr" / "cube_behind_sphere.jpeg").unlink()
    bench = read_whatsup(root)
    stems = list(dict.fromkeys(i.item_id.split("/")[0] for i in bench.items))
    assert stems == list(WHATSUP_FILES)  # the paper's order
    assert [i.subtype for i in bench.items] == (["controlled-A"] * 4 + ["controlled-B"] * 2
                                                + ["coco-spatial one-object"] * 2 + ["coco-spatial two-object"] * 3
                                                + ["gqa-spatial one-object"] + ["gqa-spatial two-object"] * 3)
    assert [len(i.texts) for i in bench.items] == [4] * 6 + [2] * 9
    assert bench.skipped == [{"item_id": "controlled_clevr_dataset/1", "reason": "missing image",
                              "location": f"{root / 'controlled_clevr_dataset.json'}: entry 1",
                              "image": str(root / "controlled_clevr" / "cube_behind_sphere.jpeg")}]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="controlled_images_dataset.json"):
        read_whatsup(empty)


def test_whatsup_image_paths_with_and_without_image_root(tmp_path):
    root = _whatsup(tmp_path / "whatsup", ["controlled_images_dataset", "coco_qa_one_obj"])
    # image_path as written, relative to the JSON's folder, comes before the published folder
    _image(root / "data" / "controlled_images" / "mug_on_table.jpeg", size=(4, 4))
    items = {i.item_id: i for i in read_whatsup(root).items}
    assert items["controlled_images_dataset/2"].images == (str(root / "data/controlled_images/mug_on_table.jpeg"),)
    assert items["controlled_images_dataset/3"].images == (
        str(root / "controlled_images/beer-bottle_under_armchair.jpeg"),)
    # a flat image_root wins where it holds the file (basename for Controlled, the padded name for COCO)
    flat = tmp_path / "flat"
    _image(flat / "mug_left_of_table.jpeg", size=(4, 4))
    _image(flat / "000000037777.jpg", size=(4, 4))
    items = {i.item_id: i for i in read_whatsup(root, flat).items}
    assert items["controlled_images_dataset/0"].images == (str(flat / "mug_left_of_table.jpeg"),)
    assert items["coco_qa_one_obj/1"].images == (str(flat / "000000037777.jpg"),)
    # train.eval's --image-root is shared by every benchmark of a run (SugarCrepe's COCO folder, say): an image
    # it lacks is still found in the published layout
    assert items["coco_qa_one_obj/0"].images == (str(root / "val2017" / "000000397133.jpg"),)
    # image_root may also be the folder of the published download
    elsewhere = _write_json(tmp_path / "json_only" / "controlled_images_dataset.json",
                            json.loads((root / "controlled_images_dataset.json").read_text()))
    bench = read_whatsup(elsewhere, root)
    assert bench.skipped == [] and bench.items[3].images == (
        str(root / "controlled_images/beer-bottle_under_armchair.jpeg"),)
    # an absolute image_path is used as it is; found nowhere, the missing record names image_root's path
    _write_json(elsewhere, [{"image_path": str(flat / "mug_left_of_table.jpeg"), "caption_options": list("abcd")},
                            {"image_path": "data/controlled_images/gone_on_table.jpeg",
                             "caption_options": list("abcd")}])
    bench = read_whatsup(elsewhere, tmp_path / "nothing_here")
    assert bench.items[0].images == (str(flat / "mug_left_of_table.jpeg"),)
    assert [(s["item_id"], s["image"]) for s in bench.skipped] == [
        ("controlled_images_dataset/1", str(tmp_path / "nothing_here" / "gone_on_table.jpeg"))]


_OPTIONS = ["A mug on a table", "A mug under a table", "A mug to the left of a table", "A mug to the right of a table"]


@pytest.mark.parametrize("stem, entry, message", [
    ("controlled_images_dataset", {"image_path": "data/controlled_images/a_on_b.jpeg",
                                   "caption_options": _OPTIONS[:3]}, "list of 4 strings.*got 3 values"),
    ("controlled_images_dataset", {"image_path": "data/controlled_images/a_on_b.jpeg",
                                   "caption_options": "A mug on a table"}, "list of 4 strings.*got str"),
    ("controlled_clevr_dataset", {"image_path": "data/controlled_clevr/a_on_b.jpeg",
                                  "caption_options": [*_OPTIONS[:3], 7]}, "option 3 must be a string"),
    ("controlled_clevr_dataset", {"image_path": "data/controlled_clevr/a_on_b.jpeg",
                                  "caption_options": ["", *_OPTIONS[1:]]}, "option 0 is empty"),
    ("controlled_images_dataset", {"caption_options": _OPTIONS}, "missing key 'image_path'"),
    ("controlled_images_dataset", {"image_path": "data/controlled_images/a_on_b.jpeg"},
     "missing key 'caption_options'"),
    ("controlled_images_dataset", {"image_path": "data/controlled_images/", "caption_options": _OPTIONS},
     "names no file"),
    ("controlled_images_dataset", ["data/controlled_images/a_on_b.jpeg", *_OPTIONS], "JSON object"),
    ("coco_qa_one_obj", {"image_id": 1, "true": "a", "false": "b"}, r"\[image_id, true caption, false caption\]"),
    ("coco_qa_two_obj", [1, "A dog to the left of a cat"], "got 2 values"),
    ("coco_qa_two_obj", [1, "a", "b", "c"], "got 4 values"),
    ("vg_qa_one_obj", [1, "A photo of a man on the left", ["a list"]], "false caption.*must be a string"),
    ("vg_qa_two_obj", [1, "  ", "A man behind a car"], "true caption.*empty"),
    ("vg_qa_two_obj", [1.5, "a", "b"], "image_id"),
    ("coco_qa_one_obj", [True, "a", "b"], "image_id"),
])
def test_whatsup_malformed_entry_names_file_and_entry(tmp_path, stem, entry, message):
    root = _whatsup(tmp_path)
    good = json.loads((root / f"{stem}.json").read_text())
    _write_json(root / f"{stem}.json", [good[0]] * 17 + [entry])
    (root / "val2017").rename(tmp_path / "moved")  # absent images never hide a malformed entry: files come first
    with pytest.raises(BenchmarkFormatError, match=message) as err:
        read_whatsup(root)
    assert f"{stem}.json" in str(err.value) and "entry 17" in str(err.value)


def test_whatsup_wrong_top_level_bad_json_and_unknown_file(tmp_path):
    root = _whatsup(tmp_path, ["controlled_images_dataset", "vg_qa_two_obj"])
    _write_json(root / "vg_qa_two_obj.json", {"0": [1, "a", "b"]})
    with pytest.raises(BenchmarkFormatError, match="vg_qa_two_obj.json: expected a JSON list.*got dict"):
        read_whatsup(root)
    (root / "vg_qa_two_obj.json").write_text('[\n [1, "a",\n oops]\n]\n')
    with pytest.raises(BenchmarkFormatError, match="vg_qa_two_obj.json: line 3"):
        read_whatsup(root)
    renamed = _write_json(tmp_path / "whatsup_a.json", [])
    with pytest.raises(BenchmarkFormatError, match="whatsup_a.json.*controlled_images_dataset.json"):
        read_whatsup(renamed)
    with pytest.raises(FileNotFoundError):
        read_whatsup(tmp_path / "coco_qa_one_obj.json")


def _controlled(subset: str, name: str) -> Item:
    return Item(f"x/{name}", (f"/data/images/{name}.jpeg",), ("a", "b", "c", "d"), subset)


def test_whatsup_pair_and_set_accuracy():
    """The authors' Controlled_Images.evaluate_scores by hand: groups (first word, last word), pairs left/right
    and on/under (A) or in-front/behind (B), sets all four; denominators n/2 and n/4."""
    a = [("mug_left_of_table", True), ("mug_right_of_table", True), ("mug_on_table", True),
         ("mug_under_table", True),      # (mug, table): 2 pairs, 1 set
         ("cup_left_of_chair", True), ("cup_right_of_chair", False), ("cup_on_chair", True),
         ("cup_under_chair", True)]      # (cup, chair): on/under only, no set
    b = [("cube_left_of_sphere", True), ("cube_right_of_sphere", True), ("cube_in-front_of_sphere", True),
         ("cube_behind_sphere", False)]  # left/right only, no set
    items = [_controlled("controlled-A", n) for n, _ in a] + [_controlled("controlled-B", n) for n, _ in b]
    correct = [ok for _, ok in a + b]
    qa = Item("coco_qa_one_obj/0", ("/x/000000000001.jpg",), ("t", "f"), "coco-spatial one-object")
    scores = whatsup_pair_and_set([*items, qa], [*correct, False])  # other subsets are ignored
    assert scores == {"controlled-A": {"individual": 87.5, "pair": 75.0, "set": 50.0, "n": 8},
                      "controlled-B": {"individual": 75.0, "pair": 50.0, "set": 0.0, "n": 4}}
    # their denominators count the items given, so a group short of an image still divides by n/2 and n/4
    short = whatsup_pair_and_set(items[8:11], [True, True, True])
    assert short["controlled-B"]["pair"] == pytest.approx(100 / 1.5) and short["controlled-B"]["set"] == 0.0
    with pytest.raises(ValueError, match="2 items but 1"):
        whatsup_pair_and_set(items[:2], [True])
    with pytest.raises(ValueError, match="mug.jpeg"):
        whatsup_pair_and_set([_controlled("controlled-A", "mug")], [True])


def test_whatsup_pair_and_set_on_read_items(tmp_path):
    root = _whatsup(tmp_path, ["controlled_images_dataset"])
    items = read_whatsup(root).items  # (mug, table) x3 and (beer-bottle, armchair) x1
    scores = whatsup_pair_and_set(items, [True, True, False, True])
    assert scores["controlled-A"] == {"individual": 75.0, "pair": 50.0, "set": 0.0, "n": 4}



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
                            "toyworld", "toyworld-controlled", "whatsup"}
    data, coco = _sugarcrepe(tmp_path)
    assert read_benchmark("sugarcrepe", data, image_root=coco).items == read_sugarcrepe(data, coco).items
    whatsup = _whatsup(tmp_path / "whatsup")
    assert read_benchmark("whatsup", whatsup).items == read_whatsup(whatsup).items
    assert read_benchmark("whatsup", whatsup, image_root=coco).items == read_whatsup(whatsup, coco).items
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


def test_toyworld_controlled_sets_are_four_way_items(world):
    from train.eval.datasets import read_toyworld_controlled

    data = json.loads((world / "controlled.json").read_text())
    bench = read_benchmark("toyworld-controlled", world)
    assert bench == read_toyworld_controlled(world)
    assert bench.kind == "set" and len(bench.items) == len(data["sets"]) and not bench.skipped
    for item, entry in zip(bench.items, data["sets"]):
        assert item.images == tuple(str((world / s["file_name"]).resolve()) for s in entry["scenes"])
        assert item.texts == tuple(s["caption"] for s in entry["scenes"])  # caption k belongs to image k
        assert item.subtype == "four-way" and item.tags == (("held-out four-way",) if entry["heldout"] else ())


def test_a_negatives_rows_become_its_items_tags_and_a_bad_rows_field_is_refused(world, tmp_path):
    """The 3D wide language writes each negative's benchmark rows beyond its type (extract.worlds.captions3d.ROWS:
    "chain", "between", "next to", "held-out phrasing"); the reader tags the item with them, so train.eval's table
    has those rows, and refuses a field that is not a list of names."""
    import shutil

    copy = tmp_path / "world"
    shutil.copytree(world, copy)
    data = json.loads((copy / "negatives.json").read_text())
    k = next(i for i, item in enumerate(data["items"]) if item["split"] == "test")
    data["items"][k]["negatives"][0]["rows"] = ["chain", "held-out phrasing"]
    (copy / "negatives.json").write_text(json.dumps(data))
    tagged = [i for i in read_toyworld(copy).items if "chain" in i.tags]
    assert len(tagged) == 1 and tagged[0].texts[1] == data["items"][k]["negatives"][0]["text"]
    assert "held-out phrasing" in tagged[0].tags
    data["items"][k]["negatives"][0]["rows"] = "chain"
    (copy / "negatives.json").write_text(json.dumps(data))
    with pytest.raises(BenchmarkFormatError, match="'rows' must be a list of row names"):
        read_toyworld(copy)
