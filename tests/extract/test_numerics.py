"""The library's numeric settings are its own, not the tests' (extract/numerics.py): a user's process that imports
plugvlm runs MKL in its reproducible mode without setting anything."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch carries no MKL")
def test_a_process_that_imports_the_scorer_runs_mkl_strict_without_being_told():
    code = ("from adapters.load import load_scorer\n"  # what python -m serve / a user's script imports first
            "import torch\n"
            "torch.ones(64, 64) @ torch.ones(64, 64)\n"  # MKL's first call: its mode is fixed from here on
            "from extract.numerics import mkl_mode\n"
            "print(mkl_mode())\n")
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["auto,strict"]


def test_mkl_mode_reads_this_process():
    from extract.numerics import mkl_mode

    assert mkl_mode() in (None, "auto,strict")  # the tests' workers import plugvlm before any product too
