"""python -m train.bench.everyday times each job beside the day's speed, scales it to a slow day and holds it to its
budget; a failing job is named with its log and the others still run (commands here: a few Python lines; no timing
is asserted)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from extract.common.cli import JobFailed
from train import measure
from train.bench import everyday
from train.bench.everyday import EverydayOptions, run, slow_day_seconds

WRITE = [sys.executable, "-c", "import pathlib; pathlib.Path('runs').mkdir(); print('made runs/ here')"]
FAIL = [sys.executable, "-c", "raise SystemExit(5)"]


def test_each_job_beside_the_days_speed_scaled_to_a_slow_day(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(everyday, "ROOT", tmp_path / "checkout")
    (tmp_path / "checkout").mkdir()
    monkeypatch.setattr(everyday, "IN_SCRATCH", {"typed"})
    monkeypatch.setattr(everyday, "JOBS", {"typed": ([WRITE], 60), "in place": ([[sys.executable, "-c", "print(1)"]],
                                                                                None), "broken": ([FAIL, WRITE], 1)})
    speeds = iter([0.7, 0.9, 1.0, 1.0, 1.4, 1.4])
    with pytest.raises(JobFailed, match=r"^broken failed: .*broken\.log$"):
        run(EverydayOptions(jobs="typed,in place,broken", logs=str(tmp_path / "logs"), out=str(tmp_path / "f.json")),
            speed=lambda: next(speeds))
    figures = json.loads((tmp_path / "f.json").read_text())
    typed, in_place, broken = figures["rows"]
    assert (typed["loop"], in_place["loop"], broken["loop"]) == pytest.approx((0.8, 1.0, 1.4))
    assert typed["slow_day_seconds"] == pytest.approx(typed["seconds"] * 1.4 / 0.8)
    assert len(broken["command_seconds"]) == 1 and typed["seconds"] >= sum(typed["command_seconds"]) > 0
    assert broken["exit"] == 5 and (tmp_path / "logs" / "typed.log").read_text() == "made runs/ here\n"
    assert not (tmp_path / "logs" / "broken.log").read_text()  # it stopped at its first failing command
    printed = capsys.readouterr().out
    assert "| typed | 0 min 00 s | 0.70 / 0.90 s | about 0 min 00 s | 1 min 00 s: within |" in printed
    assert "| in place |" in printed and "| – |" in printed
    assert f"failed (exit 5; its output: {tmp_path / 'logs' / 'broken.log'})" in printed


def test_a_job_typed_in_a_folder_of_its_own_leaves_the_checkout_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(everyday, "ROOT", tmp_path / "checkout")
    (tmp_path / "checkout").mkdir()
    monkeypatch.setattr(everyday, "IN_SCRATCH", {"typed"})
    monkeypatch.setattr(everyday, "JOBS", {"typed": ([WRITE], None), "here": ([WRITE], None)})
    run(EverydayOptions(jobs="typed,here", logs=str(tmp_path / "logs")), speed=lambda: 1.0)
    assert list((tmp_path / "checkout").iterdir()) == [tmp_path / "checkout" / "runs"]  # "here" only


def test_the_slow_day_and_the_loop():
    assert [everyday.clock(t) for t in (59.6, 61, 463.2)] == ["1 min 00 s", "1 min 01 s", "7 min 43 s"]
    assert slow_day_seconds(100, 0.7) == pytest.approx(200) and slow_day_seconds(60, 1.4) == pytest.approx(60)
    with pytest.raises(ValueError, match="choose from demo, fast, suite, tour"):
        EverydayOptions(jobs="demo,nope")
    assert EverydayOptions(jobs=" demo , suite").jobs == "demo,suite"
    assert list(everyday.JOBS) == ["demo", "fast", "suite", "tour"]
    readme = (everyday.ROOT / "README.md").read_text()
    assert "pip install torch==2.14.1 torchvision==0.29.1 -e \".[all,dev]\" && python -m pytest -q" in readme
    assert everyday.JOBS["suite"][0] == [["{python}", "-m", "pytest", "-q"]]  # the README's test command


def test_the_days_speed_is_a_python_loop(monkeypatch):
    monkeypatch.setattr(measure, "DAY_SPEED_ADDITIONS", 10**5)
    assert 0 < measure.day_speed() < 1


def test_a_failing_job_ends_the_command_with_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(everyday, "ROOT", tmp_path)
    monkeypatch.setattr(everyday, "JOBS", {"broken": ([FAIL], None)})
    monkeypatch.setattr(measure, "DAY_SPEED_ADDITIONS", 10)
    assert everyday.main(["--jobs", "broken", "--logs", str(tmp_path / "logs")]) == JobFailed.exit_code
    assert capsys.readouterr().err == f"error: broken failed: {tmp_path / 'logs' / 'broken.log'}\n"
