"""FAISS index types for the first stage, the ``auto`` choice, tuning to a latency budget, recall measured at
build, and on-disk IVF.

Kinds (all inner product, FAISS id = row): ``flat`` (``Flat``: exact), ``hnsw`` (``HNSW32``, efConstruction 40,
tuned efSearch), ``ivf-flat`` (``IVF{nlist},Flat``, tuned nprobe), ``ivf-pq`` (``OPQ{m}_{y},IVF{nlist},PQ{m}x8``:
OPQ rotation, IVF, 8-bit product quantisation, tuned nprobe).

``auto`` (:func:`auto_keys`) follows autofaiss's published rules (``get_optimal_index_keys_v2``,
``get_optimal_nb_clusters`` and ``get_optimal_quantization`` in criteo/autofaiss ``autofaiss/external/optimize.py``,
themselves from the FAISS wiki's "Guidelines to choose an index"), in short:

- fewer than 1,000 vectors: ``Flat``; fewer than 10,000: ``HNSW15``;
- HNSW when its graph fits the memory budget: M = floor((max_bytes / (4 N) - d) / 2), ``HNSW{min(M, 32)}`` when
  M >= 8;
- below 1M vectors, ``IVF{nlist},Flat`` when it fits, nlist the power of two nearest 4 sqrt(N) (autofaiss then
  16,384 up to 10M, 65,536 up to 300M, 2^17 beyond; we keep 4 sqrt(N) up to 300M, see :func:`nb_clusters`);
- otherwise ``OPQ{m}_{y},IVF{nlist}[_HNSW32],PQ{m}x8`` with the largest m in (256, 128, 64, 48, 32, 24, 16, 8, 4),
  m < d, whose codes fit the budget, y = (min(d // m, 6) + 1) m, an HNSW coarse quantiser from 1,000 lists.

Where ours departs from them, measured: (1) exact ``Flat`` comes first whenever its vectors fit the memory budget
and an exact search, timed on the real vectors (:func:`flat_latency_ms`), fits the latency budget -- an
approximate index buys nothing there; (2) IVF-Flat comes before HNSW when both fit, at any N: on clustered
unit vectors (what embeddings are) IVF reached a higher recall at a fraction of HNSW's latency and build time --
100,000 x 256-d here: IVF1024,Flat recall@10 1.0 at nprobe 4, 0.06 ms per query, built in 4 s; HNSW32 0.995 only
at efSearch 2048, 3.9 ms, built in 6 s; 1M x 512-d: IVF4096,Flat 1.0 at nprobe 8, 0.36 ms; HNSW32 0.86 at
efSearch 128, built in 442 s; (3) the result is a list of candidates, not one answer: the build measures the
recall@10 of the first (tuned to the latency budget) and moves on to the next when it falls short of
``min_recall``, keeping the best.

Tuning (:func:`tune`), as autofaiss's ``get_optimal_hyperparameters``: the search parameter (nprobe for IVF,
efSearch for HNSW) is raised as far as the latency budget allows, timed single-threaded one query at a time
(as ``serve`` searches, one request per thread) on real queries. Ours steps through powers of two instead of a
binary search, and stops early once recall@10 reaches 0.999 (more probes would cost time for nothing). Then,
unlike autofaiss, the budget is a ceiling, not a target: the setting kept is the cheapest whose recall@10 is
within :data:`RECALL_TOLERANCE` (0.005) of the best measured (or at ``--min-recall`` where that is higher), not the
largest that fits -- measured, 0.994 at nprobe 8 against 0.999 at nprobe 256 for 13x the latency. The same rule
picks HNSW's efSearch and a refined index's shortlist; the manifest records the rule and the best recall seen.

Exact re-scoring (:class:`Refined`, ``serve.index --refine``, on by default for ivf-pq): the PQ index returns a
shortlist of ``k x k_factor``, re-scored with the vectors themselves, kept on disk as fp16 and memory-mapped;
``k_factor`` is tuned with nprobe (at each nprobe, longer shortlists while recall still rises). PQ codes then
only have to shortlist the neighbours, so ``auto`` gives a refined index one code byte per 8 dimensions
(:func:`pq_key`) instead of the most that fit.

Recall at build (:func:`recall_at_k`): recall@10 against exact search on the stored vectors, over a sample of
real queries (up to 1,000 drawn from the collection itself). Tie-tolerant: a returned item counts when its exact
inner product reaches the exact 10th best (less 1e-5 relative), so a duplicate image found in place of its twin
is no miss.

IVF training uses at most 64 points per list (FAISS's k-means caps at 256; see :func:`train_sample`). On-disk
IVF (:func:`fill_ondisk`): one trained index is filled shard by shard, each shard written as a block, and the
blocks' inverted lists merged into one ``.ivfdata`` file served memory-mapped (how clip-retrieval serves LAION-5B's
index from one machine). Memory while filling stays at one shard. The merge is our :func:`merge_ondisk`, which
takes the steps of ``faiss.contrib.ondisk.merge_ondisk`` (the blocks read with ``IO_FLAG_MMAP``, their lists merged
by FAISS's ``OnDiskInvertedLists.merge_from_multiple`` into the lists of an empty copy of the trained index) but
takes loaded indices as well as block files, so ``--add`` puts an existing on-disk index's lists first.
"""
from __future__ import annotations

import math
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

import numpy as np


def import_faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("search indices need FAISS: pip install 'plugvlm[serve]' (or pip install faiss-cpu)") from None
    return faiss


KINDS = ("flat", "hnsw", "ivf-flat", "ivf-pq")
HNSW_M = 32
EF_CONSTRUCTION = 40
FLAT_THRESHOLD = 1_000            # autofaiss: below it, Flat
QUANTIZATION_THRESHOLD = 10_000   # autofaiss: below it, no quantisation (HNSW15)
PQ_VALUES = (256, 128, 64, 48, 32, 24, 16, 8, 4)
DIMS_PER_CODE_BYTE = 8            # a refined PQ index's codes: one byte per 8 dimensions (pq_key)
POINTS_PER_LIST = 64              # training sample per IVF list, at most (train_sample)
MEASURE_K = 100                   # candidates per query when timing: a typical re-ranking depth
RECALL_K = 10
OPQ_ITERATIONS = 10               # FAISS's default 50 (new_index)
OPQ_TRAIN_POINTS = 32_768         # FAISS's default 65,536
SATURATED = 0.999
#: recall@10 the tuner gives up for a cheaper setting (:func:`tune`): measured on 200,000 vectors, IVF2048,Flat
#: reached 0.994 at nprobe 8 (0.36 ms per query) and 0.999 at nprobe 256 (4.9 ms): 13x the latency for +0.005
RECALL_TOLERANCE = 0.005
EF_SEARCH = (16, 32, 64, 128, 256, 512, 1024, 2048)


# --------------------------------------------------------------------------------------------- sizes
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_memory(text: str | int) -> int:
    """Bytes of a size such as ``4G``, ``512M``, ``1.5GB``, ``16GiB`` or ``1000000`` (units are powers of 1024)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a memory size: write e.g. 4G, 512M or 16GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def memory_size(text: str) -> str:
    """argparse type of ``--max-memory``: the text, checked by :func:`parse_memory`."""
    import argparse

    try:
        parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# --------------------------------------------------------------------------------------------- keys
def nb_clusters(n: int) -> int:
    """IVF lists for ``n`` vectors, never more than n: the power of two nearest 4 sqrt(n) (the FAISS wiki's rule,
    autofaiss's ``get_optimal_nb_clusters`` below 1M), 2^17 from 300M on. autofaiss jumps to 16,384 lists at 1M;
    we stay with 4 sqrt(n) (4,096 at 1M) because k-means costs n x lists: 16,384 lists on a 1M sample would take
    over an hour of a 2-core build, 4,096 on 262,144 points (:func:`train_sample`) a few minutes, and 1M x 512-d
    IVF4096,Flat already reaches recall@10 1.0 at nprobe 8 (0.36 ms)."""
    nc = 2 ** round(math.log2(4 * math.sqrt(max(n, 1)))) if n < 300_000_000 else 2 ** 17
    return int(max(1, min(nc, n)))


def pq_key(n: int, d: int, max_bytes: int | None = None, refined: bool = False) -> str | None:
    """autofaiss's ``get_optimal_quantization`` (its first cluster count): the largest m whose codes fit
    ``max_bytes`` (any m without a budget); None when none fits. ``refined`` (the shortlist re-scored exactly,
    :class:`Refined`): at most one byte per :data:`DIMS_PER_CODE_BYTE` dimensions, since the codes then only have to
    shortlist the neighbours, not order them -- PQ64 for 512-d vectors instead of PQ256, a quarter of the RAM and
    of the OPQ training (which took tens of minutes for PQ256 on 2 cores here; the 1M-vector figures are
    train.bench.serve's)."""
    cap = max(PQ_VALUES[-1], d // DIMS_PER_CODE_BYTE) if refined else d
    for m in PQ_VALUES:
        if m >= d or m > cap:
            continue
        key = pq_key_for(n, d, m)
        if max_bytes is None or estimate_bytes(key, n, d) <= max_bytes:
            return key
    return None


def pq_key_for(n: int, d: int, m: int) -> str:
    """The OPQ+IVF+PQ factory key with ``m`` sub-quantizers of 8 bits for ``n`` vectors of dimension ``d``
    (autofaiss's layout: OPQ to y = (min(d // m, 6) + 1) m dimensions, an HNSW coarse quantiser from 1,000
    lists)."""
    nc = nb_clusters(n)
    coarse = f"IVF{nc}" if nc < 1000 else f"IVF{nc}_HNSW32"
    y = (min(d // m, 6) + 1) * m
    return f"OPQ{m}_{y},{coarse},PQ{m}x8"


def kind_of(key: str) -> str:
    """flat | hnsw | ivf-flat | ivf-pq of a factory key."""
    if key == "Flat":
        return "flat"
    if key.startswith("HNSW"):
        return "hnsw"
    if ",PQ" in key:
        return "ivf-pq"
    if key.startswith("IVF"):
        return "ivf-flat"
    raise ValueError(f"no kind for FAISS key {key!r}")


def estimate_bytes(key: str, n: int, d: int) -> int:
    """Size of an index of ``n`` vectors of dimension ``d`` (the formulas autofaiss and the FAISS wiki use:
    HNSW (4 d + 8 M) per vector; IVF codes + 8-byte ids per vector, plus centroids, rotation and codebooks)."""
    if key == "Flat":
        return 4 * n * d
    m = re.fullmatch(r"HNSW(\d+)", key)
    if m:
        return n * (4 * d + 8 * int(m.group(1)))
    nlist = int(re.search(r"IVF(\d+)", key).group(1))
    coarse = nlist * 32 * 8 if "_HNSW" in key else 0
    pq = re.fullmatch(r"OPQ(\d+)_(\d+),IVF\d+(?:_HNSW\d+)?,PQ(\d+)(?:x8)?", key)
    if pq:
        mq, y = int(pq.group(1)), int(pq.group(2))
        return n * (mq + 8) + nlist * y * 4 + coarse + y * d * 4 + 256 * y * 4
    return n * (4 * d + 8) + nlist * d * 4 + coarse


def key_for_kind(kind: str, n: int, d: int, max_bytes: int | None = None, refined: bool = False) -> str:
    """The factory key of an explicit ``--kind`` for ``n`` vectors of dimension ``d`` (module docstring);
    ``refined``: an ivf-pq index whose shortlist will be re-scored (:func:`pq_key`)."""
    if kind == "flat":
        return "Flat"
    if kind == "hnsw":
        return f"HNSW{HNSW_M}"
    if kind == "ivf-flat":
        return f"IVF{nb_clusters(n)},Flat"
    if kind == "ivf-pq":
        if n < FLAT_THRESHOLD or d < 8:
            raise ValueError(f"--kind ivf-pq needs at least {FLAT_THRESHOLD:,} vectors of 8 or more dimensions to "
                             f"train its codebooks (this collection: {n:,} of {d}); use --kind flat or auto")
        return pq_key(n, d, max_bytes, refined) or pq_key(n, d, refined=refined)
    raise ValueError(f"unknown index kind {kind!r}; choose from auto, {', '.join(KINDS)}")


def auto_keys(n: int, d: int, max_bytes: int, *, flat_ms: float | None = None,
              max_latency_ms: float | None = None, refined: bool = False) -> list[str]:
    """Candidate factory keys for ``n`` vectors of dimension ``d`` within ``max_bytes``, best first (module
    docstring: autofaiss's ``get_optimal_index_keys_v2`` with our measured departures). ``flat_ms``: measured
    latency of an exact search over all n vectors, with ``max_latency_ms`` the budget; ``refined``: a PQ candidate
    will have its shortlist re-scored (:func:`pq_key`). Raises ValueError when no index fits the budget, naming the
    smallest."""
    flat_fits = 4 * n * d <= max_bytes
    if n < FLAT_THRESHOLD and flat_fits:
        return ["Flat"]
    if flat_fits and flat_ms is not None and max_latency_ms is not None and flat_ms <= max_latency_ms:
        return ["Flat"]
    if n < QUANTIZATION_THRESHOLD:
        keys = ["HNSW15"] if estimate_bytes("HNSW15", n, d) <= max_bytes else []
        keys += ["Flat"] if flat_fits else []
        if not keys:
            raise ValueError(f"no index of {n:,} vectors of {d} dimensions fits --max-memory "
                             f"{_human(max_bytes)} (Flat needs {_human(4 * n * d)}); raise it")
        return keys
    keys = []
    ivf = f"IVF{nb_clusters(n)},Flat"
    if estimate_bytes(ivf, n, d) <= max_bytes:  # autofaiss: below IVF_FLAT_THRESHOLD and after HNSW (docstring)
        keys.append(ivf)
    m_hnsw = int(math.floor((max_bytes / (4 * n) - d) / 2))
    if m_hnsw >= 8:
        keys.append(f"HNSW{min(m_hnsw, 32)}")
    pq = pq_key(n, d, max_bytes, refined)
    if pq is not None:
        keys.append(pq)
    if not keys:
        smallest = pq_key(n, d) or ivf
        raise ValueError(f"no index of {n:,} vectors of {d} dimensions fits --max-memory {_human(max_bytes)}: the "
                         f"smallest, {smallest}, needs about {_human(estimate_bytes(smallest, n, d))}; raise it")
    return keys


def _human(n: int) -> str:
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


# --------------------------------------------------------------------------------------------- building
def _rows(vectors, rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(vectors[np.sort(rows)], dtype=np.float32)


def train_sample(vectors, key: str, seed: int = 0) -> np.ndarray:
    """The rows an index is trained on: all of them, or a seeded sample of :data:`POINTS_PER_LIST` per IVF list.

    64 per list, not FAISS's cap of 256: k-means costs grow with the sample, and 4,096 lists trained on 32 per list
    of 512-d vectors took 74 s on 2 cores here, so 256 per list (a 1M sample) would take about 9 minutes of a 1M
    build and 64 about 2.5; FAISS warns only below 39 per list, and IVF lists need to partition the collection,
    not to be optimal centroids (recall is then bought with nprobe, which `tune` sets)."""
    n = len(vectors)
    nlist = re.search(r"IVF(\d+)", key)
    size = n if nlist is None else min(n, POINTS_PER_LIST * int(nlist.group(1)))
    if size >= n:
        return np.ascontiguousarray(vectors[:], dtype=np.float32)
    return _rows(vectors, np.random.default_rng([seed, 0x1DE]).choice(n, size, replace=False))


def new_index(key: str, d: int):
    faiss = import_faiss()
    index = faiss.index_factory(d, key, faiss.METRIC_INNER_PRODUCT)
    hnsw = getattr(index, "hnsw", None)
    if hnsw is not None:
        hnsw.efConstruction = EF_CONSTRUCTION
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and hasattr(faiss.downcast_index(ivf), "do_polysemous_training"):
        # The factory turns polysemous training on for IVF-PQ: a code reordering that only serves polysemous
        # (Hamming-filtered) search, which we do not use, and costs 30x the PQ training (25 s vs 0.9 s measured
        # on 3,000 x 32-d here).
        faiss.downcast_index(ivf).do_polysemous_training = False
    if key.startswith("OPQ"):
        # FAISS trains the OPQ rotation with 50 alternations of PQ training and Procrustes on up to 65,536 points,
        # minutes to hours on a small machine; 10 on 32,768 cost a sixth and kept the recall: 50,000 x 512-d,
        # OPQ64_448,IVF1024,PQ64x8 on 2 cores here: 210 s -> 33 s of training, recall@10 0.477 -> 0.471 at nprobe 16.
        opq = faiss.downcast_VectorTransform(faiss.downcast_index(index).chain.at(0))
        opq.niter, opq.max_train_points = OPQ_ITERATIONS, OPQ_TRAIN_POINTS
    return index


def train_index(vectors, key: str, seed: int = 0):
    """An empty index of ``key`` trained on a sample of ``vectors`` ([N, d] float32, a memmap is fine)."""
    index = new_index(key, vectors.shape[1])
    if not index.is_trained:
        index.train(train_sample(vectors, key, seed))
    return index


def add_vectors(index, vectors, start: int = 0, batch: int = 65_536, pbar=None, ids: bool = False) -> None:
    """Add ``vectors`` in batches (bounded memory); ``ids``: with explicit ids ``start + row`` (IVF blocks)."""
    for a in range(0, len(vectors), batch):
        x = np.ascontiguousarray(vectors[a:a + batch], dtype=np.float32)
        if ids:
            index.add_with_ids(x, np.arange(start + a, start + a + len(x), dtype=np.int64))
        else:
            index.add(x)
        if pbar is not None:
            pbar.update(len(x))


def build(vectors, key: str, *, seed: int = 0, pbar=None):
    """An in-memory index of ``key`` over ``vectors`` (FAISS id = row)."""
    index = train_index(vectors, key, seed)
    add_vectors(index, vectors, pbar=pbar)
    return index


def empty_like(trained):
    """A copy of a trained index with no vectors (for the blocks of an on-disk fill)."""
    faiss = import_faiss()
    return faiss.clone_index(trained)


def fill_ondisk(trained, vectors, ivfdata: Path, scratch: Path, *, shard_rows: int = 1_000_000, start: int = 0,
                keep: Sequence = (), pbar=None):
    """Fill a copy of the empty trained IVF index ``trained`` with ``vectors`` shard by shard (ids ``start +
    row``), each shard written as a block under ``scratch``, and merge the blocks' inverted lists -- after those of
    the IVF indices in ``keep`` (an existing index being extended) -- into the on-disk file ``ivfdata`` with
    :func:`merge_ondisk`. Returns the index, whose lists live in ``ivfdata``; write it with ``faiss.write_index``
    next to that file."""
    faiss = import_faiss()
    scratch.mkdir(parents=True, exist_ok=True)
    blocks = []
    for k, a in enumerate(range(0, len(vectors), shard_rows)):
        block = empty_like(trained)
        add_vectors(block, vectors[a:a + shard_rows], start=start + a, ids=True, pbar=pbar)
        path = scratch / f"block-{k:05d}.index"
        faiss.write_index(block, str(path))
        del block
        blocks.append(path)
    # the blocks are mapped, not loaded: the merged lists may exceed the RAM
    sources = list(keep) + [faiss.read_index(str(p), faiss.IO_FLAG_MMAP) for p in blocks]
    return merge_ondisk(empty_like(trained), sources, ivfdata)


def merge_ondisk(empty, sources: Sequence, ivfdata: Path):
    """The inverted lists of the IVF indices ``sources``, in order, merged into ``ivfdata`` as the lists of
    ``empty`` (a trained IVF index without vectors), which is returned.

    Ours, not ``faiss.contrib.ondisk.merge_ondisk`` itself, though the same steps: an ``OnDiskInvertedLists`` on
    ``ivfdata`` filled by ``merge_from_multiple`` from the sources' lists, then swapped into ``empty``
    (``replace_invlists``, owned by it). The differences: the sources are loaded indices (the contrib function
    reads file names), so an existing on-disk index can be one; ids are kept as the sources hold them
    (``shift_ids=False``: the blocks were added with their global ids); the sources stay referenced (``sources``)
    while their lists are read, instead of having those lists disowned; and FAISS's unconditional "resizing"
    printf on file descriptor 1 is silenced (:func:`quiet_stdout`)."""
    faiss = import_faiss()
    ivf = faiss.extract_index_ivf(empty)
    if empty.ntotal != 0:
        raise ValueError("merge_ondisk needs an empty trained index")
    invlists = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(ivfdata))
    vec = faiss.InvertedListsPtrVector()
    for s in sources:
        vec.push_back(faiss.extract_index_ivf(s).invlists)
    with quiet_stdout():
        ntotal = invlists.merge_from_multiple(vec.data(), vec.size(), False)
    empty.ntotal = ivf.ntotal = ntotal
    ivf.replace_invlists(invlists, True)
    invlists.this.disown()
    return empty


@contextmanager
def quiet_stdout():
    """Silence what C++ prints on file descriptor 1 meanwhile: FAISS's on-disk inverted lists printf "resizing
    FILE to N bytes" on every merge and "IO_FLAG_ONDISK_SAME_DIR: updating ondisk filename ..." on every read,
    unconditionally. Process-wide while it lasts: used around those calls only."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no file descriptor 1 (embedded interpreters)
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


# --------------------------------------------------------------------------------------------- exact re-scoring
class Refined:
    """A product-quantised index whose shortlist is re-scored exactly: ``search(q, k)`` asks the PQ index for its
    top ``k x k_factor`` (approximate inner products of the codes), then computes the true inner products of those
    candidates from the collection's own vectors, stored as fp16 and memory-mapped from disk (``vectors``: an
    [N, d] array or ``np.load(..., mmap_mode="r")``), and keeps the best ``k``. FAISS's ``IndexRefine`` does the
    same with a refinement index held in RAM (4 d bytes per vector: as much as IVF-Flat); here the vectors stay on
    disk and only the ``k x k_factor`` rows a query touches are read, so RAM holds the PQ codes alone (m + 8 bytes
    per vector). PQ at 64 bytes per 512-d vector ranks the true neighbours well enough to have them in a shortlist
    of a few hundred, not well enough to order them: this is what makes it usable for retrieval (train.bench.serve:
    recall@10 0.23 without, table in the README). ``k_factor`` is tuned like nprobe (:func:`tune`).

    Everything else (``ntotal``, ``d``, ``metric_type``, ...) is the wrapped index's; ``reconstruct_batch`` returns
    the stored vectors (exact, unlike PQ's reconstruction)."""

    def __init__(self, index, vectors, k_factor: int = 8):
        if len(vectors) != index.ntotal or vectors.shape[1] != index.d:
            raise ValueError(f"refinement vectors {tuple(vectors.shape)} do not match the index ({index.ntotal} x "
                             f"{index.d})")
        self.index, self.vectors, self.k_factor = index, vectors, int(k_factor)

    def __getattr__(self, name):
        return getattr(self.index, name)

    def search(self, queries: np.ndarray, k: int):
        q = np.ascontiguousarray(queries, dtype=np.float32)
        shortlist = max(k, min(self.index.ntotal, k * self.k_factor))
        _, ids = self.index.search(q, shortlist)
        scores = np.full((len(q), k), -np.inf, dtype=np.float32)
        out = np.full((len(q), k), -1, dtype=np.int64)
        for i in range(len(q)):
            found = ids[i][ids[i] >= 0]
            if not len(found):
                continue
            order = np.argsort(found, kind="stable")  # rows read in file order
            rows = np.asarray(self.vectors[found[order]], dtype=np.float32)
            exact = np.empty(len(found), dtype=np.float32)
            exact[order] = rows @ q[i]
            top = np.lexsort((found, -exact.astype(np.float64)))[:k]  # best first, ties by row
            scores[i, :len(top)], out[i, :len(top)] = exact[top], found[top]
        return scores, out

    def reconstruct_batch(self, rows):
        return np.asarray(self.vectors[np.asarray(rows, dtype=np.int64)], dtype=np.float32)


# --------------------------------------------------------------------------------------------- search parameters
#: shortlist multiples :func:`tune` tries for a Refined index
K_FACTORS = (2, 4, 8, 16, 32, 64, 128, 256)


def apply_params(index, params: dict) -> None:
    """Set search parameters (``{"nprobe": 8}``, ``{"efSearch": 64}``, ``{"nprobe": 8, "quantizer_efSearch":
    16}``) through ``faiss.ParameterSpace``, which reaches through OPQ pre-transforms to the IVF / HNSW inside;
    ``k_factor`` sets a :class:`Refined` index's shortlist (as FAISS names IndexRefine's)."""
    params = dict(params or {})
    k_factor = params.pop("k_factor", None)
    if k_factor is not None:
        if not isinstance(index, Refined):
            raise ValueError("k_factor applies to an index with exact re-scoring (Refined) only")
        index.k_factor = int(k_factor)
    if not params:
        return
    faiss = import_faiss()
    inner = index.index if isinstance(index, Refined) else index
    faiss.ParameterSpace().set_index_parameters(inner, ",".join(f"{k}={v}" for k, v in params.items()))


def param_ladder(key: str) -> list[dict]:
    """The search settings :func:`tune` tries, cheapest first ([] for Flat)."""
    if key.startswith("HNSW"):
        return [{"efSearch": ef} for ef in EF_SEARCH]
    m = re.search(r"IVF(\d+)", key)
    if not m:
        return []
    nlist = int(m.group(1))
    probes = sorted({min(2 ** k, nlist) for k in range(0, int(math.log2(nlist)) + 2)})
    if "_HNSW" in key:  # autofaiss: the HNSW coarse quantiser searched at efSearch 2 nprobe
        return [{"nprobe": p, "quantizer_efSearch": max(16, 2 * p)} for p in probes]
    return [{"nprobe": p} for p in probes]


def max_norm(vectors, chunk: int = 1 << 16) -> float:
    """The largest Euclidean norm among ``vectors`` (a memmap is read in chunks): recorded at build, it bounds every
    inner product a query ``q`` can have with them, ``|<q, v>| <= |q| max_norm`` (serve.search checks each score)."""
    best = 0.0
    for a in range(0, len(vectors), chunk):
        block = np.asarray(vectors[a:a + chunk], dtype=np.float32)
        if len(block):
            best = max(best, float(np.sqrt(np.einsum("nd,nd->n", block, block).max())))
    return round(best, 6)


def score_bound(kind: str, norm_bound: float, query_norm: float) -> float:
    """The largest first-stage score an undamaged index of ``kind`` can give a query of norm ``query_norm``: the
    inner-product bound with slack for float rounding, and for PQ for its reconstructions, whose norms differ from
    the vectors' (by up to a few tenths for unit vectors at 64 bytes per code)."""
    slack = 0.5 if kind == "ivf-pq" else 0.01
    return query_norm * norm_bound * (1 + slack) + 1e-3


def exact_top(vectors, queries: np.ndarray, k: int, chunk_bytes: int = 1 << 26) -> np.ndarray:
    """[Q, k] exact top-k inner products of ``queries`` over ``vectors`` (a memmap is read in chunks), best first."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    k = min(k, len(vectors))
    best = np.full((len(q), k), -np.inf, dtype=np.float32)
    step = max(1, chunk_bytes // (4 * max(1, len(q))))
    for a in range(0, len(vectors), step):
        s = q @ np.asarray(vectors[a:a + step], dtype=np.float32).T
        both = np.concatenate([best, s], axis=1)
        best = -np.partition(-both, k - 1, axis=1)[:, :k]
    return -np.sort(-best, axis=1)


def recall_at_k(found: np.ndarray, vectors, queries: np.ndarray, exact: np.ndarray) -> float:
    """Tie-tolerant recall@k (module docstring) of ``found`` ([Q, k] ids, -1 for none) against ``exact`` ([Q, k]
    exact top scores): the share of found items whose exact inner product reaches the exact k-th best."""
    k = exact.shape[1]
    found = found[:, :k]
    kth = exact[:, -1:]
    valid = found >= 0
    rows = np.where(valid, found, 0)
    flat = np.unique(rows)  # each vector read once (a memmap: one fancy index)
    gathered = np.asarray(vectors[flat], dtype=np.float32)
    scores = np.einsum("qd,qkd->qk", queries.astype(np.float32), gathered[np.searchsorted(flat, rows)])
    hit = valid & (scores >= kth - 1e-5 * np.maximum(1.0, np.abs(kth)))
    return float(hit.sum() / (len(found) * k)) if len(found) else 1.0


class single_thread:
    """``with single_thread():`` FAISS on one OpenMP thread (as one serving request), restored after."""

    def __enter__(self):
        self.faiss = import_faiss()
        self.before = self.faiss.omp_get_max_threads()
        self.faiss.omp_set_num_threads(1)

    def __exit__(self, *exc):
        self.faiss.omp_set_num_threads(self.before)


def latency_ms(index, queries: np.ndarray, k: int = MEASURE_K, max_queries: int = 200,
               max_seconds: float = 2.0) -> float:
    """Mean milliseconds per query, single-threaded, one query at a time (after one warm-up search)."""
    q = np.ascontiguousarray(queries[:max_queries], dtype=np.float32)
    k = max(1, min(k, index.ntotal))
    with single_thread():
        index.search(q[:1], k)
        done, start = 0, time.perf_counter()
        for i in range(len(q)):
            index.search(q[i:i + 1], k)
            done += 1
            if time.perf_counter() - start > max_seconds:
                break
        return 1000.0 * (time.perf_counter() - start) / max(1, done)


def flat_latency_ms(vectors, queries: np.ndarray, sample: int = 1 << 18) -> float:
    """Milliseconds of an exact single-threaded search over all of ``vectors``: timed on a Flat index of them, or of
    ``sample`` of them scaled linearly beyond (an exact scan is linear in N; the sample is large enough to be out
    of the CPU caches, which a small one would not be: 20,000 x 256-d scaled to 100,000 under-estimated by a
    third here). Called only when the vectors fit the memory budget."""
    faiss = import_faiss()
    n = len(vectors)
    part = np.ascontiguousarray(vectors[:min(n, sample)], dtype=np.float32)
    flat = faiss.IndexFlatIP(part.shape[1])
    flat.add(part)
    return latency_ms(flat, queries, max_queries=50, max_seconds=1.0) * n / len(part)


def tune(index, key: str, vectors, queries: np.ndarray, max_latency_ms: float,
         say: Callable[[str], None] = lambda s: None, exact: np.ndarray | None = None, *,
         min_recall: float | None = None, tolerance: float | None = None) -> dict:
    """Search parameters for ``index`` (of ``key``, over ``vectors``) within ``max_latency_ms`` (module
    docstring), with the measurements: ``{"params", "recall_at_10" (None for Flat), "ms_per_query", "ladder":
    [{..params, "ms", "recall"}], "best_recall_at_10", "rule"}``. The budget is a ceiling, not a target: of the
    settings measured within it, the cheapest whose recall@10 is within ``tolerance`` (:data:`RECALL_TOLERANCE`) of
    the best measured, or reaches ``min_recall`` where that is higher (and reachable), is kept. The cheapest setting
    is kept even when over budget (nothing is faster). ``exact``: :func:`exact_top` of the queries at k = 10, when
    already computed (several candidates)."""
    tolerance = RECALL_TOLERANCE if tolerance is None else float(tolerance)
    ladder = param_ladder(key)
    if not ladder:
        return {"params": {}, "recall_at_10": None, "ms_per_query": round(latency_ms(index, queries), 4), "ladder": []}
    if exact is None:
        exact = exact_top(vectors, queries, RECALL_K)
    tried, chosen = [], None

    def measure(params: dict) -> tuple[float, float | None]:
        apply_params(index, params)
        ms = latency_ms(index, queries)
        if chosen is not None and ms > max_latency_ms:
            tried.append({**params, "ms": round(ms, 4), "recall": None})
            return ms, None
        _, found = index.search(np.ascontiguousarray(queries, dtype=np.float32), min(RECALL_K, index.ntotal))
        recall = recall_at_k(found, vectors, queries, exact)
        tried.append({**params, "ms": round(ms, 4), "recall": round(recall, 4)})
        say(f"  {key} {', '.join(f'{k} {v}' for k, v in params.items())}: recall@10 {recall:.3f}, {ms:.3f} ms/query")
        return ms, recall

    factors = K_FACTORS if isinstance(index, Refined) else (None,)
    measured = []  # (params, recall, ms) of the settings whose recall was measured
    for params in ladder:
        stop, previous = False, None
        for j, factor in enumerate(factors):  # a Refined index: longer shortlists at each nprobe while recall rises
            step = params if factor is None else {**params, "k_factor": factor}
            ms, recall = measure(step)
            if recall is not None:
                measured.append((step, recall, ms))
                if chosen is None:
                    chosen = step
            if recall is None or ms > max_latency_ms:
                stop = j == 0  # even the shortest shortlist is over budget: more probes would be too
                break
            if recall >= SATURATED:
                stop = True
                break
            if previous is not None and recall < previous + 0.002:
                break
            previous = recall
        if stop:
            break
    within = [m for m in measured if m[2] <= max_latency_ms] or measured[:1]  # else the cheapest, over budget
    best = max(r for _, r, _ in within)
    target = max(best - tolerance, min(min_recall or 0.0, best))
    params, recall, ms = min((m for m in within if m[1] >= target - 1e-9), key=lambda m: m[2])
    apply_params(index, params)
    rule = (f"the cheapest setting within {tolerance:g} of the best recall@10 measured within "
            f"{max_latency_ms:g} ms ({best:.4f})" + (f" or at --min-recall {min_recall:g}" if min_recall else ""))
    return {"params": params, "recall_at_10": round(recall, 4), "ms_per_query": round(ms, 4), "ladder": tried,
            "best_recall_at_10": round(best, 4), "rule": rule}
