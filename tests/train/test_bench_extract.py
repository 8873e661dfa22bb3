"""python -m train.bench.extract: one tiny run of its three figures (the random tiny backbone on 8 small toy-world
images, 50 captions, 256 cached samples), checked for what it prints and returns; a bad backbone is one error line
with exit 2 (run_job), not a traceback. Nothing here asserts a timing beyond "positive"."""
from __future__ import annotations

import re

from train.bench.extract import main, parse_args, run

TINY = ["--base", "tiny", "--images", "8", "--image-size", "32", "--batch-size", "4", "--workers", "0", "--rounds",
        "1", "--captions", "50", "--read-samples", "256", "--read-batch", "32", "--phrase-scenes", "20"]


def test_each_figure_is_measured_once_and_judged_against_its_target(tmp_path, capsys):
    held = run(parse_args([*TINY, "--workdir", str(tmp_path)]))
    out = capsys.readouterr().out
    assert set(held) == {"overhead", "spacy", "read"} and all(isinstance(v, bool) for v in held.values())
    for n in (1, 2, 3, 4):
        assert len(re.findall(rf"^\[{n}\] ", out, flags=re.M)) == 1, out
    ratio = float(re.search(r"-> ratio ([\d.]+)", out).group(1))
    rate = float(re.search(r"-> (\d+) captions/s", out).group(1))
    warm = float(re.search(r"(\d+)/s warm", out).group(1))
    phrases = re.search(r"\[4\] phrases alone \(tiny, cpu\): the (\d+) distinct phrases .*: ([\d.]+) times", out)
    assert ratio > 0 and rate > 0 and warm > 0 and int(phrases.group(1)) > 0 and float(phrases.group(2)) > 0
    verdict = ", ".join(f"{k} {'met' if held[k] else 'MISSED'}" for k in ("overhead", "spacy", "read"))
    assert out.rstrip().endswith(f"targets: {verdict}")
    assert list(tmp_path.iterdir()) == []  # its scratch folder is removed


def test_only_one_figure_and_a_bad_backbone_is_one_error_line(tmp_path, capsys):
    assert main(["--only", "spacy", "--captions", "20", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[2] spaCy components: 20 captions" in out and "[1]" not in out and "[3]" not in out
    assert main(["--only", "overhead", "--base", "no-such-model", "--images", "4", "--image-size", "32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown backbone 'no-such-model'") and "Traceback" not in err
