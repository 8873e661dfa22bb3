"""The index directory on disk: its files and manifest, reading them back with every check, the model's fingerprint,
and how a build replaces a directory atomically under a lock.

What the directory holds is the contract in :mod:`serve` (``serve/__init__.py``). This module is both sides of it:

Reading (the search side). :func:`read_manifest` validates ``manifest.json`` (format, version, the keys the contract
names) and that every file it lists exists with the byte size it recorded (a copy cut short fails here, naming the
file, not at the first search) and that the files still have the SHA-256 it recorded -- the metadata tables and
every file up to VERIFY_AT_OPEN_BYTES at every open, all of them with :func:`verify_files` (``python -m serve.index
--verify``; an edit that keeps a file's size would otherwise give wrong hits); :func:`open_index` loads ``image.index`` /
``text.index`` with the tuned search parameters applied, memory-mapped when large or on-disk; :func:`read_metadata`
reads a side's metadata table (an Arrow IPC file, memory-mapped: opening a 1M-row table reads nothing but its
footer; indices of format version 1 hold parquet, still read); :func:`check_alignment` checks that every index's
``ntotal``, its metadata's rows and the manifest agree -- the most reported failure of self-hosted clip-retrieval
indices (an index rebuilt without its metadata, or the other way round, silently returns the wrong images). Every
failure is an :class:`IndexDirError` (a ValueError, so command lines print it as one line and exit 2) naming the
file and what to do.

Memory mapping, as measured with faiss 1.15 here: ``faiss.IO_FLAG_MMAP`` maps the inverted lists of IVF indices
but still reads a Flat index (and HNSW's vectors) into RAM; ``faiss.IO_FLAG_MMAP_IFC`` maps all four kinds
(Flat, HNSW's storage, IVF-Flat, IVF-PQ: a 195 MB Flat index opened with +1 MB of resident memory). On-disk IVF
indices (``ondisk``: ``image.index`` + ``image.ivfdata``) are opened with ``faiss.IO_FLAG_ONDISK_SAME_DIR``, which
finds the ``.ivfdata`` file next to the index whatever folder it was built in (the file records the absolute
path it was written to, which an atomic replacement or a copy changes).

Building (``serve.index``). A build writes everything into a temporary sibling folder (``INDEX_DIR.tmp-<pid>``),
``manifest.json`` last, then swaps it into place: with Linux's ``renameat2(RENAME_EXCHANGE)`` one atomic step;
elsewhere two renames (old folder aside to ``INDEX_DIR.old-<pid>``, new one in), and the moment in between is
repaired by the next reader or build, which moves the complete old folder back (:func:`recover`). So a build
killed at any point leaves the old complete index (or, for a first build, none), never a torn one. One build
per directory at a time: an ``flock`` on ``INDEX_DIR.lock`` (a sibling: the folder itself is replaced; deleted when
the build ends); a second build refuses at once, naming the holder (:class:`IndexBusyError`). Stale ``.tmp-`` / ``.old-`` folders of
killed builds are removed by the next build.

Testing aid: ``PLUGVLM_INDEX_TEST_HOOK=POINT:ACTION`` makes a build kill itself (``kill``: SIGKILL, as kill -9)
or pause (``sleep=SECONDS``) at ``POINT``: ``locked`` (the lock just taken), the name of any file just written
into the new folder (``image.index``, ``image.arrow``, ``text.index``, ``text.arrow``, ``manifest.json``),
``aside`` (two-rename swap only: the old folder moved aside, the new one not yet in) or ``swapped``. Used by
tests/serve/test_serve_index.py; never set it otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from extract.models.weights import file_sha256

if TYPE_CHECKING:  # imported where used: the annotations only
    import pyarrow as pa

FORMAT = "plugvlm-index"
VERSION = 2  # 2: metadata as Arrow IPC files (``.arrow``); 1: parquet, still read
METADATA_SUFFIX = ".arrow"
MANIFEST = "manifest.json"
SIDES = ("image", "text")
KINDS = ("flat", "hnsw", "ivf-flat", "ivf-pq")
HOOK_ENV = "PLUGVLM_INDEX_TEST_HOOK"
#: indices larger than this are memory-mapped by :func:`open_index` unless told otherwise
MMAP_ABOVE_BYTES = 256 << 20
# Integrity. A build records the SHA-256 of every file of the index (the manifest's ``digests``). Opening the
# index checks every file's size, and its SHA-256 for the metadata tables (a same-size edit there pairs hits with
# the wrong images) and for any other file up to VERIFY_AT_OPEN_BYTES: FAISS files, stored stage-2 arrays and
# refinement vectors of a collection up to ~100k vectors are hashed whole at every start-up (hashing runs at
# ~1 GB/s here, so 256 MiB costs ~0.25 s). Larger files are checked in full by ``python -m serve.index --verify``;
# at start-up they get FAISS's structural read and at query time every score they give is checked (finite, and
# within the bound ``|q| * max_norm`` that the vectors' largest norm recorded at build allows: a score outside it
# is a damaged file, never a hit; serve.search).
VERIFY_AT_OPEN_BYTES = 256 << 20
ALWAYS_VERIFIED_SUFFIXES = (METADATA_SUFFIX, ".parquet")
VERIFY_LEVELS = ("none", "open", "full")

#: metadata columns per side (serve/__init__.py), in order; ``part`` says which added source a row came from
IMAGE_COLUMNS = ("row", "image_id", "path", "captions", "cache_row", "part")
TEXT_COLUMNS = ("row", "caption_id", "text", "image_row", "image_id", "cache_row", "part")
_INDEX_KEYS = ("file", "metadata", "key", "kind", "params", "ntotal", "bytes", "recall_at_10", "recall_queries",
               "build_seconds", "ondisk")
_TOP_KEYS = ("format", "version", "model", "data", "cache", "collection", "indexes")


class IndexDirError(ValueError):
    """An index directory that cannot be used as it is (missing, half-written, tampered with, busy); the
    message names the file and what to do. A ValueError: command lines print it as one line and exit 2."""


class IndexBusyError(IndexDirError):
    """Another build holds the directory's lock."""


class ModelMismatchError(IndexDirError):
    """The model at hand is not the one the index was built with (fingerprints differ)."""


# --------------------------------------------------------------------------------------------- the model's identity
def model_identity(scorer) -> dict:
    """What identifies a scorer's numbers, as JSON: the backbone's ``describe(hash_weights=True)`` without where
    its weights file lies (a moved file is the same model; its SHA-256 stays), plus for an adapter its method and
    the digest of its head's tensors (the ``tensors_sha256`` its checkpoint carries, see
    :mod:`extract.common.tensorfile`)."""
    describe = dict(scorer.backbone.describe(hash_weights=True))
    describe.pop("weights_file", None)
    if describe.get("weights") == "file":
        describe.pop("pretrained", None)
    out: dict[str, Any] = {"backbone": describe}
    head = getattr(scorer, "head", None)
    if head is not None:
        from extract.common.tensorfile import tensors_digest

        out["adapter"] = {"method": head.name,
                          "tensors_sha256": tensors_digest({f"head.{k}": v for k, v in head.state_dict().items()})}
    return out


def model_fingerprint(scorer) -> str:
    """SHA-256 of :func:`model_identity` as canonical JSON: the manifest's ``model.fingerprint``. The search side
    computes it for the model it loaded and refuses to query an index built with another (:func:`check_model`)."""
    from extract.cache import fingerprint

    return fingerprint(model_identity(scorer))


def check_model(manifest: dict, fingerprint: str, name: str, index_dir: str | os.PathLike = "") -> None:
    """Raise :class:`ModelMismatchError` naming both models unless ``fingerprint`` is the manifest's."""
    theirs = manifest["model"]
    if theirs.get("fingerprint") != fingerprint:
        where = f"{index_dir} was" if index_dir else "this index was"
        raise ModelMismatchError(
            f"{where} built with {theirs.get('name')} ({theirs.get('model')}, fingerprint "
            f"{str(theirs.get('fingerprint'))[:16]}), not {name} (fingerprint {fingerprint[:16]}): use that model, "
            "or build an index for this one")


# --------------------------------------------------------------------------------------------- reading
def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise IndexDirError(f"{path} is unreadable ({e}): the index is damaged; rebuild it with python -m serve.index"
                            ) from None


def _missing_dir_message(index_dir: Path) -> str:
    leftovers = sorted(p.name for p in index_dir.parent.glob(index_dir.name + ".tmp-*")) if index_dir.parent.is_dir() \
        else []
    hint = f" ({', '.join(leftovers)} beside it: a build that did not finish)" if leftovers else ""
    return (f"{index_dir} does not exist{hint}: build the index with `python -m serve.index --model MODEL --data "
            f"SOURCE --out {index_dir}`")


def read_manifest(index_dir: str | os.PathLike, *, verify: str = "open") -> dict:
    """The validated ``manifest.json`` of a finished index directory: format ``plugvlm-index``, a version this
    code reads, the contract's keys, every file it lists present at its recorded size, and the files' recorded
    SHA-256 checked as ``verify`` says: "open" (the metadata tables and every file up to VERIFY_AT_OPEN_BYTES: what
    every open does), "full" (every file: :func:`verify_files`) or "none" (a caller that opens the index afterwards
    leaves it to the open). A folder left by a killed two-rename swap is put back first (:func:`recover`). Raises
    :class:`IndexDirError` naming the file."""
    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {VERIFY_LEVELS}, got {verify!r}")
    index_dir = Path(index_dir)
    if not index_dir.exists():
        recover(index_dir)
    if index_dir.exists() and not index_dir.is_dir():
        raise IndexDirError(f"{index_dir} is a file, not an index folder: give the folder python -m serve.index wrote "
                            "(the one holding manifest.json)")
    if not index_dir.is_dir():
        raise IndexDirError(_missing_dir_message(index_dir))
    path = index_dir / MANIFEST
    if not path.is_file():
        raise IndexDirError(f"{index_dir} is not a finished index: {MANIFEST} is missing (a build writes it last; "
                            "this folder is half-written or not an index). Rebuild it with python -m serve.index")
    manifest = _json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IndexDirError(f"{path} is not a plugvlm index manifest (format "
                            f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, expected {FORMAT!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise IndexDirError(f"{path} has index format version {version!r}; this plugvlm reads versions 1 to {VERSION}: "
                            "update plugvlm, or rebuild the index")
    missing = [k for k in _TOP_KEYS if k not in manifest]
    indexes = manifest.get("indexes")
    if missing or not isinstance(indexes, dict) or "image" not in indexes or set(indexes) - set(SIDES):
        raise IndexDirError(f"{path} lacks {missing or ['indexes.image']} or names unknown sides "
                            f"{sorted(set(indexes or {}) - set(SIDES))}: it was edited or damaged; rebuild the index")
    for side, entry in indexes.items():
        lacking = [k for k in _INDEX_KEYS if k not in entry]
        if lacking:
            raise IndexDirError(f"{path}: indexes.{side} lacks {lacking}; rebuild the index")
    for name, size in (manifest.get("files") or {}).items():
        f = index_dir / name
        try:
            actual = f.stat().st_size
        except FileNotFoundError:
            raise IndexDirError(f"{f} is missing (listed in {path}): the index is incomplete; copy the whole folder "
                                "again or rebuild it") from None
        if actual != size:
            raise IndexDirError(f"{f} is {actual:,} bytes, {path} says {size:,}: the file was cut short or replaced; "
                                "copy the whole folder again or rebuild the index")
    digests = manifest.get("digests") or {}  # absent in indices built before digests
    if not isinstance(digests, dict):
        raise IndexDirError(f"{path}: 'digests' is not a mapping: the manifest was edited or damaged; rebuild the "
                            "index")
    if verify != "none":
        verify_files(index_dir, manifest, whole=verify == "full")
    return manifest


def verify_files(index_dir: str | os.PathLike, manifest: dict, *, whole: bool = True,
                 say=lambda line: None) -> dict[str, str]:
    """Check the files of an index against the SHA-256 its build recorded: every file (``whole``), or those that
    every open checks (the metadata tables and files up to VERIFY_AT_OPEN_BYTES). Returns file -> "ok" or
    "not recorded" (built before whole-file digests); raises :class:`IndexDirError` at the first file that
    differs, naming it. ``say``: called with a line per file checked (progress for a long --verify)."""
    index_dir = Path(index_dir)
    digests = manifest.get("digests") or {}
    sizes = manifest.get("files") or {}
    out = {}
    for name in sorted(set(sizes) | set(digests)):
        f = index_dir / name
        if not f.is_file():
            raise IndexDirError(f"{f} is missing (listed in {index_dir / MANIFEST}): the index is incomplete; copy the "
                                "whole folder again or rebuild it")
        size = f.stat().st_size
        if not whole and not name.endswith(ALWAYS_VERIFIED_SUFFIXES) and size > VERIFY_AT_OPEN_BYTES:
            continue
        if name not in digests:
            out[name] = "not recorded"
            continue
        started = time.perf_counter()
        if file_sha256(f) != digests[name]:
            what = ("its rows may no longer describe the index's vectors" if name.endswith(ALWAYS_VERIFIED_SUFFIXES)
                    else "searching it would give wrong hits")
            raise IndexDirError(f"{f} does not match the SHA-256 {index_dir / MANIFEST} recorded: it was edited or "
                                f"damaged after the build, and {what}; copy the whole folder again or rebuild the "
                                "index")
        out[name] = "ok"
        say(f"  {name}: {size:,} bytes, SHA-256 as recorded ({time.perf_counter() - started:.2f} s)")
    return out


def index_entry(manifest: dict, side: str, index_dir: str | os.PathLike = "") -> dict:
    """The manifest's ``indexes[side]``; :class:`IndexDirError` when the index has none (``text`` for a collection
    without captions)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    entry = manifest["indexes"].get(side)
    if entry is None:
        raise IndexDirError(f"{index_dir or 'this index'} has no {side} index (its collection has no captions): "
                            "search it with text queries (image index) only")
    return entry


def open_index(index_dir: str | os.PathLike, side: str, manifest: dict | None = None, *, mmap: bool | None = None):
    """The FAISS index of ``side`` ("image" | "text") with its tuned search parameters (``params``: nprobe /
    efSearch) applied, checked against the manifest's ``ntotal`` and the metadata's rows.

    ``mmap``: memory-map instead of reading into RAM (``IO_FLAG_MMAP_IFC``, read-only; module docstring); default:
    for files over :data:`MMAP_ABOVE_BYTES`. On-disk IVF indices always map their ``.ivfdata``."""
    from serve.faiss_index import import_faiss

    faiss = import_faiss()
    index_dir = Path(index_dir)
    manifest = manifest if manifest is not None else read_manifest(index_dir)
    entry = index_entry(manifest, side, index_dir)
    path = index_dir / entry["file"]
    if entry.get("ondisk"):
        flags = faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY
    else:
        if mmap is None:
            mmap = path.stat().st_size > MMAP_ABOVE_BYTES
        flags = (faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY) if mmap else 0
    from serve.faiss_index import quiet_stdout

    try:
        with quiet_stdout():
            index = faiss.read_index(str(path), flags)
    except RuntimeError as e:
        raise IndexDirError(f"{path} is not a readable FAISS index ({str(e).splitlines()[-1][:200]}); copy the whole "
                            "folder again or rebuild the index") from None
    if index.ntotal != entry["ntotal"]:
        raise IndexDirError(f"{path} holds {index.ntotal:,} vectors, {index_dir / MANIFEST} says {entry['ntotal']:,}: "
                            "the index and its manifest come from different builds; rebuild the index")
    rows = metadata_rows(index_dir, side, manifest)
    if rows != index.ntotal:
        raise IndexDirError(f"{index_dir / entry['metadata']} has {rows:,} rows but {path} holds {index.ntotal:,} "
                            "vectors: the metadata does not line up with the index (one of them was replaced); "
                            "rebuild the index")
    from serve.faiss_index import Refined, apply_params

    refine = entry.get("refine")
    if refine:  # exact re-scoring of a PQ shortlist from the fp16 vectors beside the index, memory-mapped
        import numpy as np

        vectors_path = index_dir / refine["file"]
        try:
            vectors = np.load(vectors_path, mmap_mode="r")
            index = Refined(index, vectors)
        except (OSError, ValueError) as e:
            raise IndexDirError(f"{vectors_path}: the refinement vectors cannot be used ({e}); rebuild the index"
                                ) from None
    apply_params(index, entry.get("params") or {})
    return index


def _unreadable(path: Path, e: Exception) -> IndexDirError:
    what = "parquet" if path.suffix == ".parquet" else "Arrow"
    return IndexDirError(f"{path} is not a readable {what} table ({e}); copy the whole folder again or rebuild the "
                         "index")


def read_table(path: str | os.PathLike, columns: list[str] | None = None):
    """The ``pyarrow.Table`` in a metadata file, unchecked: an Arrow IPC file (``.arrow``) memory-mapped without
    copying (the table's buffers point into the map, so only the pages a search touches are read), or a parquet
    file (index format version 1) read whole. Raises :class:`IndexDirError` naming the file."""
    path = Path(path)
    try:
        if path.suffix == ".parquet":
            return import_pyarrow_parquet().read_table(path, columns=columns)
        import pyarrow as pa

        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        return table.select(columns) if columns is not None else table
    except FileNotFoundError:
        raise IndexDirError(f"{path} is missing: the index is incomplete; rebuild it") from None
    except IndexDirError:
        raise
    except Exception as e:  # pyarrow's ArrowInvalid / KeyError for a cut or foreign file, a missing column
        raise _unreadable(path, e) from None


def column_numpy(column):
    """A table column as a numpy array: integer and float columns without nulls as a zero-copy view of the (memory-
    mapped) buffer -- pyarrow's own ``to_numpy`` imports pandas on first use, a second of a cold start --, any
    other column through ``to_numpy`` (object arrays for strings and lists)."""
    import numpy as np
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    dtypes = {pa.int64(): np.int64, pa.int32(): np.int32, pa.int16(): np.int16, pa.int8(): np.int8,
              pa.uint64(): np.uint64, pa.uint32(): np.uint32, pa.float64(): np.float64, pa.float32(): np.float32}
    dtype = dtypes.get(arr.type)
    if dtype is not None and arr.null_count == 0:
        return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize)
    return arr.to_numpy(zero_copy_only=False)


def arrow_int64(values):
    """A numpy integer array as an Arrow int64 array, built from its buffer (``pa.array`` imports pandas)."""
    import numpy as np
    import pyarrow as pa

    values = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def arrow_strings(values) -> "pa.Array":
    """A sequence of str as an Arrow large_string array, built from its UTF-8 bytes and offsets (``pa.array``
    imports pandas: a second of a cold start for 1M ids)."""
    import numpy as np
    import pyarrow as pa

    encoded = [str(v).encode("utf-8") for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return pa.Array.from_buffers(pa.large_string(), len(encoded),
                                 [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))])


def write_table(table, path: str | os.PathLike) -> None:
    """Write a metadata table as an uncompressed Arrow IPC file (memory-mappable, see :func:`read_table`)."""
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())  # one record batch: read back as one chunk per column


def metadata_rows(index_dir: str | os.PathLike, side: str, manifest: dict) -> int:
    """Rows of a side's metadata table, from its footer / record batch headers (no column data read)."""
    path = Path(index_dir) / index_entry(manifest, side, index_dir)["metadata"]
    try:
        if path.suffix == ".parquet":
            return import_pyarrow_parquet().ParquetFile(path).metadata.num_rows
        import pyarrow as pa

        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    except FileNotFoundError:
        raise IndexDirError(f"{path} is missing: the index is incomplete; rebuild it") from None
    except Exception as e:
        raise _unreadable(path, e) from None


def read_metadata(index_dir: str | os.PathLike, side: str, manifest: dict | None = None,
                  columns: list[str] | None = None):
    """A side's metadata as a ``pyarrow.Table`` (``columns``: a subset), checked: the contract's columns, ``row``
    numbered 0..n-1, as many rows as the manifest's ``ntotal``. Raises :class:`IndexDirError` naming the file."""
    index_dir = Path(index_dir)
    manifest = manifest if manifest is not None else read_manifest(index_dir)
    entry = index_entry(manifest, side, index_dir)
    path = index_dir / entry["metadata"]
    table = read_table(path)
    want = IMAGE_COLUMNS if side == "image" else TEXT_COLUMNS
    lacking = [c for c in (columns or want) if c not in table.column_names]
    if lacking:
        raise IndexDirError(f"{path} lacks column(s) {lacking} (has {table.column_names}); rebuild the index")
    if columns is not None:
        table = table.select(columns)
    if table.num_rows != entry["ntotal"]:
        raise IndexDirError(f"{path} has {table.num_rows:,} rows, {index_dir / MANIFEST} says the {side} index holds "
                            f"{entry['ntotal']:,}: the metadata does not line up with the index; rebuild the index")
    if "row" in table.column_names:
        import numpy as np

        rows = column_numpy(table.column("row"))
        if len(rows) and not np.array_equal(rows, np.arange(len(rows))):
            raise IndexDirError(f"{path}: column 'row' is not 0..{len(rows) - 1} in order (the FAISS id of each row): "
                                "the table was edited or damaged; rebuild the index")
    return table


def check_alignment(index_dir: str | os.PathLike, manifest: dict | None = None) -> dict:
    """Check every side without loading any index: the manifest's ``ntotal``, the index file's own count (read from
    its header) and the metadata's rows agree, and ``collection`` counts match. Returns the manifest."""
    index_dir = Path(index_dir)
    manifest = manifest if manifest is not None else read_manifest(index_dir)
    counts = {"image": manifest["collection"].get("images"), "text": manifest["collection"].get("captions")}
    for side, entry in manifest["indexes"].items():
        rows = metadata_rows(index_dir, side, manifest)
        if rows != entry["ntotal"] or counts[side] != entry["ntotal"]:
            raise IndexDirError(f"{index_dir / entry['metadata']} has {rows:,} rows, the {side} index {entry['ntotal']:,} "
                                f"vectors and the collection {counts[side]} {side}s ({index_dir / MANIFEST}): they do "
                                "not line up; rebuild the index")
        ntotal = _header_ntotal(index_dir / entry["file"])
        if ntotal != entry["ntotal"]:
            raise IndexDirError(f"{index_dir / entry['file']} holds {ntotal:,} vectors, {index_dir / MANIFEST} says "
                                f"{entry['ntotal']:,}: they come from different builds; rebuild the index")
    return manifest


def _header_ntotal(path: Path) -> int:
    """``ntotal`` from a FAISS index file's header: every index type writes its fourcc, then ``d`` (int32) and
    ``ntotal`` (int64) -- IndexPreTransform (OPQ) included, which writes its own header before its transforms."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise IndexDirError(f"{path} cannot be read ({e.strerror or e}); rebuild the index") from None
    if len(head) < 16:
        raise IndexDirError(f"{path} is cut short ({len(head)} bytes); copy the whole folder again or rebuild it")
    return struct.unpack("<q", head[8:16])[0]


# --------------------------------------------------------------------------------------------- optional libraries
def import_pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("index metadata is read and written with pyarrow: pip install 'plugvlm[serve]' "
                          "(or pip install pyarrow)") from None
    return pq


# --------------------------------------------------------------------------------------------- building
def test_hook(point: str) -> None:
    """The testing aid of the module docstring: act at ``point`` when $PLUGVLM_INDEX_TEST_HOOK names it."""
    spec = os.environ.get(HOOK_ENV, "")
    where, _, action = spec.rpartition(":")
    if not spec or where != point:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith("sleep="):
        time.sleep(float(action.split("=", 1)[1]))


test_hook.__test__ = False  # not a pytest test, whatever its name


def lock_path(index_dir: Path) -> Path:
    return index_dir.with_name(index_dir.name + ".lock")


@contextmanager
def build_lock(index_dir: str | os.PathLike) -> Iterator[None]:
    """Hold the build lock of ``index_dir`` (an exclusive flock on ``INDEX_DIR.lock``), or raise
    :class:`IndexBusyError` at once naming the build that holds it (``extract.common.files.take_flock``: the kernel
    drops the lock of a killed build)."""
    from extract.common.files import release_flock, take_flock

    index_dir = Path(index_dir)
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(index_dir)
    run = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
    while True:
        f = open(path, "a+")
        try:
            take_flock(f, path, run, timeout=0.0, busy=lambda holder: IndexBusyError(
                f"{index_dir} is being built by another run ({path} is held by {holder}); wait for it to finish, or "
                "build into another --out"))
            # The holder deletes the lock file when it is done (no litter beside the index): a build that opened the
            # file just before could have locked the deleted one, so the lock counts only on the file in place.
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        except BaseException:
            f.close()
            raise
        f.close()
    try:
        test_hook("locked")
        yield
    finally:
        try:
            os.unlink(path)  # while still held: whoever locks the file next checks it is the one in place
        except FileNotFoundError:
            pass
        release_flock(f)
        f.close()


def recover(index_dir: Path) -> bool:
    """Undo a two-rename swap killed half-way: when ``index_dir`` is missing and an ``INDEX_DIR.old-<pid>`` sibling
    holds a complete index, move it back (True). Does nothing while a build holds the lock."""
    index_dir = Path(index_dir)
    if index_dir.exists() or not index_dir.parent.is_dir():
        return False
    olds = [p for p in sorted(index_dir.parent.glob(index_dir.name + ".old-*")) if (p / MANIFEST).is_file()]
    if not olds:
        return False
    try:
        with build_lock(index_dir):
            if index_dir.exists():
                return False
            os.rename(olds[-1], index_dir)
            _fsync_dir(index_dir.parent)
            return True
    except IndexBusyError:
        return False  # the build holding it finishes the swap itself


def remove_leftovers(index_dir: Path) -> list[str]:
    """Delete the ``.tmp-`` / ``.old-`` siblings killed builds left (call under the build lock: no live build owns
    them then). An ``.old-`` folder is only deleted once ``index_dir`` exists (else :func:`recover` needs it)."""
    removed = []
    for p in sorted(index_dir.parent.glob(index_dir.name + ".tmp-*")):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    if index_dir.exists():
        for p in sorted(index_dir.parent.glob(index_dir.name + ".old-*")):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def check_replaceable(index_dir: Path) -> None:
    """Refuse to replace a folder that is not a plugvlm index: a build never deletes anything else."""
    if not index_dir.exists():
        return
    if not index_dir.is_dir():
        raise IndexDirError(f"{index_dir} exists and is not a folder; choose another --out")
    if not any(index_dir.iterdir()):
        return
    manifest = index_dir / MANIFEST
    try:
        ours = json.loads(manifest.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise IndexDirError(f"{index_dir} exists and is not a plugvlm index (no valid {MANIFEST}); a build replaces "
                            "only an index folder: remove it yourself, or choose another --out")


class BuildDir:
    """The temporary sibling folder a build writes into, and its atomic swap into place (module docstring)."""

    def __init__(self, index_dir: str | os.PathLike):
        self.final = Path(index_dir)
        self.path = self.final.with_name(f"{self.final.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        self.scratch = self.path / "scratch"
        self.scratch.mkdir()

    def file(self, name: str) -> Path:
        return self.path / name

    def wrote(self, name: str) -> None:
        """Call after writing (and closing) a file of the new folder: flushes it to disk, then the test hook."""
        _fsync_file(self.path / name)
        test_hook(name)

    def write_json(self, name: str, data: dict) -> None:
        from extract.common.files import atomic_write_text

        atomic_write_text(self.path / name, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        test_hook(name)

    def sizes(self) -> dict[str, int]:
        """Byte size of every file of the new folder (for the manifest's ``files``), scratch excluded."""
        return {p.name: p.stat().st_size for p in sorted(self.path.iterdir()) if p.is_file()}

    def digests(self) -> dict[str, str]:
        """SHA-256 of every file of the new folder (for the manifest's ``digests``; module docstring), scratch
        excluded."""
        return {p.name: file_sha256(p) for p in sorted(self.path.iterdir()) if p.is_file()}

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def commit(self) -> None:
        """Swap the finished folder (manifest written) into place; the old index, if any, is deleted after."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        _fsync_dir(self.path)
        if not self.final.exists():
            os.rename(self.path, self.final)
        elif _exchange(self.path, self.final):  # self.path now holds the old index
            test_hook("swapped")
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            aside = self.final.with_name(f"{self.final.name}.old-{os.getpid()}")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(self.final, aside)
            _fsync_dir(self.final.parent)
            test_hook("aside")
            os.rename(self.path, self.final)
            _fsync_dir(self.final.parent)
            test_hook("swapped")
            shutil.rmtree(aside, ignore_errors=True)
        _fsync_dir(self.final.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2 with RENAME_EXCHANGE, kernel >= 3.15 and a filesystem that
    supports it); False where that is unavailable (the caller falls back to two renames)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    from extract.common.files import fsync_path

    fsync_path(path)
