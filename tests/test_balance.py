"""tests/fixtures/balance.py: test files go to the workers heaviest first, by measured seconds, else by markers; each
file's tests keep their order; a run's seconds per file are stored and read back."""
from __future__ import annotations

import json
from types import SimpleNamespace

from fixtures.balance import (file_weights, heaviest_files_first, measured, measured_tests, seconds_by_file,
                              write_durations)


def _item(nodeid, slow=False):
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: object() if slow and name == "slow" else None)


ITEMS = [_item("a.py::t1"), _item("a.py::t2"), _item("b.py::t1", slow=True), _item("c.py::t1"),
         _item("c.py::t2", slow=True), _item("c.py::t3"), _item("d.py::t1")]


def test_markers_weigh_a_file_nobody_has_measured():
    weights = file_weights(ITEMS, {})
    assert weights["c.py"] > weights["b.py"] > weights["a.py"] > weights["d.py"]
    order = [i.nodeid for i in heaviest_files_first(ITEMS, {})]
    assert order == ["c.py::t1", "c.py::t2", "c.py::t3", "b.py::t1", "a.py::t1", "a.py::t2", "d.py::t1"]


def test_measured_seconds_come_first_and_ties_keep_collection_order():
    order = [i.nodeid for i in heaviest_files_first(ITEMS, {"d.py": 100.0, "a.py": 0.1, "b.py": 0.1})]
    # d measured heaviest; c unmeasured (its markers: 10.5 s); a and b tie at 0.1 and keep their collected order
    assert order == ["d.py::t1", "c.py::t1", "c.py::t2", "c.py::t3", "a.py::t1", "a.py::t2", "b.py::t1"]
    assert sorted(order) == sorted(i.nodeid for i in ITEMS)  # nothing dropped, nothing doubled


def test_a_runs_seconds_are_stored_per_file_and_read_back(tmp_path):
    reports = [SimpleNamespace(nodeid="a.py::t1", when="setup", duration=2.0),
               SimpleNamespace(nodeid="a.py::t1", when="call", duration=1.04),
               SimpleNamespace(nodeid="a.py::t2[x]", when="call", duration=3.0),
               SimpleNamespace(nodeid="b.py::t", when="call", duration=0.5),
               SimpleNamespace(nodeid="b.py", when=None, duration=9.0)]  # a collect report: no test's time
    assert seconds_by_file(reports) == {"a.py": 6.04, "b.py": 0.5}
    path = write_durations(reports, tmp_path / "durations.json")
    assert measured(path) == {"a.py": 6.0, "b.py": 0.5}
    assert measured_tests(path) == {"a.py::t1": 3.04, "a.py::t2[x]": 3.0, "b.py::t": 0.5}
    # a run that left tests out (-m 'not slow'): each test it ran gets its new figure, the others and the files keep
    # theirs
    write_durations([SimpleNamespace(nodeid="a.py::t2[x]", when="setup", duration=7.5),
                     SimpleNamespace(nodeid="c.py::t", when="call", duration=0.25)], path, whole=False)
    assert measured(path) == {"a.py": 6.0, "b.py": 0.5}
    assert measured_tests(path) == {"a.py::t1": 3.04, "a.py::t2[x]": 7.5, "b.py::t": 0.5, "c.py::t": 0.25}
    write_durations([SimpleNamespace(nodeid="c.py::t", when="call", duration=1.0)], path)  # a whole run: its files
    assert measured(path) == {"a.py": 6.0, "b.py": 0.5, "c.py": 1.0} and measured_tests(path)["a.py::t2[x]"] == 7.5
    (tmp_path / "a.py").write_text("")  # with a root, what no longer exists under it goes (b.py, c.py: renamed)
    write_durations([], path, root=tmp_path)
    assert measured(path) == {"a.py": 6.0} and measured_tests(path) == {"a.py::t1": 3.04, "a.py::t2[x]": 7.5}
    path.write_text("{not json")
    assert measured(path) == {} and measured_tests(path) == {}  # unreadable: every file weighed from its markers
    assert measured(tmp_path / "missing.json") == {} and measured_tests(tmp_path / "missing.json") == {}
    write_durations([SimpleNamespace(nodeid="d.py::t", when="call", duration=2.0)], path, whole=False)
    assert measured(path) == {} and measured_tests(path) == {"d.py::t": 2.0}  # over an unreadable file: anew
    path.write_text(json.dumps({"seconds": [1], "tests": {"d.py::t": "x", "e.py::t": 1.5}}))  # parts that do not read
    write_durations([SimpleNamespace(nodeid="f.py::t", when="call", duration=0.5)], path)
    assert measured(path) == {"f.py": 0.5} and measured_tests(path) == {"e.py::t": 1.5, "f.py::t": 0.5}


def test_the_shipped_durations_name_files_that_exist():
    from fixtures.balance import DURATIONS

    seconds = json.loads(DURATIONS.read_text())["seconds"]
    root = DURATIONS.parent.parent
    assert len(seconds) >= 50 and all((root / f).is_file() for f in seconds), [f for f in seconds
                                                                                 if not (root / f).is_file()]
