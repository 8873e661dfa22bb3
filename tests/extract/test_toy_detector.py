"""extract.components.toy_detector: the toy world in ultralytics' dataset format, a YOLO trained on it for a token epoch, and
its weights through the real YoloDetector path (the weights are read back by ultralytics, detections by the
extraction), reuse by fingerprint, and the one-line error for a missing world.

One world of 24 scenes (64 px; about 19 train, 3 val, 2 test) and one training of 1 epoch are shared by the file
(module-scoped fixtures); conftest's socket guard turns any download attempt into a failure.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from extract.components import toy_detector as td

pytest.importorskip("ultralytics")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from extract.worlds.toyworld import generate

    root = tmp_path_factory.mktemp("toy-detector") / "toy"
    generate(root, 24, 0, workers=1)
    return root


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory) -> tuple[td.ToyDetectorOptions, dict]:
    opts = td.ToyDetectorOptions(data=str(world), out=str(tmp_path_factory.mktemp("runs")), epochs=1, batch=8,
                                 close_mosaic=0, workers=0, device="cpu")
    return opts, td.train_toy_detector(opts)


def _scenes(world: Path, split: str) -> list[dict]:
    return [s for s in json.loads((world / "annotations.json").read_text())["scenes"] if s["split"] == split]


@pytest.mark.parametrize("classes", ["object", "shape"])
def test_export_labels_round_trip_to_the_world_boxes(world, tmp_path, classes):
    from extract.worlds.toyworld import SHAPES

    data_yaml = td.export_dataset(world, tmp_path / "ds", classes)
    import yaml

    data = yaml.safe_load(data_yaml.read_text())
    assert data["names"] == ({0: "object"} if classes == "object" else dict(enumerate(SHAPES)))
    assert Path(data["path"]) == (tmp_path / "ds").resolve() and {data["train"], data["val"]} == {"images/train",
                                                                                                "images/val"}
    assert not (tmp_path / "ds" / "images" / "test").exists()  # adapters are compared on test: never exported
    for split in ("train", "val"):
        scenes = _scenes(world, split)
        assert len(list((tmp_path / "ds" / "labels" / split).glob("*.txt"))) == len(scenes) > 0
        for scene in scenes:
            name = Path(scene["file_name"])
            image = tmp_path / "ds" / "images" / split / name.name
            assert os.path.samefile(image, world / name)  # linked (or copied: same bytes) from the world
            rows = np.loadtxt(tmp_path / "ds" / "labels" / split / f"{name.stem}.txt", ndmin=2)
            w, h = scene["width"], scene["height"]
            cx, cy, bw, bh = rows[:, 1] * w, rows[:, 2] * h, rows[:, 3] * w, rows[:, 4] * h
            back = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], axis=1)
            np.testing.assert_allclose(back, [o["box"] for o in scene["objects"]], atol=1e-3)
            want = [0 if classes == "object" else SHAPES.index(o["shape"]) for o in scene["objects"]]
            assert rows[:, 0].astype(int).tolist() == want


def test_matching_against_a_hand_worked_case():
    gt = np.array([[0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50]], float)
    pred = np.array([[0, 0, 10, 9],      # IoU 0.9 with gt 0
                     [1, 1, 11, 11],     # IoU 81/119 with gt 0, but the better-scored box 0 took it
                     [20, 20, 30, 40],   # IoU 0.5 with gt 1: counts (>= 0.5)
                     [40, 40, 44, 44]])  # IoU 0.16 with gt 2: a miss
    scores = np.array([0.9, 0.95, 0.5, 0.8])
    # box 1 scores highest, so it takes gt 0 and box 0 finds nothing left
    assert td.match_detections(pred, scores, gt).tolist() == [1, 2, -1]
    np.testing.assert_allclose(td.box_iou(pred[:1], gt[:1]), [[0.9]])
    assert td.match_detections(pred[:0], scores[:0], gt).tolist() == [-1, -1, -1]


@pytest.mark.slow
def test_training_writes_weights_that_yolodetector_loads_and_runs(trained, world):
    from PIL import Image

    from extract.components.detectors import Detections, YoloDetector

    opts, result = trained
    weights = Path(result["weights"])
    assert weights.is_file() and weights.parent == Path(opts.out) / result["fingerprint"][:16]
    record = json.loads((weights.parent / "detector.json").read_text())
    assert not result["reused"] and record["weights"] == str(weights) and record["val"] == result["val"]
    v, val = result["val"], _scenes(world, "val")
    assert v["images"] == len(val) and v["objects"] == sum(len(s["objects"]) for s in val)
    assert all(0.0 <= v[k] <= 1.0 for k in ("map50", "map50_95", "recall", "precision"))
    det = YoloDetector(str(weights), conf=0.0, max_det=5)
    assert det.imgsz == 64  # the checkpoint's training size, not ultralytics' 640 (10x upscaled toy images)
    assert det.names == {0: "object"}
    images = [Image.open(world / s["file_name"]).convert("RGB") for s in _scenes(world, "test")]
    threads = torch.get_num_threads()
    found = det.detect(images)
    assert torch.get_num_threads() == threads  # ultralytics' select_device would leave it at min(8, cores - 1)
    assert len(found) == len(images) and any(len(d) for d in found)
    for d in found:
        assert isinstance(d, Detections) and d.boxes.shape == (len(d), 4) and len(d) <= 5
        assert (d.boxes >= 0).all() and (d.boxes <= 64).all() and (np.diff(d.scores) <= 0).all()
        assert set(d.names) <= {"object"}
    assert "--detector " + str(weights) in td.summary(result)


@pytest.mark.slow
def test_the_same_world_and_settings_reuse_the_weights(trained, monkeypatch):
    opts, first = trained
    stamp = os.stat(first["weights"]).st_mtime_ns
    monkeypatch.setattr(td, "_train", lambda *a, **k: pytest.fail("trained again"))
    again = td.train_toy_detector(opts)
    assert again["reused"] and again["weights"] == first["weights"] and again["val"] == first["val"]
    assert os.stat(first["weights"]).st_mtime_ns == stamp
    world = Path(opts.data)
    base = td.settings(opts, world)
    for change in ({"epochs": 2}, {"classes": "shape"}, {"imgsz": 128}, {"seed": 1}):
        other = td.ToyDetectorOptions(**{**opts.__dict__, **change})
        assert td.fingerprint(td.settings(other, world)) != first["fingerprint"], change
    assert td.fingerprint(base) == first["fingerprint"]
    same = td.ToyDetectorOptions(**{**opts.__dict__, "workers": 2, "device": "cpu", "threads": 1})
    assert td.fingerprint(td.settings(same, world)) == first["fingerprint"]  # how it runs is not what it is


@pytest.mark.slow
def test_detector_boxes_reach_the_extraction_cache(trained, world, tmp_path):
    """--boxes yolo --detector RUN/best.pt: the unchanged extraction path crops what the trained detector finds."""
    from extract.pipeline import build_cache
    from extract.models.weights import file_sha256

    _, result = trained
    cache = build_cache(world, tmp_path / "cache", base="tiny", split="val", components=["entities", "relations"],
                        boxes="yolo", detector=result["weights"], conf=0.001, workers=0)
    det = cache.settings["boxes"]["detector"]
    assert cache.settings["boxes"]["source"] == "yolo" and det["imgsz"] == 64
    assert det["weights"]["sha256"] == file_sha256(Path(result["weights"]))
    rows = np.arange(len(cache.image_ids()))
    valid, boxes = cache.gather("ventity_valid", rows), cache.gather("ventity_boxes", rows)
    assert valid.any() and (boxes[valid] >= 0).all() and (boxes[valid] <= 64).all()


def test_a_3d_world_trains_its_detector_twice_as_long_unless_told(tmp_path):
    drawn, solid = tmp_path / "drawn", tmp_path / "solid"
    for folder, meta in ((drawn, {"size": 96, "hard": True}), (solid, {"size": 96, "hard": True, "world": "3d"})):
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps(meta))
        (folder / "annotations.json").write_text("{}")
    assert (td.training_epochs(drawn, None), td.training_epochs(solid, None), td.training_epochs(solid, 5)) == (12, 24, 5)
    # the default is resolved before the fingerprint: no --epochs finds the 24-pass detector trained before
    opts = td.ToyDetectorOptions(data=str(solid), out=str(tmp_path / "runs"))
    fp = td.fingerprint(td.settings(dataclasses.replace(opts, epochs=24), solid))
    run = tmp_path / "runs" / fp[:16]
    run.mkdir(parents=True)
    (run / "best.pt").write_bytes(b"weights")
    (run / "detector.json").write_text(json.dumps({"fingerprint": fp}))
    assert td.train_toy_detector(opts)["reused"]


def test_a_missing_world_is_one_error_line(tmp_path, capsys):
    code = td.main(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "toy-world folder" in err[0]
    assert "python -m extract.worlds.toyworld" in err[0] and not (tmp_path / "runs").exists()
    with pytest.raises(SystemExit) as e:
        td.parse_args(["--imgsz", "100"])
    assert e.value.code == 2


def test_recall_by_hidden_share_on_a_hard_world(tmp_path):
    """On a hard world the report splits recall by how much of each object the others hide (its ``visible``): a
    detector that finds exactly the whole objects reads 100 on "whole" and 0 on the partly hidden bins."""
    from extract.components.detectors import Detections
    from extract.worlds import hardworld

    world = tmp_path / "hard"
    hardworld.generate(world, 40, seed=4, workers=1)
    val = _scenes(world, "val")
    order = iter(val)

    class WholeOnly:  # reads the scenes in the report's order
        def detect(self, images):
            out = []
            for _ in images:
                boxes = [o["box"] for o in next(order)["objects"] if o["visible"] >= 0.999]
                out.append(Detections(np.asarray(boxes, np.float32).reshape(-1, 4),
                                      np.linspace(0.9, 0.5, len(boxes)).astype(np.float32),
                                      np.zeros(len(boxes), np.int64), ["object"] * len(boxes)))
            return out

    report = td.detection_report(WholeOnly(), world, "val")
    objects = [o for s in val for o in s["objects"]]
    hidden = [o for o in objects if o["visible"] < 0.999]
    assert hidden, "the world should hide some objects"
    assert report["recall_by_hidden"]["whole"] == 1.0
    assert all(report["recall_by_hidden"][k] == 0.0 for k in report["recall_by_hidden"] if k != "whole")
    assert sum(report["objects_by_hidden"].values()) == len(objects)
    assert list(report["recall_by_hidden"])[0] == "whole"  # least hidden first
    # the 3D world hides up to three quarters: its own bin past half
    assert [td.hidden_bin({"visible": v}) for v in (1.0, 0.8, 0.6, 0.5, 0.26)] == [
        "whole", "hidden < 25%", "hidden 25-50%", "hidden 50-75%", "hidden 50-75%"]
    assert report["recall"] == pytest.approx(1 - len(hidden) / len(objects))


# ------------------------------------------------------------------------------------ --boxes yolo, no --detector
@pytest.mark.slow
def test_boxes_yolo_on_a_toy_world_trains_its_detector_once_then_reuses_it(world, tmp_path, monkeypatch, capsys):
    """``--boxes yolo`` without ``--detector`` on a toy world: the extraction trains the toy detector on the world's
    train split with the default settings (epochs 12 ...) into runs/toy-detector/<fingerprint>, says so, and detects
    with its best.pt; a second extraction reuses it without training; a detector trained again (other weights at the
    same place) gives another cache, never the boxes of the first. Training itself is replaced by a random detector
    file (the real one is tested above); everything around it is the real path."""
    from extract.models.weights import file_sha256
    from extract.pipeline import build_cache
    from fixtures.detector import random_detector

    monkeypatch.chdir(tmp_path)  # the default out folder is relative: runs/toy-detector
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path / ".yolo"))
    trainings = []

    def fake_train(opts, data_yaml, run, imgsz):
        assert (opts.epochs, opts.batch, opts.model, opts.data) == (12, 16, "yolov8n.yaml", str(world))  # defaults
        assert Path(data_yaml).is_file() and imgsz == 64
        trainings.append(run)
        best = random_detector(run / "yolo" / "weights" / "best.pt", imgsz, bump=len(trainings) - 1)
        return {"best": best, "map50": 0.5, "map50_95": 0.25, "train_seconds": 0.0}

    monkeypatch.setattr(td, "_train", fake_train)
    options = dict(base="tiny", components=["entities", "relations"], boxes="yolo", conf=0.0, workers=0)
    first = build_cache(world, tmp_path / "cache", split="val", **options)
    weights = Path(trainings[0]) / "best.pt"
    assert len(trainings) == 1 and Path(trainings[0]).parent == Path("runs") / "toy-detector"
    out = capsys.readouterr().out
    assert f"toy detector of {world} (trained now, val recall" in out and str(weights) in out
    assert first.settings["boxes"]["detector"]["weights"]["sha256"] == file_sha256(weights)
    assert json.loads((first.path / "config.json").read_text())["detector"] == str(weights)

    again = build_cache(world, tmp_path / "cache", split="test", **options)  # another cache, the same detector
    assert len(trainings) == 1 and again.settings["boxes"]["detector"] == first.settings["boxes"]["detector"]
    assert "(reused, val recall" in capsys.readouterr().out

    (weights.parent / "detector.json").unlink()  # trained again: other weights at the same place
    retrained = build_cache(world, tmp_path / "cache", split="val", **options)
    assert len(trainings) == 2 and retrained.fingerprint != first.fingerprint
    assert retrained.settings["boxes"]["detector"]["weights"]["sha256"] == file_sha256(weights)


def test_boxes_yolo_elsewhere_still_asks_for_a_detector(world, tmp_path, capsys):
    """Not a toy world (a CSV of the same images): nothing is trained; the error says what to pass."""
    from extract.pipeline import main

    scene = _scenes(world, "val")[0]
    table = tmp_path / "pairs.csv"
    table.write_text(f"filepath,title\n{world / scene['file_name']},a red circle\n")
    assert main(["--data", str(table), "--out", str(tmp_path / "cache"), "--boxes", "yolo",
                 "--components", "entities", "--base", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--detector WEIGHTS.pt" in err[0] and not (tmp_path / "runs").exists()
