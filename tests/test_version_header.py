"""The run's first lines name what pip resolved (conftest.pytest_report_header), also under ``-q``, the README's and
CI's command, so a failure report says which pytest, torch, gradio ... it ran on."""
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from conftest import KEY_PACKAGES

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quiet_run_names_the_resolved_versions():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           "tests/test_network_guard.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    head = done.stdout.split("test_network_guard.py", 1)[0]  # the lines before the first collected test
    assert f"at {sys.prefix}" in head  # which environment: a fresh venv's path in CI
    assert f"pytest {version('pytest')}" in head and f"torch {version('torch')}" in head
    for name in KEY_PACKAGES:  # every key package, installed or said to be absent, never split over two lines
        assert any(line.split(": ", 1)[-1].lstrip().startswith(name + " ") or f", {name} " in line
                   for line in head.splitlines()), (name, head)
    assert max(map(len, head.splitlines())) <= 110
