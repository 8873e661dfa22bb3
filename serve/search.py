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

:func:`serve.recall.served_recall` measures R@k of the served results (``serve/recall.py``). The parts: results
(``serve.hits``), the index directory's sides, filters and caches (``serve.sides``).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from adapters.eval.ranking import rank_safe
from adapters.scoring import Reps, num_items
from serve import layout
from serve.layout import IndexDirError, ModelMismatchError, model_fingerprint

from serve.hits import Hit, Hits, QueryError
from serve.sides import check_lineup, default_boxes, open_caches, open_side, Side, where_mask


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

    def __init__(self, index_dir: Path, manifest: dict, scorer, sides: dict[str, Side], caches: list | None,
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
        ``adapters.load.load_scorer``). ``annotations`` / ``detector``: the boxes of image queries, for any adapter
        that reads boxes (either replaces the source the adapter was trained with, said in the log; default: those
        the index was built with, else for adapters trained on ground-truth boxes the indexed toy world's, or the
        annotations file the cache was extracted with; without any, text queries work and image queries are
        refused, saying why).
        ``scorer``: an already loaded model instead of ``model`` (checked all the same).

        Refused (IndexDirError / ModelMismatchError, naming what is wrong): a missing or half-written
        directory, a manifest or metadata that does not line up with its index files or the cache, a model whose
        fingerprint is not the manifest's (both named), and a feature cache other than the one indexed."""
        from adapters.load import load_scorer

        index_dir = Path(index_dir)
        manifest = layout.read_manifest(index_dir)  # every file checked before the model loads: seconds, not minutes
        sides = {name: open_side(index_dir, manifest, name) for name in manifest["indexes"]}
        # A bare backbone's first stage is its score: searching never reads the cache, so it is not opened (its
        # shards' ids are seconds of reading for a million images); an adapter's stage 2 is checked against it.
        bare = manifest["model"].get("kind") == "backbone" if scorer is None else not has_second_stage(scorer)
        caches, cache_problem = (None, "a bare backbone's index") if bare else open_caches(index_dir, manifest)
        image_problem = None
        if scorer is None:
            spec = model or manifest["model"]["model"]
            weights = pretrained if (model or pretrained) else manifest["model"].get("pretrained")
            chosen = annotations is not None  # the caller's box file replaces a detector the head was trained with
            if annotations is None and detector is None and not model:  # the boxes the index was built with
                annotations, detector = manifest["model"].get("annotations"), manifest["model"].get("detector")
                chosen = annotations is not None and _indexed_boxes(caches) == {"gt"}  # (older builds: the detector's)
            if annotations is None and detector is None:  # the data's own boxes: for heads trained on them only
                annotations, image_problem = default_boxes(spec, manifest, caches)
            scorer = load_scorer(spec, weights, device=device, annotations=annotations, detector=detector,
                                 use_annotations=chosen)
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
        check_lineup(index_dir, sides, caches)
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

    def _search_vector(self, side: Side, vector: torch.Tensor, k, rerank, where, offset, reps: Reps | None,
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
    def _search(self, side: Side, vector: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, scores) of the index's top ``n``, ordered by score (ties by row); FAISS on one thread."""
        import faiss

        faiss.omp_set_num_threads(1)  # per request: see the module docstring
        scores, ids = side.index.search(vector, int(n))
        side.check_found(ids[0], scores[0], vector[0])
        keep = ids[0] >= 0  # approximate indexes may return fewer than n
        return _ordered(ids[0][keep].astype(np.int64), scores[0][keep])

    def _first_stage(self, side: Side, vector: np.ndarray, want: int, where) -> tuple[np.ndarray, np.ndarray]:
        """The best ``want`` rows passing ``where`` (fewer when fewer pass), with their first-stage scores."""
        if where is None:
            return self._search(side, vector, min(want, side.n))
        if callable(where):
            fraction, mask = None, None
        elif isinstance(where, Mapping):
            mask = where_mask(side, where)
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

    def _score_subset(self, side: Side, vector: np.ndarray, rows: np.ndarray):
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

    def _rerank(self, side: Side, rows: np.ndarray, query_reps: Reps, direction: str) -> np.ndarray:
        """The scorer's own scores of candidate ``rows`` against the query: from their representations stored in
        the index (serve.stage2) when it has them, else encoded from their cached arrays."""
        cache_rows, parts = side.column("cache_row").astype(np.int64)[rows], side.parts()[rows]
        out = []
        with torch.no_grad():
            for a in range(0, len(rows), RERANK_BATCH):
                if side.stage2 is not None:
                    candidates = side.stage2.take(rows[a:a + RERANK_BATCH], self.scorer.device)
                else:
                    arrays = gather(self.scorer, self.caches, side.name, cache_rows[a:a + RERANK_BATCH],
                                     parts[a:a + RERANK_BATCH])
                    candidates = encode_arrays(self.scorer, arrays, side.name)
                if side.name == "image":
                    s = directed_score(self.scorer, candidates, query_reps, direction)[:, 0]
                else:
                    s = directed_score(self.scorer, query_reps, candidates, direction)[0]
                out.append(s.float().cpu())
        return torch.cat(out).numpy()

    def _hits(self, side: Side, rows, scores, rerank_scores, rank_before, offset: int) -> list[Hit]:
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


def gather(scorer, caches: list, side: str, cache_rows: np.ndarray, parts: np.ndarray) -> dict[str, np.ndarray]:
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


def _indexed_boxes(caches: list | None) -> set:
    """The box sources (gt / yolo / random) the index's caches were extracted with: the manifest's annotations are
    the boxes of image queries only where they were the indexed items' boxes too."""
    return {((c.settings.get("boxes") or {}).get("source")) for c in caches or ()}


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
