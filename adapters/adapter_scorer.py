"""A trained adapter as a :class:`adapters.scoring.Scorer`: frozen backbone + live component extraction + head.

The head was trained on cached arrays (``python -m extract``). To score new images and texts, the
:class:`LiveExtractor` recomputes exactly those arrays with the pipeline's own code
(:class:`extract.pipeline.ShardBuilder`) and the cache's own settings (stored in the checkpoint): the same
backbone (weights checked by SHA-256), crops of the same boxes embedded the same way, the same spaCy rules,
the same fp16 rounding. The head then sees what it saw in training.

Boxes: a head trained on detected boxes detects with the very detector it was trained with, which its run folder
carries (``RUN/detector.pt``, checked by SHA-256), so a copied run folder scores anywhere. A head trained on
ground-truth boxes (the toy world, ``--annotations FILE``) needs boxes for the images it scores: pass
``annotations`` (anything :func:`extract.data.boxes.read_boxes` reads: COCO instances, a Visual Genome
``objects.json``, a toy-world folder, or a dict keyed by image id), or ``detector`` (YOLO weights) to detect them
instead. A box source the caller chooses is used whatever the head was trained on, and said: ``detector``, or
``annotations`` with ``use_annotations=True`` (what ``--annotations`` means; annotations passed without it, as
``--data`` of a toy world passes its own, serve only heads trained on ground-truth boxes). Images are identified
by the ids the caller gives, ints or strings (``str(id)``; evaluation passes file paths: a path whose file name an
entry names maps to that entry's image id, which also seeds random regions exactly as in the cache). An image the
file holds no entry for is an error naming both (:class:`extract.data.boxes.MissingBoxes`), unless the caller asks
for ``missing_boxes="empty"`` after counting such images itself (:meth:`AdapterScorer.box_coverage`).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from adapters.heads.base import AdapterHead, Reps, to_tensors
from adapters.checkpoint import CheckpointError, load_adapter
from adapters.live_memo import MEMO, phrase_table, pixels_digest, scope_key
from adapters.scoring import CacheReadable, token_keys


def _extract_defaults() -> dict:
    from extract.pipeline import build_parser

    p = build_parser()
    return {a.dest: a.default for a in p._actions if a.dest not in ("help",)}


class LiveExtractor:
    """The cache's arrays for new images / texts (module docstring).

    ``extraction_args``: the resolved ``python -m extract`` arguments of the training cache (its
    ``config.json``); ``box_source``: the cache's box source (``"gt"`` / ``"yolo"`` / None).

    Each image and each caption is computed **alone**, a batch of one in its own shape (a caption on its own
    columns, an image's crops and detections in one forward of their own), so its arrays are a function of that item
    only: the same bits whichever items it was asked for with, in this process or another, and whether this process
    computed it before (the memory of :mod:`adapters.live_memo` then gives exactly what a fresh computation gives).
    Kernels choose their summation order by the shapes they are given: a caption among others ran on its batch's
    longest columns and in a larger product, and on an AMD EPYC with AVX2 kernels that moved a served score by a
    float32 step once the memory held the caption from a batch of the final evaluation (issue 81). Not alone: spaCy's
    parse, a discrete decision, made for a batch of captions at once and remembered per process (``parse``); it
    could change only at a near tie of its scores, and the batch's and each caption's own parse agree on all 3,087
    distinct captions of a 2,000-scene toy world (measured for issue 81). The cost: a forward per item (toy-negclip's
    text tower on one thread: 0.74 ms a caption alone, 0.09 in batches of 256; an image with its crops about 2 ms
    more than in a batch), which serving pays anyway (a query is one item); a run's bulk inputs (its hard negatives,
    an evaluation's batches) take :meth:`batch_text_arrays` / :meth:`batch_image_arrays` instead (extract/README,
    "Batch invariance").
    """

    def __init__(self, backbone, extraction_args: dict, *, box_source: str | None = None, annotations=None,
                 detector: str | None = None, weights_sha256: str | None = None,
                 max_missing_boxes: float | None = None, use_annotations: bool = False):
        from extract.data.boxes import read_boxes
        from extract.pipeline import ShardBuilder, ExtractionComponents

        args = argparse.Namespace(**{**_extract_defaults(), **extraction_args})
        args.workers, args.annotations = 0, None
        if args.crop_scale is None:  # a cache from before --crop-scale existed: its crops were tight
            args.crop_scale = 1.0
        if args.phrase_prompt is None:  # a cache from before --phrase-prompt: phrases as parsed
            args.phrase_prompt = "{}"
        if isinstance(args.components, str):
            args.components = [c for c in args.components.split(",") if c]
        if use_annotations and detector is not None:
            raise ValueError("two box sources were given, annotations (--annotations) and a detector (--detector): "
                             "give one")
        if use_annotations and annotations is None:
            raise ValueError("use_annotations=True needs annotations (the box file to score with)")
        #: the ground-truth boxes (extract.data.boxes.BoxAnnotations), None without any
        self.boxes = read_boxes(annotations, max_missing=max_missing_boxes)
        if detector is not None:
            box_source, args.detector = "yolo", detector
        elif use_annotations and box_source is not None:  # the caller's box file replaces the trained source
            box_source = "gt"
        needs_gt = box_source == "gt" or ("regions" in args.components and args.regions == "gt")
        if needs_gt and self.boxes is None:
            raise ValueError("this adapter was trained on ground-truth boxes: give the boxes of the images to score "
                             "(annotations=FILE: COCO instances, Visual Genome objects.json or a toy-world folder; "
                             "--annotations in python -m train.eval) or a detector to find them (detector=WEIGHTS.pt, "
                             "--detector)")
        if box_source is not None:
            args.boxes = box_source
        self.args = args
        self.components = ExtractionComponents(args, None, backbone.device, boxes=self.boxes)
        # what decides the arrays, for the process's memory of them (adapters/live_memo.py); without the weights'
        # digest there is no telling two backbones apart, so nothing is remembered. What the backbone alone computes
        # for an item (its towers' outputs, each phrase's embedding) depends on the backbone only: remembered under
        # ``tower_scope``, shared by the extractors of every adapter on that backbone (each item alone: the same bits)
        self.scope = self.tower_scope = None
        if weights_sha256 is not None:
            self.tower_scope = scope_key(weights=weights_sha256, backbone=backbone.describe())
            self.scope = scope_key(weights=weights_sha256, backbone=backbone.describe(), settings=self.settings(),
                                   annotations=_annotations_token(annotations))
        phrases = None if self.tower_scope is None else phrase_table(self.tower_scope)
        self.builder = ShardBuilder(backbone, self.components, args, phrases=phrases)
        self.backbone = backbone

    @property
    def needs_pixels(self) -> bool:
        """True when crops, detections or masks need the decoded image (not only the preprocessed tensor)."""
        return self.builder.keep_raw

    @property
    def reads_boxes(self) -> bool:
        """True when the arrays need ground-truth boxes (:attr:`boxes`): the head was trained on them."""
        return self.components.reads_boxes

    def image_id(self, key) -> str:
        """The id an image known by ``key`` (an id, int or str, or a path) has in the box file, else ``str(key)``."""
        return self.boxes.image_id(key) if self.boxes is not None else str(key)

    def settings(self) -> dict:
        return self.components.settings()

    def coverage(self, collection: str):
        """An :class:`extract.data.boxes.Coverage` of ``collection`` when the arrays read ground-truth boxes, else
        None."""
        return self.boxes.coverage(collection) if self.reads_boxes else None

    @torch.no_grad()
    def image_arrays(self, images: Sequence, ids: Sequence, missing_boxes: str = "error") -> dict[str, np.ndarray]:
        """PIL images (RGB) with their ids (int or str) -> per-image arrays as cached (fp16 features, bool masks); an
        image this process extracted the same way before (same id and pixels) is not extracted again.
        ``missing_boxes``: as in :meth:`extract.pipeline.ShardBuilder.image_batch`."""
        ids = [self.image_id(i) for i in ids]
        digests = [None if self.scope is None else pixels_digest(im) for im in images]

        def compute(positions: list[int]) -> dict[str, np.ndarray]:
            return _join([self._image_alone(images[k], ids[k], missing_boxes, digests[k]) for k in positions])

        if self.scope is None:
            return compute(list(range(len(images))))
        # an image extracted without its (missing) boxes is remembered apart: asked for with boxes, it is still refused
        boxless = {i for i in ids if missing_boxes == "empty" and self.reads_boxes and not self.boxes.has(i)}
        keys = [f"{i}|{d}" + ("|boxless" if i in boxless else "") for d, i in zip(digests, ids)]
        return MEMO.get_many(self.scope + ":image", keys, compute, _join)

    @torch.no_grad()
    def tensor_arrays(self, images: torch.Tensor, ids: Sequence, missing_boxes: str = "error") -> dict[str, np.ndarray]:
        """Already preprocessed images [B, 3, H, W] -> arrays; only for heads that need no pixels."""
        if self.needs_pixels:
            raise ValueError("this adapter's components crop or detect on the original image: pass PIL images "
                             "(encode_pil), not preprocessed tensors")
        return _join([self.builder.image_batch(images[b:b + 1], [None], [self.image_id(i)], missing_boxes)
                      for b, i in enumerate(ids)])  # each image alone (class docstring)

    def _image_alone(self, image, image_id: str, missing_boxes: str, digest: str | None) -> dict[str, np.ndarray]:
        """One decoded image's arrays, computed as a batch of one (class docstring); its image tower's output from
        the process's memory when an extractor of this backbone computed it before (``digest``: of its pixels)."""
        raw = [np.asarray(image)] if self.needs_pixels else [None]
        pixels = self.backbone.preprocess(image)[None]
        tower = None if self.tower_scope is None else MEMO.get(self.tower_scope + ":image", digest,
                                                               lambda: self.builder.image_tower(pixels))
        return self.builder.image_batch(pixels, raw, [image_id], missing_boxes, tower=tower)

    def _caption_alone(self, text: str) -> dict[str, np.ndarray]:
        """One caption's arrays, computed as a batch of one (class docstring); its text tower's output from the
        process's memory when an extractor of this backbone computed it before."""
        tower = None if self.tower_scope is None else MEMO.get(self.tower_scope + ":text", text,
                                                               lambda: self.builder.caption_tower([text]))
        return self.builder.caption_batch([text], tower=tower)[0]

    @torch.no_grad()
    def text_arrays(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Captions -> per-caption arrays as cached, each caption computed alone (class docstring); a caption this
        process extracted the same way before is not extracted again."""
        texts = list(texts)

        def compute(positions: list[int]) -> dict[str, np.ndarray]:
            chosen = [texts[k] for k in positions]
            if self.components.text is not None:  # spaCy parses them in one batch; each parse is remembered
                self.components.text.parse(chosen)
            return _join([self._caption_alone(t) for t in chosen])

        if self.scope is None:
            return compute(list(range(len(texts))))
        return MEMO.get_many(self.scope + ":text", texts, compute, _join)

    @torch.no_grad()
    def batch_text_arrays(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Captions -> their arrays computed together, as one batch, the way the cache computes its shards: for a
        run's bulk inputs (its hard negatives, a held-out split's negatives, an evaluation's captions), where a
        forward per caption would cost ~8x the time (toy-negclip's tower, one thread: 0.74 ms a caption alone, 0.09
        in batches of 256). Each caption's arrays then depend on its batch, which is a function of the run's own
        inputs (its data, its seed, its batch size); this process remembers them under the whole batch (the text
        tower's output too, for every extractor of this backbone), so a remembered batch is exactly the batch
        computed again. Never what is served (:meth:`text_arrays`)."""
        texts = list(texts)

        def compute() -> dict[str, np.ndarray]:
            tower = None if self.tower_scope is None else MEMO.get(
                self.tower_scope + ":text-batch", scope_key(batch=texts), lambda: self.builder.caption_tower(texts))
            return self.builder.caption_batch(texts, tower=tower)[0]

        if self.scope is None or not texts:
            return compute()
        return MEMO.get(self.scope + ":text-batch", scope_key(batch=texts), compute)

    @torch.no_grad()
    def batch_image_arrays(self, images: Sequence, ids: Sequence, missing_boxes: str = "error") -> dict[str, np.ndarray]:
        """PIL images (RGB) with their ids -> their arrays computed together, as one batch (the image tower's forward
        and the crops' forward shared by the batch), the way the cache computes its shards: for a run's bulk images
        (an evaluation's splits), where an image alone costs about 3x (:meth:`batch_text_arrays` says why that is
        sound there). Remembered under the whole batch (ids, pixels and ``missing_boxes``); never what is served
        (:meth:`image_arrays`)."""
        ids = [self.image_id(i) for i in ids]
        images = list(images)
        digests = [pixels_digest(im) for im in images] if self.scope is not None else None

        def compute() -> dict[str, np.ndarray]:
            raw = [np.asarray(im) if self.needs_pixels else None for im in images]
            pixels = torch.stack([self.backbone.preprocess(im) for im in images])
            tower = None if self.tower_scope is None else MEMO.get(
                self.tower_scope + ":image-batch", scope_key(batch=digests), lambda: self.builder.image_tower(pixels))
            return self.builder.image_batch(pixels, raw, ids, missing_boxes, tower=tower)

        if self.scope is None or not images:
            return compute()
        return MEMO.get(self.scope + ":image-batch", scope_key(batch=list(zip(ids, digests)), missing=missing_boxes),
                        compute)


def _join(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    from extract.pipeline import concat_rows  # zero-pads trailing dims that differ (token lengths), as the cache

    return concat_rows(parts)


def _annotations_token(spec) -> str:
    """Where ground-truth boxes come from, as part of a memory scope: a file or folder by path and modification
    times, a dict or read boxes by identity (no two scorers share it), none."""
    if spec is None:
        return "none"
    if not isinstance(spec, (str, os.PathLike)):  # a dict, or extract.data.boxes.BoxAnnotations
        return f"{type(spec).__name__}:{id(spec)}"
    path = Path(spec).resolve()
    files = [path / "annotations.json", path / "controlled.json"] if path.is_dir() else [path]
    return f"{path}:" + ",".join(str(f.stat().st_mtime_ns) for f in files if f.is_file())


def _settings_diff(trained: dict, live: dict) -> list[str]:
    from extract.cache import settings_diff

    keys = ("components", "limits", "text", "boxes", "regions")
    return settings_diff(_portable({k: trained.get(k) for k in keys}), _portable({k: live.get(k) for k in keys}))


def _portable(settings: dict) -> dict:
    """``settings`` without where the detector file lies: its SHA-256 says which detector it is, and a run scores
    with the copy in its own folder (:func:`adapters.checkpoint.run_detector`), wherever it was trained from."""
    weights = ((settings.get("boxes") or {}).get("detector") or {}).get("weights")
    if not isinstance(weights, dict) or "file" not in weights:
        return settings
    detector = {**settings["boxes"]["detector"], "weights": {k: v for k, v in weights.items() if k != "file"}}
    return {**settings, "boxes": {**settings["boxes"], "detector": detector}}


def _describe_boxes(source: str | None, trained: str | None, detector: str | None, annotations) -> dict | None:
    """Where the boxes of the images a head scores come from: ``source`` (gt / yolo / random), the ``trained`` one,
    and ``from`` (the detector file or the box file; a box file given as data is named by its type)."""
    if source is None:
        return None
    where = {"yolo": detector, "gt": annotations if isinstance(annotations, (str, os.PathLike)) else
             type(annotations).__name__, "random": "seeded random boxes"}.get(source)
    return {"source": source, "trained": trained, "from": str(where)}


class AdapterScorer(CacheReadable):
    """Scorer for a trained head (see the module docstring). ``encode_pil(images, ids)`` is the entry point for
    evaluation and serving; ``encode_images`` works for heads whose components need no pixels."""

    #: representations are the head's (components, masks), not one embedding a linear probe could read
    has_global_embedding = False

    def __init__(self, head: AdapterHead, backbone, extractor: LiveExtractor, name: str, meta: dict | None = None,
                 boxes_used: dict | None = None):
        self.head = head.eval()
        self.backbone = backbone
        self.extractor = extractor
        self.name = name
        self.meta = meta or {}
        #: where the boxes of scored images come from (``{"source", "trained", "from"}``), None for a head without
        #: entity boxes; evaluation records it with the figures
        self.boxes_used = boxes_used
        self.preprocess = backbone.preprocess
        self.device = backbone.device
        self.directional = bool(head.directional)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu", precision: str | None = None,
                        pretrained: str | None = None, annotations=None, detector: str | None = None,
                        max_missing_boxes: float | None = None, use_annotations: bool = False) -> "AdapterScorer":
        """Rebuild from the checkpoint alone. ``pretrained`` overrides where the base weights are (a moved file;
        its SHA-256 must still match). Boxes: a head trained on detected boxes detects with the detector copied
        into its run folder (``RUN/detector.pt``, checked by SHA-256: :func:`adapters.checkpoint.run_detector`); one
        trained on ground-truth boxes reads ``annotations``. A box source the caller chooses replaces the trained
        one, said in the log and in :attr:`boxes_used`: ``detector`` (YOLO weights), or ``annotations`` with
        ``use_annotations=True`` (an explicit ``--annotations``; both at once are refused). ``max_missing_boxes``:
        the share of a collection's images the annotations may leave out (:meth:`box_coverage`).
        A checkpoint of an ``--unfreeze`` fine-tune names its backbone weights (``RUN/backbone.safetensors``,
        read from the adapter's folder; ``pretrained`` then points at a moved copy) and its text context."""
        from adapters.checkpoint import run_detector
        from extract.common.cli import say
        from extract.models.backbone import load_backbone

        path = Path(path)
        if path.is_dir():
            path = path / "adapter.safetensors"
        head, meta = load_adapter(path, device=device)
        base, extraction = meta["base"], meta["extraction"]
        precision = precision or extraction["args"].get("precision", "fp32")
        tuned = meta.get("backbone")
        if tuned:  # an --unfreeze fine-tune: the backbone's own weights sit next to the adapter
            weights = Path(pretrained) if pretrained else path.parent / tuned["file"]
            if not weights.is_file():
                raise FileNotFoundError(f"{path} was trained with a fine-tuned backbone, {tuned['file']}, which is not "
                                        f"next to it ({weights} missing): copy the run folder whole, or pass the "
                                        "file (pretrained=PATH / --pretrained PATH)")
            backbone = load_backbone(base["base"], str(weights), device=device, precision=precision,
                                     context_length=tuned.get("context_length"))
            theirs, what = tuned.get("weights_sha256"), f"fine-tuned {base['base']} weights ({weights})"
        else:
            backbone = load_backbone(base["base"], pretrained or base["pretrained"], device=device, precision=precision)
            theirs, what = base.get("weights_sha256"), f"{pretrained or base['pretrained']}"
        ours = backbone.describe(hash_weights=True)["weights_sha256"]
        if theirs and theirs != ours:
            raise CheckpointError(f"{path} was trained on {base['base']} weights with SHA-256 {theirs[:16]}..., but "
                                  f"{what} has {ours[:16]}...: pass the original weights (--pretrained PATH)")
        trained = (extraction["settings"].get("boxes") or {}).get("source")
        args = dict(extraction["args"])
        if trained == "yolo" and detector is None and not use_annotations:
            own = run_detector(path, meta)  # None: the detector is named where it lay (older runs)
            if own is not None:
                args["detector"] = own
                # what the index of a collection extracts with (serve.index reads the description's args)
                meta = {**meta, "extraction": {**extraction, "args": args}}
        extractor = LiveExtractor(backbone, args, box_source=trained, annotations=annotations, detector=detector,
                                  weights_sha256=ours, max_missing_boxes=max_missing_boxes,
                                  use_annotations=use_annotations)
        label = f"{base['base']} fine-tuned" if tuned else base["base"]
        name = f"{label} + {meta['method']}"
        used = extractor.components.box_source
        boxes_used = _describe_boxes(used, trained, extractor.args.detector, annotations)
        diff = _settings_diff(extraction["settings"], extractor.settings())
        if detector is not None or use_annotations:  # the caller's box source, said once
            if boxes_used is None:
                if detector is not None or not extractor.reads_boxes:  # ground-truth regions read the annotations
                    say(f"note: {name} reads no entity boxes: the given {'detector' if detector else 'annotations'} "
                        "change nothing in its scores")
            elif used != trained or diff:
                other = " of another detector" if used == trained == "yolo" else ""
                say(f"{name}: scoring with {used} boxes from {boxes_used['from']}, as given (it was trained on "
                    f"{trained} boxes{other})")
        elif diff:
            print(f"warning: live extraction for {path} differs from the training cache's:\n  " + "\n  ".join(diff[:8]))
        return cls(head, backbone, extractor, name=name, meta=meta, boxes_used=boxes_used)

    # -- encoding ----------------------------------------------------------------------------------------
    def _image_reps(self, arrays: dict[str, np.ndarray]) -> Reps:
        batch = to_tensors({k: arrays[k] for k in self.head.image_keys}, self.device)
        return self.head.encode_image(batch)

    @torch.no_grad()
    def encode_pil(self, images: Sequence, ids: Sequence | None = None, *, missing_boxes: str = "error") -> Reps:
        """Decoded images with their ids (ints or strings, paths are fine; without ids, their positions) -> head
        representations. A head trained on ground-truth boxes needs an entry for each image in its annotations
        (else :class:`extract.data.boxes.MissingBoxes`); ``missing_boxes="empty"`` gives such images no boxes, for
        a caller that counted them (:meth:`box_coverage`) or tells its user (serving's note)."""
        images = [im.convert("RGB") for im in images]
        ids = [str(i) for i in ids] if ids is not None else [str(k) for k in range(len(images))]
        return self._image_reps(self.extractor.image_arrays(images, ids, missing_boxes))

    @torch.no_grad()
    def encode_pil_bulk(self, images: Sequence, ids: Sequence | None = None, *, missing_boxes: str = "error") -> Reps:
        """:meth:`encode_pil` for a run's bulk images (an evaluation's splits, in its batches): the batch computed
        together (:meth:`LiveExtractor.batch_image_arrays`), at about a third of the cost; what is served goes
        through :meth:`encode_pil`, each image alone."""
        images = [im.convert("RGB") for im in images]
        ids = [str(i) for i in ids] if ids is not None else [str(k) for k in range(len(images))]
        return self._image_reps(self.extractor.batch_image_arrays(images, ids, missing_boxes))

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, ids: Sequence | None = None, *, missing_boxes: str = "error") -> Reps:
        ids = [str(i) for i in ids] if ids is not None else [str(k) for k in range(len(images))]
        return self._image_reps(self.extractor.tensor_arrays(images.to(self.device), ids, missing_boxes))

    def box_coverage(self, collection: str):
        """A tally of which images of ``collection`` the annotations cover (:class:`extract.data.boxes.Coverage`:
        ``add`` their ids, ``close`` to log the count and refuse past ``max_missing_boxes``); None when the head
        reads no ground-truth boxes."""
        return self.extractor.coverage(collection)

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str]) -> Reps:
        arrays = self.extractor.text_arrays(texts)
        return self.head.encode_text(to_tensors({k: arrays[k] for k in self.head.text_keys}, self.device))

    @torch.no_grad()
    def encode_texts_bulk(self, texts: Sequence[str]) -> Reps:
        """:meth:`encode_texts` for a run's bulk captions (an evaluation's, in its batches): the batch computed
        together (:meth:`LiveExtractor.batch_text_arrays`); what is served goes through :meth:`encode_texts`."""
        arrays = self.extractor.batch_text_arrays(list(texts))
        return self.head.encode_text(to_tensors({k: arrays[k] for k in self.head.text_keys}, self.device))

    def text_input_keys(self, texts: Sequence[str]) -> list:
        """One key per text, equal exactly when the head receives the same arrays (adapters.scoring.Scorer): the
        backbone's token ids after truncation for heads that read tokens only (``text_from_tokens``), else the
        text itself (a spaCy parse of the whole caption can tell apart what truncation cut)."""
        return token_keys(self.backbone, texts) if self.head.text_from_tokens else list(texts)

    # -- from a feature cache (train.eval.evaluate --cache, serving's second stage) ------------------------------
    def cache_keys(self, side: str) -> tuple[str, ...]:
        """The cache arrays the head reads per item of ``side`` ("image" or "text")."""
        if side not in ("image", "text"):
            raise ValueError(f"side must be 'image' or 'text', got {side!r}")
        return tuple(self.head.image_keys if side == "image" else self.head.text_keys)

    @torch.no_grad()
    def encode_arrays(self, arrays: dict[str, np.ndarray], side: str) -> Reps:
        """Arrays of ``side`` as a cache holds them (``cache.gather(key, rows)`` for each of :meth:`cache_keys`) ->
        head representations: what :meth:`encode_pil` / :meth:`encode_texts` give for items whose live arrays are
        these (fp16 features, as the pipeline writes them)."""
        keys = self.cache_keys(side)
        encode = self.head.encode_image if side == "image" else self.head.encode_text
        return encode(to_tensors({k: arrays[k] for k in keys}, self.device))

    def text_tower(self):
        return self.backbone

    def check_cache(self, cache) -> None:
        """The cache must hold what live extraction would give the head: extracted with the adapter's own settings
        (its checkpoint's ``extraction.settings``; the data aside)."""
        diff = self.cache_settings_diff(cache.settings)
        if diff:
            ours = self.meta.get("extraction", {}).get("path", "its training cache")
            raise ValueError(f"--cache {cache.path} ({cache.settings.get('summary', '')}) was extracted with other "
                             f"settings than {self.name} was trained on ({ours}); checkpoint's -> cache's:\n  "
                             + "\n  ".join(diff[:8]) + "\nExtract the retrieval data with the adapter's settings "
                             "(python -m extract with its --components and extraction flags), or drop --cache")

    def cache_settings_diff(self, settings: dict) -> list[str]:
        """Differences (``key: checkpoint's -> cache's``) between the extraction settings this head was trained
        with and a feature cache's ``settings``: empty when the cache holds exactly the arrays live extraction
        gives this head. What the settings say about the data (which records, the summary naming them) and the
        shard size (how rows are grouped in files) are not compared: a cache of other data is what evaluation
        and serving read."""
        from extract.cache import settings_diff

        ignored = ("data", "summary", "shard_size")
        trained = {k: v for k, v in self.meta["extraction"]["settings"].items() if k not in ignored}
        return settings_diff(_portable(trained), _portable({k: v for k, v in settings.items() if k not in ignored}))

    # -- scoring -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, image_reps: Reps, text_reps: Reps) -> torch.Tensor:
        return self.head.score(image_reps, text_reps)

    @torch.no_grad()
    def score_directed(self, image_reps: Reps, text_reps: Reps, direction: str) -> torch.Tensor:
        return self.head.score_directed(image_reps, text_reps, direction)

    @torch.no_grad()
    def first_stage_image(self, image_reps: Reps, direction: str = "t2i") -> torch.Tensor:
        return self.head.first_stage_image(image_reps, direction)

    @torch.no_grad()
    def first_stage_text(self, text_reps: Reps, direction: str = "t2i") -> torch.Tensor:
        return self.head.first_stage_text(text_reps, direction)
