"""``python -m extract.components.toy_detector``: train a small YOLO on the toy world, so that ComAlign runs on detected boxes
instead of the ground-truth ones no user has.

    python -m extract.components.toy_detector                                 # the embedded toy world (runs/toy)
    python -m extract.components.toy_detector --data runs/demo/toyworld       # a toy world of your own
    python -m train.adapter --method comalign --boxes yolo --detector runs/toy-detector/<fingerprint>/best.pt
    python -m train.adapter --method grounded --base toy-clip-hard --data W --boxes yolo   # no --detector: W's own

``--boxes yolo`` without ``--detector`` on a toy world (``python -m extract``, ``python -m train.adapter``) uses this
detector with its default settings, trained on that world's train split the first time and reused by fingerprint
after (:func:`world_detector`, called where an extraction resolves its detector; one log line says trained or
reused, where, and its val recall).

What it does, in order (``train_toy_detector(ToyDetectorOptions(...))`` from Python):

1. Exports the world's ``train`` and ``val`` splits in ultralytics' dataset layout under ``RUN/dataset``:
   ``images/{split}/`` (symbolic links to the world's PNGs; copies where links cannot be made),
   ``labels/{split}/*.txt`` (one ``class cx cy w h`` line per object, normalised to the image side) and
   ``data.yaml``. The ``test`` split is never exported: adapters are compared on it. One class, ``object``, by
   default (``--classes shape`` for the 6 shapes): ComAlign keeps only a detection's box and confidence, which
   the paper reads as objectness (sec. III-A, "Our object detector provides a confidence score for each detected
   object, reflecting its likelihood of objectness"), and crops the box for the frozen image encoder to describe;
   class labels are never used. One class gives that objectness directly, and it avoids per-class NMS keeping one
   object twice under two labels.
2. Trains ``yolov8n.yaml`` from scratch (no pretrained weights are reachable offline) with ultralytics at the
   world's own image size (64 px, rounded up to the stride 32), ``--epochs`` epochs, AdamW as ultralytics picks it
   for short runs, its default augmentation (mosaic off for the last ``--close-mosaic`` epochs), fp32 (ultralytics'
   AMP check downloads a model), validation on ``val`` every epoch choosing ``best.pt``. Quiet unless ``--verbose``:
   one line per epoch.
3. Reports the detector on ``val``: ultralytics' mAP50 and mAP50-95, and what ComAlign will get through the
   extraction's own path (:class:`extract.components.detectors.YoloDetector`, confidence ``--conf`` = ``python -m extract``'s
   default 0.25, at most ``--max-det`` = its ``--max-entities`` boxes): the share of objects found (a detection of
   IoU >= 0.5, matched greedily by confidence; per object size too), the share of detections that are objects,
   and detections per image. ``val`` also chose the best epoch, so these figures lean optimistic by that choice.

Everything lands in ``RUN = --out/<fingerprint>`` (default ``runs/toy-detector/<16 hex digits>``): ``best.pt``,
``detector.json`` (settings, figures, time), ``dataset/`` and ``yolo/`` (ultralytics' own run folder:
``results.csv``, ``args.yaml``, ``weights/``). The fingerprint covers the world's annotations (SHA-256), the
model config, every training setting and the ultralytics version, not the device or worker count; a second run
with the same ones reuses ``best.pt`` and prints the recorded figures.

Network and side effects: ultralytics is imported through :mod:`extract.components.detectors` (``YOLO_OFFLINE=1``, no
auto-install); ``YOLO_CONFIG_DIR`` defaults to ``--out/.ultralytics`` (not ``~/.config``); the dataset check's
font download (for plots, which are off) is skipped; ultralytics' global seeding, deterministic-algorithm switch
and thread count are undone after training, so an in-process caller keeps its own.

Safety: ``best.pt`` is a pickle written by ultralytics on this machine; loading it (here and in ``YoloDetector``)
goes through ultralytics' own loader, which unpickles, as for any YOLO weights a user supplies. Load only
detector weights you made or trust.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from extract.common.cli import Parser, VERBOSE, check_options, option, parse_options, run_job, say, verbosity
from extract.common.cli import build_parser as build_cli
from extract.worlds import toyworld
from extract.common.config import fraction, nonnegative_int, positive_int

PROG = "python -m extract.components.toy_detector"
#: bump when the export or the training recipe changes what a fingerprint produces
VERSION = 1
CLASS_MODES = ("object", "shape")
EXPORTED_SPLITS = ("train", "val")
DEFAULT_OUT = Path("runs") / "toy-detector"
STRIDE = 32  # YOLOv8's largest stride: ultralytics rounds the input size up to a multiple of it
# ultralytics' defaults are tuned for COCO runs of 100+ epochs: they accumulate gradients to a nominal batch of 64 and
# warm up for 3 epochs. A run of minutes has few updates to spare: one update per batch, one epoch of warm-up.
RECIPE = {"warmup_epochs": 1.0}  # and nbs = --batch


@dataclass
class ToyDetectorOptions:
    """What ``python -m extract.components.toy_detector`` does, as data: ``train_toy_detector(ToyDetectorOptions(epochs=5))``."""

    data: str | None = option(None, help="toy-world folder (default: the embedded toy world, runs/toy, generated on "
                                         "first use)")
    out: str = option(str(DEFAULT_OUT), help="runs folder: each settings fingerprint gets its own sub-folder")
    model: str = option("yolov8n.yaml", help="ultralytics model config, trained from scratch (a .yaml shipped with "
                                             "ultralytics or a local file)")
    classes: str = option("object", choices=list(CLASS_MODES),
                          help="object: one class (ComAlign uses boxes and objectness only); shape: the 6 shapes")
    epochs: int | None = option(None, type=positive_int, group="training",
                                help="passes over the train split (default: 12; 24 on a 3D world, whose objects "
                                     "hidden past a quarter need them: extract/README, the 3D world)")
    imgsz: int | None = option(None, type=positive_int, group="training",
                               help="training input size in px, a multiple of 32 (default: the world's image size "
                                    "rounded up to one)")
    batch: int = option(16, type=positive_int, group="training", help="images per step (one update each)")
    close_mosaic: int = option(3, type=nonnegative_int, group="training",
                               help="train the last N epochs without mosaic augmentation")
    seed: int = option(0, type=nonnegative_int, group="training", help="ultralytics' training seed")
    conf: float = option(0.25, type=fraction, group="report",
                         help="confidence threshold of the recall report, as python -m extract --conf")
    max_det: int = option(10, type=positive_int, group="report",
                          help="detections kept per image in the recall report, as python -m extract --max-entities")
    device: str | None = option(None, group="run", help="torch device (default: cuda when available, else cpu)")
    workers: int = option(2, type=nonnegative_int, group="run", help="data-loading processes (0: in this process)")
    threads: int = option(0, type=nonnegative_int, group="run",
                          help="torch CPU threads while training (0: ultralytics' choice, min(8, cores - 1), which "
                               "leaves a core to the data loader)")

    def __post_init__(self):
        if self.classes not in CLASS_MODES:
            raise ValueError(f"classes must be one of {', '.join(CLASS_MODES)}, got {self.classes!r}")
        if self.imgsz is not None and self.imgsz % STRIDE:
            raise ValueError(f"--imgsz must be a multiple of {STRIDE}, got {self.imgsz}")


def build_parser() -> Parser:
    return build_cli(ToyDetectorOptions, PROG, __doc__)


def parse_args(argv: Sequence[str] | None = None) -> ToyDetectorOptions:
    return parse_options(ToyDetectorOptions, build_parser(), argv)


# --------------------------------------------------------------------------------------------- the world
def resolve_world(data: str | None) -> Path:
    """The toy-world folder ``data`` names (checked), or the embedded default (generated on first use)."""
    if data is None:
        return toyworld.ensure(say=say)
    world = Path(data)
    if not toyworld.is_toyworld(world):
        raise FileNotFoundError(f"--data {world} is not a toy-world folder (no annotations.json / meta.json there): "
                                f"generate one with `python -m extract.worlds.toyworld --out {world}`, or leave --data out "
                                "for the embedded toy world")
    return world


def _scenes(world: Path) -> list[dict]:
    return json.loads((world / "annotations.json").read_text(encoding="utf-8"))["scenes"]


def class_names(classes: str) -> list[str]:
    """The detector's class names for ``--classes``."""
    from extract.worlds.toyworld import SHAPES

    return ["object"] if classes == "object" else list(SHAPES)


def label_lines(scene: dict, classes: str) -> list[str]:
    """One ultralytics label line per object of ``scene``: ``class cx cy w h``, normalised by the image's width
    and height; boxes are end-exclusive pixels (``[x0, y0, x1, y1]``), so a box's extent is ``x1 - x0`` px."""
    from extract.worlds.toyworld import SHAPES

    w, h = scene["width"], scene["height"]
    lines = []
    for obj in scene["objects"]:
        x0, y0, x1, y1 = obj["box"]
        k = 0 if classes == "object" else SHAPES.index(obj["shape"])
        lines.append(f"{k} {(x0 + x1) / 2 / w:.6f} {(y0 + y1) / 2 / h:.6f} {(x1 - x0) / w:.6f} {(y1 - y0) / h:.6f}")
    return lines


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    try:
        os.symlink(src.resolve(), dst)
    except OSError:  # no symbolic links here (some Windows setups, some mounts): a copy serves as well
        shutil.copy2(src, dst)


def export_dataset(world: str | os.PathLike, out: str | os.PathLike, classes: str = "object",
                   splits: Sequence[str] = EXPORTED_SPLITS) -> Path:
    """Write the ultralytics dataset of ``world``'s ``splits`` into ``out`` (layout: module docstring); returns
    the path of ``data.yaml``. Files from an earlier export there are replaced, ultralytics' label caches
    dropped. Raises ValueError when a split has no scene."""
    import yaml

    world, out = Path(world), Path(out)
    scenes = _scenes(world)
    for split in splits:
        chosen = [s for s in scenes if s.get("split") == split]
        if not chosen:
            raise ValueError(f"toy world {world} has no {split} scenes: the detector needs both {' and '.join(splits)}"
                             " (python -m extract.worlds.toyworld --splits)")
        images, labels = out / "images" / split, out / "labels" / split
        for d in (images, labels):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        (out / "labels" / f"{split}.cache").unlink(missing_ok=True)
        for scene in chosen:
            name = Path(scene["file_name"]).name
            _link_or_copy(world / scene["file_name"], images / name)
            text = "\n".join(label_lines(scene, classes))
            (labels / name).with_suffix(".txt").write_text(text + "\n" if text else "")
    data = {"path": str(out.resolve()), **{s: f"images/{s}" for s in splits},
            "names": dict(enumerate(class_names(classes)))}
    path = out / "data.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --------------------------------------------------------------------------------------------- settings
def training_size(world: Path, imgsz: int | None) -> int:
    """``imgsz``, or the world's image side rounded up to a multiple of the stride."""
    if imgsz is not None:
        return imgsz
    side = int(json.loads((world / "meta.json").read_text())["size"])
    return -(-side // STRIDE) * STRIDE


def training_epochs(world: Path, epochs: int | None) -> int:
    """``epochs``, or the world's default: 12 passes, 24 on a 3D world (``--world 3d``). Measured on a 2,000-scene 3D
    world: 24 passes lift the validation recall from 96.7 to 97.3% (objects hidden 50-75%: 21.7 -> 26.1) and the
    grounded head's replace-rel from 94.9 +/- 0.2 to 96.4 +/- 0.3 over 3 seeds (train/adapter/README, the 3D world); a
    drawn world's detector is done at 12."""
    if epochs is not None:
        return epochs
    return 24 if json.loads((world / "meta.json").read_text()).get("world") == "3d" else 12


def _model_description(model: str) -> dict:
    spec = str(model)
    if Path(spec).suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"--model {spec}: expected an ultralytics model config (.yaml), trained from scratch; "
                         "pretrained .pt weights cannot be fetched here")
    path = Path(os.path.expanduser(spec))
    if path.is_file():
        return {"config": str(path.resolve()), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {"config": spec}  # one ultralytics ships: its version (in the settings) pins it


def settings(opts: ToyDetectorOptions, world: Path) -> dict:
    """What determines the trained detector (module docstring), with the ultralytics version."""
    from importlib import metadata

    return {"version": VERSION, "world_sha256": hashlib.sha256((world / "annotations.json").read_bytes()).hexdigest(),
            "model": _model_description(opts.model), "classes": opts.classes, "epochs": opts.epochs,
            "imgsz": training_size(world, opts.imgsz), "batch": opts.batch, "close_mosaic": opts.close_mosaic,
            "seed": opts.seed, "recipe": {**RECIPE, "nbs": "batch"}, "ultralytics": metadata.version("ultralytics")}


def fingerprint(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------- evaluation
def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in ``a`` [N, 4] with every box in ``b`` [M, 4] (xyxy, continuous px) -> [N, M]."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=2)
    area = lambda x: np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), axis=1)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def match_detections(pred: np.ndarray, scores: np.ndarray, gt: np.ndarray, iou: float = 0.5) -> np.ndarray:
    """Greedy matching as detection benchmarks do it: detections in order of decreasing score each take the
    unmatched ground-truth box they overlap most, if that IoU is >= ``iou``. Returns, per ground-truth box, the
    index of its detection or -1."""
    match = np.full(len(gt), -1, dtype=np.int64)
    if len(pred) == 0 or len(gt) == 0:
        return match
    overlap = box_iou(pred, gt)
    for d in np.argsort(-np.asarray(scores), kind="stable"):
        free = np.where(match < 0, overlap[d], -1.0)
        g = int(np.argmax(free))
        if free[g] >= iou:
            match[g] = d
    return match


def detection_report(detector, world: Path, split: str = "val", batch: int = 64) -> dict:
    """What ``detector`` (anything with ``detect(images) -> list[Detections]``: a YoloDetector, RandomBoxes)
    finds on ``world``'s ``split``: ``recall`` (share of objects matched at IoU >= 0.5, and per object size
    under ``recall_by_size``; on a hard or 3D world by how much of the object other objects hide, ``recall_by_hidden``
    with ``objects_by_hidden``), ``precision`` (share of detections matched), ``mean_iou`` (of the matched pairs),
    ``detections_per_image``, ``objects``, ``images``."""
    from PIL import Image

    scenes = [s for s in _scenes(world) if s.get("split") == split]
    found = matched = dets = 0
    ious: list[float] = []
    by_size: dict[str, list[int]] = {}
    by_hidden: dict[str, list[int]] = {}
    for start in range(0, len(scenes), batch):
        chunk = scenes[start:start + batch]
        images = []
        for s in chunk:
            with Image.open(world / s["file_name"]) as im:
                images.append(im.convert("RGB"))
        for scene, det in zip(chunk, detector.detect(images)):
            gt = np.asarray([o["box"] for o in scene["objects"]], np.float64).reshape(-1, 4)
            m = match_detections(det.boxes, det.scores, gt)
            dets += len(det)
            matched += int((m >= 0).sum())
            ious += [float(box_iou(det.boxes[k:k + 1], g[None])[0, 0]) for k, g in zip(m, gt) if k >= 0]
            for obj, k in zip(scene["objects"], m):
                for table, key in ((by_size, obj.get("size", "all")), (by_hidden, hidden_bin(obj))):
                    if key is not None:
                        hit = table.setdefault(key, [0, 0])
                        hit[0] += int(k >= 0)
                        hit[1] += 1
            found += len(gt)
    return {"split": split, "images": len(scenes), "objects": found, "recall": matched / max(found, 1),
            "precision": matched / max(dets, 1), "detections_per_image": dets / max(len(scenes), 1),
            "mean_iou": float(np.mean(ious)) if ious else 0.0,
            "recall_by_size": {k: v[0] / v[1] for k, v in sorted(by_size.items())},
            **({"recall_by_hidden": {k: by_hidden[k][0] / by_hidden[k][1] for k in _bins(by_hidden)},
                "objects_by_hidden": {k: by_hidden[k][1] for k in _bins(by_hidden)}} if by_hidden else {})}


# upper bounds of the hidden share: the hard world hides at most half of an object, the 3D world three quarters
HIDDEN_BINS = ((0.001, "whole"), (0.25, "hidden < 25%"), (0.5, "hidden 25-50%"), (1.0, "hidden 50-75%"))


def _bins(table: dict) -> list[str]:
    return [name for _, name in HIDDEN_BINS if name in table]  # least hidden first


def hidden_bin(obj: dict) -> str | None:
    """The bin of an object's hidden share (a hard world's ``visible``); None where the world does not record it."""
    if "visible" not in obj:
        return None
    hidden = 1.0 - float(obj["visible"])
    return next(name for bound, name in HIDDEN_BINS if hidden < bound or bound == 1.0)


# --------------------------------------------------------------------------------------------- training
@contextlib.contextmanager
def _restored_process_state():
    """ultralytics seeds python / numpy / torch globally, switches torch to deterministic algorithms, sets torch's
    thread count and two environment variables; give the caller its own back afterwards."""
    import torch

    py, np_state = random.getstate(), np.random.get_state()
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn, fill = torch.backends.cudnn.deterministic, torch.utils.deterministic.fill_uninitialized_memory
    env = {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")}
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn
        torch.utils.deterministic.fill_uninitialized_memory = fill
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_ultralytics():
    """ultralytics logs (and draws its progress bars) at INFO: keep to warnings unless --verbose. The dataset
    check's font lookup (for plots, which are off) would try a download: skipped for the duration."""
    import ultralytics.data.utils as data_utils
    from ultralytics.utils import LOGGER

    level, check_font = LOGGER.level, data_utils.check_font
    if verbosity() < VERBOSE:
        LOGGER.setLevel("WARNING")
    data_utils.check_font = lambda *args, **kwargs: None
    try:
        yield
    finally:
        LOGGER.setLevel(level)
        data_utils.check_font = check_font


def _epoch_line(epochs: int, started: float):
    def report(trainer) -> None:
        m = trainer.metrics or {}
        if trainer.epoch >= epochs:  # the final validation of best.pt runs as epoch "epochs + 1"
            return
        loss = getattr(trainer, "tloss", None)  # mean loss items of the epoch (a dict in ultralytics 8.4)
        total = sum(float(v) for v in loss.values()) if isinstance(loss, dict) else (
            float(loss.sum()) if loss is not None else None)
        loss_text = f"loss {total:.3f}, " if total is not None else ""
        say(f"  epoch {trainer.epoch + 1}/{epochs}: {loss_text}val mAP50 {m.get('metrics/mAP50(B)', 0):.3f}, "
            f"mAP50-95 {m.get('metrics/mAP50-95(B)', 0):.3f} ({time.perf_counter() - started:.0f} s)")

    return report


def _device(device: str | None) -> str:
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _train(opts: ToyDetectorOptions, data_yaml: Path, run: Path, imgsz: int) -> dict:
    """ultralytics training into ``run/yolo``; returns the final validation's figures of best.pt."""
    import torch

    from extract.components.detectors import import_yolo

    YOLO = import_yolo()
    device = _device(opts.device)
    with _restored_process_state(), _quiet_ultralytics():
        model = YOLO(opts.model)
        started = time.perf_counter()
        model.add_callback("on_fit_epoch_end", _epoch_line(opts.epochs, started))
        if opts.threads:  # after the trainer's select_device, which sets its own count
            model.add_callback("on_pretrain_routine_end", lambda trainer: torch.set_num_threads(opts.threads))
        model.train(data=str(data_yaml), epochs=opts.epochs, imgsz=imgsz, batch=opts.batch, device=device,
                    workers=opts.workers, project=str(run.resolve()), name="yolo", exist_ok=True, pretrained=False,
                    amp=False, plots=False, seed=opts.seed, deterministic=True, close_mosaic=opts.close_mosaic,
                    patience=opts.epochs, verbose=False, nbs=opts.batch, **RECIPE)
        m = model.trainer.metrics or {}
        best = Path(model.trainer.best)
    if not best.is_file():
        raise RuntimeError(f"ultralytics finished without writing {best}")
    return {"best": best, "map50": float(m.get("metrics/mAP50(B)", 0.0)),
            "map50_95": float(m.get("metrics/mAP50-95(B)", 0.0)),
            "train_seconds": time.perf_counter() - started}


def train_toy_detector(opts: ToyDetectorOptions, announce: bool = True) -> dict:
    """Export, train (or reuse by fingerprint) and report (module docstring). Returns ``{"weights": RUN/best.pt,
    "run", "fingerprint", "reused", "settings", "val": {"map50", "map50_95", "recall", "precision",
    "detections_per_image", "recall_by_size", ...}, "seconds"}`` (also ``RUN/detector.json``). Raises
    FileNotFoundError for a missing world, ValueError for bad settings. ``announce``: say the line of a reuse (a
    caller that says its own, :func:`world_detector`, turns it off)."""
    check_options(opts, build_parser())
    started = time.perf_counter()
    world = resolve_world(opts.data)
    opts = dataclasses.replace(opts, epochs=training_epochs(world, opts.epochs))
    values = settings(opts, world)
    fp = fingerprint(values)
    run = Path(opts.out) / fp[:16]
    weights, record = run / "best.pt", run / "detector.json"
    if weights.is_file() and record.is_file():
        done = json.loads(record.read_text())
        if done.get("fingerprint") == fp:
            if announce:
                say(f"toy detector: {weights} (trained before with these settings; reused)")
            return {**done, "weights": str(weights), "run": str(run), "reused": True,
                    "seconds": time.perf_counter() - started}
    os.environ.setdefault("YOLO_CONFIG_DIR", str((Path(opts.out) / ".ultralytics").resolve()))
    run.mkdir(parents=True, exist_ok=True)
    data_yaml = export_dataset(world, run / "dataset", opts.classes)
    say(f"toy detector: training {opts.model} from scratch on {world} (train split, {values['imgsz']} px, "
        f"{opts.epochs} epochs, classes: {opts.classes}) -> {run}")
    trained = _train(opts, data_yaml, run, values["imgsz"])
    shutil.copyfile(trained["best"], weights)
    from extract.components.detectors import YoloDetector

    detector = YoloDetector(str(weights), conf=opts.conf, max_det=opts.max_det, device=_device(opts.device))
    val = {"map50": trained["map50"], "map50_95": trained["map50_95"], **detection_report(detector, world, "val"),
           "conf": opts.conf, "max_det": opts.max_det}
    result = {"fingerprint": fp, "settings": values, "world": str(world.resolve()), "val": val,
              "train_seconds": trained["train_seconds"], "weights": str(weights), "run": str(run), "reused": False}
    tmp = record.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, record)  # written last: its presence means best.pt is complete
    return {**result, "seconds": time.perf_counter() - started}


def world_detector(world: str | os.PathLike, device: str | None = None) -> str:
    """The detector of ``--boxes yolo`` without ``--detector`` on the toy world ``world`` (decided in
    :meth:`extract.pipeline.ExtractionComponents`, for ``python -m extract`` and ``python -m train.adapter`` alike):
    this module's detector with its default settings, trained on the world's train split into
    ``runs/toy-detector/<fingerprint>`` once and reused whenever the fingerprint matches. Says one line (trained or
    reused, where, its val recall); returns the path of its ``best.pt``. The extraction fingerprints that file's
    SHA-256, so a retrained detector never meets boxes cached from another."""
    result = train_toy_detector(ToyDetectorOptions(data=str(world), device=device), announce=False)
    say(f"boxes: no --detector, so the toy detector of {world} ({'reused' if result['reused'] else 'trained now'}, "
        f"val recall {100 * result['val']['recall']:.1f}%): {result['weights']}")
    return str(result["weights"])


def summary(result: dict) -> str:
    """The figures of a :func:`train_toy_detector` result, and how to use the weights."""
    v = result["val"]
    sizes = ", ".join(f"{k} {100 * r:.1f}" for k, r in v["recall_by_size"].items())
    return (f"toy detector {result['weights']}\n"
            f"  val ({v['images']} images, {v['objects']} objects): mAP50 {100 * v['map50']:.1f}, "
            f"mAP50-95 {100 * v['map50_95']:.1f}\n"
            f"  at conf {v['conf']:g}, <= {v['max_det']} per image: recall {100 * v['recall']:.1f}% of objects "
            f"({sizes}), precision {100 * v['precision']:.1f}%, "
            + (f"mean IoU of the matches {v['mean_iou']:.3f}, " if "mean_iou" in v else "")
            + f"{v['detections_per_image']:.2f} detections per image\n"
            + ("  recall by hidden share: " + ", ".join(
                f"{k} {100 * r:.1f} ({v['objects_by_hidden'][k]})" for k, r in v["recall_by_hidden"].items()) + "\n"
               if v.get("recall_by_hidden") else "")
            + f"  use it: python -m train.adapter --method comalign --boxes yolo --detector {result['weights']}")


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: ToyDetectorOptions) -> None:
        print(summary(train_toy_detector(opts)))

    return run_job(job, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
