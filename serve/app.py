"""The Gradio page of ``python -m serve``: text -> image with the model's own re-ranking and a heatmap per noun phrase,
image -> text, the caption probe (base vs adapter on a caption and its hard negative), and an about line.

Everything the page does is a method of :class:`Served`, which returns plain data and is tested without a browser;
:func:`build_blocks` lays out the page over it and names its events, which are the app's Gradio API
(``gradio_client.Client(URL).predict(..., api_name=...)``; the page's "Use via API" link lists them):

    /text_to_image(query, k, rerank, candidates)   -> gallery, hits table, notes
    /heatmap(image_id, caption, method)             -> annotated image, explanation of the re-ranked score
    /image_to_text(upload, image_id, k, rerank, candidates) -> the query image, captions table, notes
    /caption_heatmap(upload, image_id, caption, method)     -> annotated image, explanation
    /caption_probe(upload, image_id, caption_a, caption_b, method) -> preferences table, heatmap A, heatmap B, notes
    /about()                                        -> the about line (Markdown)

``image_id`` names an image of the served collection (its ``image_id`` in ``image.arrow``); ``upload`` is a file
(``gradio_client.handle_file(path)``); give one of the two.

Safety. Collection images are read by their row in the index's metadata, never by a path from a request, and
handed to Gradio as pixels (so Gradio's file route needs no ``allowed_paths``); uploads are read from Gradio's upload
folder only, refused above ``Limits.max_upload_bytes`` and decoded by :func:`extract.images.decode_image` with
``Limits.max_pixels`` checked from the header before any pixel is decoded (decompression bombs are refused, not
decoded). At most ``Limits.concurrency`` model computations run at once and ``Limits.queue`` more wait
(:class:`Gate`, shared with the HTTP API); beyond that a request is told the server is busy. Every refused input is
one readable message (a ``gr.Error`` in the page, an ``AppError`` for gradio_client) and the app keeps serving.
"""
from __future__ import annotations

import contextlib
import html
import json
import math
import os
import re
import threading
import time
import traceback
from dataclasses import dataclass, field, replace as with_fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from serve.heatmap_render import fit, render
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
GRADED_TYPES = ("swap-att", "swap-obj")
#: hard-negative pairs scored per graded type, looking for one right and one wrong (bounds the app's start-up)
GRADE_CANDIDATES = 12


# --------------------------------------------------------------------------------------------- limits
@dataclass(frozen=True)
class Limits:
    """What one request may ask. ``max_upload_bytes``: an uploaded image (or a /knn-service body, base64 and JSON
    added); ``max_pixels``: width x height of any decoded image, read from the header; ``concurrency``: model
    computations at once (page and HTTP API together); ``queue``: requests waiting beyond those (more are told the
    server is busy); ``max_results``: hits (and re-ranked candidates) one request may ask for."""

    max_upload_bytes: int = 10 * 2**20
    max_pixels: int = 25_000_000
    concurrency: int = 2
    queue: int = 32
    max_results: int = 1000

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
    ``method``."""

    image: Any
    annotations: list
    maps: list
    explanation: Any
    method: str


@dataclass
class Probe:
    """The caption probe's answer: one row per model (``model``, ``score_a``, ``score_b``, ``prefers`` "A" / "B" /
    "tie"), the heatmaps of both captions, and notes."""

    rows: list[dict]
    heat_a: Heatmaps | None
    heat_b: Heatmaps | None
    notes: list[str] = field(default_factory=list)


_DECODE_LOCK = threading.Lock()  # extract.images.decode_image changes the process's warning filters while it runs


def decode_checked(src, max_pixels: int, what: str):
    """extract.images.decode_image under the process-wide decode lock; a refusal is a QueryError naming ``what``."""
    from extract.images import BadImage, decode_image

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
        """Captions for a decoded query image (Searcher.search_image)."""
        k, rerank = self._bounded(k, rerank)
        pil = image.image
        pil.filename = image.name  # the name Searcher reads from a PIL image: an adapter's boxes are found by it
        with self.gate.hold():
            hits = self.searcher.search_image(pil, k=k, rerank=rerank, where=where, offset=offset)
        notes = [n for n in (image.note and f"query image: {image.note}", box_note(self.searcher.scorer, image)) if n]
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
        from extract.backbone import is_vit
        from serve.heatmap import METHODS

        model = getattr(getattr(self.searcher.scorer, "backbone", None), "model", None)
        return ("raw",) if model is not None and not is_vit(model.visual) else METHODS

    def heatmaps(self, image: QueryImage, caption, method: str | None = None, explain: bool = True) -> Heatmaps:
        """Per-phrase heatmaps of ``caption`` on ``image`` by ``method`` (default: serve.heatmap's), with ComAlign's
        winning boxes and, with ``explain``, its score rebuilt from its parts. One Heatmapper.explained_maps call:
        the boxes drawn are those of the explanation shown (ComAlign's components are extracted once)."""
        from extract.images import BadCaption, validate_caption

        try:
            text = validate_caption(caption)
        except BadCaption as e:
            raise QueryError(f"bad caption: {e}") from None
        text, _ = self.searcher.check_text(text)
        if method is not None and method not in self.heatmap_methods:
            raise QueryError(f"unknown heatmap method {method!r}; choose from {', '.join(self.heatmap_methods)}")
        mapper = self.heatmapper
        with self.gate.hold():
            maps, explanation = mapper.explained_maps(image.image, text, method, image_id=image.name)
        if not explain:
            explanation = None
        pil, annotations = render(image.image, maps)
        return Heatmaps(pil, annotations, maps, explanation, method or self.heatmap_methods[0])

    # -- the caption probe -----------------------------------------------------------------------------
    def probe(self, image: QueryImage, caption_a, caption_b, method: str | None = None,
              with_heatmaps: bool = True) -> Probe:
        """Which of two captions each model prefers for ``image``: the base (the frozen backbone alone: cosine)
        and the served model (its own score, image -> text direction as the evaluation suite's hard-negative
        accuracy: ComAlign eq. 11); a bare backbone is its own base and gives one row."""
        from extract.images import BadCaption, validate_caption

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
        rows, notes = [], [n for n in (box_note(scorer, image),) if n]
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
    """served R@1/5/10 of the collection (serve.search.served_recall, queries from the cache): the first stage,
    and re-ranked with ``candidates`` when the model has a second stage; with the seconds it took."""
    from serve.search import served_recall

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


def box_note(scorer, image: QueryImage) -> str | None:
    """A note when ``scorer`` is an adapter trained on ground-truth boxes and none are known for ``image`` (an
    upload): its entity / relation components are then empty and its score rests on the global terms."""
    extractor = getattr(scorer, "extractor", None)
    if extractor is None or getattr(extractor.components, "box_source", None) != "gt":
        return None
    from extract.regions import annotation_for

    if annotation_for(extractor.annotations or {}, extractor.image_id(image.name)).get("objects"):
        return None
    return (f"{scorer.name} was trained on ground-truth boxes and none are known for this image: its entity and "
            "relation components are empty, so its score rests on the global terms")


def encode_image(scorer, image: QueryImage):
    """The scorer's representation of one decoded image (adapters: live component extraction, boxes by name)."""
    if hasattr(scorer, "encode_pil"):
        return scorer.encode_pil([image.image], [image.name])
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
def rank_change(hit) -> str:
    """"↑2" (moved up two places by re-ranking), "↓1", or "=" ."""
    moved = hit.rank_before - hit.rank_after
    return "=" if moved == 0 else (f"↑{moved}" if moved > 0 else f"↓{-moved}")


def _score(value) -> str:
    return "" if value is None else f"{value:.4f}"


def gallery_items(served: Served, hits) -> list[tuple[Any, str]]:
    """(thumbnail, caption) per image hit: rank, its move under re-ranking, both scores, id."""
    items = []
    for h in hits:
        moved = f" {rank_change(h)} from #{h.rank_before}" if h.rerank_score is not None else ""
        scores = (f"re-ranked {h.rerank_score:.3f} · stage 1 {h.score:.3f}" if h.rerank_score is not None
                  else f"score {h.score:.3f}")
        items.append((served.thumbnail(h.row), f"#{h.rank_after}{moved} · {scores} · {h.id}"))
    return items


HIT_HEADERS = ["rank", "stage-1 rank", "change", "stage-1 score", "re-ranked score", "id", "caption"]


def hits_table(hits) -> dict:
    """The hits as gr.Dataframe data (``headers``, ``data``): image hits show their first caption, caption hits
    their text."""
    data = []
    for h in hits:
        caption = h.text if h.text is not None else next(iter(h.metadata.get("captions") or []), "")
        data.append([h.rank_after, h.rank_before, rank_change(h), _score(h.score), _score(h.rerank_score),
                     h.id, caption])
    return {"headers": HIT_HEADERS, "data": data}


def notes_text(hits, extra: Sequence[str] = ()) -> str:
    """The search's notes and timings as Markdown."""
    stages = ", ".join(f"{k} {v:.1f} ms" for k, v in hits.timings.items())
    what = "images" if hits.direction == "t2i" else "captions"
    head = (f"{len(hits)} {what} of {hits.considered} candidates"
            + (f", first {hits.rerank} re-ranked by the model" if hits.rerank else ", first stage only")
            + (f" · {stages}" if stages else ""))
    return "\n".join([head] + [f"- {html.escape(n)}" for n in [*extra, *hits.notes]])


def explanation_text(heat: Heatmaps) -> str:
    """The phrases' peaks and, for ComAlign, its text->image score rebuilt from the winning components (eq. 10)."""
    lines = [f"heatmap: **{heat.method}** · " + ", ".join(
        f"{html.escape(m.label)} (peak {m.peak:.3f})" for m in heat.maps)]
    e = heat.explanation
    if e is not None:
        lines += ["", "| component | kind | winning box | similarity |", "|---|---|---|---|"]
        for c in e.components:
            box = "none" if c.box is None else "(" + ", ".join(f"{v:.0f}" for v in c.box) + ")"
            lines.append(f"| {html.escape(c.text)} | {c.kind} | {box} | {c.score:.4f} |")
        terms = " + ".join(f"{e.weights[k]:.3f} × {k} {e.terms[k]:.4f}" for k in e.weights)
        lines += ["", f"score = {terms} = **{e.score:.4f}** (the re-ranked text→image score)"]
    return "\n".join(lines)


def probe_table(probe: Probe) -> dict:
    data = [[r["model"], f"{r['score_a']:.4f}", f"{r['score_b']:.4f}", r["prefers"]] for r in probe.rows]
    return {"headers": ["model", "caption A", "caption B", "prefers"], "data": data}


# --------------------------------------------------------------------------------------------- calls through the API
_CALL = re.compile(r"^/gradio_api/(?:call|run|api)/(?!v2/)([^/]+)/?$")
_CALL_V2 = re.compile(r"^/gradio_api/call/v2/([^/]+)/?$")


def call_problem(blocks, path: str, body) -> str | None:
    """Why a Gradio API call of this page (``POST /gradio_api/call|run|api/<name>``, ``/call/v2/<name>`` or the
    page's ``/gradio_api/queue/join``) cannot even reach its event, or None: the number of its arguments, and a file
    argument that is not a file reference. Gradio fails on those before any of our code runs, and prints a
    traceback in the server's log for each; refused here with one line instead. A value of the wrong kind for its
    input (a word for a slider) reaches the event and is answered there, by :func:`check_inputs`, as an error
    event every client reads (gradio_client raises it as AppError). Anything else (an unknown name, a body of
    another shape) is left to Gradio, which answers it."""
    import gradio as gr

    if not isinstance(body, dict):
        return None
    fn = None
    m = _CALL.match(path) or _CALL_V2.match(path)
    if m:
        fn = next((f for f in blocks.fns.values() if f.api_name == m.group(1)), None)
    elif path.rstrip("/") == "/gradio_api/queue/join" and isinstance(body.get("fn_index"), int):
        fn = blocks.fns.get(body["fn_index"])
    data = body.get("data")
    if fn is None or not isinstance(data, list):
        return None
    name = fn.api_name if isinstance(fn.api_name, str) else f"event {fn._id}"
    if len(data) != len(fn.inputs):
        return f"{name} takes {len(fn.inputs)} arguments, got {len(data)}"
    for k, (component, value) in enumerate(zip(fn.inputs, data)):
        if isinstance(component, gr.File) and value is not None and not isinstance(value, dict):
            return (f"{name}: argument {k + 1} ({component.label}): expected a file (upload it: "
                    "gradio_client.handle_file) or null")
    return None


def check_inputs(blocks) -> None:
    """Make every input of the page's events refuse a value of the wrong kind with one line (a gr.Error that prints
    nothing in the server's log) before Gradio's own handling of it, which answers too but prints a traceback
    first: each component's ``preprocess`` is wrapped with :func:`argument_problem`."""
    import functools

    import gradio as gr

    seen = set()
    for fn in blocks.fns.values():
        for component in fn.inputs:
            if id(component) in seen or isinstance(component, (gr.File, gr.State)):
                continue
            seen.add(id(component))
            original = component.preprocess

            @functools.wraps(original)
            def preprocess(payload, component=component, original=original):
                label = getattr(component, "label", None) or type(component).__name__
                problem = argument_problem(component, payload)
                if problem:
                    raise gr.Error(html.escape(f"{label}: {problem}"), print_exception=False)
                try:
                    return original(payload)
                except gr.Error as e:
                    raise gr.Error(e.message, print_exception=False) from None
                except Exception as e:  # Gradio's own check of the value: its message, on one line
                    raise gr.Error(html.escape(f"{label}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"),
                                   print_exception=False) from None

            component.preprocess = preprocess


def argument_problem(component, value) -> str | None:
    """What is wrong with ``value`` as the input of ``component`` of this page, or None (a file argument is checked
    by :func:`call_problem` and serve.request_guard.file_problem, before Gradio reads it)."""
    import gradio as gr

    def number() -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if isinstance(component, gr.Slider):
        if not number():
            return f"expected a number, got {_shown(value)}"
        if not component.minimum <= value <= component.maximum:
            return f"expected {component.minimum:g} to {component.maximum:g}, got {value:g}"
        return None
    if isinstance(component, gr.Checkbox):
        return None if isinstance(value, bool) else f"expected true or false, got {_shown(value)}"
    if isinstance(component, (gr.Radio, gr.Dropdown)):
        choices = [c[1] if isinstance(c, (tuple, list)) else c for c in (component.choices or [])]
        if value is None or (isinstance(component, gr.Dropdown) and component.allow_custom_value
                             and isinstance(value, (str, int, float)) and not isinstance(value, bool)):
            return None
        return None if value in choices else f"expected one of {', '.join(map(str, choices[:8]))}, got {_shown(value)}"
    if isinstance(component, gr.Textbox):
        return None if value is None or isinstance(value, str) else f"expected text, got {_shown(value)}"
    return None


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=True) if isinstance(value, (str, int, float, bool, type(None))) else \
        type(value).__name__
    return text if len(text) <= 60 else text[:60] + "..."


# --------------------------------------------------------------------------------------------- the page
def page_error(e: BaseException) -> str:
    """The one readable line a refused request shows (HTML-escaped: Gradio renders error messages as HTML)."""
    return html.escape(str(e).splitlines()[0] if str(e) else type(e).__name__)


def _guard(fn):
    """Wrap a page handler: refused input and a busy server become a gr.Error with their message; anything else is
    logged with its traceback on the console and shown as one line, and the app keeps serving."""
    import functools

    import gradio as gr

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except (ValueError, OSError, Busy) as e:
            raise gr.Error(page_error(e), duration=15, print_exception=False) from None
        except Exception as e:  # a bug: the traceback goes to the server's console, the page gets one line
            traceback.print_exc()
            raise gr.Error(f"internal error ({html.escape(type(e).__name__)}); the server logged it and keeps "
                           "serving", duration=15, print_exception=False) from None

    return wrapped


def page_theme():
    """Gradio's default theme with system fonts: the page fetches no web font (it works offline)."""
    import gradio as gr

    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


def build_blocks(served: Served):
    """The gr.Blocks page over ``served`` (module docstring), its queue set from ``served.limits``."""
    import gradio as gr

    methods = list(served.heatmap_methods)
    example = served.examples[0] if served.examples else None
    id_choices = served.image_ids(2000)  # a dropdown of a million ids helps nobody; any id can be typed
    first_id = example.image_id if example else (id_choices[0] if id_choices else None)

    def image_input(label: str, elem: str):
        with gr.Row():
            upload = gr.File(label=f"{label}: upload an image (it takes precedence)", type="filepath",
                             file_count="single", scale=2, elem_id=f"{elem}-upload")
            image_id = gr.Dropdown(choices=id_choices, value=first_id, allow_custom_value=True, scale=1,
                                   label="... or an image of the collection (its id)", elem_id=f"{elem}-image-id")
        return upload, image_id

    def search_controls(noun: str):
        """k, the re-ranking switch (off and fixed for a model without a second stage) and K."""
        second = served.searcher.has_second_stage
        return (gr.Slider(1, 50, value=10, step=1, label=f"k ({noun})"),
                gr.Checkbox(value=second, label="re-rank with the model's score", interactive=second),
                gr.Slider(1, min(1000, served.limits.max_results), value=DEFAULT_CANDIDATES, step=1,
                          label="K (first-stage candidates re-ranked)"))

    def annotated(heat: Heatmaps | None):
        return None if heat is None else (heat.image, heat.annotations)

    @_guard
    def text_to_image(query, k, rerank, candidates):
        hits = served.text_to_image(query, k, candidates if rerank else None)
        state = {"query": hits.query, "ids": [h.id for h in hits]}
        return gallery_items(served, hits), hits_table(hits), notes_text(hits), state, hits.query

    @_guard
    def heatmap(image_id, caption, method):
        heat = served.heatmaps(served.collection_image(image_id), caption, method)
        return annotated(heat), explanation_text(heat)

    def pick(state, evt):
        ids = (state or {}).get("ids") or []
        return ids[evt.index] if isinstance(evt.index, int) and evt.index < len(ids) else None

    @_guard
    def image_to_text(upload, image_id, k, rerank, candidates):
        image = served.query_image(upload, image_id)
        hits = served.image_to_text(image, k, candidates if rerank else None)
        caption = hits[0].text if hits else ""
        return fit(image.image, THUMBNAIL), hits_table(hits), notes_text(hits), caption

    @_guard
    def caption_heatmap(upload, image_id, caption, method):
        heat = served.heatmaps(served.query_image(upload, image_id), caption, method)
        return annotated(heat), explanation_text(heat)

    def pick_caption(table, evt):
        try:
            row = evt.index[0] if isinstance(evt.index, (list, tuple)) else int(evt.index)
            rows = table.values.tolist() if hasattr(table, "values") else table["data"]
            return str(rows[row][HIT_HEADERS.index("caption")])
        except (IndexError, KeyError, TypeError, ValueError):
            return gr.skip()

    @_guard
    def caption_probe(upload, image_id, caption_a, caption_b, method):
        result = served.probe(served.query_image(upload, image_id), caption_a, caption_b, method)
        notes = "\n".join(f"- {html.escape(n)}" for n in result.notes)
        return (probe_table(result), annotated(result.heat_a), explanation_text(result.heat_a),
                annotated(result.heat_b), explanation_text(result.heat_b), notes)

    # Gradio passes the selection to the parameter annotated gr.SelectData; the class itself, since this module's
    # annotations are strings (from __future__ import annotations) that Gradio cannot resolve to a local import
    pick.__annotations__["evt"] = pick_caption.__annotations__["evt"] = gr.SelectData

    def use_example(label):
        chosen = next((e for e in served.examples if e.label == label), None)
        if chosen is None:
            return gr.skip(), gr.skip(), gr.skip()
        return chosen.image_id, chosen.positive, chosen.negative

    heavy = {"concurrency_id": "model"}  # one concurrency limit shared by every event that runs the model
    # analytics off: the server calls nobody; delete_cache: the heatmaps and thumbnails Gradio saved for the page
    # are removed an hour after they were made, so the disk does not fill over a long run
    with gr.Blocks(title="plugvlm retrieval", analytics_enabled=False, delete_cache=(600, 3600)) as blocks:
        gr.Markdown("## plugvlm: compositional retrieval")
        about = gr.Markdown(served.about(), elem_id="about")
        with gr.Tab("Text → image", id="t2i"):
            with gr.Row():
                query = gr.Textbox(label="query", placeholder="a red circle to the left of a blue square", scale=4,
                                   elem_id="query", max_length=2000)
                search = gr.Button("Search", variant="primary", scale=1, elem_id="search")
            with gr.Row():
                k, rerank, candidates = search_controls("hits")
            notes = gr.Markdown(elem_id="t2i-notes")
            gallery = gr.Gallery(label="hits (select one for its heatmaps)", columns=5, height="auto",
                                 elem_id="gallery", allow_preview=False, format="png")
            table = gr.Dataframe(headers=HIT_HEADERS, label="hits", interactive=False, elem_id="t2i-table")
            state = gr.State({})
            gr.Markdown("### Heatmap of a hit: where the backbone finds each noun phrase of the query")
            with gr.Row():
                hit_id = gr.Textbox(label="image id", elem_id="hit-id", scale=1)
                hit_caption = gr.Textbox(label="caption whose phrases are mapped", elem_id="hit-caption", scale=3)
                method = gr.Radio(methods, value=methods[0], label="heatmap", elem_id="method", scale=1)
                show = gr.Button("Show heatmap", elem_id="show-heatmap", scale=1)
            heat = gr.AnnotatedImage(label="per-phrase heatmaps", elem_id="heatmap", height=420)
            explanation = gr.Markdown(elem_id="explanation")
        with gr.Tab("Image → text", id="i2t"):
            upload, image_id = image_input("query image", "i2t")
            with gr.Row():
                k2, rerank2, candidates2 = search_controls("captions")
                search2 = gr.Button("Search captions", variant="primary", elem_id="search-captions")
            with gr.Row():
                shown = gr.Image(label="query image", interactive=False, height=260, scale=1)
                with gr.Column(scale=3):
                    notes2 = gr.Markdown(elem_id="i2t-notes")
                    table2 = gr.Dataframe(headers=HIT_HEADERS, label="captions (select one for its heatmaps)",
                                          interactive=False, elem_id="i2t-table")
            with gr.Row():
                caption2 = gr.Textbox(label="caption whose phrases are mapped", scale=3)
                method2 = gr.Radio(methods, value=methods[0], label="heatmap", scale=1)
                show2 = gr.Button("Show heatmap", scale=1)
            heat2 = gr.AnnotatedImage(label="per-phrase heatmaps", height=420)
            explanation2 = gr.Markdown()
        with gr.Tab("Caption probe", id="probe"):
            gr.Markdown("One image, two captions: which does each model prefer? Pre-filled with a caption of the "
                        "image and one of its hard negatives (the toy world's swapped or replaced attributes, "
                        "objects, relations).")
            examples = gr.Dropdown([e.label for e in served.examples], value=example.label if example else None,
                                   label="hard-negative examples of the collection", elem_id="examples")
            upload3, image_id3 = image_input("image", "probe")
            with gr.Row():
                caption_a = gr.Textbox(value=example.positive if example else "", label="caption A",
                                       elem_id="caption-a")
                caption_b = gr.Textbox(value=example.negative if example else "", label="caption B",
                                       elem_id="caption-b")
            with gr.Row():
                method3 = gr.Radio(methods, value=methods[0], label="heatmap")
                compare = gr.Button("Compare", variant="primary", elem_id="compare")
            preferences = gr.Dataframe(headers=["model", "caption A", "caption B", "prefers"], interactive=False,
                                       label="scores (image → text direction)", elem_id="preferences")
            probe_notes = gr.Markdown()
            with gr.Row():
                with gr.Column():
                    heat_a = gr.AnnotatedImage(label="caption A's phrases", height=360, elem_id="heat-a")
                    explain_a = gr.Markdown()
                with gr.Column():
                    heat_b = gr.AnnotatedImage(label="caption B's phrases", height=360, elem_id="heat-b")
                    explain_b = gr.Markdown()

        # the named endpoints first: an event registered earlier with the same function would take its name
        gr.on([search.click, query.submit], text_to_image, [query, k, rerank, candidates],
              [gallery, table, notes, state, hit_caption], api_name="text_to_image", **heavy)
        show.click(heatmap, [hit_id, hit_caption, method], [heat, explanation], api_name="heatmap", **heavy)
        search2.click(image_to_text, [upload, image_id, k2, rerank2, candidates2], [shown, table2, notes2, caption2],
                      api_name="image_to_text", **heavy)
        show2.click(caption_heatmap, [upload, image_id, caption2, method2], [heat2, explanation2],
                    api_name="caption_heatmap", **heavy)
        compare.click(caption_probe, [upload3, image_id3, caption_a, caption_b, method3],
                      [preferences, heat_a, explain_a, heat_b, explain_b, probe_notes], api_name="caption_probe",
                      **heavy)
        blocks.load(served.about, None, [about], api_name="about")
        # the page's own wiring
        gallery.select(pick, [state], [hit_id], api_visibility="private").then(
            heatmap, [hit_id, hit_caption, method], [heat, explanation], api_visibility="private", **heavy)
        method.change(lambda i, c, m: heatmap(i, c, m) if i else (gr.skip(), gr.skip()),  # no hit chosen yet
                      [hit_id, hit_caption, method], [heat, explanation], api_visibility="private", **heavy)
        table2.select(pick_caption, [table2], [caption2], api_visibility="private").then(
            caption_heatmap, [upload, image_id, caption2, method2], [heat2, explanation2], api_visibility="private",
            **heavy)
        examples.change(use_example, [examples], [image_id3, caption_a, caption_b], api_visibility="private")
    blocks.queue(max_size=served.limits.queue, default_concurrency_limit=served.limits.concurrency)
    check_inputs(blocks)
    return blocks
