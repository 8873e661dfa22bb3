"""The README is the front door: its set-up commands are what CI runs, it has a contents list, and every block
marked ``<!-- runnable -->`` (shell or Python) runs as written, in order, in a fresh folder, on the embedded
default, and reads well in a log (issue 15)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"<!-- runnable(?P<opts>[^>]*)-->\n```(?P<lang>bash|python)\n(?P<body>.*?)```", re.S)
BLOCKS = [(m.group("lang"), m.group("body"), int(re.search(r"exit=(\d+)", m.group("opts")).group(1))
           if "exit=" in m.group("opts") else 0) for m in BLOCK.finditer(README)]


def test_the_front_door():
    assert README.index("## Contents") < README.index("## Set up") < README.index("## A five-minute tour")
    setup = README.split("## Set up", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^pip install .*$", setup, re.M)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert len(commands) == 2 and ci == [commands[1]]  # CI runs exactly the README's test command
    assert "python -m train.demo" in commands[0]
    for section in ("Your own data", "On a GPU", "Watching a run", "Detector and segmenter weights",
                    "Install size and a CPU-only torch", "Python use", "What happens with bad input"):
        assert f"## {section}" in README and f"(#{section.lower().replace(' ', '-').replace(',', '')}" in README
    assert "../shared" not in README and "design.md" not in README  # nothing outside the repository
    assert len(BLOCKS) >= 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_runnable_block_runs_as_written(workdir, index):
    lang, body, expected = BLOCKS[index]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "YOLO_OFFLINE": "1",
           "YOLO_CONFIG_DIR": str(workdir / ".yolo")}
    command = ["bash", "-c", "set -eo pipefail\n" + body] if lang == "bash" else [sys.executable, "-c", body]
    done = subprocess.run(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1200)
    log = done.stdout
    assert done.returncode == expected, f"block {index} ({lang}):\n{body}\n--- output ---\n{log[-4000:]}"
    assert "Traceback" not in log, log[-4000:]
    assert max(map(len, log.splitlines() or [""])) <= 300, max(log.splitlines(), key=len)
