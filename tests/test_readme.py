"""The README is the front door (at most 400 lines): its set-up commands are what CI runs, it has a contents list;
the reference lives next to the code, a README per package and a page per job beside it, none over 600 lines. In every
documentation page, each block marked ``<!-- runnable -->`` (shell or Python) runs as written, in order, in a fresh
folder per file, on the embedded default, and reads well in a log; every ``python -m`` command's flags exist; every
link and anchor resolves."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: every documentation page: the front door, a README per package, a page per job beside its code (``git ls-files``
#: would miss a new one; this cannot); run folders, hidden folders (.git, .pytest_cache) and node_modules are not ours
DOCS = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(ROOT.glob("**/*.md"))
        if not any(part.startswith(".") or part in {"runs", "node_modules"} for part in p.relative_to(ROOT).parts)}
READMES = {name: text for name, text in DOCS.items() if Path(name).name == "README.md"}
#: a page a reader can take in: past this, split it by job (the developers' guide)
MAX_PAGE_LINES = 600
BLOCK = re.compile(r"<!-- runnable(?P<opts>[^>]*)-->\n```(?P<lang>bash|python)\n(?P<body>.*?)```", re.S)
BLOCKS = [(name, m.group("lang"), m.group("body"), int(re.search(r"exit=(\d+)", m.group("opts")).group(1))
           if "exit=" in m.group("opts") else 0) for name, text in DOCS.items() for m in BLOCK.finditer(text)]


def test_the_front_door():
    assert README.index("## Contents") < README.index("## Set up") < README.index("## A five-minute tour")
    setup = README.split("## Set up", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^pip install .*$", setup, re.M)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert len(commands) == 2 and ci == [commands[1]]  # CI runs exactly the README's test command
    assert "python -m train.demo" in commands[0]
    for section in ("Your own data", "On a GPU", "Watching a run", "Detector and segmenter weights",
                    "Install size and a CPU-only torch", "Python use", "Headline results", "Tests", "Layout"):
        assert f"## {section}" in README and f"(#{section.lower().replace(' ', '-').replace(',', '')}" in README
    for package in ("extract", "adapters", "serve", "train"):  # the reference, linked from the front door
        assert f"({package}/README.md)" in README and f"{package}/README.md" in READMES
    for name, text in DOCS.items():
        assert "../shared" not in text and "design.md" not in text, name  # nothing outside the repository
    assert README.count("\n") <= 400, "the front door is at most 400 lines: move reference into a package README"
    assert len(BLOCKS) >= 4


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped but hyphens, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # a '#' line in a code block is no heading
    return {_slug(line) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def _too_long(pages: dict[str, str]) -> list[str]:
    return [f"{name}: {len(text.splitlines())} lines" for name, text in pages.items()
            if len(text.splitlines()) > MAX_PAGE_LINES]


def test_no_documentation_page_is_over_600_lines():
    """One page per job, next to its code: a page that grows past 600 lines is split by role, as code is."""
    assert len(DOCS) > len(READMES), "the pages beside the READMEs were not found"
    assert not _too_long(DOCS), _too_long(DOCS)


def test_every_link_and_anchor_resolves():
    """A moved section leaves links behind: every relative link of every documentation page names a file that
    exists, and every ``#anchor`` a heading of the file it points to."""
    broken = []
    for name, text in DOCS.items():
        here = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (here / path).resolve() if path else ROOT / name
            if not file.exists():
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_runnable_block_runs_as_written(workdir, index):
    name, lang, body, expected = BLOCKS[index]
    workdir = workdir / name.replace("/", "_")  # each README's blocks in order, in a folder of their own
    workdir.mkdir(exist_ok=True)
    # the embedded toy world at 320 scenes, not 2,000: these blocks check that each command runs as typed and reads
    # well, not the figures (those of the demo's world are checked against the generator below); 6x less to train.
    # The smallest that runs them as typed: its 256 training images fill train.adapter's default batch of 256
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "YOLO_OFFLINE": "1",
           "YOLO_CONFIG_DIR": str(workdir / ".yolo"), "PLUGVLM_TOY_N": "320"}
    command = ["bash", "-c", "set -eo pipefail\n" + body] if lang == "bash" else [sys.executable, "-c", body]
    done = subprocess.run(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1200)
    log = done.stdout
    assert done.returncode == expected, f"block {index} of {name} ({lang}):\n{body}\n--- output ---\n{log[-4000:]}"
    assert "Traceback" not in log, log[-4000:]
    if expected:  # a block that is meant to stop says why and what to do (so far: weights to supply)
        assert log.startswith("error: ") and "To supply them" in log and "--pretrained /path" in log, log[-4000:]
    assert max(map(len, log.splitlines() or [""])) <= 300, max(log.splitlines(), key=len)


def _readme_commands():
    """Every ``python -m MODULE ...`` command in every documentation page's code blocks (continuation lines joined)
    and inline code spans (which the text wraps over lines)."""
    commands = []
    text = "\n".join(DOCS.values())
    spans = [s.replace("\n", " ") for s in re.findall(r"(?<!`)`(python -m [^`]+)`(?!`)", text)]
    for block in re.findall(r"```bash\n(.*?)```", text, re.S) + spans:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            for m in re.finditer(r"python -m ([\w.]+)(.*?)(?=&&|\||$)", line):
                commands.append((m.group(1), m.group(2).split(" -- ", 1)[0]))  # after " -- ": another job's flags
    return commands


def test_every_flag_the_readme_shows_exists():
    """A README command with a flag its module no longer has fails for the user at once: check them all."""
    import importlib

    from adapters.registry import ADAPTERS

    parsers, unknown, checked, ours = {}, [], 0, {"extract", "adapters", "train", "serve"}
    for name, args in _readme_commands():
        module_name = {"extract": "extract.pipeline", "serve": "serve.__main__", "train.eval": "train.eval.evaluate"}.get(name, name)
        # train.adapter's head flags exist once --method names the head (its Config's fields)
        found = re.search(r"--method (\w+)", args) if name == "train.adapter" else None
        method = found.group(1) if found and found.group(1) in ADAPTERS.names() else None
        key = (module_name, method)
        if key not in parsers:
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:  # one of ours that does not import fails the user at once: so it fails here
                assert name.split(".")[0] not in ours, f"the README runs python -m {name}, which does not import: {e}"
                parsers[key] = None
            else:
                if method is not None:
                    parsers[key] = module.build_parser(ADAPTERS.get(method))
                else:
                    parsers[key] = module.build_parser() if hasattr(module, "build_parser") else None
        parser = parsers[key]
        if parser is None or any(a.nargs == argparse.REMAINDER for a in parser._actions):
            continue  # no parser of its own, or one that passes its options on to another program's
        known = {s for a in parser._actions for s in a.option_strings}
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", re.sub(r'"[^"]*"', "", args)):  # quoted: a value
            checked += 1
            if flag not in known:
                unknown.append(f"python -m {name} ... {flag}")
    assert checked > 100 and not unknown, unknown


@pytest.mark.slow
def test_the_demo_worlds_figures_in_the_readme_are_the_generators(tmp_path):
    """The binding table's test split, as the README states it, is what the demo's world holds: same scenes, captions,
    hard negatives and held-out combinations (deterministic: the generator is seeded)."""
    import json

    from extract.worlds import toyworld
    from extract.models.backbone import trained_holdout
    from train.demo import DEFAULT_BASES, parse_args

    opts = parse_args([])
    held = sorted({c for b in DEFAULT_BASES for c in trained_holdout(b)})
    world = toyworld.ensure(tmp_path / "world", opts.n, opts.seed, say=lambda *a: None, holdout=held)
    test = json.loads((world / "meta.json").read_text())["counts"]["splits"]["test"]
    stated = re.search(r"Test split: ([\d,]+) images, ([\d,]+) captions, ([\d,]+) hard negatives, 4 combinations held "
                       r"out\n\(([^)]*)\)", README)
    assert stated, "the binding table's test-split sentence moved: update this test with it"
    numbers = [int(stated.group(k).replace(",", "")) for k in (1, 2, 3)]
    assert numbers == [test["images"], test["captions"], test["negatives"]]
    assert stated.group(4).split(", ") == held
