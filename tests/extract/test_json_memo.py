"""extract.common.json_memo: a file is parsed once while unchanged, again after any change, and errors pass through."""
from __future__ import annotations

import json
import os

import pytest

from extract.common import json_memo
from extract.common.json_memo import read_json


def test_an_unchanged_file_is_parsed_once_and_a_changed_one_again(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"scenes": [1, 2]}))
    calls = []
    real = json.loads
    monkeypatch.setattr(json_memo.json, "loads", lambda s: calls.append(1) or real(s))
    first = read_json(path)
    assert read_json(str(path)) is first and len(calls) == 1
    path.write_text(json.dumps({"scenes": [1, 2, 3]}))  # other size
    assert read_json(path) == {"scenes": [1, 2, 3]} and len(calls) == 2
    path.write_text(json.dumps({"scenes": [4, 5, 6]}))  # same size: the modification time tells
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert read_json(path) == {"scenes": [4, 5, 6]} and len(calls) == 3
    assert sum(k[0] == str(path.resolve()) for k in json_memo._MEMO) == 1  # the old version was dropped


def test_errors_are_json_and_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(json.JSONDecodeError):
        read_json(tmp_path / "bad.json")


def test_at_most_max_files_are_kept(tmp_path):
    for i in range(json_memo.MAX_FILES + 3):
        (tmp_path / f"{i}.json").write_text(str(i))
        assert read_json(tmp_path / f"{i}.json") == i
    assert len(json_memo._MEMO) <= json_memo.MAX_FILES
