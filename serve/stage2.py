"""Stored second-stage representations: what re-ranking reads instead of re-encoding its candidates.

Stage 2 re-scores the first K candidates with the model's own score, ``score_directed(image_reps, text_reps)``.
The collection side of that score is the head's *representation* of each candidate (ComAlign: its entities,
relations and global component after the head's two-layer transformers; SmartCLIP: the image embedding or the
caption's embedding and mask; PowerCLIP: the regions), which depends on the candidate alone. Computing it from
the cached backbone arrays at query time is the expensive part of re-ranking: for ComAlign at ViT-B-32 shapes
(21 components x 512-d through 2 transformer layers per candidate) it took 329 ms per 100 candidates on one CPU
thread here (``python -m train.bench.serve``), against the issue's budget of 30 ms. ``serve.index`` computes exactly
these representations anyway while it writes the first-stage vectors (the first stage is a projection of them),
so it can keep them: then re-ranking gathers K rows and computes only the score.

Files (flat in the index directory, listed in the manifest's ``files`` and checked on open like every other):
``<side>.stage2.<name>.npy`` per representation tensor, row r = FAISS id r of ``<side>.index`` (not a cache row),
stored at the dtype the head computes (float32 stays float32, so stored and encoded re-ranking give the same
scores: the exactness check of ``serve.query --recall`` holds either way). The manifest's
``indexes.<side>.stage2`` is ``{"stored": true, "arrays": {name: {"file", "dtype", "shape"}}, "bytes"}`` or
``{"stored": false, "reason": ...}``.

Stored only when every batch gives the same trailing shape for every tensor (a representation padded to each
batch's longest caption cannot be stacked without knowing how the head masks padding, so such a side is encoded
per query instead, and the manifest says why), and when the arrays fit the build's byte budget
(``--stage2-max-bytes``): ComAlign at ViT-B-32 shapes takes 45 KB per image, 45 GB for a million.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from serve.layout import IndexDirError

MODES = ("auto", "stored", "encoded")


def file_name(side: str, name: str) -> str:
    """``<side>.stage2.<name>.npy`` with anything but letters, digits, ``_`` and ``-`` in ``name`` replaced."""
    return f"{side}.stage2.{re.sub(r'[^A-Za-z0-9_-]', '_', name)}.npy"


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


class Stage2Writer:
    """Collects the representations of ``total`` items of ``side``, batch by batch in row order, into memory-mapped
    ``.npy`` files of ``folder``. ``max_bytes``: give up (nothing kept) when the arrays would take more; None: no
    limit. After the last batch, :meth:`finish` returns the manifest entry (and the file names written)."""

    def __init__(self, folder: Path, side: str, total: int, max_bytes: int | None):
        self.folder, self.side, self.total, self.max_bytes = Path(folder), side, int(total), max_bytes
        self.arrays: dict[str, np.ndarray] = {}
        self.spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.row = 0
        self.reason: str | None = None

    def _give_up(self, reason: str) -> None:
        self.reason = reason
        for name in list(self.arrays):
            self.arrays[name] = None  # drop the memmap before its file
            (self.folder / file_name(self.side, name)).unlink(missing_ok=True)
        self.arrays = {}

    def add(self, reps: dict) -> None:
        """Append the representations of the next items (every value a tensor with first dimension = the batch)."""
        if self.reason is not None:
            return
        values = {k: v for k, v in reps.items()}
        if not values or not all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in values.values()):
            return self._give_up("its representation is not a set of tensors with one row per item")
        n = {int(v.shape[0]) for v in values.values()}
        if len(n) != 1:
            return self._give_up("its representation's tensors disagree on the number of items")
        n = n.pop()
        if not self.spec:
            self.spec = {k: (tuple(v.shape[1:]), _numpy(v[:0]).dtype) for k, v in values.items()}
            per_item = sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in self.spec.values())
            need = per_item * self.total
            if self.max_bytes is not None and need > self.max_bytes:
                return self._give_up(f"stored, it would take {need / 2**30:.2f} GiB, over the "
                                     f"{self.max_bytes / 2**30:.2f} GiB budget (--stage2-max-bytes)")
            for k, (shape, dtype) in self.spec.items():
                self.arrays[k] = np.lib.format.open_memmap(self.folder / file_name(self.side, k), mode="w+",
                                                           dtype=dtype, shape=(self.total, *shape))
        if set(values) != set(self.spec):
            return self._give_up("its representation's keys change from batch to batch")
        for k, v in values.items():
            shape, dtype = self.spec[k]
            if tuple(v.shape[1:]) != shape or _numpy(v[:0]).dtype != dtype:
                return self._give_up(f"its {k!r} changes shape from batch to batch ({tuple(v.shape[1:])} vs "
                                     f"{shape}: padded per batch)")
        if self.row + n > self.total:
            raise ValueError(f"stage-2 store of {self.side}: more than the {self.total} items announced")
        for k, v in values.items():
            self.arrays[k][self.row:self.row + n] = _numpy(v)
        self.row += n

    def finish(self) -> tuple[dict, list[str]]:
        """(the manifest entry, the file names written, to be flushed and listed)."""
        if self.reason is None and self.row != self.total:
            self._give_up(f"only {self.row} of {self.total} items were given")
        if self.reason is not None:
            return {"stored": False, "reason": self.reason}, []
        entry, names, size = {}, [], 0
        for k, (shape, dtype) in self.spec.items():
            self.arrays[k].flush()
            name = file_name(self.side, k)
            entry[k] = {"file": name, "dtype": str(dtype), "shape": [self.total, *shape]}
            names.append(name)
            size += (self.folder / name).stat().st_size
        self.arrays = {}
        return {"stored": True, "arrays": entry, "bytes": size}, names


class Stage2Store:
    """The stored representations of one side, memory-mapped: :meth:`take` gathers rows as the head's Reps."""

    def __init__(self, arrays: dict[str, np.ndarray], paths: dict[str, Path] | None = None):
        self.arrays = arrays
        self.paths = paths or {name: Path(name) for name in arrays}

    @classmethod
    def open(cls, index_dir: Path, side: str, entry: dict | None, rows: int) -> "Stage2Store | None":
        """The store of ``side`` from its manifest entry (None when nothing was stored). Raises ValueError naming
        the file when an array is missing or does not match the entry (``rows`` items, its dtype and shape)."""
        if not entry or not entry.get("stored"):
            return None
        arrays, paths = {}, {}
        for name, spec in (entry.get("arrays") or {}).items():
            path = paths[name] = Path(index_dir) / str(spec.get("file", ""))
            try:
                arr = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise ValueError(f"{path}: stored stage-2 array cannot be read ({e}); rebuild the index") from None
            if list(arr.shape) != list(spec.get("shape", [])) or str(arr.dtype) != spec.get("dtype") or \
                    len(arr) != rows:
                raise ValueError(f"{path} holds {arr.dtype} {list(arr.shape)}, the manifest says {spec.get('dtype')} "
                                 f"{spec.get('shape')} for {rows} rows: it was replaced; rebuild the index")
            arrays[name] = arr
        if not arrays:
            raise ValueError(f"{index_dir}: the manifest says the {side} stage-2 store exists but names no array; "
                             "rebuild the index")
        return cls(arrays, paths)

    def take(self, rows: np.ndarray, device) -> dict:
        """Reps of ``rows`` (side rows = FAISS ids), in the order given."""
        rows = np.asarray(rows, dtype=np.int64)
        order = np.argsort(rows, kind="stable")  # sorted reads are sequential on disk
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        out = {}
        for name, arr in self.arrays.items():
            block = np.asarray(arr[rows[order]])[back]
            if block.dtype.kind == "f" and not np.isfinite(block).all():  # what the head wrote is always finite
                raise IndexDirError(f"{self.paths[name]} holds a non-finite value in a row re-ranking read: the file "
                                    f"is damaged; python -m serve.index --verify {self.paths[name].parent} checks "
                                    "every file of the index, then copy it again or rebuild it")
            out[name] = torch.from_numpy(block).to(device)
        return out
