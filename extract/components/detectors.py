"""Region proposals from pretrained models: YOLO boxes (ComAlign §III) and SAM2 masks (PowerCLIP-S §3.2).

- :class:`YoloDetector` wraps ultralytics ``YOLO``: ``detect`` returns, per image, boxes in the original
  image's pixels sorted by confidence. ComAlign uses YOLOv9; any ultralytics detection ``.pt`` works, and a
  model ``.yaml`` (e.g. ``yolov8n.yaml``) builds random weights for offline checks.
- :class:`Sam2MaskGenerator` wraps sam2's ``build_sam2`` + ``SAM2AutomaticMaskGenerator``: ``generate``
  returns binary masks at the original resolution sorted by predicted IoU.

Both validate their files when constructed (before any image is read) and never download: a missing
checkpoint raises :class:`~extract.models.weights.WeightsNotFoundError` naming the file and where to get it. The
heavy dependencies are imported only here, inside the classes (``pip install plugvlm[detect]`` /
``plugvlm[segment]``).

Network: on import, ultralytics resolves DNS names to decide whether it is online and, when it is, sends
usage analytics after each prediction and pip-installs packages a checkpoint needs. We only predict from a
local file, so unless the user set ``YOLO_OFFLINE`` themselves we set it to 1 before the first import of
ultralytics (``YOLO_OFFLINE=0`` opts back in), and we drop the analytics callback from our predictor in case
ultralytics was imported online earlier in the process.

Installs: ultralytics pip-installs packages it misses ("attempting AutoUpdate"), e.g. ``pi-heif`` from the
``PIL.Image.open`` it patches on import, which would then run on every image our own decoder fails to identify
(and put ultralytics' message in our skip report). Loading a detector turns that off for good
(:func:`_no_autoinstall`: ``YOLO_AUTOINSTALL=False`` before the import, the flag itself after it, whatever the
environment said: changing installed packages mid-run is never wanted) and gives ``PIL.Image.open`` back.

Random weights (``.yaml`` detectors, SAM2 with ``weights="none"``) are drawn from a fixed seed
(:data:`RANDOM_INIT_SEED`) without touching the global RNG, so every rank and every resumed run builds the
same model and the cache fingerprint from ``settings()`` means something.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from extract.models.weights import WeightsNotFoundError, file_sha256

RANDOM_INIT_SEED = 0
_YOLO_WEIGHT_SUFFIXES = (".pt",)
_YOLO_CONFIG_SUFFIXES = (".yaml", ".yml")
# ultralytics tasks whose results carry axis-aligned boxes (OBB gives rotated boxes, classify none).
_BOX_TASKS = ("detect", "segment", "pose")
SAM2_CHECKPOINTS_URL = "https://github.com/facebookresearch/sam2#download-checkpoints"


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message says which extra to install."""


@contextmanager
def _seeded_init():
    """Seed torch's CPU RNG with RANDOM_INIT_SEED for a model build; the caller's RNG state is restored after.
    Models are built on the CPU (then moved), so the CPU generator is the only one their init draws from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_INIT_SEED)
        yield


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ============================================================================================ YOLO
@dataclass
class Detections:
    """Detections for one image, sorted by score (descending), at most ``max_det``.

    boxes: float32 [n, 4], (x1, y1, x2, y2) in the original image's pixels, 0 <= x <= width, 0 <= y <= height.
    scores: float32 [n], detector confidence in [0, 1].
    classes: int64 [n], class indices of the detector.
    names: n class names, ``names[k]`` is the name of ``classes[k]``.
    An image without detections has n = 0 (boxes of shape [0, 4]).
    """

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray
    names: list[str]

    def __len__(self) -> int:
        return len(self.scores)


def import_yolo():
    if "ultralytics" not in sys.modules:
        # Must precede the first import: ultralytics probes DNS at import time (see the module docstring).
        os.environ.setdefault("YOLO_OFFLINE", "1")
    # ultralytics.utils reads this once, at its import; _no_autoinstall covers an earlier import
    os.environ["YOLO_AUTOINSTALL"] = "False"
    try:
        from ultralytics import YOLO
    except ImportError as e:
        raise MissingDependencyError(
            "YOLO detection needs ultralytics, which is not installed: pip install 'plugvlm[detect]'") from e
    _no_autoinstall()
    return YOLO


def _no_autoinstall() -> None:
    """Stop ultralytics from pip-installing anything in this process, and undo its ``PIL.Image.open`` patch.

    ``AUTOINSTALL`` is copied into each ultralytics module that imports it by name (``checks`` among them), so
    every loaded copy is set, besides the source in ``ultralytics.utils`` that later imports copy. The patched
    ``Image.open`` calls ``check_requirements("pi-heif")`` on any file PIL cannot identify, and then fails
    with ModuleNotFoundError instead of PIL's own error; we give images to ultralytics already decoded, so
    its HEIF support is not needed and the original is restored.
    """
    for name, module in list(sys.modules.items()):
        if (name == "ultralytics" or name.startswith("ultralytics.")) and hasattr(module, "AUTOINSTALL"):
            module.AUTOINSTALL = False
    patches = sys.modules.get("ultralytics.utils.patches")
    original = getattr(patches, "_image_open", None)
    from PIL import Image

    if original is not None and Image.open is getattr(patches, "image_open", None):
        Image.open = original


def _drop_analytics(predictor) -> None:
    """ultralytics registers its usage-analytics sender on every new predictor; remove it before it fires.

    Runs as an ``on_predict_start`` callback, i.e. after the predictor is built and before the run ends; that
    event's own list is left alone because it is being iterated (the sender does not use it).
    """
    for event in list(predictor.callbacks):
        if event != "on_predict_start":
            predictor.callbacks[event] = [f for f in predictor.callbacks[event]
                                          if not getattr(f, "__module__", "").startswith("ultralytics.utils.events")]


def _resolve_yolo_weights(weights: str) -> tuple[str, Path | None]:
    """Return (what to give YOLO, the local file or None for a config ultralytics ships); raise if absent.

    Runs before ultralytics is imported: YOLO("name.pt") would otherwise download a missing file.
    """
    spec = str(weights).strip()
    if "://" in spec:
        raise ValueError(f"YOLO weights must be a local file, not a URL ({spec}): download it and pass its path, "
                         "so that extraction never depends on the network.")
    path = Path(os.path.expanduser(spec))
    suffix = path.suffix.lower()
    if suffix in _YOLO_CONFIG_SUFFIXES:  # a local file, else a name ultralytics ships (YOLO() looks it up)
        return (str(path.resolve()), path.resolve()) if path.is_file() else (spec, None)
    if suffix not in _YOLO_WEIGHT_SUFFIXES:
        raise ValueError(f"YOLO weights '{spec}': expected a PyTorch checkpoint (.pt) or a model config (.yaml) "
                         "for random weights; exported formats (ONNX, TensorRT, ...) are not supported here.")
    if not path.is_file():
        raise WeightsNotFoundError(
            f"YOLO weights file '{spec}' does not exist (looked at {path.resolve()}). Nothing is downloaded here.\n"
            f"To get it, on a machine with internet run `python -c \"from ultralytics import YOLO; "
            f"YOLO('{path.name}')\"` (ultralytics saves its released weights, e.g. yolov9c.pt, into the current "
            "folder; they are also on https://github.com/ultralytics/assets/releases), or use your own trained "
            f".pt; then pass --detector /path/to/{path.name}.\n"
            "For an offline check with random weights, pass a model config instead, e.g. --detector yolov8n.yaml.")
    return str(path.resolve()), path.resolve()


def _trained_imgsz(model) -> int:
    """The training image size a loaded ultralytics checkpoint records (``overrides["imgsz"]``, kept from its
    train args), else 640 (ultralytics' default; a ``.yaml`` records none)."""
    size = model.overrides.get("imgsz")
    if isinstance(size, (list, tuple)) and size:
        size = max(size)
    return int(size) if isinstance(size, int) and size >= 32 else 640


class YoloDetector:
    """Boxes from an ultralytics YOLO model (ComAlign's entity detector).

    weights: a local ``.pt`` (YOLOv9 in the ComAlign paper; any ultralytics detection weights) or a model
        ``.yaml`` (a local file or one ultralytics ships, e.g. ``yolov8n.yaml``) for random weights drawn from
        RANDOM_INIT_SEED. A ``.pt`` that does not exist raises WeightsNotFoundError here, before ultralytics
        is imported (it would try to download it).
    conf, iou: confidence threshold and NMS IoU threshold; max_det: detections kept per image; imgsz: the
        letterboxed inference size in pixels (default: the size the checkpoint was trained at, as ultralytics' own
        ``predict`` does, so a detector trained on 64-px images is not run on 10x upscaled ones; 640 for a
        ``.yaml`` and for checkpoints that do not record it); device: "cpu", "cuda", "cuda:1", "mps", ...;
        batch_size: images per forward pass (bounds GPU memory when ``detect`` gets a large list).
    """

    def __init__(self, weights: str, conf: float = 0.25, iou: float = 0.7, max_det: int = 10,
                 imgsz: int | None = None, device: str = "cpu", batch_size: int = 32):
        if not 0.0 <= conf <= 1.0 or not 0.0 <= iou <= 1.0:
            raise ValueError(f"conf and iou must lie in [0, 1], got conf={conf}, iou={iou}")
        if max_det < 1 or (imgsz is not None and imgsz < 32) or batch_size < 1:
            raise ValueError(f"need max_det >= 1, imgsz >= 32, batch_size >= 1; got {max_det}, {imgsz}, {batch_size}")
        self.source, self.path = _resolve_yolo_weights(weights)
        self.conf, self.iou, self.max_det = float(conf), float(iou), int(max_det)
        self.device, self.batch_size = str(device), int(batch_size)
        YOLO = import_yolo()
        self.random_init = Path(self.source).suffix.lower() in _YOLO_CONFIG_SUFFIXES
        try:
            with _seeded_init() if self.random_init else nullcontext():
                self._model = YOLO(self.source)
        except FileNotFoundError as e:  # a .yaml that neither exists here nor ships with ultralytics
            raise FileNotFoundError(
                f"YOLO model config '{self.source}' is neither a local file nor a config shipped with ultralytics "
                f"({e}). Shipped examples: yolov8n.yaml, yolov9c.yaml, yolo11n.yaml.") from e
        if self._model.task not in _BOX_TASKS:
            raise ValueError(f"YOLO weights '{self.source}' are a '{self._model.task}' model; box detection needs "
                             f"one of {', '.join(_BOX_TASKS)}")
        self.imgsz = int(imgsz) if imgsz is not None else _trained_imgsz(self._model)
        self._model.add_callback("on_predict_start", _drop_analytics)
        self.names: dict[int, str] = dict(self._model.names)
        self._settings: dict | None = None

    def detect(self, images: Sequence) -> list[Detections]:
        """Detect objects in PIL images (any size, any mode; converted to RGB). Returns one
        :class:`Detections` per image, in order; boxes are in that image's own pixel coordinates."""
        out: list[Detections] = []
        # ultralytics' select_device (run when the first predict builds the predictor) sets torch's thread count
        # for the whole process to min(8, cores - 1); the backbone that runs next keeps the caller's.
        threads = torch.get_num_threads()
        try:
            for start in range(0, len(images), self.batch_size):
                results = self._model.predict(list(images[start:start + self.batch_size]), conf=self.conf,
                                              iou=self.iou, max_det=self.max_det, imgsz=self.imgsz,
                                              device=self.device, verbose=False, save=False)
                out += [self._to_detections(r) for r in results]
        finally:
            torch.set_num_threads(threads)
        return out

    def _to_detections(self, result) -> Detections:
        b = result.boxes
        scores = b.conf.detach().cpu().numpy().astype(np.float32).reshape(-1)
        order = np.argsort(-scores, kind="stable")[: self.max_det]  # NMS output is sorted; the contract says so
        boxes = b.xyxy.detach().cpu().numpy().astype(np.float32).reshape(-1, 4)[order]
        classes = b.cls.detach().cpu().numpy().astype(np.int64).reshape(-1)[order]
        return Detections(boxes, scores[order], classes, [self.names[int(c)] for c in classes])

    def settings(self) -> dict:
        """What determines the detections, for cache fingerprints: the weights (file sha256, or the model
        config's content and the init seed for random weights), thresholds, input size, ultralytics version."""
        if self._settings is None:
            import ultralytics

            if self.random_init:
                cfg = {k: v for k, v in self._model.model.yaml.items() if k != "yaml_file"}  # not the path
                digest = _sha256_text(json.dumps(cfg, sort_keys=True, default=str))
                weights = {"config": self.source, "config_sha256": digest, "init_seed": RANDOM_INIT_SEED}
            else:
                weights = {"file": str(self.path), "sha256": file_sha256(self.path)}
            self._settings = {"kind": "yolo", "weights": weights, "task": self._model.task,
                              "classes": len(self.names), "conf": self.conf, "iou": self.iou,
                              "max_det": self.max_det, "imgsz": self.imgsz, "ultralytics": ultralytics.__version__}
        return self._settings


def load_detector(spec: str, **kwargs) -> YoloDetector:
    """Build the ``--detector`` (YOLO ``.pt`` or model ``.yaml``); raises before any image work if the file is
    missing (WeightsNotFoundError), the format is unsupported (ValueError) or ultralytics is not installed
    (MissingDependencyError). ``kwargs`` go to :class:`YoloDetector`."""
    return YoloDetector(spec, **kwargs)


# ============================================================================================ SAM2
@dataclass
class Masks:
    """Automatic masks for one image, sorted by predicted IoU (descending), at most ``max_masks``.

    masks: bool [n, H, W] at the original image's resolution (H, W = its height and width).
    scores: float32 [n], SAM2's predicted IoU of each mask.
    areas: int64 [n], pixels in each mask.
    """

    masks: np.ndarray
    scores: np.ndarray
    areas: np.ndarray

    def __len__(self) -> int:
        return len(self.scores)


def _import_sam2():
    try:
        from sam2.automatic_mask_generator import SAM2AutomaticMaskGenerator
        from sam2.build_sam import build_sam2
    except ImportError as e:
        raise MissingDependencyError(
            "SAM2 masks need the sam2 package, which is not installed: pip install 'plugvlm[segment]'") from e
    return build_sam2, SAM2AutomaticMaskGenerator


def _shipped_sam2_configs() -> tuple[Path, list[str]]:
    import sam2

    root = Path(sam2.__file__).resolve().parent
    names = (p.relative_to(root).as_posix() for p in (root / "configs").rglob("*.yaml"))
    return root, sorted(n for n in names if "_training/" not in n)  # training recipes, not model configs


def _resolve_sam2_config(config: str) -> tuple[str, str, Path]:
    """Return (how settings name it, the hydra config name for build_sam2, the YAML file); raise if absent.

    A local YAML is registered in hydra's ConfigStore under a name derived from its content: sam2 composes
    configs through a global hydra instance whose search path is the sam2 package, and a primary config
    cannot be added to that path (hydra.searchpath only serves secondary configs).
    """
    local = Path(os.path.expanduser(str(config)))
    if local.is_file():
        from hydra.core.config_store import ConfigStore
        from omegaconf import OmegaConf

        text = local.read_text()
        try:
            cfg = OmegaConf.create(text)
        except Exception as e:  # omegaconf / yaml raise several types for malformed files
            raise ValueError(f"SAM2 config {local.resolve()} is not valid YAML: {e}") from e
        if "model" not in cfg:
            raise ValueError(f"SAM2 config {local.resolve()} has no 'model' section; start from a config shipped "
                             "with sam2, e.g. configs/sam2.1/sam2.1_hiera_t.yaml")
        name = f"plugvlm_local_{_sha256_text(text)[:16]}"
        ConfigStore.instance().store(name=name, node=cfg)
        return str(local.resolve()), name, local.resolve()
    root, shipped = _shipped_sam2_configs()
    if str(config) in shipped:
        return str(config), str(config), root / str(config)
    raise FileNotFoundError(f"SAM2 config '{config}' is neither a local YAML file nor a config shipped with sam2. "
                            f"Shipped: {', '.join(shipped)}")


def _sam2_checkpoint_hint(config_name: str) -> str:
    from sam2.build_sam import HF_MODEL_ID_TO_FILENAMES

    for hf_id, (cfg, ckpt) in HF_MODEL_ID_TO_FILENAMES.items():
        if cfg == config_name:
            release = "092824" if ckpt.startswith("sam2.1") else "072824"  # SAM 2.1 and SAM 2 release folders
            return (f"The release checkpoint for {cfg} is {ckpt}: https://dl.fbaipublicfiles.com/segment_anything_2/"
                    f"{release}/{ckpt} (also on Hugging Face as {hf_id}; all of them: {SAM2_CHECKPOINTS_URL}).")
    return f"The SAM 2 release checkpoints and their matching configs are listed at {SAM2_CHECKPOINTS_URL}."


def _resolve_sam2_weights(weights: str | None, config_name: str) -> Path | None:
    """The checkpoint file, or None for random weights (only for the explicit string "none")."""
    if weights is not None and str(weights).strip().lower() == "none":
        return None
    if weights is None or not str(weights).strip():
        raise WeightsNotFoundError(
            f"No SAM2 checkpoint given for {config_name}: pass --segmenter-weights /path/to/checkpoint.pt (or "
            "'none' for random weights, for offline checks only). " + _sam2_checkpoint_hint(config_name))
    path = Path(os.path.expanduser(str(weights)))
    if not path.is_file():
        raise WeightsNotFoundError(
            f"SAM2 checkpoint '{weights}' does not exist (looked at {path.resolve()}). Nothing is downloaded here; "
            "download it on a machine with internet and pass its path. " + _sam2_checkpoint_hint(config_name))
    return path.resolve()


class Sam2MaskGenerator:
    """Automatic (prompt-free) masks from SAM2: a grid of point prompts, filtered and de-duplicated.

    config: a config shipped with sam2 (e.g. "configs/sam2.1/sam2.1_hiera_t.yaml") or a local YAML path.
    weights: a checkpoint matching the config (the SAM 2 / 2.1 release files, e.g. sam2.1_hiera_tiny.pt), or
        the explicit string "none" for random weights drawn from RANDOM_INIT_SEED. A missing file (or None)
        raises WeightsNotFoundError here, naming the file and where to get it.
    points_per_side: the prompt grid is points_per_side x points_per_side; pred_iou_thresh /
        stability_score_thresh / box_nms_thresh: SAM2AutomaticMaskGenerator's filters (random weights may leave
        no mask at the defaults); min_mask_region_area: remove disconnected regions and holes smaller than this
        many pixels (needs OpenCV; without sam2's compiled extension, sam2 warns that it skips its own
        low-resolution hole filling, and OpenCV's clean-up still applies); max_masks: keep at most this many
        masks (None: all); device: torch device; image_size: overrides the config's ``model.image_size`` (px,
        a multiple of 32; e.g. 128 for fast offline checks; the checkpoint's weights do not depend on it).
    """

    def __init__(self, config: str, weights: str | None, points_per_side: int = 16, pred_iou_thresh: float = 0.8,
                 stability_score_thresh: float = 0.9, min_mask_region_area: int = 0, max_masks: int | None = None,
                 device: str = "cpu", box_nms_thresh: float = 0.7, image_size: int | None = None):
        if image_size is not None and (image_size < 32 or image_size % 32):
            raise ValueError(f"SAM2 image_size must be a multiple of 32 (>= 32), got {image_size}")
        if points_per_side < 1 or min_mask_region_area < 0 or (max_masks is not None and max_masks < 0):
            raise ValueError(f"need points_per_side >= 1, min_mask_region_area >= 0, max_masks >= 0 or None; got "
                             f"{points_per_side}, {min_mask_region_area}, {max_masks}")
        build_sam2, SAM2AutomaticMaskGenerator = _import_sam2()
        self.config, hydra_name, self.config_file = _resolve_sam2_config(config)
        self.path = _resolve_sam2_weights(weights, self.config)
        if min_mask_region_area > 0:
            try:  # sam2 imports OpenCV only once it post-processes the first image; fail here instead
                import cv2  # noqa: F401
            except ImportError as e:
                raise MissingDependencyError("min_mask_region_area > 0 needs OpenCV: pip install "
                                             "opencv-python-headless (or pass min_mask_region_area=0)") from e
        self.points_per_side, self.pred_iou_thresh = int(points_per_side), float(pred_iou_thresh)
        self.stability_score_thresh, self.box_nms_thresh = float(stability_score_thresh), float(box_nms_thresh)
        self.min_mask_region_area, self.max_masks, self.device = int(min_mask_region_area), max_masks, str(device)

        with _seeded_init():  # the random weights of "none"; overwritten when a checkpoint is loaded
            overrides = [] if image_size is None else [f"++model.image_size={int(image_size)}"]
            model = build_sam2(hydra_name, None, device="cpu", hydra_overrides_extra=overrides)  # checkpoint loaded below, with a clearer error
        if self.path is not None:
            self._load_checkpoint(model)
        model = model.to(self.device).eval()
        self._generator = SAM2AutomaticMaskGenerator(
            model, points_per_side=self.points_per_side, pred_iou_thresh=self.pred_iou_thresh,
            stability_score_thresh=self.stability_score_thresh, box_nms_thresh=self.box_nms_thresh,
            min_mask_region_area=self.min_mask_region_area, output_mode="binary_mask")
        # SAM2ImagePredictor hard-codes the backbone feature sizes of 1024-px inputs; configs at another
        # model.image_size need the sizes of their own strides 4, 8, 16 (the hiera levels SAM2 keeps).
        s = int(model.image_size)
        self._generator.predictor._bb_feat_sizes = [(s // 4, s // 4), (s // 8, s // 8), (s // 16, s // 16)]
        self.image_size = s
        self._settings: dict | None = None

    def _load_checkpoint(self, model: torch.nn.Module) -> None:
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated download, not a torch file, pickled code: all unusable here
            raise ValueError(f"SAM2 checkpoint {self.path} could not be read ({type(e).__name__}: {e})") from e
        state = state.get("model", state) if isinstance(state, dict) else state  # release files: {"model": ...}
        try:
            model.load_state_dict(state)  # strict: a checkpoint for another config names the mismatched keys
        except RuntimeError as e:
            raise ValueError(f"SAM2 checkpoint {self.path} does not fit config {self.config}: {e}\n"
                             + _sam2_checkpoint_hint(self.config)) from e

    def generate(self, image) -> Masks:
        """Masks for one PIL image (any mode; converted to RGB), at its own resolution; see :class:`Masks`."""
        rgb = np.array(image.convert("RGB"))  # a writable copy: torchvision warns on read-only arrays
        found = sorted(self._generator.generate(rgb), key=lambda m: -m["predicted_iou"])
        if self.max_masks is not None:
            found = found[: self.max_masks]
        h, w = rgb.shape[:2]
        masks = np.stack([m["segmentation"] for m in found]).astype(bool) if found else np.zeros((0, h, w), bool)
        return Masks(masks, np.array([m["predicted_iou"] for m in found], np.float32),
                     np.array([m["area"] for m in found], np.int64))

    def settings(self) -> dict:
        """What determines the masks, for cache fingerprints: config (name and content hash), weights (file
        sha256, or the init seed for random weights), generator thresholds, sam2 version."""
        if self._settings is None:
            weights = ({"file": str(self.path), "sha256": file_sha256(self.path)} if self.path is not None
                       else {"init_seed": RANDOM_INIT_SEED})
            self._settings = {
                "kind": "sam2", "config": self.config, "config_sha256": file_sha256(self.config_file),
                "weights": weights, "image_size": self.image_size, "points_per_side": self.points_per_side,
                "pred_iou_thresh": self.pred_iou_thresh, "stability_score_thresh": self.stability_score_thresh,
                "box_nms_thresh": self.box_nms_thresh, "min_mask_region_area": self.min_mask_region_area,
                "max_masks": self.max_masks, "sam2": metadata.version("sam2")}
        return self._settings


def load_segmenter(config: str, weights: str | None, **kwargs) -> Sam2MaskGenerator:
    """Build the ``--segmenter`` (SAM2 config + ``--segmenter-weights``); raises before any image work if
    sam2 is missing (MissingDependencyError), the config does not resolve (FileNotFoundError / ValueError)
    or the checkpoint is missing (WeightsNotFoundError). ``kwargs`` go to :class:`Sam2MaskGenerator`."""
    return Sam2MaskGenerator(config, weights, **kwargs)
