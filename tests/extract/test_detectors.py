"""extract.components.detectors: YOLO boxes and SAM2 masks, offline, on random weights.

YOLO runs from ``yolov8n.yaml`` (random init, 320-px input); SAM2 from the shipped hiera-tiny config with
``image_size`` 128 written into tmp_path (a 4 x 4 prompt grid), so the whole file runs in seconds on a CPU.
conftest's socket guard turns any download attempt into a failure.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from extract.components.detectors import (Detections, Masks, MissingDependencyError, Sam2MaskGenerator, YoloDetector,
                               load_detector, load_segmenter)
from extract.models.weights import WeightsNotFoundError

SAM2_TINY = "configs/sam2.1/sam2.1_hiera_t.yaml"


def _scene(width: int, height: int, mode: str = "RGB") -> Image.Image:
    im = Image.new("RGB", (width, height), (40, 40, 40))
    d = ImageDraw.Draw(im)
    d.rectangle([width * 0.1, height * 0.1, width * 0.45, height * 0.5], fill=(220, 30, 30))
    d.ellipse([width * 0.5, height * 0.3, width * 0.9, height * 0.9], fill=(30, 200, 60))
    return im.convert(mode)


# ============================================================================================ YOLO
@pytest.fixture
def toy_images() -> list[Image.Image]:
    """Three sizes and aspect ratios, one greyscale (the detector converts it)."""
    return [_scene(320, 240), _scene(200, 500), _scene(64, 64, "L")]


def test_yolo_detections_shapes_bounds_order_and_cap(toy_images):
    pytest.importorskip("ultralytics")
    det = load_detector("yolov8n.yaml", conf=0.0, max_det=4, imgsz=320)
    found = det.detect(toy_images)
    assert len(found) == len(toy_images)
    for d, im in zip(found, toy_images):
        assert isinstance(d, Detections)
        n = len(d)
        assert 0 < n <= 4  # conf=0 keeps every candidate NMS leaves, so the cap is what limits n
        assert d.boxes.shape == (n, 4) and d.boxes.dtype == np.float32
        assert d.scores.shape == (n,) and d.scores.dtype == np.float32
        assert d.classes.shape == (n,) and d.classes.dtype == np.int64
        assert d.names == [det.names[int(c)] for c in d.classes]
        w, h = im.size
        x1, y1, x2, y2 = d.boxes.T
        assert (x1 >= 0).all() and (y1 >= 0).all() and (x2 <= w).all() and (y2 <= h).all()
        assert (x1 <= x2).all() and (y1 <= y2).all()
        assert (np.diff(d.scores) <= 0).all()
    assert any(len(d) == 4 for d in found)
    # ultralytics' analytics sender must not survive on our predictor (it would post after every run online)
    sent = [f for fns in det._model.callbacks.values() for f in fns
            if f.__module__.startswith("ultralytics.utils.events")]
    assert sent == []


def test_yolo_boxes_are_in_original_pixels():
    """An image and its exact 2x nearest-neighbour upscale give the same letterboxed input (a 2:1 linear
    downscale averages identical pixel pairs), so the boxes must differ by exactly the factor 2."""
    pytest.importorskip("ultralytics")
    det = YoloDetector("yolov8n.yaml", conf=0.0, max_det=5, imgsz=320)
    small = _scene(320, 240)
    big = small.resize((640, 480), Image.NEAREST)
    a, b = det.detect([small, big])
    assert len(a) == len(b) > 0
    np.testing.assert_allclose(b.boxes, 2 * a.boxes, rtol=1e-3, atol=0.5)
    np.testing.assert_allclose(b.scores, a.scores, rtol=1e-3, atol=1e-5)


def test_yolo_no_detection_gives_empty_arrays(toy_images):
    pytest.importorskip("ultralytics")
    det = YoloDetector("yolov8n.yaml", conf=1.0, imgsz=320)  # random weights never reach confidence 1
    for d in det.detect(toy_images[:2]):
        assert len(d) == 0
        assert d.boxes.shape == (0, 4) and d.boxes.dtype == np.float32
        assert d.scores.shape == (0,) and d.classes.shape == (0,) and d.classes.dtype == np.int64
        assert d.names == []
    assert det.detect([]) == []


def test_yolo_random_init_is_reproducible_and_pt_round_trips(tmp_path, toy_images):
    """A .yaml detector is the same model every time (seeded), so its settings are a valid fingerprint; saved
    as a .pt it loads through the weights path and detects the same boxes, fingerprinted by the file's hash."""
    pytest.importorskip("ultralytics")
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = YoloDetector("yolov8n.yaml", conf=0.0, max_det=3, imgsz=320)
    assert torch.rand(1) == before  # the seeded init leaves the caller's RNG alone
    second = YoloDetector("yolov8n.yaml", conf=0.0, max_det=3, imgsz=320)
    assert first.settings() == second.settings()
    assert first.settings()["weights"]["init_seed"] == 0
    a, b = first.detect(toy_images[:1])[0], second.detect(toy_images[:1])[0]
    np.testing.assert_array_equal(a.boxes, b.boxes)

    pt = tmp_path / "random-yolov8n.pt"
    first._model.save(str(pt))
    from_file = YoloDetector(str(pt), conf=0.0, max_det=3, imgsz=320)
    c = from_file.detect(toy_images[:1])[0]
    np.testing.assert_allclose(c.boxes, a.boxes, atol=1e-3)
    s = from_file.settings()
    assert s["weights"]["file"] == str(pt.resolve()) and len(s["weights"]["sha256"]) == 64
    assert {"conf", "iou", "max_det", "imgsz", "ultralytics"} <= set(s)


def test_missing_yolo_weights_fail_before_ultralytics_is_touched(tmp_path, monkeypatch):
    """A bare name like yolov9c.pt is exactly what ultralytics would download: we must refuse first. With
    ultralytics made unimportable, reaching it would raise MissingDependencyError instead."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "ultralytics", None)
    with pytest.raises(WeightsNotFoundError) as err:
        load_detector("yolov9c.pt")
    assert sys.modules["ultralytics"] is None  # refused before any attempt to import it
    msg = str(err.value)
    assert "yolov9c.pt" in msg and str(tmp_path / "yolov9c.pt") in msg and "--detector" in msg
    assert not list(tmp_path.iterdir())  # nothing was downloaded or written


@pytest.mark.parametrize("spec, error", [("model.onnx", ValueError), ("https://example.com/yolov9c.pt", ValueError)])
def test_yolo_rejects_formats_that_would_need_the_network(spec, error, monkeypatch):
    monkeypatch.setitem(sys.modules, "ultralytics", None)  # refused before ultralytics is imported
    with pytest.raises(error):
        YoloDetector(spec)


def test_unknown_yolo_config_names_it():
    pytest.importorskip("ultralytics")
    with pytest.raises(FileNotFoundError, match="no-such-model.yaml"):
        YoloDetector("no-such-model.yaml")


@pytest.fixture
def no_subprocess(monkeypatch):
    """Records (and refuses) every subprocess start: pip / uv installs included. Returns the list of commands."""
    import subprocess

    started = []

    def refuse(*args, **kwargs):
        started.append(args[0] if args else kwargs.get("args"))
        raise OSError("tests start no subprocess here")

    for name in ("Popen", "run", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, refuse)
    return started


def test_our_detector_leaves_ultralytics_auto_install_off(monkeypatch, no_subprocess):
    """ultralytics pip-installs what it misses ("attempting AutoUpdate"), e.g. pi-heif from its patched
    Image.open during extraction. After our detector loads, a requirement check for a missing package must not
    start pip even where ultralytics believes it is online."""
    pytest.importorskip("ultralytics")
    monkeypatch.setenv("YOLO_AUTOINSTALL", "True")  # what the user's environment says changes nothing
    det = load_detector("yolov8n.yaml", imgsz=320)
    from ultralytics.utils import checks

    assert checks.AUTOINSTALL is False and sys.modules["ultralytics.utils"].AUTOINSTALL is False
    monkeypatch.setattr(checks, "ONLINE", True)
    assert checks.check_requirements("plugvlm-surely-not-a-package>=1") is False
    assert det.detect([_scene(64, 48)])[0].boxes.shape[1] == 4
    assert no_subprocess == []


def test_ultralytics_does_not_take_over_our_image_decoding(monkeypatch, no_subprocess):
    """ultralytics patches PIL.Image.open on import to fetch pi-heif for any file PIL cannot identify; after our
    detector loads, a file no format recognises is still our clear refusal, with no install attempt."""
    pytest.importorskip("ultralytics")
    from PIL import Image

    from extract.data.images import BadImage, decode_image

    YoloDetector("yolov8n.yaml", imgsz=320)
    from ultralytics.utils import checks

    monkeypatch.setattr(checks, "ONLINE", True)
    assert getattr(Image.open, "__module__", "").startswith("PIL")
    with pytest.raises(BadImage) as err:
        decode_image(b"neither PNG nor JPEG nor HEIF")
    assert err.value.detail == "no image format recognises it"
    assert no_subprocess == []


def test_missing_ultralytics_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ultralytics", None)
    with pytest.raises(MissingDependencyError, match=r"plugvlm\[detect\]"):
        YoloDetector("yolov8n.yaml")


# ============================================================================================ SAM2
@pytest.fixture(scope="module")
def sam2_128(tmp_path_factory) -> str:
    """The shipped hiera-tiny config at image_size 128 instead of 1024, as a local YAML file."""
    sam2 = pytest.importorskip("sam2")
    text = (Path(sam2.__file__).parent / SAM2_TINY).read_text()
    assert "image_size: 1024" in text
    path = tmp_path_factory.mktemp("sam2") / "sam2.1_hiera_t_128.yaml"
    path.write_text(text.replace("image_size: 1024", "image_size: 128"))
    return str(path)


LOOSE = dict(points_per_side=4, pred_iou_thresh=0.0, stability_score_thresh=0.0, box_nms_thresh=1.0)


@pytest.mark.slow
def test_sam2_masks_at_original_size_sorted_and_capped(sam2_128):
    image = _scene(200, 120, "RGBA")
    everything = Sam2MaskGenerator(sam2_128, "none", **LOOSE).generate(image)
    capped = load_segmenter(sam2_128, "none", max_masks=5, **LOOSE).generate(image)
    assert len(everything) > 5  # so the cap below is what limits the count
    for found in (everything, capped):
        assert isinstance(found, Masks)
        n = len(found)
        assert found.masks.shape == (n, 120, 200) and found.masks.dtype == bool
        assert found.scores.shape == (n,) and found.scores.dtype == np.float32
        assert found.areas.dtype == np.int64
        np.testing.assert_array_equal(found.areas, found.masks.sum(axis=(1, 2)))
        assert (np.diff(found.scores) <= 0).all()
    assert len(capped) == 5
    np.testing.assert_array_equal(capped.scores, everything.scores[:5])  # same seeded model, top 5 kept


def test_sam2_zero_masks_and_settings(sam2_128):
    gen = Sam2MaskGenerator(sam2_128, "none", points_per_side=4)  # default thresholds: random masks fail them
    found = gen.generate(_scene(90, 70, "L"))
    assert len(found) == 0
    assert found.masks.shape == (0, 70, 90) and found.masks.dtype == bool
    assert found.scores.shape == (0,) and found.scores.dtype == np.float32 and found.areas.shape == (0,)
    s = gen.settings()
    assert s["image_size"] == 128 and s["weights"] == {"init_seed": 0} and len(s["config_sha256"]) == 64
    assert s == Sam2MaskGenerator(sam2_128, "none", points_per_side=4).settings()


def test_sam2_shipped_config_name_resolves():
    pytest.importorskip("sam2")
    gen = Sam2MaskGenerator(SAM2_TINY, "none")
    assert gen.settings()["config"] == SAM2_TINY and gen.image_size == 1024


@pytest.mark.parametrize("weights", ["sam2.1_hiera_tiny.pt", None])
def test_missing_sam2_checkpoint_fails_fast_naming_it(weights, tmp_path, monkeypatch):
    build_sam = pytest.importorskip("sam2.build_sam")

    def build_sam2(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint was checked")

    monkeypatch.setattr(build_sam, "build_sam2", build_sam2)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WeightsNotFoundError) as err:
        load_segmenter(SAM2_TINY, weights)
    msg = str(err.value)
    assert "dl.fbaipublicfiles.com/segment_anything_2/092824/sam2.1_hiera_tiny.pt" in msg
    if weights is not None:
        assert str(tmp_path / weights) in msg


def test_sam2_checkpoint_for_another_model_is_refused(sam2_128, tmp_path):
    ckpt = tmp_path / "other.pt"
    torch.save({"model": {"not.a.sam2.weight": torch.zeros(1)}}, ckpt)
    with pytest.raises(ValueError, match="does not fit config") as err:
        Sam2MaskGenerator(sam2_128, str(ckpt))
    assert str(ckpt) in str(err.value)


def test_unknown_sam2_config_lists_the_shipped_ones(tmp_path):
    pytest.importorskip("sam2")
    with pytest.raises(FileNotFoundError, match="sam2.1_hiera_t.yaml"):
        Sam2MaskGenerator("configs/sam3/nope.yaml", "none")
    not_sam2 = tmp_path / "other.yaml"
    not_sam2.write_text("trainer: {}\n")
    with pytest.raises(ValueError, match="no 'model' section"):
        Sam2MaskGenerator(str(not_sam2), "none")


def test_missing_sam2_says_what_to_install(monkeypatch):
    for name in ("sam2", "sam2.build_sam", "sam2.automatic_mask_generator"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependencyError, match=r"plugvlm\[segment\]"):
        Sam2MaskGenerator(SAM2_TINY, "none")


def test_sam2_image_size_override_equals_edited_config(sam2_128):
    """--segmenter-image-size on the shipped config builds the same model as a YAML edited to that size."""
    pytest.importorskip("sam2")
    image = _scene(160, 96)
    edited = Sam2MaskGenerator(sam2_128, "none", **LOOSE)
    override = Sam2MaskGenerator(SAM2_TINY, "none", image_size=128, **LOOSE)
    assert override.image_size == edited.image_size == 128
    a, b = edited.generate(image), override.generate(image)
    assert len(a) == len(b) > 0
    np.testing.assert_array_equal(a.masks, b.masks)
    assert override.settings()["image_size"] == 128
    with pytest.raises(ValueError, match="multiple of 32"):
        Sam2MaskGenerator(SAM2_TINY, "none", image_size=100)
