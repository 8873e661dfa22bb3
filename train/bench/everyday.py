"""``python -m train.bench.everyday``: the everyday loop's times (the demo, the test suite, its fast subset, the tour),
each beside the day's speed, scaled to a slow day and held to its budget, measured in one run.

    python -m train.bench.everyday                        # demo, fast subset, suite: about 15 min on 2 quiet cores
    python -m train.bench.everyday --jobs demo --fresh    # the demo in a fresh clone of this checkout's last commit

This project's machines change speed by about 2x by the hour (other tenants), so a time means little without the
day's speed beside it: a pure-Python loop of 10^7 additions (``train.measure.day_speed``), timed before and after each
job. A slow day is one where the loop takes :data:`SLOW_DAY` s; the budgets are for such a day (the suite 8 min, its
fast subset 3, the demo 6), and a job timed on a quicker day is scaled up by ``SLOW_DAY / loop`` (the mean of the
loop before and after it). That scaling is a rough gauge, not a law (a whole run is not a Python loop): read it as
"about". Nothing else should run meanwhile; the load average before each job is printed and kept.

Each job runs as a user types it, in the checkout (``--fresh``: ``git clone`` of its last commit into a temporary
folder, so files the commit lacks are not used; the Python environment is this one), the demo and the tour in a
folder of their own (their runs/ there, not in the checkout), its output in a log file (``--logs``). A job that fails
is reported in its row with its exit status and log, the others still run, and the command ends with one ``error:``
line naming it (exit status 3). ``--out``: the figures as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from extract.common.cli import JobFailed, clock, option, parse_options, run_job, say
from extract.common.cli import build_parser as build_cli

ROOT = Path(__file__).resolve().parents[2]
PROG = "python -m train.bench.everyday"
#: the loop's seconds on a slow day: the budgets below hold on such a day
SLOW_DAY = 1.4
#: name -> (the commands as the README types them, the budget in seconds on a slow day or None)
JOBS = {
    "demo": ([["{python}", "-m", "train.demo"]], 6 * 60),
    "fast": ([["{python}", "-m", "pytest", "-q", "-m", "not slow"]], 3 * 60),
    "suite": ([["{python}", "-m", "pytest", "-q"]], 8 * 60),
    "tour": ([["{python}", "-m", "train.adapter", "--method", "grounded", "--base", "toy-negclip"],
              ["{python}", "-m", "train.eval", "--model", "runs/toy-negclip-grounded", "--data", "runs/toy", "--out",
               "runs/eval"],
              ["{python}", "-m", "train.pretrain", "--method", "powerclip"]], None),
}
#: jobs typed in a folder of their own (they write runs/ where they are typed: not into the checkout's), the checkout
#: on PYTHONPATH; the others run in the checkout
IN_SCRATCH = {"demo", "tour"}


@dataclass
class EverydayOptions:
    """What ``python -m train.bench.everyday`` times, as data (``run(EverydayOptions(jobs="demo"))``)."""

    jobs: str = option("demo,fast,suite", metavar="JOBS",
                       help=f"comma list of jobs to time, in order, from {', '.join(JOBS)}")
    fresh: bool = option(False, action="store_true",
                         help="run them in a fresh clone of this checkout's last commit (git clone), not in place")
    logs: str | None = option(None, help="folder for each job's output (default: a temporary folder, printed)")
    out: str | None = option(None, help="write the figures as JSON here")

    def __post_init__(self):
        names = [j.strip() for j in str(self.jobs).split(",") if j.strip()]
        unknown = [j for j in names if j not in JOBS]
        if not names or unknown:
            raise ValueError(f"--jobs {self.jobs!r}: choose from {', '.join(JOBS)}")
        self.jobs = ",".join(names)


def slow_day_seconds(seconds: float, loop: float) -> float:
    """``seconds`` measured on a day whose loop took ``loop`` s, as it would be on a slow day (:data:`SLOW_DAY`)."""
    return seconds * SLOW_DAY / loop


def time_job(name: str, commands: list[list[str]], cwd: Path, log: Path, env: dict, speed=None) -> dict:
    """Run ``commands`` one after another (stopping at the first failure) with their output in ``log``; the wall
    time of all of them and of each, the day's speed before and after, the load average before."""
    from train.measure import day_speed, machine_load

    speed = speed or day_speed
    row = {"job": name, "commands": [" ".join(c) for c in commands], "log": str(log), "load_before": machine_load()}
    row["loop_before"] = speed()
    start, status, row["command_seconds"] = time.perf_counter(), 0, []
    with open(log, "w") as f:
        for command in commands:
            began = time.perf_counter()
            status = subprocess.run(command, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
            row["command_seconds"].append(time.perf_counter() - began)
            if status:
                break
    row["seconds"], row["exit"] = time.perf_counter() - start, status
    row["loop_after"] = speed()
    row["loop"] = (row["loop_before"] + row["loop_after"]) / 2
    row["slow_day_seconds"] = slow_day_seconds(row["seconds"], row["loop"])
    return row


def table(rows: list[dict]) -> str:
    lines = [f"| job | time | loop of 10^7 additions (before / after) | on a {SLOW_DAY} s day | budget there |",
             "|---|---|---|---|---|"]
    for r in rows:
        budget = r.get("budget")
        within = budget is not None and r["slow_day_seconds"] <= budget
        verdict = "–" if budget is None else f"{clock(budget)}: {'within' if within else 'over'}"
        if r["exit"]:
            verdict = f"failed (exit {r['exit']}; its output: {r['log']})"
        lines.append(f"| {r['job']} | {clock(r['seconds'])} | {r['loop_before']:.2f} / {r['loop_after']:.2f} s | "
                     f"about {clock(r['slow_day_seconds'])} | {verdict} |")
    return "\n".join(lines)


def _checkout(opts: EverydayOptions, scratch: Path) -> Path:
    if not opts.fresh:
        return ROOT
    clone = scratch / "clone"
    done = subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], capture_output=True, text=True)
    if done.returncode:
        raise ValueError(f"--fresh: git clone of {ROOT} failed: {done.stderr.strip()}")
    return clone


def run(opts: EverydayOptions, speed=None) -> dict:
    """Time each of ``opts.jobs`` (:data:`JOBS`); returns the figures (printed as a table). ``speed``: what says the
    day's speed (default: ``train.measure.day_speed``)."""
    with tempfile.TemporaryDirectory(prefix="plugvlm-everyday-") as tmp:
        scratch = Path(tmp)
        checkout = _checkout(opts, scratch)
        # the scratch folder goes at the end, the logs stay where they can be read
        logs = Path(opts.logs) if opts.logs else Path(tempfile.mkdtemp(prefix="plugvlm-everyday-logs-"))
        logs.mkdir(parents=True, exist_ok=True)
        say(f"timing {opts.jobs.replace(',', ', ')} in {checkout} with {sys.executable}; logs in {logs}")
        rows = []
        for name in opts.jobs.split(","):
            commands, budget = JOBS[name]
            work = scratch / name if name in IN_SCRATCH else checkout
            work.mkdir(parents=True, exist_ok=True)
            fill = {"python": sys.executable}
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout),
                                                                                os.environ.get("PYTHONPATH")]))}
            row = time_job(name, [[part.format(**fill) for part in c] for c in commands], work, logs / f"{name}.log",
                           env, speed)
            row["budget"] = budget
            rows.append(row)
            each = " + ".join(f"{t:.1f}" for t in row["command_seconds"]) if len(commands) > 1 else ""
            say(f"  {name}: {clock(row['seconds'])}{f' ({each} s)' if each else ''}, the loop {row['loop']:.2f} s"
                + (f" (failed, exit {row['exit']})" if row["exit"] else ""))
    figures = {"slow_day_loop": SLOW_DAY, "python": sys.executable, "fresh": opts.fresh, "rows": rows,
               "date": time.strftime("%Y-%m-%d %H:%M")}
    print(table(rows))
    if opts.out:
        Path(opts.out).write_text(json.dumps(figures, indent=2))
    failed = [r["job"] for r in rows if r["exit"]]
    if failed:
        raise JobFailed(f"{', '.join(failed)} failed: {'; '.join(r['log'] for r in rows if r['exit'])}")
    return figures


def build_parser():
    return build_cli(EverydayOptions, PROG, __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_options(EverydayOptions, build_parser(), argv)
    return run_job(run, opts)


if __name__ == "__main__":
    raise SystemExit(main())
