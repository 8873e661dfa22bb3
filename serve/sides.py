"""An index directory's two sides as a search reads them: each side's FAISS index, metadata table and stage-2
representations, checked against each other and the caches they were built from; metadata filters (``where``);
the caches and the ground-truth boxes a searcher opens with."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from serve import layout
from serve.layout import IndexDirError

from serve.hits import QueryError


def damaged(path: Path) -> str:
    return (f"the file is damaged; python -m serve.index --verify {path.parent} checks every file of the index, then "
            "copy it again or rebuild it")


class Side:
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
            raise IndexDirError(f"{self.scored_by} returned row {row} of an index of {self.n:,}: {damaged(self.path)}")
        found = scores[real]
        limit = None if self.max_norm is None else score_bound(self.kind, self.max_norm,
                                                                float(np.linalg.norm(query)))
        wrong = ~np.isfinite(found) | (np.abs(found) > limit if limit is not None else False)
        if wrong.any():
            first = int(np.flatnonzero(wrong)[0])
            raise IndexDirError(f"{self.scored_by} scored row {int(ids[real][first])} {float(found[first]):.6g}"
                                + ("" if limit is None else f", outside the +/-{limit:.4g} its vectors allow")
                                + f": {damaged(self.path)}")

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


def open_side(index_dir: Path, manifest: dict, name: str) -> Side:
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
    return Side(name, index, table, index_path, meta_path, stage2, entry)


def check_lineup(index_dir: Path, sides: dict[str, Side], caches: list | None) -> None:
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


def where_mask(side: Side, where: Mapping[str, Any]) -> np.ndarray:
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


# --------------------------------------------------------------------------------------------- opening: the caches and the boxes
def open_caches(index_dir: Path, manifest: dict) -> tuple[list | None, str | None]:
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


def default_boxes(model: str, manifest: dict, caches: list | None) -> tuple[Any, str | None]:
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
