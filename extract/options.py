"""The options of ``python -m extract`` (:class:`ExtractOptions`) and its parser, apart from the pipeline itself:
``python -m extract --help`` and a mistyped flag are answered without importing torch or a model library."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from extract.common.cli import Parser, option, parse_options
from extract.common.cli import build_parser as build_cli
from extract.common.config import at_least_one, fraction, nonnegative_int, positive_int
from extract.common.source_args import SourceOptions
from extract.data.boxes import DEFAULT_MAX_MISSING, MAX_MISSING_HELP

DEFAULT_WORKERS = max(1, min(8, (os.cpu_count() or 2) // 2))
COMPONENTS = ("patches", "tokens", "entities", "relations", "roles", "tree", "regions")


# --------------------------------------------------------------------------------------------- options
@dataclass
class ExtractOptions(SourceOptions):
    """What ``python -m extract`` does, as data: ``run(ExtractOptions(data="toy", out="cache"))`` builds the same
    cache as the command line with those flags. ``components`` may be a comma string or a list."""

    data: str | None = option(None, help="CSV/TSV, COCO JSON, toy-world folder, .tar shards / brace pattern")
    out: str | None = option(None, help="cache folder (a sub-folder per settings fingerprint)")
    base: str = option("tiny", help="backbone alias or open_clip model name")
    pretrained: str | None = option(None, help="tag, checkpoint path or 'none' (default: the alias's weights)")
    split: str | None = option(None, help="toy world: train, val or test (default: train)")
    image_root: str | None = option(None, help="CSV/COCO: folder relative image paths start from (default: the "
                                               "file's folder)")
    components: Any = option(",".join(COMPONENTS), group="components",
                             help=f"comma list from {', '.join(COMPONENTS)} (global embeddings are always cached)")
    boxes: str = option("auto", choices=["auto", "gt", "yolo", "random"], group="components",
                        help="entity boxes: ground truth (toy world or --annotations), YOLO (--detector; on a toy "
                             "world without one, the world's toy detector, trained on its train split once and reused "
                             "by fingerprint from runs/toy-detector), or random "
                             "(--max-entities boxes per image, seeded by --region-seed: a control); auto = gt when "
                             "annotations exist")
    annotations: str | None = option(None, group="components", help="ground-truth boxes (for --boxes gt / --regions "
                                     "gt): COCO instances, Visual Genome objects.json or a toy-world folder, matched "
                                     "by image id or file name (extract/data/boxes.py)")
    max_missing_boxes: float = option(DEFAULT_MAX_MISSING, type=fraction, metavar="SHARE", group="components",
                                      help=MAX_MISSING_HELP)
    detector: str | None = option(None, group="components",
                                  help="YOLO weights (.pt) or model .yaml (random init); default on a toy world: its "
                                       "toy detector (python -m extract.components.toy_detector)")
    conf: float = option(0.25, type=fraction, group="components", help="detector confidence threshold")
    regions: str = option("random", choices=["random", "gt", "sam2"], group="components",
                          help="region masks: random boxes on the patch grid (PowerCLIP-R), ground-truth boxes, or "
                               "SAM2")
    num_regions: int = option(10, type=positive_int, group="components", help="region masks per image (M)")
    region_seed: int = option(0, type=nonnegative_int, group="components",
                              help="seed of the random region boxes (and of --boxes random)")
    segmenter: str | None = option(None, group="components", help="SAM2 config (name shipped with sam2 or a YAML "
                                                                  "path), or 'toy': the toy world's exact object "
                                                                  "masks (extract/components/toy_segmenter.py)")
    segmenter_weights: str | None = option(None, group="components",
                                           help="SAM2 checkpoint, or 'none' for random init")
    segmenter_image_size: int | None = option(None, type=positive_int, group="components",
                                              help="override the SAM2 config's input size (px, multiple of 32; 128 "
                                                   "for quick offline checks)")
    sam_points: int = option(16, type=positive_int, group="components", help="SAM2 prompt grid: points per side")
    sam_iou_thresh: float = option(0.8, type=fraction, group="components", help="SAM2 predicted-IoU filter")
    sam_stability_thresh: float = option(0.9, type=fraction, group="components", help="SAM2 stability-score filter")
    crop_scale: float | None = option(None, type=at_least_one, group="components",
                                      help="entity crops are centred on a black square this many times their longer "
                                           "side before the backbone sees them, so an object fills 1/scale of the "
                                           "crop as objects do in the images the backbone was trained on (1: the "
                                           "tight crop, ComAlign's; default: the backbone's, 1 for open_clip models, "
                                           "3 for the toy-world bases, extract/models/backbones.json)")
    phrase_prompt: str | None = option(None, group="components",
                                       help="how an entity, subject or object phrase is written before the text tower "
                                            "embeds it, {} standing for the phrase: the parse gives 'brown cube', a "
                                            "tower trained on captions reads 'a brown cube' (default: the backbone's, "
                                            "'a {}' for toy-clip-3d-mixed, '{}' as parsed for the rest, "
                                            "extract/models/backbones.json)")
    max_entities: int = option(10, type=positive_int, group="components",
                               help="entity components per image and per caption (ComAlign: 10)")
    max_relations: int = option(10, type=positive_int, group="components",
                                help="relation components per image and per caption (ComAlign: 10)")
    max_leaves: int = option(24, type=positive_int, group="components",
                             help="phrase-tree leaves per caption (the first ones in caption order)")
    max_nodes: int = option(47, type=positive_int, group="components",
                            help="phrase-tree nodes per caption; 2 x max-leaves - 1 keeps every node of every tree")
    shard_size: int = option(2048, type=positive_int, group="run", help="images per shard (the unit of resumption)")
    batch_size: int = option(128, type=positive_int, group="run", help="images / captions per backbone batch")
    workers: int = option(DEFAULT_WORKERS, type=nonnegative_int, group="run",
                          help="image decoding processes (default: half the CPU cores, so decoding does not starve the "
                               "forward pass on CPU-only machines)")
    device: str | None = option(None, group="run", help="default: the accelerate process's device, else cuda/cpu")
    precision: str = option("fp32", choices=["fp32", "fp16", "bf16"], group="run", help="backbone precision")
    unusual: str = option("convert", choices=["convert", "skip"], group="run",
                          help="CMYK / 16-bit / transparent images: convert (reported) or skip")

    def __post_init__(self):
        if isinstance(self.components, str):
            self.components = [c.strip() for c in self.components.split(",")]
        self.components = sorted({str(c).strip() for c in self.components if str(c).strip()})
        if self.phrase_prompt is not None and self.phrase_prompt.count("{}") != 1:
            raise ValueError(f"--phrase-prompt {self.phrase_prompt!r}: write the phrase's place as {{}} once, "
                             "e.g. 'a {}' or 'a photo of a {}'")
        unknown = set(self.components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown component(s) {', '.join(sorted(unknown))}; choose from {', '.join(COMPONENTS)}")


def build_parser() -> Parser:
    return build_cli(ExtractOptions, "python -m extract",
                     "Cache frozen-backbone features and compositional components for a data source.")


def parse_args(argv: Sequence[str] | None = None) -> ExtractOptions:
    def required(ns):
        if not ns.data or not ns.out:
            raise ValueError("--data and --out are required, e.g. python -m extract --data runs/toy --out runs/cache")

    return parse_options(ExtractOptions, build_parser(), argv, required)
