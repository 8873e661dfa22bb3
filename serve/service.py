"""The service behind ``python -m serve``: what the page and the HTTP API both call, as plain data, tested without a
browser. :class:`Served` (search text -> image and image -> text, heatmaps, the caption probe and its graded
examples, the about line) over a :class:`serve.search.Searcher`; :class:`Limits` (upload size, pixels, concurrency)
and :class:`Gate` (at most ``Limits.concurrency`` computations at once, ``Limits.queue`` waiting, beyond that
:class:`Busy`), shared by the page (:mod:`serve.app`) and the API (:mod:`serve.http`).

Safety. Collection images are read by their row in the index's metadata, never by a path from a request; uploads
are decoded by :func:`extract.data.images.decode_image` with ``Limits.max_pixels`` checked from the header before any
pixel is decoded (decompression bombs are refused, not decoded), under :func:`decode_checked`.
"""
from __future__ import annotations

import contextlib
import html
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field, replace as with_fields
from pathlib import Path
from typing import Any

import numpy as np

from serve.heatmap_render import fit, render
from serve.redact import Redactor, server_paths, source_name
from serve.search import QueryError, Searcher

#: the longest side of a gallery thumbnail (px); smaller images are enlarged by a whole factor, pixels kept sharp
THUMBNAIL = 256
#: the page's default re-ranking depth (K first-stage candidates re-scored by the model)
DEFAULT_CANDIDATES = 50
#: served R@k is measured at start-up only for collections up to this many images + captions (each is a query)
RECALL_LIMIT = 5000
#: the toy world's hard-negative types, in the order the probe offers them (attribute binding first)
PROBE_TYPES = ("swap-att", "swap-obj", "replace-att", "replace-rel", "replace-obj", "add-obj")
#: the types whose examples show one the served model gets right and one it gets wrong (binding is the point)
GRADED_TYPES = ("swap-att", "swap-obj", "replace-rel")
#: hard-negative pairs scored per graded type, looking for one right and one wrong (bounds the app's start-up)
GRADE_CANDIDATES = 12


# --------------------------------------------------------------------------------------------- limits
@dataclass(frozen=True)
class Limits:
    """What one request may ask. ``max_upload_bytes``: an uploaded image (or a /knn-service body, base64 and JSON
    added); ``max_pixels``: width x height of any decoded image, read from the header; ``concurrency``: model
    computations at once (page and HTTP API together); ``queue``: requests waiting beyond those (more are told the
    server is busy); ``max_results``: hits (and re-ranked candidates) one request may ask for; ``show_paths``: HTTP
    answers also hold each image's file path on the server (``image_path``) and no answer of either API is
    filtered for the server's paths (off by default: a client needs the image's URL and id, not the
    server's folder layout, and every answer goes through :meth:`Served.public`; on for a trusted local setup)."""

    max_upload_bytes: int = 10 * 2**20
    max_pixels: int = 25_000_000
    concurrency: int = 2
    queue: int = 32
    max_results: int = 1000
    show_paths: bool = False

    def __post_init__(self):
        for name in ("max_upload_bytes", "max_pixels", "concurrency", "max_results"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.queue < 0:
            raise ValueError(f"queue must be >= 0, got {self.queue}")


class Busy(RuntimeError):
    """Every computation slot is taken and the queue is full: try again shortly (HTTP 503)."""


class Gate:
    """At most ``concurrency`` holders at once and at most ``queue`` more waiting; a caller beyond that, or one that
    waited ``wait_s`` seconds, gets :class:`Busy`. Bounds the memory a burst of requests can take: each computation
    holds a decoded image and activations; waiting requests hold only their request."""

    def __init__(self, concurrency: int, queue: int, wait_s: float = 120.0):
        self.concurrency, self.queue, self.wait_s = concurrency, queue, wait_s
        self._slots = threading.BoundedSemaphore(concurrency)
        self._lock = threading.Lock()
        self._inside = 0  # running + waiting
        self.refused = 0

    @contextlib.contextmanager
    def hold(self):
        with self._lock:
            if self._inside >= self.concurrency + self.queue:
                self.refused += 1
                raise Busy(f"the server is busy ({self.concurrency} searches running, {self.queue} waiting): try "
                           "again in a moment")
            self._inside += 1
        try:
            if not self._slots.acquire(timeout=self.wait_s):
                with self._lock:
                    self.refused += 1
                raise Busy(f"the server is busy (waited {self.wait_s:.0f} s for a free slot): try again in a moment")
            try:
                yield
            finally:
                self._slots.release()
        finally:
            with self._lock:
                self._inside -= 1


def whole_number(value, name: str) -> int:
    """A request's count as an int: a whole number, which Gradio's sliders send as a float; anything else (text,
    infinity, NaN, 2.5, a bool) is a QueryError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) or (
            not math.isfinite(value) or value != int(value)):
        shown = repr(value) if isinstance(value, (int, float, str)) else type(value).__name__
        raise QueryError(f"{name} must be a whole number, got {shown[:80]}")
    return int(value)


# --------------------------------------------------------------------------------------------- what is served
@dataclass
class ProbeExample:
    """A caption of a collection image and one of its toy-world hard negatives (``negatives.json``)."""

    image_id: str
    positive: str
    negative: str
    type: str
    verdict: str = ""  # swaps: "<served model> right" / "... wrong", measured when the app opens (grade_examples)

    @property
    def label(self) -> str:
        return f"{self.type}{f' ({self.verdict})' if self.verdict else ''}: {self.positive}  |  {self.negative}"


@dataclass
class QueryImage:
    """An image a request named: ``image`` RGB PIL, ``name`` (its file path, which also identifies it for adapters
    trained on ground-truth boxes), ``image_id`` (collection images; None for uploads), ``note`` (how its pixels
    were converted, if they were)."""

    image: Any
    name: str
    image_id: str | None = None
    note: str | None = None


@dataclass
class Heatmaps:
    """Heatmaps of one caption's phrases on one image: ``image`` and ``annotations`` as gr.AnnotatedImage takes
    them, ``maps`` (serve.heatmap.PhraseMap), ``explanation`` (ComAlign's score rebuilt from its parts, or None),
    ``method``; ``note``: why there are no boxes (:func:`box_note`), or None."""

    image: Any
    annotations: list
    maps: list
    explanation: Any
    method: str
    note: str | None = None


@dataclass
class Probe:
    """The caption probe's answer: one row per model (``model``, ``score_a``, ``score_b``, ``prefers`` "A" / "B" /
    "tie"), the heatmaps of both captions, and notes."""

    rows: list[dict]
    heat_a: Heatmaps | None
    heat_b: Heatmaps | None
    notes: list[str] = field(default_factory=list)


_DECODE_LOCK = threading.Lock()  # extract.data.images.decode_image changes the process's warning filters while it runs


def decode_checked(src, max_pixels: int, what: str):
    """extract.data.images.decode_image under the process-wide decode lock; a refusal is a QueryError naming ``what``."""
    from extract.data.images import BadImage, decode_image

    try:
        with _DECODE_LOCK:
            return decode_image(src, max_pixels=max_pixels)
    except BadImage as e:
        raise QueryError(f"{what}: {e}") from None


class Served:
    """One index served with limits: its :class:`serve.search.Searcher`, the base model under it (for the caption
    probe), per-phrase heatmaps (:class:`serve.heatmap.Heatmapper`, made on first use), the toy world's probe
    examples and the about line. Thread-safe: searches only read, the gate bounds the work in flight."""

    def __init__(self, searcher: Searcher, limits: Limits = Limits(), *, recall: dict | None = None):
        self.searcher, self.limits = searcher, limits
        self.gate = Gate(limits.concurrency, limits.queue)
        self.recall = recall
        self.base = base_scorer(searcher.scorer)
        self._heatmapper = None
        self._lock = threading.Lock()
        self._rows: dict[str, int] | None = None  # image id -> row, made on first use
        self.started = time.time()
        self.upload_dir: str | None = None  # where uploads may be read from; None: Gradio's upload folder
        self.redactor = Redactor(server_paths(searcher))
        self.examples = grade_examples(self, probe_examples(searcher, GRADE_CANDIDATES))  # scores: needs the above

    @classmethod
    def open(cls, index_dir: str | os.PathLike, *, device: str = "cpu", annotations=None, detector: str | None = None,
             limits: Limits = Limits(), recall: bool | None = None, candidates: int = DEFAULT_CANDIDATES) -> "Served":
        """Open ``index_dir`` (serve.search.Searcher.open) and, with ``recall`` True (None: when the collection
        holds at most RECALL_LIMIT images + captions), measure its served R@k once: first stage, and re-ranked
        with ``candidates`` when the model has a second stage."""
        searcher = Searcher.open(index_dir, device=device, annotations=annotations, detector=detector)
        if recall is None:
            recall = searcher.num_captions > 0 and searcher.num_images + searcher.num_captions <= RECALL_LIMIT
        return cls(searcher, limits, recall=measure_recall(searcher, candidates) if recall else None)

    def public(self, value):
        """``value`` (an answer: text, JSON-like data, a page's outputs) as a client may see it: every path of the
        server replaced by its name (serve.redact), unless the operator started the server with ``--show-paths``."""
        return value if self.limits.show_paths else self.redactor.value(value)

    # -- the collection --------------------------------------------------------------------------------
    def image_ids(self, limit: int | None = None) -> list[str]:
        """The collection's image ids in row order (the first ``limit``)."""
        ids = self.searcher.collection("image").column("image_id")
        return [str(v) for v in (ids if limit is None else ids[:limit])]

    def row_of(self, image_id) -> int:
        """The row of a collection image id; an unknown id is a QueryError."""
        with self._lock:
            if self._rows is None:
                self._rows = {v: r for r, v in enumerate(self.image_ids())}
        key = str(image_id).strip()
        if key not in self._rows:
            raise QueryError(f"no image {key[:80]!r} in the served collection ({len(self._rows):,} images; ids look "
                             f"like {next(iter(self._rows), '?')!r})")
        return self._rows[key]

    def collection_image(self, image_id) -> QueryImage:
        """A collection image by id, decoded with the pixel limit (its path comes from the index's metadata)."""
        row = self.row_of(image_id)
        path = str(self.searcher.collection("image").column("path")[row])
        decoded = decode_checked(path, self.limits.max_pixels, f"collection image {image_id}")
        return QueryImage(decoded.image, path, str(image_id).strip(), decoded.note)

    def uploaded_image(self, path) -> QueryImage:
        """An uploaded file: a regular file inside Gradio's upload folder (serve.request_guard, which refuses any
        other reference before Gradio sees it; checked again here, on the name alone), its size in bytes checked
        before reading, then decoded."""
        from serve.request_guard import in_folder

        if not isinstance(path, (str, os.PathLike)):
            raise QueryError(f"an upload is a file sent to the upload route, got {type(path).__name__}")
        path = os.fspath(path)
        name = os.path.basename(path) or "upload"
        if not in_folder(path, self.upload_dir):
            raise QueryError(f"{name[:80]!r} was not uploaded to this server: only files sent to its upload route "
                             "are read")
        path = os.path.realpath(path)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise QueryError(f"the upload {name!r} is gone (uploads are kept a while only): upload it again") from None
        if not os.path.isfile(path):
            raise QueryError(f"the upload {name[:80]!r} is not a file")
        if size > self.limits.max_upload_bytes:
            raise QueryError(f"{name}: {size:,} bytes is more than the {self.limits.max_upload_bytes:,} an upload "
                             "may have")
        decoded = decode_checked(path, self.limits.max_pixels, name)
        return QueryImage(decoded.image, path, None, decoded.note)

    def query_image(self, upload=None, image_id=None) -> QueryImage:
        """The upload if one was given, else the collection image ``image_id``; neither is a QueryError."""
        if upload:
            return self.uploaded_image(upload)
        if image_id is not None and str(image_id).strip():
            return self.collection_image(image_id)
        raise QueryError("no image: upload one, or pick one of the collection by its id")

    def thumbnail(self, row: int):
        """Collection image ``row`` for the gallery: at most THUMBNAIL px on its long side (JPEGs decoded at reduced
        size), a small image enlarged by a whole factor with its pixels kept sharp. A file that cannot be read any
        more gives a grey square (the hit stays listed)."""
        from PIL import Image

        path = str(self.searcher.collection("image").column("path")[row])
        grey = Image.new("RGB", (THUMBNAIL, THUMBNAIL), (128, 128, 128))
        try:
            with Image.open(path) as im:
                if im.size[0] * im.size[1] > self.limits.max_pixels:
                    return grey
                im.draft("RGB", (THUMBNAIL, THUMBNAIL))
                image = im.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError):
            return grey
        return fit(image, THUMBNAIL)

    # -- searching -------------------------------------------------------------------------------------
    def _bounded(self, k, candidates) -> tuple[int, int | None]:
        k = whole_number(k, "k")
        candidates = None if candidates is None else whole_number(candidates, "candidates")
        for name, value in (("k", k), ("candidates", candidates)):
            if value is not None and not 1 <= value <= self.limits.max_results:
                raise QueryError(f"{name} must be between 1 and {self.limits.max_results}, got {value}")
        return k, candidates

    def text_to_image(self, query, k: int = 10, rerank: int | None = None, where=None, offset: int = 0):
        """Images for a text (serve.search.Searcher.search_text), ``rerank`` first-stage candidates re-scored."""
        k, rerank = self._bounded(k, rerank)
        with self.gate.hold():
            return self.searcher.search_text(query, k=k, rerank=rerank, where=where, offset=offset)

    def image_to_text(self, image: QueryImage, k: int = 10, rerank: int | None = None, where=None, offset: int = 0):
        """Captions for a decoded query image (Searcher.search_image). A model that reads ground-truth boxes and has
        none for the image (an upload its annotations do not name) is not asked to re-rank blind: the image is
        searched by the first stage only, and the hits carry :func:`box_note` (``hits.box_note``, and a note)."""
        k, rerank = self._bounded(k, rerank)
        pil = image.image
        pil.filename = image.name  # the name Searcher reads from a PIL image: an adapter's boxes are found by it
        boxes = box_note(self.searcher.scorer, image, "searched by the first stage only, not re-ranked"
                         if rerank and self.searcher.has_second_stage else "searched by the first stage only")
        with self.gate.hold():
            hits = self.searcher.search_image(pil, k=k, rerank=None if boxes else rerank, where=where, offset=offset,
                                              missing_boxes="empty" if boxes else "error")
        hits.box_note = boxes
        notes = [n for n in (image.note and f"query image: {image.note}", boxes) if n]
        hits.notes[:0] = notes
        return hits

    # -- heatmaps --------------------------------------------------------------------------------------
    @property
    def heatmapper(self):
        """serve.heatmap.Heatmapper of the served scorer, made on first use (it loads spaCy)."""
        with self._lock:
            if self._heatmapper is None:
                from serve.heatmap import Heatmapper

                scorer = self.searcher.scorer
                self._heatmapper = Heatmapper(scorer, device=scorer.backbone.device)
            return self._heatmapper

    @property
    def heatmap_methods(self) -> tuple[str, ...]:
        """The heatmap methods of the served backbone (a ResNet tower has the raw map only)."""
        from extract.models.backbone import is_vit
        from serve.heatmap import METHODS

        model = getattr(getattr(self.searcher.scorer, "backbone", None), "model", None)
        return ("raw",) if model is not None and not is_vit(model.visual) else METHODS

    def heatmaps(self, image: QueryImage, caption, method: str | None = None, explain: bool = True) -> Heatmaps:
        """Per-phrase heatmaps of ``caption`` on ``image`` by ``method`` (default: serve.heatmap's), with ComAlign's
        winning boxes and, with ``explain``, its score rebuilt from its parts. One Heatmapper.explained_maps call:
        the boxes drawn are those of the explanation shown (ComAlign's components are extracted once)."""
        from extract.data.images import BadCaption, validate_caption

        try:
            text = validate_caption(caption)
        except BadCaption as e:
            raise QueryError(f"bad caption: {e}") from None
        text, _ = self.searcher.check_text(text)
        if method is not None and method not in self.heatmap_methods:
            raise QueryError(f"unknown heatmap method {method!r}; choose from {', '.join(self.heatmap_methods)}")
        mapper = self.heatmapper
        chosen = method or self.heatmap_methods[0]
        # the model's boxes come from the image's annotations: an image they do not name gets the maps alone
        note = box_note(self.searcher.scorer, image, "its heatmaps are shown without boxes or a score explanation")
        with self.gate.hold():
            if note is None:
                maps, explanation = mapper.explained_maps(image.image, text, chosen, image_id=image.name)
            else:
                maps = mapper.maps_by_method(image.image, text, [chosen], image_id=image.name, explain=False)[chosen]
                explanation = None
        if not explain:
            explanation = None
        pil, annotations = render(image.image, maps)
        return Heatmaps(pil, annotations, maps, explanation, chosen, note)

    # -- the caption probe -----------------------------------------------------------------------------
    def probe(self, image: QueryImage, caption_a, caption_b, method: str | None = None,
              with_heatmaps: bool = True) -> Probe:
        """Which of two captions each model prefers for ``image``: the base (the frozen backbone alone: cosine)
        and the served model (its own score, image -> text direction as the evaluation suite's hard-negative
        accuracy: ComAlign eq. 11); a bare backbone is its own base and gives one row."""
        from extract.data.images import BadCaption, validate_caption

        texts = []
        for label, caption in (("A", caption_a), ("B", caption_b)):
            try:
                texts.append(self.searcher.check_text(validate_caption(caption))[0])
            except BadCaption as e:
                raise QueryError(f"caption {label}: {e}") from None
            except QueryError as e:
                raise QueryError(f"caption {label}: {e}") from None
        from serve.search import directed_score

        import torch

        scorer = self.searcher.scorer
        rows, notes = [], [n for n in (box_note(scorer, image, "its score here rests on the global terms (no entity "
                                                               "or relation components)"),) if n]
        models = ([("base: " + self.base.name, self.base)] if self.base is not None else []) + [(scorer.name, scorer)]
        if self.base is None:
            notes.append(f"{scorer.name} is a bare backbone: there is no adapter to compare with (serve an adapter's "
                         "index, e.g. the one python -m train.demo builds, to see both)")
        with self.gate.hold():
            for label, model in models:
                with torch.no_grad():
                    reps = encode_image(model, image)
                    s = directed_score(model, reps, model.encode_texts(texts), "i2t")[0].float().cpu().numpy()
                a, b = float(s[0]), float(s[1])
                prefers = "tie" if a == b or not (math.isfinite(a) and math.isfinite(b)) else ("A" if a > b else "B")
                rows.append({"model": label, "score_a": a, "score_b": b, "prefers": prefers})
        heat_a = self.heatmaps(image, texts[0], method, explain=False) if with_heatmaps else None
        heat_b = self.heatmaps(image, texts[1], method, explain=False) if with_heatmaps else None
        return Probe(rows, heat_a, heat_b, notes)

    # -- about -----------------------------------------------------------------------------------------
    def describe(self) -> dict:
        """What is served, as data: model, its kind and method, the index key, collection size, served R@k."""
        m = self.searcher.manifest
        scorer = self.searcher.scorer
        entry = m["indexes"]["image"]
        meta = getattr(scorer, "meta", None) or {}
        if meta.get("method"):
            how = f"adapter {meta['method']}: re-ranks its first-stage candidates with its own score"
        elif self.searcher.has_second_stage:
            how = f"{m['model'].get('kind')}: re-ranks its first-stage candidates with its own score"
        else:
            how = "bare backbone: its first stage is its exact score, no second stage"
        return {"index": str(self.searcher.index_dir), "model": scorer.name, "kind": m["model"].get("kind"),
                "method": meta.get("method"), "how": how, "second_stage": self.searcher.has_second_stage,
                "index_key": entry["key"], "index_kind": entry["kind"], "params": entry.get("params") or {},
                "images": self.searcher.num_images, "captions": self.searcher.num_captions, "recall": self.recall}

    def about(self) -> str:
        """The about line (Markdown)."""
        d = self.describe()
        line = (f"**{html.escape(d['model'])}** ({html.escape(d['how'])}) · index "
                f"`{d['index_key']}` ({search_params(d)}) · **{d['images']:,} images, {d['captions']:,} captions**")
        return line + " · " + recall_text(self.recall)


def search_params(described: dict) -> str:
    """"exact" for a flat index, else its search parameters ("nprobe 16")."""
    if described["index_kind"] == "flat":
        return "exact"
    return ", ".join(f"{k} {v}" for k, v in described["params"].items()) or described["index_kind"]


def recall_text(recall: dict | None) -> str:
    """served R@k as one line of Markdown (from :func:`measure_recall`)."""
    if not recall:
        return (f"served R@k not measured at start-up (--recall off, or more than {RECALL_LIMIT:,} images + captions): "
                "`python -m serve.query INDEX --recall` measures it")
    parts = []
    for label, r in recall["rows"].items():
        cells = [f"{name} " + "/".join(f"{r[d][f'R@{k}']:.1f}" for k in recall["ks"])
                 for d, name in (("text_to_image", "text→image"), ("image_to_text", "image→text"))]
        parts.append(f"{label}: " + ", ".join(cells))
    return f"served R@{'/'.join(map(str, recall['ks']))} (%) " + "; ".join(parts)


def measure_recall(searcher: Searcher, candidates: int | None = DEFAULT_CANDIDATES) -> dict:
    """served R@1/5/10 of the collection (serve.recall.served_recall, queries from the cache): the first stage,
    and re-ranked with ``candidates`` when the model has a second stage; with the seconds it took."""
    from serve.recall import served_recall

    started = time.perf_counter()
    rows = {"first stage": served_recall(searcher, None)}
    if searcher.has_second_stage and candidates:
        rows[f"re-ranked K={candidates}"] = served_recall(searcher, candidates)
    ks = [int(k.split("@")[1]) for k in rows["first stage"]["text_to_image"] if k.startswith("R@")]
    return {"rows": rows, "ks": ks, "seconds": round(time.perf_counter() - started, 2)}


def base_scorer(scorer):
    """The frozen backbone under an adapter or pre-trained scorer, as a scorer (cosine of global embeddings), for
    the probe's base column; None when ``scorer`` is that already."""
    from adapters.scoring import BackboneScorer

    backbone = getattr(scorer, "backbone", None)
    if isinstance(scorer, BackboneScorer) or backbone is None:
        return None
    base = (getattr(scorer, "meta", None) or {}).get("base", {}).get("base") or backbone.spec.model
    return BackboneScorer(backbone, name=str(base))


def box_note(scorer, image: QueryImage, consequence: str) -> str | None:
    """None, or the note (``consequence``: what the answer does about it) when ``scorer`` reads ground-truth boxes
    and its annotations hold no entry for ``image`` (an upload they do not name by file name): the model would
    score it blind, so the answer says so and how to give it boxes."""
    extractor = getattr(scorer, "extractor", None)
    if extractor is None or not getattr(extractor, "reads_boxes", False):
        return None
    boxes = extractor.boxes
    if boxes is not None and boxes.has(image.name):
        return None
    # the box file by its name only: an answer never says where the server keeps its files (serve.redact)
    where = (f"{source_name(boxes.source)!r} ({boxes.format}) holds no entry for {source_name(image.name)!r}"
             if boxes is not None and len(boxes) else "no box file was given")
    return (f"{scorer.name} reads ground-truth boxes and has none for this image ({where}): {consequence}. To give "
            "it boxes, start the server with --annotations FILE (COCO instances, Visual Genome objects.json or a "
            "toy world, naming the image by file name) or --detector WEIGHTS.pt")


def encode_image(scorer, image: QueryImage):
    """The scorer's representation of one decoded image (adapters: live component extraction, boxes by name). An
    image the model has no boxes for is encoded without them: callers say so (:func:`box_note`)."""
    if hasattr(scorer, "encode_pil"):
        return scorer.encode_pil([image.image], [image.name], missing_boxes="empty")
    return scorer.encode_images(scorer.preprocess(image.image)[None])


def grade_examples(served: "Served", candidates: list[ProbeExample], per_type: int = 2) -> list[ProbeExample]:
    """The probe's examples: of each :data:`GRADED_TYPES` type, the first pair the served model gets right and the
    first it gets wrong (its own image -> text score, as :meth:`Served.probe`), labelled so; of the other types the
    first ``per_type``; shortest captions first (they read at a glance). PROBE_TYPES order."""
    out = []
    for kind in PROBE_TYPES:
        pool = sorted((e for e in candidates if e.type == kind), key=lambda e: len(e.positive))
        if kind not in GRADED_TYPES:
            out += pool[:per_type]
            continue
        found: dict[bool, ProbeExample] = {}
        for e in pool:
            try:
                row = served.probe(served.collection_image(e.image_id), e.positive, e.negative,
                                   with_heatmaps=False).rows[-1]  # the served model's row
            except (QueryError, OSError):  # an image moved or unreadable since indexing: not an example
                continue
            right = row["prefers"] == "A"
            found.setdefault(right, with_fields(
                e, verdict=f"{served.searcher.scorer.name} {'right' if right else 'wrong'}"))
            if len(found) == 2:
                break
        out += [found[v] for v in (True, False) if v in found]
    return out


def probe_examples(searcher: Searcher, per_type: int = 2) -> list[ProbeExample]:
    """Hard-negative pairs of the served collection's images from the toy world's ``negatives.json`` (up to
    ``per_type`` of each type, PROBE_TYPES order); [] when the collection is not a toy world."""
    spec = (searcher.manifest.get("data") or {}).get("spec")
    path = Path(str(spec)) / "negatives.json" if isinstance(spec, str) else None
    if path is None or not path.is_file():
        return []
    try:
        items = json.loads(path.read_text(encoding="utf-8"))["items"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    ids = set(str(v) for v in searcher.collection("image").column("image_id"))
    found: dict[str, list[ProbeExample]] = {t: [] for t in PROBE_TYPES}
    for item in items:
        if str(item.get("image_id")) not in ids:
            continue
        for neg in item.get("negatives", ()):
            bucket = found.get(neg.get("type"))
            if bucket is not None and len(bucket) < per_type:
                bucket.append(ProbeExample(str(item["image_id"]), item["positive"], neg["text"], neg["type"]))
    return [e for t in PROBE_TYPES for e in found[t]]


# --------------------------------------------------------------------------------------------- display helpers
