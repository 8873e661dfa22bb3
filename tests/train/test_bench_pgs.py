"""python -m train.bench.pgs at toy sizes: what it prints and returns (never its timings)."""
from __future__ import annotations

import json

import pytest

from train.bench import pgs
from train.measure import batch_sizes

TOY = ["--batch-size", "2,3", "--image-size", "32", "--patch", "8", "--dim", "16", "--repeats", "1"]


def test_every_part_and_the_whole_are_reported(capsys, tmp_path):
    assert pgs.main([*TOY, "--profile", "--json", str(tmp_path / "p.json")]) == 0
    text = capsys.readouterr().out
    saved = json.loads((tmp_path / "p.json").read_text())
    assert set(saved["ms"]) == {"2", "3"}
    for b in ("2", "3"):
        ms = saved["ms"][b]
        assert set(ms) == {"pixel patches", "pixel cosine", "feature cosine", "sinkhorn", "sobel edges", "selection"}
        assert all(v > 0 for v in ms.values())
        assert f"batch {b}: selection {ms['selection']:.2f} ms" in text
    assert "Self CPU" in text  # the profiler's table


def test_a_bad_batch_list_is_one_line_with_the_fix(capsys):
    assert pgs.main(["--batch-size", "8,x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch-size" in err[0] and "128,256" in err[0]


def test_batch_size_lists_shared_by_the_benchmarks():
    assert batch_sizes("128, 256") == [128, 256] and batch_sizes([8]) == [8] and batch_sizes(4) == [4]
    for bad in ("", "8,x", "0", [0], "-2"):
        with pytest.raises(ValueError, match="128,256"):
            batch_sizes(bad)


@pytest.mark.slow
def test_compile_times_the_compiled_selection_and_says_how_many_patches_differ(capsys, monkeypatch, tmp_path):
    """Wiring only: aot_eager stands in for inductor (no C++ build), so no patch may differ."""
    from adapters.objectives.clip_pgs import compiled_order

    monkeypatch.setattr(pgs, "compiled_order", lambda backend, mode: compiled_order("aot_eager", mode))
    assert pgs.main([*TOY, "--batch-size", "3", "--compile", "--json", str(tmp_path / "p.json")]) == 0
    ms = json.loads((tmp_path / "p.json").read_text())["ms"]["3"]
    assert ms["selection, compiled"] > 0 and ms[pgs.DIFFER] == 0.0
    assert "compiled, kept patches differing from eager: 0.00%" in capsys.readouterr().out
