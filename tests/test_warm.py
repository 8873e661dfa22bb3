"""tests/fixtures/warm.py: a warm process runs ``python -m`` / ``python -c`` as a process of its own, with the
arguments, folder and environment given, and reports its exit status (-9 when killed) and its output."""
from __future__ import annotations

import os
import signal

import pytest

from fixtures import slow_rule, warm

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "pid", os.getpid(), "env", os.environ.get("WARM_TEST"))
print("to stderr", file=sys.stderr)
raise SystemExit(int(sys.argv[1]))
"""


@pytest.mark.slow
def test_a_warm_process_runs_code_with_its_arguments_folder_and_environment(tmp_path):
    slow_rule.start()
    code, out, err = warm.run(["-c", SCRIPT, "3", "x y"], cwd=tmp_path, env={**os.environ, "WARM_TEST": "here"})
    assert code == 3 and err == "to stderr\n"
    words = out.split()
    assert words[:4] == ["argv", "['3',", "'x", "y']"] and words[5] == str(tmp_path) and words[-1] == "here"
    assert int(words[7]) != os.getpid()  # a process of its own
    assert slow_rule.started()[-1].startswith("python -c") and slow_rule.reasons() == []


@pytest.mark.slow
def test_a_module_runs_as_main_and_a_kill_9_reads_as_one(tmp_path):
    code, out, _ = warm.run(["-m", "extract.worlds.toyworld", "--help"], cwd=tmp_path)
    assert code == 0 and "usage: python -m extract.worlds.toyworld" in out
    proc = warm.start(["-c", "import time; print('up', flush=True); time.sleep(60)"], cwd=tmp_path)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL and proc.returncode == -signal.SIGKILL
    with pytest.raises(ValueError, match="'-m module' or '-c code'"):
        warm.start(["script.py"])
