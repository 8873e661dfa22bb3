"""The process's memory of live extraction (adapters/live_memo.py): computed once, returned in order, bounded."""
from __future__ import annotations

import numpy as np
from PIL import Image

from adapters.live_memo import ArrayMemo, pixels_digest, scope_key


def _rows(keys, width=3):
    return {"x": np.array([[len(k)] * width for k in keys], np.float32), "mask": np.ones((len(keys), width), bool)}


def _join(parts):
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def test_only_what_is_missing_is_computed_and_the_order_is_the_callers():
    memo, asked = ArrayMemo(), []

    def compute(keys):
        def inner(positions):
            asked.append([keys[p] for p in positions])
            return _rows([keys[p] for p in positions])
        return inner

    first = ["a", "bb", "a", "ccc"]
    out = memo.get_many("s", first, compute(first), _join)
    assert asked == [["a", "bb", "ccc"]]  # "a" twice in the request, computed once
    assert out["x"][:, 0].tolist() == [1, 2, 1, 3]
    second = ["ccc", "dddd", "bb"]
    out = memo.get_many("s", second, compute(second), _join)
    assert asked[-1] == ["dddd"] and out["x"][:, 0].tolist() == [3, 4, 2]
    other = ["a"]
    memo.get_many("another scope", other, compute(other), _join)  # another scope never reads these
    assert asked[-1] == ["a"] and (memo.hits, memo.misses) == (3, 5)


def test_the_budget_drops_the_least_recently_used():
    per_item = _rows(["a"])["x"].nbytes + _rows(["a"])["mask"].nbytes
    memo = ArrayMemo(budget=2 * per_item)
    for keys in (["a"], ["b"], ["a"], ["c"]):  # "a" used again before "c" arrives: "b" goes
        memo.get_many("s", keys, lambda pos, keys=keys: _rows([keys[p] for p in pos]), _join)
    assert set(k for _, k in memo._items) == {"a", "c"} and memo.used <= memo.budget


def test_an_image_is_known_by_its_pixels_not_only_its_name():
    a = Image.new("RGB", (8, 8), (10, 20, 30))
    b = Image.new("RGB", (8, 8), (10, 20, 31))
    assert pixels_digest(a) == pixels_digest(a.copy()) != pixels_digest(b)
    assert pixels_digest(Image.new("RGB", (4, 16))) != pixels_digest(Image.new("RGB", (16, 4)))  # same bytes, other shape
    assert scope_key(weights="w", settings={"a": 1, "b": 2}) == scope_key(settings={"b": 2, "a": 1}, weights="w")
