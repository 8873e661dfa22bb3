"""``python -m extract``: run the frozen backbone once over a data source and cache everything adapters need.

Per image: the global embedding, patch tokens, region masks on the patch grid (random boxes, ground-truth
boxes or SAM2 masks: PowerCLIP §3.2), and entity / relation boxes (ground truth or YOLO) whose crops are
embedded by the backbone (ComAlign §III). Per caption: the global embedding, token embeddings with their
mask, spaCy entities and relation triplets embedded by the text tower, and the phrase tree as token /
leaf masks (PowerCLIP §3.3).

Work is split into shards of ``--shard-size`` images (one per input tar for webdataset sources). Each
shard is computed from its own records only, in fixed batches, so its content does not depend on which
rank computed it or on what ran before: a killed run resumes shard by shard, and N processes under
``accelerate launch`` (shard k goes to rank k mod N) write the same cache as one.

One run builds a given cache at a time (:meth:`extract.cache.CacheDir.build_lock`): a second run with the same
settings and ``--out`` waits for the first (saying which pid / host holds it, and since when), then reuses the
finished cache; it gives up after ``$PLUGVLM_CACHE_LOCK_TIMEOUT`` seconds (default 24 h). A shard whose files
no longer match the sizes its meta.json recorded counts as not done: rerunning the command rebuilds just it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from extract.components.overlap import FEATURES as OVERLAP_FEATURES
from extract.components.thumbnails import SIDE as THUMB_SIDE
from extract.models.backbone import FrozenBackbone, load_backbone
from extract.cache import CacheDir, FeatureCache, settings_diff
from extract.common.cli import check_options, progress, run_job
from extract.common.cli import say as status
from extract.common.config import save_config
from extract.data.sources import (DataSource, IndexedSource, SampleDataset, ToyWorldSource, WebDatasetSource,
                          collate_skipping, expand_shards, open_source)
from extract.data.report import Skip, SkipReport
from extract.options import ExtractOptions, build_parser, parse_args
from extract.common.source_args import open_options

# Bump when a code change alters what is cached for the same settings: the fingerprint then changes and old
# caches are rebuilt instead of silently reused.
PIPELINE_VERSION = 6  # 2: ventity_image_size; 3: ventity_overlap; 4: its symmetry features; 5: entity_count;
#                        6: ventity_pixels
#: distinct entity / relation / role phrases whose embeddings a shard builder keeps (a phrase is embedded on its own,
#: so it has one embedding whatever caption it came from)
PHRASE_MEMO = 100_000

# --------------------------------------------------------------------------------------------- setup
@dataclass
class _Ranks:
    index: int
    count: int
    device: torch.device
    state: object | None

    def barrier(self) -> None:
        if self.state is not None and self.count > 1:
            self.state.wait_for_everyone()


def _ranks(device: str | None) -> _Ranks:
    """This process's rank, world size and device: from accelerate when launched by it, else one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState  # launched by accelerate/torchrun: use its process group

        # without cpu=True accelerate falls back to one process when no accelerator is visible (gloo on CPU)
        cpu = (device is not None and torch.device(device).type == "cpu") or not torch.cuda.is_available()
        state = PartialState(cpu=cpu)
        return _Ranks(state.process_index, state.num_processes, torch.device(device) if device else state.device, state)
    return _Ranks(0, 1, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")), None)


def data_fingerprint(source: DataSource) -> dict:
    """What identifies the input: every record (ids, paths, caption texts) and each file's size and mtime.

    Content hashes of every image would cost a full read of the dataset; size + mtime is what make and
    rsync trust, and a changed caption or a re-encoded image changes it.

    Paths enter resolved (absolute, symbolic links followed), and so does ``name``: ``--data toy``, ``--data
    ../here/toy`` and the absolute path (``--image-root`` likewise) describe the same files and reuse one cache,
    while the same spelling from another directory names other files and does not.
    """
    h = hashlib.sha256()
    resolve = _path_resolver()
    if isinstance(source, IndexedSource):
        for r in source.records():
            path = resolve(r.source)
            h.update(json.dumps([r.image_id, path, _stat(path), [[c.id, c.text] for c in r.captions]]).encode())
        kind, n = type(source).__name__, len(source)
    else:
        shards = source.shards
        for s in shards:
            path = resolve(s)
            h.update(json.dumps([path, _stat(path)]).encode())
        kind, n = type(source).__name__, len(shards)
    return {"source": kind, "name": _source_name(source), "items": n, "sha256": h.hexdigest(),
            "unusual": source.unusual, "max_pixels": source.max_pixels}


def _path_resolver():
    """``resolve(path)`` -> the absolute path with every folder's symbolic links followed (os.path.realpath of
    the folder, once per folder: a million images in a few folders cost a few realpath calls, not a million)."""
    import functools

    @functools.lru_cache(maxsize=None)
    def folder(d: str) -> str:
        return os.path.realpath(d or ".")

    def resolve(path: str) -> str:
        d, name = os.path.split(os.fspath(path))
        return os.path.join(folder(d), name)

    return resolve


def _source_name(source: DataSource) -> str:
    """``source.name`` without the spelling of ``--data`` (which is fingerprinted, through ``summary`` too)."""
    if isinstance(source, ToyWorldSource):  # "<folder name>:<split>"; `--data .` would leave the name empty
        return f"{Path(source.path).resolve().parent.name}:{source.split}"
    if isinstance(source, WebDatasetSource):  # the spec as typed: a file, folder or brace pattern
        return os.path.realpath(source.name)
    return source.name  # CSV / COCO: the file's name alone


def _stat(path: str) -> list:
    try:
        st = os.stat(path)
        return [st.st_size, st.st_mtime_ns]
    except OSError:
        return [None, None]


def needs_world_detector(args, source: DataSource | None) -> bool:
    """True when ``--boxes yolo`` came without ``--detector`` on a toy world: the extraction then detects with that
    world's toy detector (:func:`extract.components.toy_detector.world_detector`: trained once, reused by
    fingerprint). Elsewhere a missing ``--detector`` is an error that says what to pass."""
    return (args.boxes == "yolo" and not args.detector and isinstance(source, ToyWorldSource)
            and bool({"entities", "relations"} & set(args.components)))


class ExtractionComponents:
    """The component extractors this run needs, built (and validated) before any image is read."""

    def __init__(self, args, source: DataSource | None, device: torch.device, boxes=None):
        """``boxes``: ground-truth boxes given directly (an :class:`extract.data.boxes.BoxAnnotations`; the live
        extractor's), instead of ``--annotations`` or the toy world ``source``."""
        self.args = args
        want = set(args.components)
        self.text = None
        if want & {"entities", "relations", "roles", "tree"}:
            from extract.components.text import TextComponentExtractor

            self.text = TextComponentExtractor(max_entities=args.max_entities, max_relations=args.max_relations,
                                               max_leaves=args.max_leaves, max_nodes=args.max_nodes)
        self.annotations_file = None
        max_missing = getattr(args, "max_missing_boxes", None)
        if boxes is None and args.annotations:
            from extract.data.boxes import read_boxes

            folder = Path(args.annotations)  # a toy-world folder: its box file is what read_boxes reads
            self.annotations_file = folder / "annotations.json" if folder.is_dir() else folder
            boxes = read_boxes(args.annotations, max_missing=max_missing)
        elif boxes is None and isinstance(source, ToyWorldSource):
            # the world's own box file enters the fingerprint like --annotations: the records' hash reads images
            # and captions, not the boxes, and a cache built on other boxes must not be reused
            self.annotations_file = source.root / "annotations.json"
            boxes = source.boxes(max_missing=max_missing)
        #: the ground-truth boxes (extract.data.boxes.BoxAnnotations), None without any
        self.boxes = boxes
        has_gt = boxes is not None
        self.box_source = None
        if want & {"entities", "relations"}:
            self.box_source = ("gt" if has_gt else "yolo") if args.boxes == "auto" else args.boxes
            if self.box_source == "gt" and not has_gt:
                raise ValueError("--boxes gt needs box annotations (the toy world, or --annotations FILE: COCO "
                                 "instances or Visual Genome objects.json); "
                                 "pass --detector "
                                 "WEIGHTS for YOLO boxes, or drop entities,relations from --components")
        self.detector = None
        if self.box_source == "yolo":
            if needs_world_detector(args, source):  # a toy world detects with its own toy detector
                from extract.components.toy_detector import world_detector

                args.detector = world_detector(source.root, device=str(device))  # config.json records the file
            if not args.detector:
                raise ValueError("entity/relation components need boxes: pass --detector WEIGHTS.pt (YOLO boxes; only "
                                 "a toy world trains its own detector when none is given) or --annotations FILE "
                                 "(ground-truth boxes, with --boxes auto or gt), or drop entities,relations from "
                                 "--components")
            from extract.components.detectors import load_detector

            self.detector = load_detector(args.detector, conf=args.conf, max_det=args.max_entities,
                                          device=str(device))
        elif self.box_source == "random":  # the control for detector boxes (extract/components/random_boxes.py)
            from extract.components.random_boxes import RandomBoxes

            self.detector = RandomBoxes(count=args.max_entities, seed=args.region_seed)
        self.segmenter = None
        if "regions" in want and args.regions == "sam2":
            if not args.segmenter:
                raise ValueError("--regions sam2 needs --segmenter CONFIG (and --segmenter-weights PATH), or "
                                 "--segmenter toy on a toy world (its exact object masks)")
            from extract.components import toy_segmenter

            if args.segmenter == toy_segmenter.NAME:  # the toy world's oracle masks, in SAM2's place
                self.segmenter = toy_segmenter.ToySegmenter()
            else:
                from extract.components.detectors import load_segmenter

                self.segmenter = load_segmenter(args.segmenter, args.segmenter_weights, device=str(device),
                                                image_size=args.segmenter_image_size,
                                                points_per_side=args.sam_points, pred_iou_thresh=args.sam_iou_thresh,
                                                stability_score_thresh=args.sam_stability_thresh)
        if "regions" in want and args.regions == "gt" and not has_gt:
            raise ValueError("--regions gt needs box annotations (the toy world, or --annotations FILE: COCO instances "
                             "or Visual Genome objects.json)")

    @property
    def reads_boxes(self) -> bool:
        """True when the arrays need ground-truth boxes (entity boxes or region masks from :attr:`boxes`)."""
        a = self.args
        return self.box_source == "gt" or ("regions" in a.components and a.regions == "gt")

    def settings(self) -> dict:
        a = self.args
        out = {"components": a.components,
               "limits": {"entities": a.max_entities, "relations": a.max_relations, "leaves": a.max_leaves,
                          "nodes": a.max_nodes}}
        if self.text is not None:
            out["text"] = self.text.settings()
            if a.phrase_prompt != "{}":  # as parsed: no key, so caches from before the option keep their fingerprint
                out["text"]["phrase_prompt"] = a.phrase_prompt
        if self.annotations_file and self.reads_boxes:
            from extract.models.weights import file_sha256

            out["annotations"] = {"file": str(Path(self.annotations_file).resolve()),
                                  "sha256": file_sha256(Path(self.annotations_file))}
        if self.box_source:
            out["boxes"] = {"source": self.box_source,
                            "detector": self.detector.settings() if self.detector is not None else None,
                            "crop_scale": a.crop_scale}
        if "regions" in a.components:
            out["regions"] = {"source": a.regions, "m": a.num_regions,
                              "seed": a.region_seed if a.regions == "random" else None,
                              "segmenter": self.segmenter.settings() if self.segmenter is not None else None}
        return out


# --------------------------------------------------------------------------------------------- per shard
class _KeepRaw:
    """Picklable transform for DataLoader workers: backbone preprocessing, plus the decoded pixels when crops,
    detections or SAM2 masks need the original image."""

    def __init__(self, preprocess, keep_raw: bool):
        self.preprocess, self.keep_raw = preprocess, keep_raw

    def __call__(self, image):
        return self.preprocess(image), (np.asarray(image) if self.keep_raw else None)


def _image_seed(seed: int, image_id) -> np.random.Generator:
    # per-image stream: the same boxes whatever the shard size, batch or rank; an id is its str() (COCO's are ints)
    digest = int.from_bytes(hashlib.sha256(str(image_id).encode()).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, digest]))


class ShardBuilder:
    """Computes one shard's arrays from its samples (see the module docstring for what is cached)."""

    def __init__(self, backbone: FrozenBackbone, comps: ExtractionComponents, args, phrases: dict | None = None):
        """``phrases``: the phrase -> embedding table to fill and read, shared by builders of one frozen backbone
        (a phrase is embedded alone: its embedding is the same for every builder); default: this builder's own."""
        self.bb, self.c, self.args = backbone, comps, args
        self.want = set(args.components)
        self.keep_raw = bool(comps.box_source or (("regions" in self.want) and args.regions in ("gt", "sam2")))
        from extract.components.regions import preprocess_geometry

        self.geometry = preprocess_geometry(backbone)  # ((W, H) of the network input, resize mode)
        self._phrases: dict[str, np.ndarray] = {} if phrases is None else phrases  # phrase -> embedding
        # how a noun phrase is written before the text tower reads it: the run's (run() resolves it before the
        # settings are fingerprinted), else the backbone's own, as run() would have resolved it
        self.phrase_prompt = backbone.spec.phrase_prompt if args.phrase_prompt is None else args.phrase_prompt

    def image_batch(self, images: torch.Tensor, raws: list, image_ids: list[str], missing_boxes: str = "error",
                    tower: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The image arrays of a batch. ``missing_boxes``: what an image without an entry in the box file gets, an
        error (:class:`extract.data.boxes.MissingBoxes`) or, for a caller that counted and reported such images
        (a collection's check), ``"empty"``: no boxes. ``tower``: :meth:`image_tower` of these images, when the
        caller has it already."""
        tower = self.image_tower(images, patches="patches" in self.want) if tower is None else tower
        out = {"image_embed": tower["image_embed"]}
        if "patches" in self.want:
            out["patch_tokens"] = tower["patch_tokens"]
        if "regions" in self.want:
            sizes = [None if r is None else (r.shape[1], r.shape[0]) for r in raws]
            out.update(self.region_arrays(image_ids, sizes, raws, missing_boxes))
        if self.c.box_source:
            out.update(self._visual_components(raws, image_ids, missing_boxes))
        return out

    def image_tower(self, images: torch.Tensor, patches: bool = True) -> dict[str, np.ndarray]:
        """What the image tower alone gives a batch, as cached: ``image_embed`` and (``patches``) ``patch_tokens``."""
        feats = self.bb.encode_images(images)
        out = {"image_embed": feats.embedding.half().cpu().numpy()}
        if patches:
            out["patch_tokens"] = feats.patches.half().cpu().numpy()
        return out

    @property
    def region_needs_pixels(self) -> bool:
        """True when the region masks are computed from the decoded image (a segmenter's), not only from its id
        and size (random boxes, ground-truth boxes)."""
        return "regions" in self.want and self.args.regions == "sam2"

    def region_arrays(self, image_ids: Sequence[str], sizes: Sequence, raws: Sequence | None = None,
                      missing_boxes: str = "error") -> dict[str, np.ndarray]:
        """``region_masks`` [B, M, rows, cols] and ``region_valid`` [B, M] on the backbone's patch grid: seeded
        random boxes (per image id), ground-truth boxes of images of ``sizes`` ((width, height) each) or, with a
        segmenter, its masks of the decoded images ``raws`` (HxWx3). No backbone forward: ``--unfreeze`` computes
        them per batch from the data (train/adapter/live.py), the cache once. ``missing_boxes``: as in
        :meth:`image_batch`."""
        from extract.components.regions import boxes_to_grid_masks, gt_boxes, masks_to_grid, random_grid_boxes

        a, grid, (input_size, mode) = self.args, self.bb.grid, self.geometry
        m = a.num_regions
        masks = np.zeros((len(image_ids), m, *grid), dtype=bool)
        for i, image_id in enumerate(image_ids):
            if a.regions == "random":
                _, mk = random_grid_boxes(grid, m, _image_seed(a.region_seed, image_id))
            else:
                size = tuple(int(v) for v in sizes[i])
                if a.regions == "gt":
                    boxes, _ = gt_boxes(self.c.boxes.entry(image_id, missing_boxes))
                    mk = boxes_to_grid_masks(boxes, size, input_size, grid, resize_mode=mode)
                else:
                    from PIL import Image

                    found = self.c.segmenter.generate(Image.fromarray(raws[i]))
                    mk = masks_to_grid(found.masks, size, input_size, grid, resize_mode=mode)
                mk = mk[mk.any(axis=(1, 2))][:m]  # masks outside the centre crop are dropped
            masks[i, : len(mk)] = mk
        return {"region_masks": masks, "region_valid": masks.reshape(len(image_ids), m, -1).any(-1)}

    def _visual_components(self, raws, image_ids, missing_boxes: str = "error") -> dict[str, np.ndarray]:
        from PIL import Image

        from extract.components.overlap import ownership
        from extract.components.regions import crop_regions, gt_boxes, relation_boxes
        from extract.components.thumbnails import thumbnails

        a, d = self.args, self.bb.embed_dim
        n, E, R = len(image_ids), a.max_entities, a.max_relations
        out = {"ventity_boxes": np.zeros((n, E, 4), np.float32), "ventity_scores": np.zeros((n, E), np.float32),
               "ventity_embed": np.zeros((n, E, d), np.float16), "ventity_valid": np.zeros((n, E), bool),
               "vrelation_boxes": np.zeros((n, R, 4), np.float32), "vrelation_scores": np.zeros((n, R), np.float32),
               "vrelation_embed": np.zeros((n, R, d), np.float16), "vrelation_valid": np.zeros((n, R), bool),
               "vrelation_pairs": np.zeros((n, R, 2), np.int16),
               # who owns each pair's overlap, from the pixels (extract/components/overlap.py)
               "ventity_overlap": np.zeros((n, E, E, OVERLAP_FEATURES), np.float16),
               # each box's own pixels, small: what the crop's embedding may lose (extract/components/thumbnails.py)
               "ventity_pixels": np.zeros((n, E, THUMB_SIDE, THUMB_SIDE, 3), np.uint8),
               # (width, height) of the image the boxes are in: box geometry in image units needs it
               "ventity_image_size": np.asarray([(r.shape[1], r.shape[0]) for r in raws], np.float32).reshape(n, 2)}
        pils = [Image.fromarray(r) for r in raws]
        if self.c.box_source == "gt":
            found = [gt_boxes(self.c.boxes.entry(i, missing_boxes)) for i in image_ids]
            dets = [(np.asarray(b, np.float32), np.ones(len(b), np.float32)) for b, _ in found]
        else:
            dets = [(x.boxes, x.scores) for x in self.c.detector.detect(pils)]
        crops, where = [], []
        for i, (boxes, scores) in enumerate(dets):
            boxes, scores = boxes[:E], scores[:E]
            ub, us, pairs = relation_boxes(boxes, scores, top_n=R) if "relations" in self.want else \
                (np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros((0, 2), np.int64))
            for kind, bx, sc in (("ventity", boxes, scores), ("vrelation", ub, us)):
                k = len(bx)
                out[f"{kind}_boxes"][i, :k], out[f"{kind}_scores"][i, :k], out[f"{kind}_valid"][i, :k] = bx, sc, True
                if k:
                    crops.append(crop_regions(pils[i], bx, self.bb.preprocess,
                                              scale=self.args.crop_scale if kind == "ventity" else 1.0))
                    where += [(kind, i, j) for j in range(k)]
            out["vrelation_pairs"][i, : len(pairs)] = pairs
            out["ventity_overlap"][i] = ownership(raws[i], boxes, E)
            out["ventity_pixels"][i] = thumbnails(raws[i], boxes, E)
        if crops:
            emb = self._encode_image_tensor(torch.cat(crops)).astype(np.float16)
            for (kind, i, j), e in zip(where, emb):
                out[f"{kind}_embed"][i, j] = e
        return out

    def _encode_image_tensor(self, x: torch.Tensor) -> np.ndarray:
        bs = self.args.batch_size
        return np.concatenate([self.bb.encode_images(x[i:i + bs]).embedding.cpu().numpy()
                               for i in range(0, len(x), bs)])

    def caption_tower(self, texts: list[str], tok=None, tokens: bool = True) -> dict[str, np.ndarray]:
        """What the text tower alone gives a batch of captions, as cached: ``text_embed``, ``truncated`` and
        (``tokens``) the tokens up to the batch's longest caption, ``token_embed`` / ``token_mask``."""
        tok = self.bb.tokenize(texts) if tok is None else tok
        emb, embedded = self.bb.encode_token_ids(tok.ids, tok.attention_mask)
        out = {"text_embed": emb.half().cpu().numpy(), "truncated": tok.truncated.numpy()}
        if tokens:
            length = int(tok.attention_mask.sum(1).max()) if len(texts) else 0
            out["token_embed"] = embedded[:, :length].half().cpu().numpy()
            out["token_mask"] = tok.attention_mask[:, :length].numpy()
        return out

    def caption_batch(self, texts: list[str], tower: dict[str, np.ndarray] | None = None
                      ) -> tuple[dict[str, np.ndarray], dict]:
        """The caption arrays of a batch and its counts (``truncated``, ``phrases_cut``); ``tower``:
        :meth:`caption_tower` of these captions, when the caller has it already."""
        tok = self.bb.tokenize(texts)
        tower = self.caption_tower(texts, tok, tokens="tokens" in self.want) if tower is None else tower
        out = {"text_embed": tower["text_embed"], "truncated": tower["truncated"]}
        length = int(tok.attention_mask.sum(1).max()) if len(texts) else 0
        if "tokens" in self.want:
            out["token_embed"], out["token_mask"] = tower["token_embed"], tower["token_mask"]
        stats = {"truncated": int(tok.truncated.sum()), "phrases_cut": 0}
        if self.c.text is not None:
            from extract.components.text_pack import pack

            a = self.args
            comps = self.c.text.extract(texts, tok)
            packed = pack(comps, self.bb.context_length, a.max_entities, a.max_relations, a.max_leaves, a.max_nodes)
            stats["phrases_cut"] = int(packed["phrases_cut"].sum())
            # a noun phrase as a caption writes it ("a brown cube", --phrase-prompt), the predicate and the relation as
            # parsed: a phrase cut out of its caption is not a text the tower was trained on
            nouns = lambda rows: [[self.phrase_prompt.replace("{}", t) for t in row] for row in rows]  # noqa: E731
            for kind, component, cap, write in (("entity", "entities", a.max_entities, nouns),
                                                ("relation", "relations", a.max_relations, list)):
                if component in self.want:
                    out[f"{kind}_embed"], out[f"{kind}_valid"] = self._embed_phrases(write(packed[f"{kind}_text"]),
                                                                                     cap)
            if "entities" in self.want:  # "two red cubes": the number, apart from the phrase it counts
                out["entity_count"] = packed["entity_count"]
            if "roles" in self.want:  # each relation's subject, predicate and object embedded on its own
                for k, role in enumerate(("subject", "predicate", "object")):
                    rows = [[triple[k] for triple in row] for row in packed["role_text"]]
                    out[f"role_{role}_embed"], out["role_valid"] = self._embed_phrases(
                        rows if role == "predicate" else nouns(rows), a.max_relations)
            if "tree" in self.want:
                out.update(_tree(packed, length))
        return out, stats

    def tree_arrays(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """The phrase trees of ``texts`` as cached (``leaf_tokens`` [B, P, l], ``node_leaves`` [B, K, P],
        ``n_leaves``, ``n_nodes``; l: the batch's longest caption), without the text tower: ``--unfreeze``
        computes them per batch (train/adapter/live.py)."""
        from extract.components.text_pack import pack

        if "tree" not in self.want or self.c.text is None:
            raise ValueError("tree_arrays needs the 'tree' component")
        a, texts = self.args, list(texts)
        tok = self.bb.tokenize(texts)
        packed = pack(self.c.text.extract(texts, tok), self.bb.context_length, a.max_entities, a.max_relations,
                      a.max_leaves, a.max_nodes)
        return _tree(packed, int(tok.attention_mask.sum(1).max()) if texts else 0)

    def _embed_phrases(self, texts: list[list[str]], cap: int) -> tuple[np.ndarray, np.ndarray]:
        """Embed each distinct phrase once (captions repeat "red circle" constantly: once per builder, across its
        batches, up to PHRASE_MEMO phrases), then scatter. Each phrase alone (``FrozenBackbone.encode_each``): which
        phrases are new to this builder depends on the shards it built before, on its rank and on a rerun, so a
        phrase embedded among them would carry their batch's shape into its bits; alone, its value is its own."""
        table = self._phrases
        new = sorted({t for row in texts for t in row} - set(table))
        table.update(zip(new, self.bb.encode_each(new).numpy()))
        d = self.bb.embed_dim
        emb = np.zeros((len(texts), cap, d), np.float16)
        valid = np.zeros((len(texts), cap), bool)
        for r, row in enumerate(texts):
            for j, t in enumerate(row[:cap]):
                emb[r, j], valid[r, j] = table[t], True
        while len(table) > PHRASE_MEMO:  # oldest first (dicts keep insertion order)
            del table[next(iter(table))]
        return emb, valid


def _tree(packed: dict, length: int) -> dict[str, np.ndarray]:
    """The cached tree arrays of packed text components, leaf tokens trimmed to the batch's ``length``."""
    return {"leaf_tokens": packed["leaf_tokens"][:, :, :max(length, 1)], "node_leaves": packed["node_leaves"],
            "n_leaves": packed["n_leaves"], "n_nodes": packed["n_nodes"]}


def concat_rows(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate batch dicts along rows, zero-padding trailing dims that vary (token lengths)."""
    if not parts:
        return {}
    out = {}
    for key in parts[0]:
        arrays = [p[key] for p in parts]
        shape = np.max([a.shape for a in arrays], axis=0)
        full = np.zeros((sum(len(a) for a in arrays), *shape[1:]), dtype=arrays[0].dtype)
        row = 0
        for a in arrays:
            full[(slice(row, row + len(a)), *[slice(0, n) for n in a.shape[1:]])] = a
            row += len(a)
        out[key] = full
    return out


def _build_shard(builder: ShardBuilder, batches, shard_report: SkipReport, pbar, coverage=None,
                 missing_boxes: str = "error") -> tuple[dict, dict]:
    """Run one shard's batches (from a DataLoader or a streaming source) and assemble arrays + meta. ``coverage``:
    an :class:`extract.data.boxes.Coverage` counting the images without boxes as they come (a stream's; its counts
    go into the meta); ``missing_boxes``: as in :meth:`ShardBuilder.image_batch`."""
    img_parts, cap_parts = [], []
    image_ids, caption_ids, caption_image = [], [], []
    stats = {"truncated": 0, "phrases_cut": 0}
    pending, bs = [], builder.args.batch_size

    def encode(texts: list[str]) -> None:
        part, st = builder.caption_batch(texts)
        cap_parts.append(part)
        for k in stats:
            stats[k] += st[k]

    for good, skips in batches:
        shard_report.add_batch(good, skips)
        if good["images"] is None:
            pbar.update(len(skips))
            continue
        images = torch.stack([t for t, _ in good["images"]])
        raws = [r for _, r in good["images"]]
        if coverage is not None:
            coverage.add(good["image_ids"])
            missing_boxes = "empty"  # counted: judged over the whole stream (_finish)
        img_parts.append(builder.image_batch(images, raws, list(good["image_ids"]), missing_boxes))
        for image_id, caps in zip(good["image_ids"], good["captions"]):
            row = len(image_ids)
            image_ids.append(image_id)
            for cap in caps:
                pending.append(cap.text)
                caption_ids.append(cap.id)
                caption_image.append(row)
        # Captions wait for a full batch across image batches: ~5 captions per image would otherwise end
        # every image batch with a ragged text batch, which costs a whole forward on CPU.
        while len(pending) >= bs:
            encode(pending[:bs])
            del pending[:bs]
        pbar.update(len(good["image_ids"]) + len(skips))  # after the work, so rate and ETA are honest
    if pending:
        encode(pending)
    arrays = {**concat_rows(img_parts), **concat_rows(cap_parts)}
    arrays["caption_image"] = np.asarray(caption_image, dtype=np.int32)
    meta = {"images": len(image_ids), "captions": len(caption_ids), "image_ids": image_ids,
            "caption_ids": caption_ids, **stats,
            "skipped": [vars(s) for s in shard_report.skips], "converted": [vars(n) for n in shard_report.notes]}
    if coverage is not None:
        meta["missing_boxes"] = {"count": len(coverage.missing), "examples": coverage.missing[:3]}
    return arrays, meta


def _pair_batches(samples, transform, batch_size: int):
    """Batches shaped like ``collate_skipping``'s from a streaming source's Sample iterator."""
    from extract.data.sources import Item

    buf = []
    for s in samples:
        # the sample's own location (shard::key): the note the source recorded is then recorded once, not twice
        buf.append(Item(s.image_id, transform(s.image), s.captions, s.location, s.note))
        if len(buf) == batch_size:
            yield collate_skipping(buf)
            buf = []
    if buf:
        yield collate_skipping(buf)


# --------------------------------------------------------------------------------------------- driver
def run(args: ExtractOptions, backbone: FrozenBackbone | None = None) -> dict:
    """Build (or reuse) the cache described by ``args``; returns the manifest (plus ``seconds``, this process's
    timings, which are not written). ``backbone``: an already loaded one to use instead of ``args.base`` /
    ``args.pretrained`` (the fingerprint describes whichever is used). See the module docstring."""
    check_options(args, build_parser())
    ranks = _ranks(args.device)
    t0 = time.perf_counter()
    options = open_options(args)
    source = open_source(args.data, **options)
    # detector / segmenter / spaCy checked before the backbone loads: a missing file fails in seconds
    if ranks.count > 1 and needs_world_detector(args, source):  # rank 0 trains the toy detector, the others reuse it
        comps = ExtractionComponents(args, source, ranks.device) if ranks.index == 0 else None
        ranks.barrier()
        comps = comps or ExtractionComponents(args, source, ranks.device)
    else:
        comps = ExtractionComponents(args, source, ranks.device)
    if comps.reads_boxes and isinstance(source, IndexedSource):
        # every image's entry looked up before any is extracted: the count in the log, past --max-missing-boxes
        # (or with no image matched) an error now, not after hours (a stream is counted as it comes: _finish)
        comps.boxes.check([r.image_id for r in source.records()], source.name)
    if backbone is None:
        backbone = load_backbone(args.base, args.pretrained, device=ranks.device, precision=args.precision)
    if args.crop_scale is None:  # the backbone's own (how large objects are in the images it was trained on)
        args.crop_scale = backbone.spec.crop_scale
    if args.phrase_prompt is None:  # the backbone's own (how the captions it was trained on write a noun phrase)
        args.phrase_prompt = backbone.spec.phrase_prompt
    data = data_fingerprint(source)
    settings = {"pipeline": PIPELINE_VERSION, "backbone": backbone.describe(hash_weights=True), "data": data,
                "shard_size": args.shard_size if isinstance(source, IndexedSource) else "per-input-shard",
                **comps.settings()}
    settings["summary"] = f"{args.base} on {data['name']}: {','.join(args.components) or 'global only'}"
    cache = CacheDir(args.out, settings)
    say = status if ranks.index == 0 else (lambda *a, **k: None)  # status lines: rank 0, silenced by --quiet
    # A finished cache is reused without the lock (a read-only copy works). Not by several ranks: each would
    # decide alone, and a cache finished by another run between two ranks' checks would split them.
    if ranks.count == 1 and cache.is_complete() and not cache.problems():
        say(f"cache up to date: {cache.path} (fingerprint {cache.fingerprint[:16]}); nothing to compute")
        return json.loads((cache.path / "manifest.json").read_text())
    # One run builds a cache at a time: a second run into the same cache waits here, then reuses it. The lock
    # is the run's, not the process's: rank 0 takes it, the other ranks wait until it holds it for their run.
    with cache.build_lock(_run_id(ranks), leader=ranks.index == 0, say=say):
        return _extract(args, ranks, source, comps, backbone, settings, cache, say, t0)


def _run_id(ranks: _Ranks) -> str:
    """The same string in every process of this run, and in no other live run: the address of the process
    group's store (accelerate / torchrun) for a multi-process run, host + pid otherwise."""
    if ranks.count > 1:
        env = os.environ
        return (f"torchrun:{env.get('MASTER_ADDR', socket.gethostname())}:{env.get('MASTER_PORT', os.getppid())}:"
                f"{env.get('TORCHELASTIC_RUN_ID', '')}")
    return f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"


def _extract(args, ranks: _Ranks, source: DataSource, comps: ExtractionComponents, backbone: FrozenBackbone, settings: dict,
             cache: CacheDir, say, t0: float) -> dict:
    """run()'s work once this run holds the cache's build lock."""
    # All ranks decide before rank 0 changes anything (the barrier), so they all take the same branch.
    complete = cache.is_complete()
    damaged = cache.problems() if complete else {}
    ranks.barrier()
    if complete and not damaged:  # another run finished it while this one waited for the lock
        say(f"cache up to date: {cache.path} (fingerprint {cache.fingerprint[:16]}, finished by the run this one "
            "waited for); nothing to compute")
        return json.loads((cache.path / "manifest.json").read_text())
    if ranks.index == 0:
        if complete:  # damaged: no reader may open it until the shards are rebuilt
            say(f"cache {cache.path} is damaged: {len(damaged)} shard(s) missing or cut short; rebuilding only "
                f"{'that shard' if len(damaged) == 1 else 'those'}")
            cache.retract_manifest()
        cache.prepare()
        # Worth a note only where reuse was possible: a cache of the same data by the same backbone that differs in
        # extraction settings, which the user may have meant to reuse. Caches of other data / splits / backbones
        # in the same folder are simply other caches.
        for other, their in cache.other_caches():
            if their.get("data") == settings["data"] and their.get("backbone") == settings["backbone"]:
                say(f"note: {other} holds these data by this backbone, extracted with other settings; building a "
                    "new cache. Differences:\n  " + "\n  ".join(settings_diff(their, settings)[:12]))
    ranks.barrier()
    save_config(dataclasses.asdict(args), cache.path / "config.json") if ranks.index == 0 else None

    if isinstance(source, IndexedSource):
        records = source.records()
        n_shards = max(1, -(-len(records) // args.shard_size))
        units = [records[k * args.shard_size:(k + 1) * args.shard_size] for k in range(n_shards)]
        total = len(records)
    else:
        units = expand_shards(source.shards)
        n_shards, total = len(units), None
    mine = [k for k in range(n_shards) if k % ranks.count == ranks.index]
    cache.clean_partial(mine)
    for k, problem in cache.damaged_shards(mine).items():  # a cut or missing file: that shard is redone
        print(f"{problem}: shard {k} is damaged; rebuilding it")
        cache.discard_shard(k)
    todo = [k for k in mine if not cache.shard_done(k)]
    builder = ShardBuilder(backbone, comps, args)
    transform = _KeepRaw(backbone.preprocess, builder.keep_raw)
    done_before = len(mine) - len(todo)
    say(f"extracting {len(todo)} of {n_shards} shards into {cache.path}"
        + (f" ({done_before} already done)" if done_before else "") + f" on {ranks.count} process(es)")
    pbar_total = sum(len(units[k]) for k in todo) if total is not None else None
    t_shards = time.perf_counter()
    # One bar per rank (its own line on a terminal); in a log, one plain line per rank every 30 s:
    # "rank 1: 512/2048 img (25%) in 30 s (17.07 img/s, about 90 s left)".
    label = f"rank {ranks.index}" if ranks.count > 1 else "extracting"
    with progress(total=pbar_total, desc=label, unit="img", position=ranks.index, leave=True,
                  disable=not todo) as pbar:
        for k in todo:
            shard_report = SkipReport()
            if isinstance(source, IndexedSource):
                batches = DataLoader(SampleDataset(source, transform, units[k]), batch_size=args.batch_size,
                                     num_workers=args.workers, collate_fn=collate_skipping)
            else:
                stream = WebDatasetSource([units[k]], max_pixels=source.max_pixels, unusual=source.unusual)
                batches = _pair_batches(stream, transform, args.batch_size)
                shard_report = stream.report
            coverage = None
            if comps.reads_boxes and not isinstance(source, IndexedSource):
                coverage = comps.boxes.coverage(f"shard {units[k]}")
            arrays, meta = _build_shard(builder, batches, shard_report, pbar, coverage,
                                        "empty" if comps.reads_boxes else "error")  # an indexed source: checked
            if coverage is not None and coverage.total and len(coverage.missing) == coverage.total:
                coverage.close()  # not one image of the shard matched: the wrong file, said now
            cache.write_shard(k, arrays, meta)
    t_shards = time.perf_counter() - t_shards
    ranks.barrier()
    if ranks.index == 0:
        _finish(cache, source, n_shards, settings, backbone.context_length, time.perf_counter() - t0,
                comps.boxes if comps.reads_boxes and not isinstance(source, IndexedSource) else None)
    ranks.barrier()  # every rank returns only once the manifest exists
    manifest = json.loads((cache.path / "manifest.json").read_text())
    # not written to disk (a rerun must produce identical files): this process's time in its shard loop
    manifest["seconds"] = {"shards": t_shards, "total": time.perf_counter() - t0}
    return manifest


def _finish(cache: CacheDir, source: DataSource, n_shards: int, settings: dict, context_length: int,
            seconds: float, boxes=None) -> None:
    """Rank 0, after every shard exists: merge the shards' skip reports, write report.json and the manifest.
    ``boxes``: a stream's box file, whose coverage the shards counted, judged here before the manifest is written
    (a rerun with another --max-missing-boxes reuses the shards)."""
    report = SkipReport() if not isinstance(source, IndexedSource) else source.report  # index-time refusals
    stats = {"truncated": 0, "phrases_cut": 0}
    images = missing = 0
    examples: list[str] = []
    for k in range(n_shards):
        meta = json.loads((cache.path / f"shard-{k:05d}" / "meta.json").read_text())
        for s in meta["skipped"]:
            report.add(Skip(**s))
        for n in meta["converted"]:
            report.note(n["image_id"], n["location"], n["note"])
        for key in stats:
            stats[key] += meta[key]
        images += meta["images"]
        missing += (meta.get("missing_boxes") or {}).get("count", 0)
        examples += (meta.get("missing_boxes") or {}).get("examples", [])
    if boxes is not None:
        from extract.data.boxes import judge

        judge(boxes, source.name, images, missing, examples[:3])
    report.to_json(cache.path / "report.json")
    manifest = cache.write_manifest(n_shards, {"settings_summary": settings["summary"], **stats,
                                               "skipped": report.counts()})
    print(f"cached {manifest['images']} images and {manifest['captions']} captions in {seconds:.1f} s -> "
          f"{cache.path}\n  {report.summary()}; {stats['truncated']} captions truncated to {context_length} tokens"
          + (f", {stats['phrases_cut']} phrases lost to truncation" if stats["phrases_cut"] else "")
          + f"\n  report: {cache.path / 'report.json'}")


def build_cache(data: str | os.PathLike, out: str | os.PathLike, **options) -> FeatureCache:
    """Python entry point: ``build_cache("toy/", "cache/", base="ViT-B-32", components=["patches", "regions"])``.

    ``options`` are :class:`ExtractOptions` fields (the command-line flags with underscores: ``num_regions=10``,
    ``pretrained="none"``); checked exactly like the CLI. Returns the finished cache, opened for reading.
    """
    known = {f.name for f in dataclasses.fields(ExtractOptions)} - {"data", "out"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"build_cache: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}")
    opts = ExtractOptions(data=str(data), out=str(out), **options)
    manifest = run(opts)
    return FeatureCache.open(out, fingerprint=manifest["fingerprint"])


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
