"""extract.common.cli: options dataclasses and their parsers, one-line errors, --quiet / --verbose, progress in logs;
and, for every entry point, that --help stays cheap."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from extract.common import cli
from extract.common.config import positive_float, positive_int

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _Options:
    data: str | None = cli.option(None, help="where the data is")
    epochs: int = cli.option(10, type=positive_int, help="passes over the data")
    lr: float = cli.option(1e-3, type=positive_float, help="learning rate (default: the paper's)", group="optimisation")
    schedule: str = cli.option("cosine", choices=["cosine", "step"], help="lr schedule", group="optimisation")
    fast: bool = cli.option(False, action="store_true", help="go faster")
    tags: list = cli.option(default_factory=list, action="append", help="repeatable tag")


def _parser():
    return cli.build_parser(_Options, "prog", "``python -m prog``: does a thing.\n\nMore text.")


def test_the_parser_is_derived_from_the_dataclass():
    opts = cli.from_namespace(_Options, _parser().parse_args(["--epochs", "3", "--tags", "a", "--tags", "b", "--fast"]))
    assert opts == _Options(epochs=3, tags=["a", "b"], fast=True)
    assert cli.from_namespace(_Options, _parser().parse_args([])) == _Options()


def test_help_has_no_duplicated_default_and_no_module_label(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "Does a thing." in text and "``" not in text
    assert "passes over the data (default: 10)" in text
    assert "learning rate (default: the paper's)\n" in text  # the help names its default: nothing added
    assert "(default: the paper's) (default" not in text and "go faster (default" not in text
    assert "optimisation:" in text and "-q, --quiet" in text and "-v, --verbose" in text
    assert "lr schedule (default: cosine)" in text


def test_an_error_is_one_line_with_the_fix_not_a_usage_dump(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--epochs", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" not in err
    assert err.splitlines() == ["prog: error: argument --epochs: expected an integer >= 1, got 0",
                                "  (`prog --help` lists every option)"]


def test_python_callers_get_the_flags_checks():
    cli.check_options(_Options(epochs=2, lr=0.5, schedule="step", tags=["x"]), _parser())
    for bad, message in ((_Options(epochs=0), "epochs: expected an integer >= 1, got 0"),
                         (_Options(lr=-1.0), "lr: expected a number > 0"),
                         (_Options(schedule="linear"), "schedule: invalid choice: 'linear'")):
        with pytest.raises(ValueError, match=message):
            cli.check_options(bad, _parser())


def test_run_job_turns_user_errors_into_one_line_and_exit_codes(capsys):
    class Diverged(cli.JobFailed):
        exit_code = 3

    def job(kind):
        raise {"value": ValueError("bad value"), "file": FileNotFoundError("no such file: x"),
               "diverged": Diverged("diverged at step 9")}[kind]

    assert cli.run_job(job, "value") == 2 and cli.run_job(job, "file") == 2 and cli.run_job(job, "diverged") == 3
    assert capsys.readouterr().err.splitlines() == ["error: bad value", "error: no such file: x",
                                                    "error: diverged at step 9"]
    with pytest.raises(KeyError):  # a bug is not a user error: it keeps its traceback
        cli.run_job(job, "other")


_CLOSED_STDOUT_JOB = """
import sys
from extract.common.cli import run_job
sys.stdin.readline()  # the reader of stdout has gone by now
lines = int(sys.argv[1])
sys.exit(run_job(lambda _: [print("hit", k) for k in range(lines)], None))
"""


@pytest.mark.parametrize("lines", [1, 100_000])  # still buffered when the job ends / written during it
def test_a_stdout_closed_by_its_reader_ends_quietly(lines):
    """``python -m serve.query IDX "..." --json | head -1``: the reader closes the pipe; the job ends with 141 (as a
    tool that SIGPIPE ends) and prints nothing -- no "error: [Errno 32] Broken pipe", no "Exception ignored"."""
    proc = subprocess.Popen([sys.executable, "-c", _CLOSED_STDOUT_JOB, str(lines)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()
    _, err = proc.communicate(b"go\n", timeout=120)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE == 141 and err == b"", err.decode()


def test_a_broken_pipe_that_is_not_stdout_stays_an_error(capsys):
    def job(_):
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a worker process gone; stdout is fine

    assert cli.run_job(job, None) == 2
    assert capsys.readouterr().err == "error: [Errno 32] Broken pipe\n"


def test_quiet_and_verbose(capsys):
    cli.say("status")
    assert capsys.readouterr().out == "status\n"
    _parser().parse_args(["--quiet"])
    cli.say("status")
    assert capsys.readouterr().out == "" and cli.verbosity() == cli.QUIET
    _parser().parse_args([])  # a job parsing another job's options in-process keeps the user's --quiet
    assert cli.verbosity() == cli.QUIET
    _parser().parse_args(["--verbose"])
    assert cli.verbosity() == cli.VERBOSE
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--quiet", "--verbose"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_progress_in_a_log_is_a_few_plain_lines():
    """Not a terminal: one line per interval and a final one, never a carriage return (a log line once reached
    26 KB of tqdm frames)."""
    stream = io.StringIO()
    bar = cli.LogProgress(total=1000, desc="epoch 1/2", unit="step", interval=0.0, stream=stream)
    for k in range(1000):
        bar.update(1)
        if k == 500:
            bar.set_postfix(loss="0.1234")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and all(len(line) < 200 for line in lines)
    assert lines[0].startswith("epoch 1/2: 1/1000 step (0%)") and lines[-1].endswith("done")
    assert "loss 0.1234" in lines[-1] and "1000/1000 step (100%)" in lines[-1]
    quiet = io.StringIO()
    silent = cli.LogProgress(range(10), desc="x", interval=0.0, stream=quiet)
    assert list(silent) == list(range(10)) and quiet.getvalue().count("\n") == 11  # 10 updates + the final line
    never = io.StringIO()
    bar = cli.LogProgress(total=5, interval=3600.0, stream=never)
    bar.update(5)
    bar.close()
    assert never.getvalue() == ""  # a short loop in a log prints nothing of its own


def test_progress_is_silent_when_quiet_and_plain_when_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(cli.progress(range(3)), cli.LogProgress)
    try:
        cli.set_verbosity(cli.QUIET)
        assert cli.progress(range(3)).disable
    finally:
        cli.set_verbosity(cli.NORMAL)


# --------------------------------------------------------------------------------------------- --help is cheap
ENTRY_POINTS = ["extract", "extract.data.check", "extract.worlds.toyworld", "extract.models.backbone", "train.bench.extract",
                "train.adapter", "train.adapter.compare", "train.bench.adapter", "train.pretrain",
                "train.pretrain.compare", "train.pretrain.diagnose", "train.bench.pretrain", "train.eval", "train.demo",
                "train.eval.linear_probe", "train.eval.nla_report", "train.bench.nla", "train.bench.retrieval",
                "extract.components.text", "train.eval.clip_benchmark", "serve.query", "serve.index",
                "train.bench.serve", "extract.components.toy_detector", "train.eval.heatmaps", "serve", "train.bench.serve_load",
                "train.bench.pgs"]
# libraries a command imports only when it runs: loading them costs seconds, which --help must not
HEAVY = {"open_clip", "spacy", "ultralytics", "sam2", "gradio", "faiss", "matplotlib", "accelerate", "transformers",
         "timm", "tensorboard", "webdataset", "sklearn", "cv2", "pandas", "torchvision"}
ARGVS = (["--help"], ["--no-such-flag"])
#: one interpreter parses every entry point's --help and a bad flag in turn (54 fresh interpreters, each importing
#: torch, cost 53 s of the suite): after each it reports the heavy libraries loaded so far. The set only grows, so a
#: library one entry point loads shows at it and at every later one: sharing the process can fail a clean entry
#: point after a guilty one, never pass a guilty one.
_PROBE = """
import contextlib, io, json, runpy, sys
for name, argv in {probes!r}:
    sys.argv = [name] + argv
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        except SystemExit:
            pass
    loaded = sorted({{m.split(".")[0] for m in sys.modules}} & {heavy!r})
    print(json.dumps({{"name": name, "argv": argv, "loaded": loaded, "stderr": err.getvalue()[-2000:]}}), flush=True)
"""


@pytest.fixture(scope="module")
def help_probes():
    """``{(entry point, argv): ({heavy library loaded: the probe that loaded it first}, stderr)}`` for every entry
    point and argv of ARGVS."""
    probes = [(name, list(argv)) for name in ENTRY_POINTS for argv in ARGVS]
    out = subprocess.run([sys.executable, "-c", _PROBE.format(probes=probes, heavy=HEAVY)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(probes), out.stderr[-3000:]  # the probe itself ran to the end
    first = {}  # library -> the probe that loaded it first: the one to fix
    for r in rows:
        for library in r["loaded"]:
            first.setdefault(library, f"python -m {r['name']} {' '.join(r['argv'])}")
    return {(r["name"], tuple(r["argv"])): ({lib: first[lib] for lib in r["loaded"]}, r["stderr"]) for r in rows}


@pytest.mark.slow
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_and_argument_errors_import_no_heavy_library(name, help_probes):
    """`--help` costs at most `import torch` and a little: asserted by what it imports, not by timing it."""
    for argv in ARGVS:
        loaded, stderr = help_probes[(name, tuple(argv))]
        assert not loaded, (name, argv, loaded, stderr)
        if argv == ["--no-such-flag"]:
            assert "usage:" not in stderr and "error: unrecognized arguments: --no-such-flag" in stderr


def test_a_warning_is_printed_once_per_process(capsys):
    assert cli.warn_once("warning: split too small") and not cli.warn_once("warning: split too small")
    assert cli.warn_once("warning: another")
    assert capsys.readouterr().out.splitlines() == ["warning: split too small", "warning: another"]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_option_says_what_it_does(name):
    """--help has a line of help for every option, and names a default only once."""
    import importlib

    module = importlib.import_module({"extract": "extract.pipeline", "serve": "serve.__main__",
                                      "train.eval": "train.eval.evaluate"}.get(name, name))
    if not hasattr(module, "build_parser"):
        pytest.skip(f"{name} passes its arguments on (no parser of its own)")
    parser = module.build_parser()
    missing = [a.option_strings or a.dest for a in parser._actions if not (a.help or "").strip()]
    assert not missing, (name, missing)
    formatter = parser._get_formatter()
    doubled = [a.option_strings for a in parser._actions
               if formatter._get_help_string(a).count("(default:") > 1]
    assert not doubled, (name, doubled)


def test_no_job_builds_a_command_line_to_call_another():
    """Jobs compose as functions: no module outside tests parses an argv list it built itself."""
    import re

    calls = re.compile(r"\b(parse_args|main)\(\s*\[|\bargv \+= \[|\bargv = \[\"--|sys\.executable, \"-m\"")
    # the one process started on purpose: the load check measures the app in a process of its own (its memory
    # and CPU apart from the clients'), as a user runs it
    allowed = {"train/bench/serve_load.py": 'command = [sys.executable, "-m", "serve", "--port", "0", "--recall", "off"]'}
    offenders = [f"{path.relative_to(ROOT)}:{n}" for package in ("adapters", "extract", "train", "serve")
                 for path in (ROOT / package).rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if calls.search(line) and allowed.get(str(path.relative_to(ROOT))) != line.strip()]
    assert not offenders, offenders
