"""Search an index directory (``python -m serve.index``) with a model's own compositional re-ranking.

    searcher = Searcher.open("runs/index")                  # the model the manifest names
    hits = searcher.search_text("a red cube left of a blue ball", k=10, rerank=100)
    hits = searcher.search_image("photo.png", k=5, where={"image_id": ["00012", "00013"]}, offset=5)
    hits[0].row, hits[0].score, hits[0].rerank_score, hits[0].rank_before, hits[0].rank_after, hits.notes

Stage 1: the query is encoded once (``scorer.encode_texts`` / ``encode_pil``), turned into its first-stage vector
(``first_stage_text(reps, "t2i")`` for a text, searched in ``image.index``; ``first_stage_image(reps, "i2t")`` for
an image, searched in ``text.index``) and searched by FAISS, single-threaded (``faiss.omp_set_num_threads(1)``
before every search: concurrency comes from parallel requests, and one request on two threads was measured
slower than on one, 399 vs 149 ms for a 1M Flat search). Candidates are ordered by score, ties by row.

Stage 2 (``rerank=K``): the first K candidates (after the filter) are re-scored by the model's own scorer
(``score_directed(..., "t2i" | "i2t")`` for directional scorers, else ``score``) from their component arrays in
the feature cache the manifest names (image rows for images, caption rows for captions, the head's
``image_keys`` / ``text_keys``): nothing in the collection is re-encoded, only the query, once. Hits are then
ordered by that score (non-finite scores last, ties by first-stage rank). A bare backbone has no second stage:
its first stage is its exact score, ``has_second_stage`` is False and ``rerank`` is ignored with a note.

A FILIP pre-trained checkpoint is served the same way: its first stage is the mean of each item's unit patch /
token vectors (``FILIPScorer.first_stage_image`` / ``first_stage_text``), an approximation of its late-interaction
score (neither a lower nor an upper bound: a candidate FILIP ranks high can rank low here), and its second stage is
that late interaction (s^T for a text's images, s^I for an image's captions) on the candidates' cached patches /
tokens (``--components patches,tokens``). A search of it without ``rerank`` says so in its notes (the scorer's
``first_stage_note``); with ``rerank`` covering the collection the order is FILIP's own.

Filters (``where``): a mapping ``{column: value}`` of metadata columns (``image.arrow`` / ``text.arrow``; a
list, tuple or set of values is a membership test, several columns must all match; a list column such as
``captions`` matches when it holds a value), or a callable on the metadata row (a dict) returning True to keep
it. The index is searched for more candidates than asked (over-fetching, growing 4x) until enough pass or the
whole collection has been seen; a mapping that keeps few rows scores just those rows instead (their stored
vectors, exactly as the index does). Paging: ``offset`` hits are skipped, so ``offset=10, k=10`` is the second
page of ten; with ``rerank`` the re-ranked list holds at least ``offset + k`` candidates (K is raised, with a
note), so every hit returned has been re-ranked.

Bad input: an empty, blank, non-text or letter-less query is refused (``QueryError``); a query longer than the
model's text context (77 tokens for CLIP) is truncated to it, as captions are at extraction, with a note; a query of
more than ``MAX_QUERY_CHARS`` (2,000) characters is refused. A query image is decoded by
``extract.data.images.decode_image`` (corrupt files, non-images and decompression bombs, read from the header, are
refused). ``k`` and ``rerank`` must be >= 1, ``offset`` >= 0; a ``k`` or ``rerank`` larger than the collection is
clamped to it with a note (as clip-retrieval's service returns what it has; ``python -m serve.query`` refuses a
``--k`` larger than the collection instead). A missing, half-written (no manifest) or tampered index directory, a
cache that is not the one indexed, and a model other than the index's (by weights fingerprint) are refused with
serve.layout's ``IndexDirError`` / ``ModelMismatchError`` naming the file or both models. All of these are
ValueErrors, so ``python -m serve.query`` reports them as one line (exit status 2). Searching never writes to the
index directory or the cache.

:func:`served_recall` measures R@k of the served results on the collection itself (every caption searching
the images, every image the captions), with the evaluation suite's protocol (``adapters.eval.retrieval``), for
side-by-side tables with ``train.eval``.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from adapters.eval.ranking import KS, rank_safe
from adapters.scoring import Reps, cat_reps, num_items, take_reps
from serve import layout
from serve.layout import IndexDirError, ModelMismatchError, model_fingerprint

SIDES = {"image": "t2i", "text": "i2t"}  # the collection searched -> the direction of its queries
# A search phrase, not a document: a 248-token context (Long-CLIP's, --context-length 248) holds about 1,000
# characters of English, CLIP's 77 tokens about 300. A longer query is truncated to the context with a note; one
# over this many characters is refused rather than silently searched for by its first tenth.
MAX_QUERY_CHARS = 2_000
RERANK_BATCH = 1024  # candidates encoded from the cache at once in stage 2
# A mapping filter keeping at most this many rows (or 4x the hits asked, if more) scores those rows directly
# instead of over-fetching: an equality on an id keeps one row, which over-fetching would find only after
# searching the whole collection.
SUBSET_ROWS = 4096


def _damaged(path: Path) -> str:
    return (f"the file is damaged; python -m serve.index --verify {path.parent} checks every file of the index, then "
            "copy it again or rebuild it")


class QueryError(ValueError):
    """A query that cannot be searched for (empty text, a bad image, k <= 0 ...); a ValueError, so entry points
    report it as one line (exit status 2), like serve.layout's IndexDirError / ModelMismatchError."""


# --------------------------------------------------------------------------------------------- results
@dataclass
class Hit:
    """One result. ``row``: row of ``image.arrow`` (image hits) or ``text.arrow`` (caption hits), = the FAISS
    id; ``id``: its ``image_id`` / ``caption_id``; ``path``: the image file (a caption hit: its image's);
    ``text``: the caption (None for image hits); ``score``: first-stage inner product; ``rerank_score``: the
    model's own score (None without re-ranking); ``rank_before`` / ``rank_after``: 1-based positions in the
    filtered first-stage order and in the final order (equal without re-ranking; both count the ``offset``d
    hits); ``metadata``: the row of the metadata table, as a dict."""

    row: int
    kind: str
    id: str
    path: str | None
    text: str | None
    score: float
    rerank_score: float | None
    rank_before: int
    rank_after: int
    metadata: dict = field(default_factory=dict)

    @property
    def final_score(self) -> float:
        """The score the hit was ordered by: re-ranked if it was, else first-stage."""
        return self.score if self.rerank_score is None else self.rerank_score

    def to_dict(self) -> dict:
        return asdict(self)


class Hits(list):
    """The hits of one search, best first (a list of :class:`Hit`), with ``notes`` (one line each: a clamped
    k, an ignored rerank, a truncated query, a filter that left fewer hits, an approximate first stage searched
    without re-ranking -- FILIP's) and what was asked: ``query`` (the
    text, or the image's name), ``direction`` ("t2i": images for a text, "i2t": captions for an image), ``k``,
    ``rerank``, ``offset`` (as used, after clamping), ``considered`` (candidates that passed the filter);
    ``timings``: milliseconds per stage (``encode`` the query, ``first_stage`` with its filter, ``rerank``,
    ``metadata``: the hits' rows), for the app's and /knn-service's per-stage figures. ``box_note``: set (also
    among the notes) when the model reads ground-truth boxes and has none for the query image, which was then
    searched by the first stage only (serve.service.box_note)."""

    def __init__(self, hits: Sequence[Hit] = (), *, query: str = "", direction: str = "t2i", k: int = 0,
                 rerank: int | None = None, offset: int = 0, considered: int = 0, notes: Sequence[str] = (),
                 timings: Mapping[str, float] | None = None):
        super().__init__(hits)
        self.query, self.direction, self.k, self.rerank, self.offset = query, direction, k, rerank, offset
        self.considered = considered
        self.notes = list(notes)
        self.timings = dict(timings or {})
        self.box_note: str | None = None

    def to_dict(self) -> dict:
        return {"query": self.query, "direction": self.direction, "k": self.k, "rerank": self.rerank,
                "offset": self.offset, "considered": self.considered, "notes": self.notes,
                "box_note": self.box_note, "timings": self.timings, "hits": [h.to_dict() for h in self]}


# --------------------------------------------------------------------------------------------- scorers and caches
def has_second_stage(scorer) -> bool:
    """False for a bare backbone, whose first stage (global cosine) is its exact score."""
    return scorer.second_stage


def cache_keys(scorer, side: str) -> tuple[str, ...]:
    """The feature-cache arrays ``scorer`` reads per item of ``side`` ("image" / "text"), see :func:`encode_arrays`.
    Raises ValueError for a scorer that cannot be read from a cache."""
    if side not in SIDES:
        raise ValueError(f"side must be 'image' or 'text', got {side!r}")
    return tuple(scorer.cache_keys(side))


@torch.no_grad()
def encode_arrays(scorer, arrays: Mapping[str, np.ndarray], side: str) -> Reps:
    """Representations of items of ``side`` from their cached arrays (``cache.gather(key, rows)`` for each of
    :func:`cache_keys`): what the scorer's live encoding gives for the same arrays (the scorer's own
    ``encode_arrays``: :class:`adapters.scoring.CacheReadable`)."""
    return scorer.encode_arrays(dict(arrays), side)


def directed_score(scorer, image_reps: Reps, text_reps: Reps, direction: str) -> torch.Tensor:
    """[I, T] scores for ``direction`` ("t2i" / "i2t"): ``score_directed`` (``score`` where both directions agree)."""
    return scorer.score_directed(image_reps, text_reps, direction)


def first_stage_vectors(scorer, reps: Reps, side: str) -> np.ndarray:
    """[N, F] float32 first-stage vectors of items of ``side``, as the index holds them: images
    ``first_stage_image(reps, "t2i")``, captions ``first_stage_text(reps, "i2t")`` (see serve/__init__.py)."""
    with torch.no_grad():
        v = (scorer.first_stage_image(reps, "t2i") if side == "image" else scorer.first_stage_text(reps, "i2t"))
    return np.ascontiguousarray(v.detach().float().cpu().numpy(), dtype=np.float32)


# --------------------------------------------------------------------------------------------- the index directory
class _Side:
    """One searchable collection of the index directory: its FAISS index and its metadata table."""

    def __init__(self, name: str, index, table, path: Path, meta_path: Path, stage2=None, entry: dict | None = None):
        self.name, self.index, self.table, self.path, self.meta_path = name, index, table, path, meta_path
        self.n = int(index.ntotal)
        self.stage2 = stage2  # serve.stage2.Stage2Store: stored re-ranking representations, or None
        self.kind = (entry or {}).get("kind", "flat")
        self.max_norm = (entry or {}).get("max_norm")  # None: an index built before it was recorded
        refine = (entry or {}).get("refine")
        # what produced a score: the index, or the index's shortlist re-scored from its vectors file
        self.scored_by = str(path) if not refine else f"{path} (re-scored from {path.parent / refine['file']})"
        self._columns: dict[str, np.ndarray] = {}

    def check_found(self, ids: np.ndarray, scores: np.ndarray, query: np.ndarray) -> None:
        """What FAISS returned for ``query`` is what an undamaged index can return: rows 0..n-1 (or -1: none), and
        finite scores within the inner-product bound of the vectors' recorded largest norm (serve.faiss_index.
        score_bound). Anything else comes from a damaged file: IndexDirError, never a ranked hit."""
        from serve.faiss_index import score_bound

        real = ids >= 0
        bad = ids[real] >= self.n
        if ids.min(initial=0) < -1 or bad.any():
            row = int(ids[real][bad][0]) if bad.any() else int(ids.min())
            raise IndexDirError(f"{self.scored_by} returned row {row} of an index of {self.n:,}: {_damaged(self.path)}")
        found = scores[real]
        limit = None if self.max_norm is None else score_bound(self.kind, self.max_norm,
                                                                float(np.linalg.norm(query)))
        wrong = ~np.isfinite(found) | (np.abs(found) > limit if limit is not None else False)
        if wrong.any():
            first = int(np.flatnonzero(wrong)[0])
            raise IndexDirError(f"{self.scored_by} scored row {int(ids[real][first])} {float(found[first]):.6g}"
                                + ("" if limit is None else f", outside the +/-{limit:.4g} its vectors allow")
                                + f": {_damaged(self.path)}")

    def column(self, name: str) -> np.ndarray:
        if name not in self._columns:
            self._columns[name] = layout.column_numpy(self.table.column(name))
        return self._columns[name]

    def parts(self) -> np.ndarray:
        """[n] the part (added source) of every row; 0 throughout for a collection of one source."""
        if "part" not in self.table.column_names:
            return np.zeros(self.n, dtype=np.int64)
        return self.column("part").astype(np.int64)

    def rows(self, rows: Sequence[int]) -> list[dict]:
        return self.table.take(layout.arrow_int64(rows)).to_pylist() if len(rows) else []


def _open_side(index_dir: Path, manifest: dict, name: str) -> _Side:
    """One side, read and checked by serve.layout (columns, rows numbered 0..n-1, counts against the manifest and
    the index), plus what searching relies on beyond that: inner products, the model's first-stage width."""
    from serve.faiss_index import import_faiss

    faiss = import_faiss()
    entry = layout.index_entry(manifest, name, index_dir)
    index = layout.open_index(index_dir, name, manifest)
    # One chunk per column: taking the hits' rows from a chunked 1M-row table cost 5.6 ms per query here, 0.04 ms
    # after combining (more than the FAISS search itself). An Arrow file is written as one record batch, so this
    # copies nothing and the columns stay memory-mapped; a version-1 parquet table is combined in memory.
    table = layout.read_metadata(index_dir, name, manifest).combine_chunks()
    index_path, meta_path = index_dir / entry["file"], index_dir / entry["metadata"]
    problems = []
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        problems.append(f"{index_path} is not an inner-product index")
    dim = manifest["model"].get("first_stage_dim")
    if dim is not None and index.d != int(dim):
        problems.append(f"{index_path} holds {index.d}-d vectors, the manifest's model gives {dim}-d ones")
    if index.ntotal != table.num_rows:
        problems.append(f"{index_path} holds {index.ntotal} vectors, {meta_path} has {table.num_rows} rows")
    if problems:
        raise IndexDirError(f"index {index_dir} does not line up: " + "; ".join(problems) + "; rebuild it")
    from serve.stage2 import Stage2Store

    try:
        stage2 = Stage2Store.open(index_dir, name, entry.get("stage2"), index.ntotal)
    except ValueError as e:
        raise IndexDirError(str(e)) from None
    return _Side(name, index, table, index_path, meta_path, stage2, entry)


def _check_lineup(index_dir: Path, sides: dict[str, _Side], caches: list | None) -> None:
    """Metadata rows point where they should: captions at images of the index, cache rows inside their part's
    cache and naming the same items (image / caption ids), so stage 2 re-scores the candidate it was given.
    ``caches``: one per part (None: not checked)."""
    import pyarrow as pa

    def same(ids, rows: np.ndarray, column) -> bool:
        """``ids[rows]`` equals ``column`` as strings, compared by Arrow (1M ids in tens of ms, where numpy's
        object-to-str conversions took seconds)."""
        ids = ids if isinstance(ids, (pa.Array, pa.ChunkedArray)) else layout.arrow_strings(ids)
        taken = ids.take(layout.arrow_int64(rows))
        chunked = [x if isinstance(x, pa.ChunkedArray) else pa.chunked_array([x]) for x in (taken, column)]
        return chunked[0].cast(pa.large_string()).equals(chunked[1].cast(pa.large_string()))  # whatever the chunking

    problems = []
    image = sides["image"]
    if "text" in sides:
        text = sides["text"]
        image_row = text.column("image_row").astype(np.int64)
        if len(image_row) and (image_row.min() < 0 or image_row.max() >= image.n):
            problems.append(f"{text.meta_path.name}: image_row outside 0..{image.n - 1}")
        elif len(image_row) and not same(image.table.column("image_id"), image_row, text.table.column("image_id")):
            problems.append(f"{text.meta_path.name}'s image_id disagrees with {image.meta_path.name}'s at image_row")
    for name, side in sides.items():
        if not caches:
            break
        rows, parts = side.column("cache_row").astype(np.int64), side.parts()
        id_column = "image_id" if name == "image" else "caption_id"
        if len(parts) and (parts.min() < 0 or parts.max() >= len(caches)):
            problems.append(f"{side.meta_path.name}: part outside the manifest's {len(caches)} part(s)")
            continue
        for number, cache in enumerate(caches):
            mine = parts == number
            if not mine.any():
                continue
            n, ids = ((cache.num_images, cache.image_ids()) if name == "image" else
                      (cache.num_captions, cache.caption_ids()))
            local = rows[mine]
            theirs = side.table.column(id_column)
            if not mine.all():
                theirs = theirs.filter(pa.array(mine))
            if local.min() < 0 or local.max() >= n:
                problems.append(f"{side.meta_path.name}: cache_row outside the {n} rows of {cache.path}")
            elif not same(ids, local, theirs):
                problems.append(f"{side.meta_path.name}'s {id_column} disagrees with the cache's at cache_row "
                                f"({cache.path})")
    if problems:
        raise IndexDirError(f"index {index_dir} does not line up: " + "; ".join(problems) + "; rebuild it")


# --------------------------------------------------------------------------------------------- filters
def parse_where(expressions: Sequence[str]) -> dict[str, list[str]]:
    """``["image_id=3", "image_id=5", "path=a.png"]`` -> ``{"image_id": ["3", "5"], "path": ["a.png"]}``: a column
    repeated is a membership test (any of its values), different columns must all match. Values stay text and
    are read as the column's type when matched."""
    out: dict[str, list[str]] = {}
    for e in expressions:
        if "=" not in e or not e.split("=", 1)[0].strip():
            raise QueryError(f"--where {e!r}: expected COLUMN=VALUE (e.g. image_id=00012)")
        column, value = e.split("=", 1)
        out.setdefault(column.strip(), []).append(value)
    return out


def _coerce(values, arrow_type, column: str) -> list:
    import pyarrow as pa

    out = []
    for v in values:
        try:
            if pa.types.is_integer(arrow_type):
                out.append(int(v))
            elif pa.types.is_floating(arrow_type):
                out.append(float(v))
            elif pa.types.is_boolean(arrow_type):
                out.append(v if isinstance(v, bool) else {"true": True, "false": False}[str(v).strip().lower()])
            else:
                out.append(v if isinstance(v, str) else str(v))
        except (ValueError, KeyError, TypeError, OverflowError):  # OverflowError: int(inf), JSON's 1e400
            raise QueryError(f"filter {column}={str(v)[:80]!r}: column {column} holds {arrow_type} values") from None
    return out


def _mask(side: _Side, where: Mapping[str, Any]) -> np.ndarray:
    """[n] bool: rows whose metadata matches every column of ``where``."""
    import pyarrow as pa

    keep = np.ones(side.n, dtype=bool)
    for column, wanted in where.items():
        if column not in side.table.column_names:
            raise QueryError(f"filter on {column!r}: {side.meta_path.name} has columns "
                             f"{', '.join(side.table.column_names)}")
        values = list(wanted) if isinstance(wanted, (list, tuple, set, frozenset)) else [wanted]
        arrow_type = side.table.schema.field(column).type
        if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
            wanted_set = set(_coerce(values, arrow_type.value_type, column))
            hit = np.fromiter((bool(wanted_set.intersection(v)) if v is not None else False
                               for v in side.table.column(column).to_pylist()), dtype=bool, count=side.n)
        else:
            wanted_list = _coerce(values, arrow_type, column)
            col = side.column(column)
            if col.dtype == object:
                wanted_set = set(wanted_list)
                hit = np.fromiter((v in wanted_set for v in col), dtype=bool, count=side.n)
            else:
                hit = np.isin(col, np.asarray(wanted_list))
        keep &= hit
    return keep


# --------------------------------------------------------------------------------------------- the searcher
def query_vector(vector, width: int | None = None, held: str = "") -> np.ndarray:
    """A query vector given as numbers, checked before it is searched with: ``[1, F]`` float32, or QueryError when
    it is not a list of numbers, has another width than ``width`` (``held`` says what the index holds), has a NaN
    or an infinity, has a number beyond float32's range (checked in float64 first, so the cast never overflows and
    never prints numpy's warning into a server log), or has no direction: a zero vector, or one whose float32 norm
    underflows to 0, ranks every item the same (an arbitrary order presented as a result)."""
    try:
        wide = np.asarray(vector, dtype=np.float64).reshape(1, -1)
    except OverflowError:  # an integer beyond float64, let alone float32
        raise QueryError("a query vector with a number beyond float32's range (3.4e38): scale it down (only its "
                         "direction matters)") from None
    except (TypeError, ValueError):
        raise QueryError("a query vector is a list of numbers") from None
    if width is not None and wide.shape[1] != width:
        raise QueryError(f"a query vector of {wide.shape[1]} numbers: {held or f'the index holds {width}-d vectors'}")
    if not np.isfinite(wide).all():
        raise QueryError("a query vector with non-finite numbers (NaN or infinity): nothing to search with")
    big = float(np.abs(wide).max()) if wide.size else 0.0
    if big > float(np.finfo(np.float32).max):
        raise QueryError(f"a query vector with a number of magnitude {big:.3g}, beyond float32's range (3.4e38), "
                         "which the index computes in: scale it down (only its direction matters)")
    out = wide.astype(np.float32)
    if not float(np.linalg.norm(out)) > 0.0:
        raise QueryError("a query vector with no direction (all zeros, or so small that its float32 norm is 0): "
                         "every item would score the same; send a non-zero vector (only its direction matters)")
    return out


class Searcher:
    """Searches one index directory with one model (see the module docstring). Build with :meth:`open`.

    Attributes: ``index_dir``, ``manifest``, ``scorer`` (the model), ``has_second_stage``, ``num_images``,
    ``num_captions`` (0 without ``text.index``), ``caches`` (the feature caches stage 2 reads, one per part of
    the collection -- one per source ``serve.index --add`` added; None for a bare backbone). A model whose first
    stage only approximates its score and says so (``scorer.first_stage_note``: FILIP's mean token vectors) adds
    that note to every search without ``rerank``. Safe to share between threads: searches only read."""

    def __init__(self, index_dir: Path, manifest: dict, scorer, sides: dict[str, _Side], caches: list | None,
                 image_query_problem: str | None = None):
        self.index_dir, self.manifest, self.scorer = index_dir, manifest, scorer
        self._sides = sides
        self.caches = caches
        self.has_second_stage = has_second_stage(scorer)
        self._image_query_problem = image_query_problem

    @property
    def num_images(self) -> int:
        return self._sides["image"].n

    @property
    def num_captions(self) -> int:
        return self._sides["text"].n if "text" in self._sides else 0

    # -- opening -----------------------------------------------------------------------------------------
    @classmethod
    def open(cls, index_dir: str | os.PathLike, model: str | None = None, *, pretrained: str | None = None,
             device: str = "cpu", annotations=None, detector: str | None = None, scorer=None) -> "Searcher":
        """Open ``index_dir`` for searching with ``model`` (None: the manifest's; ``pretrained`` as in
        ``adapters.load.load_scorer``). ``annotations`` / ``detector``: boxes for image queries of adapters
        trained on ground-truth boxes (default: those the index was built with, else the indexed toy world's, or
        the annotations file the cache was extracted with; without any, text queries work and image queries are
        refused, saying why).
        ``scorer``: an already loaded model instead of ``model`` (checked all the same).

        Refused (IndexDirError / ModelMismatchError, naming what is wrong): a missing or half-written
        directory, a manifest or metadata that does not line up with its index files or the cache, a model whose
        fingerprint is not the manifest's (both named), and a feature cache other than the one indexed."""
        from adapters.load import load_scorer

        index_dir = Path(index_dir)
        manifest = layout.read_manifest(index_dir)  # every file checked before the model loads: seconds, not minutes
        sides = {name: _open_side(index_dir, manifest, name) for name in manifest["indexes"]}
        # A bare backbone's first stage is its score: searching never reads the cache, so it is not opened (its
        # shards' ids are seconds of reading for a million images); an adapter's stage 2 is checked against it.
        bare = manifest["model"].get("kind") == "backbone" if scorer is None else not has_second_stage(scorer)
        caches, cache_problem = (None, "a bare backbone's index") if bare else _open_caches(index_dir, manifest)
        image_problem = None
        if scorer is None:
            spec = model or manifest["model"]["model"]
            weights = pretrained if (model or pretrained) else manifest["model"].get("pretrained")
            if annotations is None and detector is None and not model:  # the boxes the index was built with
                annotations, detector = manifest["model"].get("annotations"), manifest["model"].get("detector")
            if annotations is None and detector is None:
                annotations, image_problem = _default_boxes(spec, manifest, caches)
            scorer = load_scorer(spec, weights, device=device, annotations=annotations, detector=detector)
        layout.check_model(manifest, model_fingerprint(scorer), scorer.name, index_dir)
        if has_second_stage(scorer):
            if caches is None:
                raise IndexDirError(f"{cache_problem}; {scorer.name} re-ranks from it: rebuild the index (its build "
                                    "rebuilds the cache) or restore the cache")
            # A cache extracted with other settings than the head's training cache (detected boxes for a head
            # trained on ground-truth ones) was accepted, with a warning, when the index was built; its fingerprint
            # is the manifest's (checked above), so it holds what was indexed.
            for cache in caches:
                missing = sorted({k for s in sides for k in cache_keys(scorer, s)} - set(cache.keys))
                if missing:
                    raise IndexDirError(f"the cache {cache.path} lacks arrays {missing} that {scorer.name} re-ranks "
                                        "with")
        _check_lineup(index_dir, sides, caches)
        return cls(index_dir, manifest, scorer, sides, caches if has_second_stage(scorer) else None, image_problem)

    # -- queries -----------------------------------------------------------------------------------------
    def search_text(self, query: str, k: int = 10, rerank: int | None = None, where=None, offset: int = 0) -> Hits:
        """Images for a text (t2i); see the module docstring for ``rerank``, ``where`` and ``offset``."""
        text, notes = self.check_text(query)
        started = time.perf_counter()
        with torch.no_grad():
            reps = self.scorer.encode_texts([text])
        encode_ms = _ms_since(started)
        hits = self.search_reps(reps, "t2i", k, rerank, where, offset, query=text, notes=notes)
        hits.timings = {"encode": encode_ms, **hits.timings}
        return hits

    def search_image(self, image, k: int = 10, rerank: int | None = None, where=None, offset: int = 0, *,
                     missing_boxes: str = "error") -> Hits:
        """Captions for an image (i2t): a path, encoded bytes or a PIL image; see :meth:`search_text`. A model that
        reads ground-truth boxes needs the image's (its annotations name it by file name or id): without them the
        search is refused (extract.data.boxes.MissingBoxes), or with ``missing_boxes="empty"`` encoded without
        any, for a caller that says so and searches by the first stage only (serve.service.Served.image_to_text)."""
        if "text" not in self._sides:
            raise QueryError(f"index {self.index_dir} has no text.index (its collection has no captions): image "
                             "queries search captions")
        if self._image_query_problem and missing_boxes == "error":
            raise QueryError(self._image_query_problem)
        started = time.perf_counter()
        pil, name, notes = _query_image(image)
        with torch.no_grad():
            if hasattr(self.scorer, "encode_pil"):
                reps = self.scorer.encode_pil([pil], [name], missing_boxes=missing_boxes)
            else:
                reps = self.scorer.encode_images(self.scorer.preprocess(pil)[None])
        encode_ms = _ms_since(started)
        hits = self.search_reps(reps, "i2t", k, rerank, where, offset, query=name, notes=notes)
        hits.timings = {"encode": encode_ms, **hits.timings}
        return hits

    def check_text(self, query) -> tuple[str, list[str]]:
        """(the text searched for, notes): refuses empty, blank, non-text, binary and letter-less queries and
        queries over MAX_QUERY_CHARS characters; notes a query longer than the text context (truncated)."""
        from extract.data.images import BadCaption, validate_caption

        if isinstance(query, str) and len(query) > MAX_QUERY_CHARS:
            raise QueryError(f"query of {len(query):,} characters refused (at most {MAX_QUERY_CHARS:,}; the model "
                             f"reads {self.scorer.backbone.context_length} tokens of it)")
        try:
            text = validate_caption(query)
        except BadCaption as e:
            raise QueryError("bad query: " + str(e).replace("caption", "query")) from None
        notes = []
        backbone = self.scorer.backbone
        if bool(backbone.tokenize([text]).truncated[0]):
            notes.append(f"the query ({len(text):,} characters) is longer than the model's {backbone.context_length}-"
                         "token text context: only its beginning is searched for (truncated, as captions are at "
                         "extraction)")
        return text, notes

    def search_reps(self, reps: Reps, direction: str, k: int = 10, rerank: int | None = None, where=None,
                    offset: int = 0, *, query: str = "", notes: Sequence[str] = ()) -> Hits:
        """Search with an already encoded query (``reps`` of one item: a text for "t2i", an image for "i2t").
        The other entry points end here; :func:`served_recall` calls it with cached queries."""
        if direction not in ("t2i", "i2t"):
            raise ValueError(f"direction must be 't2i' or 'i2t', got {direction!r}")
        if num_items(reps) != 1:
            raise ValueError(f"search_reps takes one query, got {num_items(reps)}")
        with torch.no_grad():
            vector = (self.scorer.first_stage_text(reps, "t2i") if direction == "t2i"
                      else self.scorer.first_stage_image(reps, "i2t"))
        return self._search_vector(self._sides["image" if direction == "t2i" else "text"], vector, k, rerank, where,
                                   offset, reps, query, notes)

    def search_vector(self, vector, side: str = "image", k: int = 10, where=None, offset: int = 0, *,
                      query: str = "", notes: Sequence[str] = ()) -> Hits:
        """The first stage alone for a vector given as is ([F] or [1, F], the index's width): the items of ``side``
        ("image" / "text") with the largest inner products, as ``image.index`` / ``text.index`` hold them (see
        serve/__init__.py). For clip-retrieval's ``embedding_input`` and its same-modality queries (images like an
        image: ``first_stage_image(reps, "t2i")`` searched in the image side). No second stage: the model scores
        images against texts, not against vectors. The hits' ``direction`` names the side ("t2i": image hits)."""
        if side not in self._sides:
            raise QueryError(f"index {self.index_dir} has no {side} side (it has {', '.join(self._sides)})")
        width = self._sides[side].index.d
        vector = query_vector(vector, width, f"the {side} index holds {width}-d first-stage vectors of "
                                             f"{self.scorer.name}")
        return self._search_vector(self._sides[side], torch.from_numpy(vector), k, None, where, offset, None, query,
                                   notes)

    def collection(self, side: str = "image"):
        """The ``side`` ("image" / "text") of the index, for reading: ``n``, ``index`` (FAISS), ``table`` (its
        Arrow metadata), ``column(name)`` (numpy), ``rows(rows)`` (dicts). The app maps ids to files with it."""
        if side not in self._sides:
            raise QueryError(f"index {self.index_dir} has no {side} side (it has {', '.join(self._sides)})")
        return self._sides[side]

    def _search_vector(self, side: _Side, vector: torch.Tensor, k, rerank, where, offset, reps: Reps | None,
                       query: str, notes: Sequence[str]) -> Hits:
        """Both stages for a first-stage ``vector`` [1, F] in ``side``; ``reps`` (the query's representations)
        re-rank, None: first stage only."""
        direction = SIDES[side.name]
        notes = list(notes)
        k = _whole(k, "k", 1)
        offset = _whole(offset, "offset", 0)
        if rerank is None and reps is not None and getattr(self.scorer, "first_stage_note", None):
            notes.append(f"{self.scorer.name}: {self.scorer.first_stage_note}")  # FILIP: an approximate first stage
        if rerank is not None:
            rerank = _whole(rerank, "rerank", 1)
            if not self.has_second_stage:
                notes.append(f"{self.scorer.name} has no second stage (its first stage is its exact score): "
                             f"rerank={rerank} ignored")
                rerank = None
        noun = "images" if side.name == "image" else "captions"
        if k > side.n:
            notes.append(f"k={k} is more than the {side.n} {noun} in the collection: clamped to {side.n}")
            k = side.n
        if rerank is not None and rerank > side.n:
            notes.append(f"rerank={rerank} is more than the {side.n} {noun} in the collection: clamped to {side.n}")
            rerank = side.n
        if rerank is not None and rerank < offset + k:
            notes.append(f"rerank={rerank} raised to offset + k = {offset + k}: every hit returned is re-ranked")
            rerank = offset + k
        vector = np.ascontiguousarray(vector.detach().float().cpu().numpy(), dtype=np.float32).reshape(1, -1)
        if vector.shape[1] != side.index.d:
            raise ModelMismatchError(f"{self.scorer.name} gives {vector.shape[1]}-d first-stage vectors; "
                                     f"{side.path} holds {side.index.d}-d ones")
        if not np.isfinite(vector).all():
            raise QueryError(f"{self.scorer.name} gave a non-finite query vector for {query[:60]!r}: nothing to "
                             "search with")
        want = rerank if rerank is not None else offset + k
        started = time.perf_counter()
        rows, scores = self._first_stage(side, vector, want, where)
        timings = {"first_stage": _ms_since(started)}
        if len(rows) < want and where is not None:
            notes.append(f"{len(rows)} {noun} pass the filter" + ("" if len(rows) >= offset + k else
                                                                 f": fewer than offset + k = {offset + k}"))
        rank_before = np.arange(1, len(rows) + 1)
        rerank_scores = None
        if rerank is not None and reps is not None and len(rows):
            started = time.perf_counter()
            rerank_scores = self._rerank(side, rows, reps, direction)
            safe, _ = rank_safe(torch.as_tensor(rerank_scores))
            order = np.lexsort((rank_before, -safe.numpy().astype(np.float64)))
            rows, scores, rank_before = rows[order], scores[order], rank_before[order]
            rerank_scores = rerank_scores[order]
            timings["rerank"] = _ms_since(started)
        if offset >= len(rows) and len(rows):
            notes.append(f"offset {offset} is past the last of the {len(rows)} hits: no hits")
        page = slice(offset, offset + k)
        started = time.perf_counter()
        hits = self._hits(side, rows[page], scores[page], None if rerank_scores is None else rerank_scores[page],
                          rank_before[page], offset)
        timings["metadata"] = _ms_since(started)
        return Hits(hits, query=query, direction=direction, k=k, rerank=rerank, offset=offset, considered=len(rows),
                    notes=notes, timings=timings)

    # -- the two stages --------------------------------------------------------------------------------------
    def _search(self, side: _Side, vector: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, scores) of the index's top ``n``, ordered by score (ties by row); FAISS on one thread."""
        import faiss

        faiss.omp_set_num_threads(1)  # per request: see the module docstring
        scores, ids = side.index.search(vector, int(n))
        side.check_found(ids[0], scores[0], vector[0])
        keep = ids[0] >= 0  # approximate indexes may return fewer than n
        return _ordered(ids[0][keep].astype(np.int64), scores[0][keep])

    def _first_stage(self, side: _Side, vector: np.ndarray, want: int, where) -> tuple[np.ndarray, np.ndarray]:
        """The best ``want`` rows passing ``where`` (fewer when fewer pass), with their first-stage scores."""
        if where is None:
            return self._search(side, vector, min(want, side.n))
        if callable(where):
            fraction, mask = None, None
        elif isinstance(where, Mapping):
            mask = _mask(side, where)
            passing = int(mask.sum())
            if passing == 0:
                return np.zeros(0, np.int64), np.zeros(0, np.float32)
            if passing <= max(SUBSET_ROWS, 4 * want):
                found = self._score_subset(side, vector, np.nonzero(mask)[0])
                if found is not None:
                    return found[0][:want], found[1][:want]
            fraction = passing / side.n
        else:
            raise QueryError(f"where must be a mapping of column -> value(s) or a callable on the row, got "
                             f"{type(where).__name__}")
        verdicts: dict[int, bool] = {}

        def passes(rows: np.ndarray) -> np.ndarray:
            if mask is not None:
                return mask[rows]
            todo = [int(r) for r in rows if int(r) not in verdicts]
            for r, row in zip(todo, side.rows(todo)):
                verdicts[r] = bool(where(row))
            return np.array([verdicts[int(r)] for r in rows], dtype=bool)

        fetch = min(side.n, max(want, (math.ceil(want / fraction * 1.25) + 8) if fraction else 4 * want))
        while True:
            rows, scores = self._search(side, vector, fetch)
            ok = passes(rows)
            if int(ok.sum()) >= want or fetch >= side.n:
                return rows[ok][:want], scores[ok][:want]
            fetch = min(side.n, fetch * 4)

    def _score_subset(self, side: _Side, vector: np.ndarray, rows: np.ndarray):
        """(rows, scores) of just ``rows``, ordered, from the index's stored vectors searched by FAISS's own flat
        kernel (the same inner products a flat index computes); None when the index cannot give its vectors
        back (an IVF index without a direct map)."""
        import faiss

        try:
            vectors = side.index.reconstruct_batch(rows.astype(np.int64))
        except RuntimeError:
            return None
        sub = faiss.IndexFlatIP(side.index.d)
        sub.add(np.ascontiguousarray(vectors, dtype=np.float32))
        faiss.omp_set_num_threads(1)
        scores, ids = sub.search(vector, len(rows))
        side.check_found(np.where(ids[0] >= 0, rows[np.maximum(ids[0], 0)], -1), scores[0], vector[0])
        keep = ids[0] >= 0
        return _ordered(rows[ids[0][keep]], scores[0][keep])

    def _rerank(self, side: _Side, rows: np.ndarray, query_reps: Reps, direction: str) -> np.ndarray:
        """The scorer's own scores of candidate ``rows`` against the query: from their representations stored in
        the index (serve.stage2) when it has them, else encoded from their cached arrays."""
        cache_rows, parts = side.column("cache_row").astype(np.int64)[rows], side.parts()[rows]
        out = []
        with torch.no_grad():
            for a in range(0, len(rows), RERANK_BATCH):
                if side.stage2 is not None:
                    candidates = side.stage2.take(rows[a:a + RERANK_BATCH], self.scorer.device)
                else:
                    arrays = _gather(self.scorer, self.caches, side.name, cache_rows[a:a + RERANK_BATCH],
                                     parts[a:a + RERANK_BATCH])
                    candidates = encode_arrays(self.scorer, arrays, side.name)
                if side.name == "image":
                    s = directed_score(self.scorer, candidates, query_reps, direction)[:, 0]
                else:
                    s = directed_score(self.scorer, query_reps, candidates, direction)[0]
                out.append(s.float().cpu())
        return torch.cat(out).numpy()

    def _hits(self, side: _Side, rows, scores, rerank_scores, rank_before, offset: int) -> list[Hit]:
        metadata = side.rows(rows)
        image_paths = None
        if side.name == "text" and len(rows):
            image_paths = self._sides["image"].column("path")[side.column("image_row").astype(np.int64)[rows]]
        hits = []
        for j, (row, meta) in enumerate(zip(rows, metadata)):
            is_image = side.name == "image"
            hits.append(Hit(row=int(row), kind=side.name, id=str(meta["image_id" if is_image else "caption_id"]),
                            path=str(meta["path"] if is_image else image_paths[j]),
                            text=None if is_image else str(meta["text"]), score=float(scores[j]),
                            rerank_score=None if rerank_scores is None else float(rerank_scores[j]),
                            rank_before=int(rank_before[j]), rank_after=offset + j + 1, metadata=meta))
        return hits


def _gather(scorer, caches: list, side: str, cache_rows: np.ndarray, parts: np.ndarray) -> dict[str, np.ndarray]:
    """The cached arrays of items of ``side`` at ``cache_rows`` of their ``parts``' caches, in the order given (a
    collection of several parts reads each part's rows from its own cache; token-length padding is evened out as
    ``FeatureCache.gather`` does across shards)."""
    keys = cache_keys(scorer, side)
    if len(caches) == 1 or (len(parts) and (parts == parts[0]).all()):
        cache = caches[int(parts[0]) if len(parts) else 0]
        return {key: cache.gather(key, cache_rows) for key in keys}
    from extract.pipeline import concat_rows

    order, pieces = [], []
    for number in np.unique(parts):
        sel = np.nonzero(parts == number)[0]
        order.append(sel)
        pieces.append({key: caches[int(number)].gather(key, cache_rows[sel]) for key in keys})
    joined, back = concat_rows(pieces), np.argsort(np.concatenate(order), kind="stable")
    return {key: value[back] for key, value in joined.items()}


def _ordered(rows: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((rows, -scores.astype(np.float64)))
    return rows[order], scores[order].astype(np.float32)


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


def _whole(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise QueryError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def _query_image(image) -> tuple[Any, str, list[str]]:
    """(RGB PIL image, its name, notes) of a query image given as a path, encoded bytes or a PIL image."""
    from PIL import Image

    from extract.data.images import BadImage, decode_image

    if isinstance(image, Image.Image):
        return (image if image.mode == "RGB" else image.convert("RGB")), (getattr(image, "filename", "") or "query"), []
    if not isinstance(image, (str, os.PathLike, bytes, bytearray)):
        raise QueryError(f"a query image is a path, encoded bytes or a PIL image, not {type(image).__name__}")
    name = "query" if isinstance(image, (bytes, bytearray)) else str(image)
    try:
        decoded = decode_image(bytes(image) if isinstance(image, bytearray) else image)
    except BadImage as e:
        raise QueryError(f"query image {name}: {e}") from None
    return decoded.image, name, [f"query image {name}: {decoded.note}"] if decoded.note else []


def _open_caches(index_dir: Path, manifest: dict) -> tuple[list | None, str | None]:
    """(the feature caches of the manifest's parts, in part order, None) or (None, why one cannot be used): a moved,
    damaged or replaced cache would re-rank with other arrays than were indexed."""
    from extract.cache import FeatureCache

    parts = manifest.get("parts") or [{"cache": manifest["cache"]}]
    if isinstance(parts[0], dict) and parts[0].get("cache") != manifest["cache"]:
        return None, (f"{index_dir / layout.MANIFEST} names two caches for its first part (cache and parts[0].cache "
                      "differ): it was edited; rebuild the index")
    caches = []
    for part in parts:
        entry = part.get("cache") if isinstance(part, dict) else None
        if not isinstance(entry, dict) or "path" not in entry:
            return None, f"{index_dir / layout.MANIFEST} names no cache for one of its parts"
        path = Path(entry["path"])
        if not path.is_absolute():
            path = index_dir / path
        try:
            cache = FeatureCache.open(path)
        except (OSError, ValueError) as e:
            return None, f"the index's feature cache cannot be opened ({str(e).splitlines()[0]})"
        if entry.get("fingerprint") and cache.fingerprint != entry["fingerprint"]:
            return None, (f"the feature cache {cache.path} has fingerprint {cache.fingerprint[:16]}, the index was "
                          f"built from {str(entry['fingerprint'])[:16]} (a rebuilt or replaced cache)")
        caches.append(cache)
    return caches, None


def _default_boxes(model: str, manifest: dict, caches: list | None) -> tuple[Any, str | None]:
    """(annotations for ``load_scorer``, a reason image queries cannot be served or None) for an adapter trained on
    ground-truth boxes when the caller gave neither annotations nor a detector: the indexed toy world's boxes,
    else the annotations file its cache was extracted with; else none ({}: texts still work)."""
    from adapters.load import is_adapter_path, pretrained_checkpoint

    if not is_adapter_path(model) or pretrained_checkpoint(model):  # a pre-trained model.safetensors needs no boxes
        return None, None
    from adapters.checkpoint import read_meta

    path = Path(model)
    settings = read_meta(path / "adapter.safetensors" if path.is_dir() else path)["extraction"]["settings"]
    if "gt" not in ((settings.get("boxes") or {}).get("source"), (settings.get("regions") or {}).get("source")):
        return None, None
    spec = (manifest.get("data") or {}).get("spec")
    if isinstance(spec, dict):
        spec = spec.get("data") or spec.get("path")
    candidates = [spec] if isinstance(spec, str) else []
    for cache in caches or ():
        if (cache.path / "config.json").is_file():
            candidates.append(json.loads((cache.path / "config.json").read_text()).get("annotations"))
    for c in candidates:
        if c and ((Path(c) / "annotations.json").is_file() or (Path(c).is_file() and str(c).endswith(".json"))):
            return c, None
    return {}, ("this adapter was trained on ground-truth boxes and the index names none for new images: open the "
                "searcher with annotations=FILE (COCO instances, Visual Genome objects.json or a toy-world folder) or "
                "detector=WEIGHTS.pt (--annotations / --detector) to search with images")


# --------------------------------------------------------------------------------------------- served recall
def served_recall(searcher: Searcher, rerank: int | None = None, *, ks: Sequence[int] = KS, queries: str = "cache",
                  batch_size: int = 256) -> dict:
    """R@k (percent) of the served results on the indexed collection itself, both directions, with the
    evaluation suite's protocol (``adapters.eval.retrieval``): each caption searches the images (its own image is the
    answer), each image searches the captions (found at its best own caption); ties count against the model
    and non-finite scores rank last, read from the scores the hits carry (re-ranked ones with ``rerank``). A
    query asks for ``max(ks)`` hits, and for more while the last one ties its answer (duplicate captions tie
    exactly): an item tied beyond the window counts against it, as in evaluation.

    ``queries="cache"``: the queries' representations come from the feature cache (the arrays the collection
    was indexed with), so with a flat index and ``rerank`` covering the collection the figures equal
    ``train.eval --cache`` on that cache exactly; a bare backbone's first stage is its score, so there the
    first stage alone equals it. ``queries="live"``: every caption's text and image file is encoded as a user's
    query would be (``search_text`` / ``search_image``; fp32 where the cache holds fp16).

    Returns ``{"text_to_image": {"R@1": ..., "n": queries, "rerank": K as used}, "image_to_text": {...},
    "rerank": K as asked, "queries": ...}``; K as used is clamped to the side's collection (None: no second
    stage). Images without captions are no query, as in ``adapters.eval.retrieval``."""
    if queries not in ("cache", "live"):
        raise ValueError(f"queries must be 'cache' or 'live', got {queries!r}")
    if "text" not in searcher._sides:
        raise ValueError(f"index {searcher.index_dir} has no captions: served recall needs both sides")
    image, text = searcher._sides["image"], searcher._sides["text"]
    caches = searcher.caches
    if queries == "cache" and caches is None:  # a bare backbone keeps no cache open: open them now
        caches, problem = _open_caches(searcher.index_dir, searcher.manifest)
        if caches is None:
            raise IndexDirError(problem)
    caption_image = text.column("image_row").astype(np.int64)
    own_captions: dict[int, set[int]] = {}
    for t, i in enumerate(caption_image):
        own_captions.setdefault(int(i), set()).add(t)
    used = {"t2i": None, "i2t": None}
    kmax = max(ks)

    def rank_of(search, own: set[int], n: int, direction: str) -> float:
        # The hits are a window of the ranking: while its last hit ties the query's own best one, items beyond it
        # may tie too, and ties count against the model (duplicate captions tie exactly), so the window grows.
        # With re-ranking the ranking ends at the K candidates.
        limit = n if rerank is None or not searcher.has_second_stage else min(n, max(rerank, kmax))
        k = min(kmax, limit)
        while True:
            hits = search(k)
            used[direction] = hits.rerank
            rank, open_end = _served_rank(hits, own)
            if not open_end or rank > kmax or len(hits) < k or k >= limit:
                return rank
            k = min(limit, 2 * k)

    def encoded(side: _Side):
        rows, parts = side.column("cache_row").astype(np.int64), side.parts()
        return cat_reps([encode_arrays(searcher.scorer, _gather(searcher.scorer, caches, side.name,
                                                                rows[a:a + batch_size], parts[a:a + batch_size]),
                                       side.name) for a in range(0, len(rows), batch_size)])

    t2i = []
    text_reps = encoded(text) if queries == "cache" else None
    texts = text.column("text")
    for t in range(text.n):
        search = ((lambda k, t=t: searcher.search_reps(take_reps(text_reps, [t]), "t2i", k, rerank))
                  if text_reps is not None else (lambda k, t=t: searcher.search_text(str(texts[t]), k, rerank)))
        t2i.append(rank_of(search, {int(caption_image[t])}, image.n, "t2i"))
    i2t = []
    image_reps = encoded(image) if queries == "cache" else None
    paths = image.column("path")
    for i in range(image.n):
        if i not in own_captions:
            continue  # as retrieval_metrics: an image without captions is not a query
        search = ((lambda k, i=i: searcher.search_reps(take_reps(image_reps, [i]), "i2t", k, rerank))
                  if image_reps is not None else (lambda k, i=i: searcher.search_image(str(paths[i]), k, rerank)))
        i2t.append(rank_of(search, own_captions[i], text.n, "i2t"))

    def summary(ranks, direction):
        r = np.asarray(ranks, dtype=np.float64)
        return {f"R@{j}": float((r <= j).mean() * 100) for j in ks} | {"n": len(r), "rerank": used[direction]}

    return {"text_to_image": summary(t2i, "t2i"), "image_to_text": summary(i2t, "i2t"), "rerank": rerank,
            "queries": queries}


def _served_rank(hits: Hits, own: set[int]) -> tuple[float, bool]:
    """(1 + the hits not in ``own`` scoring >= the best own hit, inf when no own hit was returned; whether the last
    hit scores >= that best own one, i.e. items after the window could still count)."""
    if not hits:
        return math.inf, False
    safe, _ = rank_safe(torch.tensor([h.final_score for h in hits], dtype=torch.float64))
    mine = torch.tensor([h.row in own for h in hits])
    if not bool(mine.any()):
        return math.inf, False
    best = safe[mine].max()
    return float(1 + int((safe[~mine] >= best).sum())), bool(safe[-1] >= best)


def recall_table(searcher: Searcher, reranks: Sequence[int] = (10, 50, 100), *, evaluation: dict | None = None,
                 ks: Sequence[int] = KS, queries: str = "cache") -> str:
    """A Markdown table of :func:`served_recall`: the first stage, re-ranked with each K of ``reranks`` (only for
    models with a second stage) and, given ``evaluation`` (the evaluation suite's retrieval result for the same
    model and data: ``adapters.eval.retrieval.run_retrieval_cached``), its figures, side by side."""
    rows = [("served, first stage", served_recall(searcher, None, ks=ks, queries=queries))]
    if searcher.has_second_stage:
        rows += [(f"served, re-ranked K={K}", served_recall(searcher, K, ks=ks, queries=queries)) for K in reranks]
    if evaluation is not None:
        rows.append(("train.eval", evaluation))
    heads = [f"{tag} R@{j}" for tag in ("T2I", "I2T") for j in ks]
    lines = ["| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for label, r in rows:
        values = [r[d][f"R@{j}"] for d in ("text_to_image", "image_to_text") for j in ks]
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines) + "\n"
