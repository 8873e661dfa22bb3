"""python -m train.bench.adapter runs and reports consistent figures (tiny sizes; no timing is asserted)."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from adapters.registry import ADAPTERS
from train.bench.adapter import main, synthetic_arrays


@pytest.mark.parametrize("method", ADAPTERS.names())
def test_every_method_gets_the_arrays_it_reads(method):
    cls = ADAPTERS.get(method)
    args = argparse.Namespace(entities=3, relations=2, regions=4, tokens=9)
    arrays = synthetic_arrays([*cls.image_keys, *cls.text_keys], 5, 16, (4, 4), args, np.random.default_rng(0))
    assert set(arrays) == {*cls.image_keys, *cls.text_keys} and all(len(a) == 5 for a in arrays.values())
    for k, a in arrays.items():
        if k.endswith("_embed") or k in ("patch_tokens", "token_embed"):
            np.testing.assert_allclose(np.linalg.norm(a.astype(np.float32), axis=-1), 1, atol=2e-3)


def test_benchmark_runs_and_its_figures_agree(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--base", "tiny", "--samples", "48", "--batch-size", "16", "--backbone-samples", "1",
                 "--entities", "3", "--relations", "2", "--matmul-size", "128", "--out", str(out)]) == 0
    f = json.loads(out.read_text())
    assert f["steps"] == 3 and f["backbone"]["image_forwards_per_sample"] == 6
    assert f["speedup"] == pytest.approx(f["backbone_fed_epoch_seconds"] / f["cached_epoch_seconds"])
    assert f["speedup"] > f["speedup_counting_image_side_only"] > 1
    assert f["step_flops"] > 0 and f["head_vs_matmul"] == pytest.approx(f["head_flop_rate"] / f["matmul_flop_rate"])
    assert "speed-up (target >= 50x)" in capsys.readouterr().out
