"""extract/data/boxes.py: every box format read from a tiny file in its published layout, files that hold no boxes
refused with what is expected, no entry is an error naming file and image, and a collection's missing share counted
and judged against --max-missing-boxes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from extract.components.regions import gt_boxes
from extract.worlds import toyworld
from extract.data.boxes import BoxAnnotations, MissingBoxes, read_boxes

# COCO instances as instances_val2017.json lays them out (ids are ints; image 1804 has no object)
COCO = {"info": {"description": "tiny"}, "licenses": [],
        "images": [{"id": 139, "file_name": "000000000139.jpg", "width": 640, "height": 426},
                   {"id": 1804, "file_name": "000000001804.jpg", "width": 500, "height": 375}],
        "annotations": [{"id": 1, "image_id": 139, "bbox": [10.5, 20.0, 30.0, 40.0], "category_id": 18, "area": 1200,
                         "iscrowd": 0, "segmentation": []},
                        {"id": 2, "image_id": 139, "bbox": [0, 0, 5, 5], "category_id": 1, "area": 25, "iscrowd": 0,
                         "segmentation": []}],
        "categories": [{"id": 1, "name": "person", "supercategory": "person"},
                       {"id": 18, "name": "dog", "supercategory": "animal"}]}
CAPTIONS = {"images": COCO["images"], "annotations": [{"id": 7, "image_id": 139, "caption": "a dog"}]}
# Visual Genome objects.json: a list of images, each with its objects (names: a list)
VG = [{"image_id": 7, "image_url": "https://cs.stanford.edu/VG_100K/7.jpg",
       "objects": [{"object_id": 1, "x": 1, "y": 2, "w": 3, "h": 4, "names": ["cat"], "synsets": ["cat.n.01"]}]},
      {"id": 8, "file_name": "imgs/8.png", "objects": []}]


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_coco_instances(tmp_path, caplog):
    with caplog.at_level("INFO", logger="extract.data.boxes"):
        boxes = read_boxes(_write(tmp_path, "instances_val2017.json", COCO))
    assert boxes.format == "COCO instances" and len(boxes) == 2
    assert "instances_val2017.json read as COCO instances: 2 images, 2 objects" in caplog.text  # the format, named
    found, labels = gt_boxes(boxes.entry(139))  # an int id, as COCO's are
    np.testing.assert_array_equal(found, [[10.5, 20, 40.5, 60], [0, 0, 5, 5]])
    assert labels == ["dog", "person"]
    assert boxes.entry("139") is boxes.entry(139) is boxes.entry("val2017/000000000139.jpg")  # by file name too
    assert boxes.image_id("/data/val2017/000000000139.jpg") == "139"
    assert boxes.entry(1804)["objects"] == []  # listed, no annotation: a legitimate zero, not a missing entry
    with pytest.raises(MissingBoxes, match=r"instances_val2017.json \(COCO instances\) holds no boxes for image '42'"):
        boxes.entry(42)


def test_visual_genome_objects(tmp_path):
    path = _write(tmp_path, "objects.json", VG)
    for data in (VG, {"images": VG}):  # a list, or {"images": [...]}
        boxes = read_boxes(_write(tmp_path, "objects.json", data))
        assert boxes.format == "Visual Genome objects.json"
        found, labels = gt_boxes(boxes.entry(7))
        np.testing.assert_array_equal(found, [[1, 2, 4, 6]])
        assert labels == ["cat"]
        assert boxes.entry("data/7.jpg") is boxes.entry("7")  # CSV ids are paths: matched by base name
        assert boxes.entry(8)["objects"] == [] and boxes.entry("8.png")["objects"] == []
    with pytest.raises(MissingBoxes, match=r"objects.json \(Visual Genome objects.json\) holds no boxes for image "
                                           "'unknown'"):
        read_boxes(path).entry("unknown")
    _write(tmp_path, "objects.json", [{"image_id": 1, "objects": [{"x": 1, "names": ["cat"]}]}])
    with pytest.raises(ValueError, match=r"entry 0, object 0 is not \{x, y, w, h, names \| name\}"):
        read_boxes(path)


def test_toy_world_folder_or_its_annotations_json(tmp_path):
    world = tmp_path / "world"
    toyworld.generate(world, n=4, seed=0, workers=1)
    scenes = json.loads((world / "annotations.json").read_text())["scenes"]
    controlled = json.loads((world / "controlled.json").read_text())["sets"][0]["scenes"][0]
    for spec in (world, world / "annotations.json"):
        boxes = read_boxes(spec)
        assert boxes.format == "toy world" and len(boxes) >= len(scenes)
        scene = scenes[2]
        assert boxes.entry(scene["image_id"]) is boxes.entry(str(world / scene["file_name"]))
        assert gt_boxes(boxes.entry(scene["image_id"]))[1] == gt_boxes(scene)[1]
        assert boxes.entry(str(world / controlled["file_name"]))["objects"] == controlled["objects"]  # by file name


def test_a_dict_keyed_by_image_id_int_or_str():
    boxes = read_boxes({3: {"objects": [{"x": 0, "y": 0, "w": 2, "h": 2, "name": "cup"}]}})
    assert boxes.entry("3") is boxes.entry(3)
    with pytest.raises(ValueError, match="the entry of 4 is not"):
        read_boxes({4: ["not", "an", "entry"]})
    assert read_boxes(None) is None and read_boxes(boxes) is boxes


def test_files_that_hold_no_boxes_are_refused_saying_what_is_expected(tmp_path):
    # a COCO captions file (what toy worlds and COCO ship next to the boxes) is the common mistake
    with pytest.raises(ValueError) as e:
        read_boxes(_write(tmp_path, "test_coco.json", CAPTIONS))
    message = str(e.value)
    assert "test_coco.json is a COCO captions file (its annotations have captions, no bbox)" in message
    assert "COCO instances (instances_*.json" in message and "Visual Genome objects.json" in message
    assert "toy-world folder" in message
    with pytest.raises(ValueError, match=r"is not a box file plugvlm reads: expected a box file: COCO instances"):
        read_boxes(_write(tmp_path, "other.json", {"what": "ever"}))
    with pytest.raises(ValueError, match="folder without annotations.json"):
        read_boxes(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_boxes(tmp_path / "missing.json")
    broken = dict(COCO, annotations=[{"id": 1, "image_id": 139, "category_id": 1}])
    with pytest.raises(ValueError, match=r"annotations\[0\] has no bbox"):
        read_boxes(_write(tmp_path, "broken.json", broken))


def test_a_collection_is_counted_and_judged_against_the_share(tmp_path, capsys):
    boxes = read_boxes(_write(tmp_path, "instances.json", COCO))
    assert boxes.check([139, "x/000000001804.jpg"], "coco:val") == []  # the empty image counts as covered
    assert "boxes: coco:val: all 2 images have an entry in " in capsys.readouterr().out
    # ids that match no image: refused whatever the share, saying what file is expected
    with pytest.raises(ValueError) as e:
        read_boxes(boxes, max_missing=0.5).check(["a.png", "b.png"], "my-photos")
    message = str(e.value)
    assert message.startswith("my-photos: none of the 2 images has an entry in ")
    assert "its images are e.g. '139', '1804'" in message and "the collection's e.g. 'a.png', 'b.png'" in message
    assert "expected the box file of this collection" in message and "COCO instances" in message
    four = [139, 1804, 139, "nope.jpg"]  # one of four missing: 25 %
    with pytest.raises(ValueError, match=r"c: 1 of 4 images \(25.00%\) have no entry in .*'nope.jpg': more than "
                                         r"--max-missing-boxes 0 allows"):
        read_boxes(boxes, max_missing=0.0).check(four, "c")
    assert read_boxes(boxes, max_missing=0.3).check(four, "c") == ["nope.jpg"]
    out = capsys.readouterr().out
    assert "boxes: c: 1 of 4 images (25.00%) have no entry" in out and "within --max-missing-boxes 0.3" in out
    stream = boxes.coverage("a stream")  # images known as they come: judged at the end
    stream.add(["nope.jpg"])
    stream.add([139])
    assert stream.missing == ["nope.jpg"] and stream.total == 2
    with pytest.raises(ValueError, match="a stream: 1 of 2 images"):
        stream.close()
    assert boxes.entry("nope.jpg", missing="empty") == {"objects": []}  # for a caller that counted it


def test_the_option_is_a_field_of_the_jobs_that_read_boxes():
    from extract.common.source_args import BoxOptions
    from extract.options import ExtractOptions, parse_args

    for cls in (ExtractOptions, BoxOptions):
        assert cls.__dataclass_fields__["max_missing_boxes"].default == 0.0
    assert parse_args(["--data", "d", "--out", "o", "--max-missing-boxes", "0.01"]).max_missing_boxes == 0.01
    with pytest.raises(SystemExit):
        parse_args(["--data", "d", "--out", "o", "--max-missing-boxes", "1.5"])
    assert isinstance(read_boxes({}), BoxAnnotations)
