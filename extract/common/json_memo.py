"""Large JSON files read once per process while they stay unchanged.

A toy world's ``annotations.json`` (every scene's objects) and ``negatives.json`` are read by the data source, the
held-out truth, the live extractor, the benchmark readers and the text-only floor, once per adapter run and per
evaluated model: the demo parsed the same files ~100 times (17 s of its 7 min, measured with cProfile). A file is
parsed again when its size or modification time changes, so a regenerated world is never served stale.

The parsed object is shared: callers read it and never change it (copy first to edit).
"""
from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

#: parsed files kept (least recently used first out); a toy world holds two large ones
MAX_FILES = 8

_MEMO: OrderedDict[tuple, Any] = OrderedDict()
_LOCK = threading.Lock()


def read_json(path: str | os.PathLike) -> Any:
    """``json.loads`` of the file at ``path`` (UTF-8), parsed once while its (size, mtime) stays the same. Raises what
    reading and parsing raise (FileNotFoundError, json.JSONDecodeError)."""
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _LOCK:
        if key in _MEMO:
            _MEMO.move_to_end(key)
            return _MEMO[key]
    data = json.loads(path.read_text(encoding="utf-8"))
    with _LOCK:
        for old in [k for k in _MEMO if k[0] == key[0]]:  # an older version of the same file
            del _MEMO[old]
        _MEMO[key] = data
        while len(_MEMO) > MAX_FILES:
            _MEMO.popitem(last=False)
    return data
