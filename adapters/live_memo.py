"""A memory of live extraction: the arrays of an image or a caption, computed once per process for every scorer that
extracts them the same way.

An evaluation of several adapters of one base (``train.adapter.compare``, the demo) rebuilds each adapter's live
extractor, and when their caches were built alike (one shared cache, the usual case) every one of them would run
the backbone over the same crops and spaCy over the same captions again. :class:`ArrayMemo` keeps each item's
arrays under a *scope* (everything that decides them: the backbone's weights, the extraction settings, where the
boxes come from) and an item key (a caption's text; an image's id together with a digest of its pixels, so an
upload that reuses a name is never confused with another image). It is bounded in bytes, least recently used out.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

#: bytes of arrays kept per process (patch tokens of a ViT-L image are ~0.4 MB; a toy-world image's arrays ~10 KB)
BUDGET = 256 << 20


def scope_key(**parts) -> str:
    """One hashable name for everything that decides the arrays (JSON of ``parts``, hashed)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def pixels_digest(image) -> str:
    """A digest of a decoded image's pixels and shape."""
    a = np.asarray(image)
    return hashlib.blake2b(a.tobytes(), digest_size=16, person=str(a.shape).encode()[:16]).hexdigest()


class ArrayMemo:
    """Per-item arrays ({name: array with a leading item dim of 1}) by (scope, key), or a batch's arrays under one
    key (:meth:`get`), bounded by :data:`BUDGET`."""

    def __init__(self, budget: int = BUDGET):
        self.budget, self.used = budget, 0
        self._items: OrderedDict[tuple[str, str], dict[str, np.ndarray]] = OrderedDict()
        self.hits = self.misses = 0

    def get_many(self, scope: str, keys: Sequence[str], compute: Callable[[list[int]], dict[str, np.ndarray]],
                 join: Callable[[list[dict[str, np.ndarray]]], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The arrays of ``keys`` in order: those not held are computed in one call, ``compute(positions)`` (the
        positions in ``keys`` of the missing ones, each key once, returning their rows in that order); ``join``
        stacks per-item arrays whose trailing dims may differ (token lengths)."""
        missing = list(dict.fromkeys(k for k in keys if (scope, k) not in self._items))
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        fresh = {}
        if missing:
            first = {k: i for i, k in reversed(list(enumerate(keys)))}
            rows = compute([first[k] for k in missing])
            for j, k in enumerate(missing):
                fresh[k] = {name: a[j:j + 1].copy() for name, a in rows.items()}
        out = [fresh.get(k) or self._items[(scope, k)] for k in keys]
        for k in keys:
            if (scope, k) in self._items:
                self._items.move_to_end((scope, k))
        for k, arrays in fresh.items():
            self._put((scope, k), arrays)
        return join(out)

    def get(self, scope: str, key: str, compute: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The arrays held under ``key`` whole (any leading dim: a batch computed together), ``compute()`` when not
        held."""
        held = self._items.get((scope, key))
        if held is not None:
            self.hits += 1
            self._items.move_to_end((scope, key))
            return held
        self.misses += 1
        arrays = compute()
        self._put((scope, key), {name: a.copy() for name, a in arrays.items()})
        return arrays

    def _put(self, key: tuple[str, str], arrays: dict[str, np.ndarray]) -> None:
        size = sum(a.nbytes for a in arrays.values())
        if size > self.budget:
            return
        self._items[key] = arrays
        self.used += size
        while self.used > self.budget:
            _, dropped = self._items.popitem(last=False)
            self.used -= sum(a.nbytes for a in dropped.values())


#: the process's memory, shared by every live extractor
MEMO = ArrayMemo()

#: phrase -> embedding tables, one per frozen backbone (``tower_scope``): a phrase is embedded alone, so every live
#: extractor of that backbone, whatever adapter it serves, computes the same bits for it (each table bounded by its
#: builder, extract.pipeline.PHRASE_MEMO)
_PHRASE_TABLES: dict[str, dict] = {}


def phrase_table(scope: str) -> dict:
    """The phrase table of the backbone named by ``scope`` (created empty the first time)."""
    return _PHRASE_TABLES.setdefault(scope, {})
