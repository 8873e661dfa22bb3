"""tests/fixtures/run_summary.py: the ten slowest tests over all their phases and every xdist worker, and the line a
run ends with."""
from __future__ import annotations

from types import SimpleNamespace

from fixtures.run_summary import busy_by_worker, slowest, summary_lines


def _report(nodeid, when, duration):
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration)


def test_phases_add_up_and_the_longest_come_first():
    reports = [_report("a", "setup", 5.0), _report("a", "call", 1.0), _report("a", "teardown", 0.5),
               _report("b", "call", 6.0), _report("c", "call", 0.1), _report("d", "call", 6.0),
               SimpleNamespace(nodeid="x", when=None, duration=99.0)]  # a collect report: not a test's time
    assert slowest(reports) == [(6.5, "a"), (6.0, "b"), (6.0, "d"), (0.1, "c")]
    assert slowest(reports, 2) == [(6.5, "a"), (6.0, "b")]
    lines = summary_lines(125.4, reports, 2)
    assert lines[0] == "wall time 2 min 05 s; the 2 slowest tests (setup + call + teardown):"
    assert lines[1:] == ["      6.5 s  a", "      6.0 s  b"]


def test_each_workers_busy_time_is_said():
    def on(worker, nodeid, when, duration):
        return SimpleNamespace(nodeid=nodeid, when=when, duration=duration,
                               node=SimpleNamespace(gateway=SimpleNamespace(id=worker)))

    reports = [on("gw1", "a", "call", 70.0), on("gw0", "b", "setup", 2.0), on("gw0", "b", "call", 58.0),
               on("gw1", "c", "teardown", 1.0)]
    assert busy_by_worker(reports) == {"gw0": 60.0, "gw1": 71.0}
    assert summary_lines(75.0, reports)[-1] == "busy per worker: gw0 1 min 00 s, gw1 1 min 11 s"
    assert busy_by_worker([_report("a", "call", 1.0)]) == {}  # one process: no line
    assert not any(line.startswith("busy") for line in summary_lines(1.0, [_report("a", "call", 1.0)]))
