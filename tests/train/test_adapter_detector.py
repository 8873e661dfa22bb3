"""An adapter trained on detected boxes carries its detector: the run folder holds a copy (``RUN/detector.pt``, named
with its SHA-256 in the checkpoint), so a copied run folder scores exactly as the original once the detector it was
trained with is gone; a missing or altered copy is refused with what to do. A box source given when scoring is used
and said: ``--annotations`` replaces the detector (the boxes change), ``--annotations`` with ``--detector`` is refused.

One 40-scene toy world and one ComAlign run of 1 epoch on the boxes of a random-weights detector (tests/fixtures/
detector.py: real ``.pt`` weights through the real YoloDetector, made in a second, detecting at 64 px) are shared by
the file and the serving tests (``detector_run``); the detector file is deleted once the reference scores are taken."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image

from adapters.checkpoint import CheckpointError, read, read_meta, write
from adapters.load import load_scorer
from train.eval.evaluate import main as eval_main

from fixtures.detector import detector_run

pytest.importorskip("ultralytics")
pytestmark = pytest.mark.usefixtures("one_thread")


def _test_split(world):
    scenes = [s for s in json.loads((world / "annotations.json").read_text())["scenes"] if s["split"] == "test"]
    files = [str(world / s["file_name"]) for s in scenes]
    captions = [c["text"] for s in scenes for c in s["captions"]]
    return files, captions


def _scores(scorer, files, captions) -> torch.Tensor:
    images = scorer.encode_pil([Image.open(f).convert("RGB") for f in files], files)
    return scorer.score(images, scorer.encode_texts(captions))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(world, run folder, test files, test captions, the run's scores with its detector where it was trained); the
    run is fixtures.detector.detector_run's, shared with tests/serve."""
    world, run, detector = detector_run(tmp_path_factory)
    files, captions = _test_split(world)
    before = _scores(load_scorer(str(run)), files, captions)
    shutil.rmtree(detector.parent, ignore_errors=True)  # from here on, only the run folder's copy exists
    return world, run, files, captions, before


@pytest.mark.slow
def test_a_copied_run_folder_scores_as_before_without_the_original_detector(trained, tmp_path):
    world, run, files, captions, before = trained
    meta = read_meta(run / "adapter.safetensors")
    assert meta["detector"]["file"] == "detector.pt" and (run / "detector.pt").is_file()
    moved = tmp_path / "elsewhere"
    shutil.copytree(run, moved)
    scorer = load_scorer(str(moved))
    assert scorer.boxes_used == {"source": "yolo", "trained": "yolo", "from": str(moved / "detector.pt")}
    assert scorer.extractor.reads_boxes is False  # the detector decides, not the world's ground truth
    assert torch.equal(_scores(scorer, files, captions), before)

    (moved / "detector.pt").write_bytes((moved / "detector.pt").read_bytes() + b"\0")  # altered: refused
    with pytest.raises(CheckpointError, match="SHA-256.*restore the run folder's detector.pt"):
        load_scorer(str(moved))
    (moved / "detector.pt").unlink()  # missing: says what to do
    with pytest.raises(FileNotFoundError, match="copy the run folder whole, or pass --detector"):
        load_scorer(str(moved))
    tensors, old = read(run / "adapter.safetensors")  # a run from before detectors travelled: named where it lay
    write(moved / "adapter.safetensors", tensors, {k: v for k, v in old.items() if k != "detector"})
    with pytest.raises(FileNotFoundError, match="not there .* pass --detector PATH"):
        load_scorer(str(moved))


@pytest.mark.slow
def test_annotations_given_when_scoring_replace_the_detector(trained, tmp_path, capsys):
    world, run, files, captions, before = trained
    scorer = load_scorer(str(run), annotations=world, use_annotations=True)
    assert scorer.boxes_used == {"source": "gt", "trained": "yolo", "from": str(world)}
    assert f"scoring with gt boxes from {world}, as given (it was trained on yolo boxes)" in capsys.readouterr().out
    images = [Image.open(f).convert("RGB") for f in files]
    gt = scorer.extractor.image_arrays(images, files)
    detected = load_scorer(str(run)).extractor.image_arrays(images, files)
    assert not (gt["ventity_boxes"].shape == detected["ventity_boxes"].shape
                and (gt["ventity_boxes"] == detected["ventity_boxes"]).all())
    assert not torch.equal(_scores(scorer, files, captions), before)
    # the world as --data alone (no --annotations) leaves the trained detector in charge
    assert load_scorer(str(run), annotations=world).boxes_used["source"] == "yolo"

    argv = ["--model", str(run), "--data", str(world), "--tasks", "retrieval", "--batch-size", "16"]
    assert eval_main([*argv, "--out", str(tmp_path / "given"), "--annotations", str(world)]) == 0
    assert eval_main([*argv, "--out", str(tmp_path / "own")]) == 0
    given, own = (json.loads((tmp_path / d / "results.json").read_text())["results"] for d in ("given", "own"))
    assert [r["boxes"]["source"] for r in given.values()] == ["gt"]
    assert [r["boxes"]["source"] for r in own.values()] == ["yolo"]
    capsys.readouterr()
    assert eval_main([*argv, "--out", str(tmp_path / "both"), "--annotations", str(world), "--detector",
                      str(run / "detector.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "two box sources" in err[0]
