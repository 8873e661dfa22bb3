"""The deferred read of a step's metrics (train/pretrain/engine.py, ``PretrainRun.read_pending``): with fused AdamW
the host reads every min(--log-every-n-steps, --max-bad-steps) steps instead of every step, and the run is the one
that reads every step: the same log rows, weights, checkpoints, skipped steps and abort. The kill -9 resume test
(test_pretrain.py, "compiled-fused") runs it too."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from extract.worlds import toyworld

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
TIMES = {"batch_time", "data_time", "samples_per_second"}  # the columns that measure time, not the run


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "world"
    toyworld.generate(out, 48, seed=0, workers=1)
    return out


def _run(toy: Path, out: Path, monkeypatch, *, defer: bool, extra: tuple[str, ...]) -> tuple[int, list[int]]:
    """main() on ``toy`` with fused AdamW; returns (exit status, the number of steps each host read took)."""
    from train.pretrain import engine
    from train.pretrain.trainer import Trainer

    reads: list[int] = []

    def counted(readouts):
        reads.append(len(readouts))
        return real(readouts)

    real = engine.read_steps
    with monkeypatch.context() as m:
        m.setattr(engine, "read_steps", counted)
        if not defer:
            m.setattr(Trainer, "defers", property(lambda self: False))
        code = engine.main(["--data", str(toy), "--out", str(out), "--batch-size", "8", "--workers", "0",
                            "--no-tensorboard", "--eval-every-n-epochs", "0", "--fused-adamw", "on",
                            "--keep-checkpoints", "0", *extra])
    return code, reads


def _rows(out: Path) -> list[dict]:
    with (out / "log.csv").open() as f:
        return [{k: v for k, v in r.items() if k not in TIMES} for r in csv.DictReader(f)]


@pytest.mark.slow
def test_reading_every_few_steps_gives_the_run_that_reads_every_step(toy, tmp_path, monkeypatch):
    extra = ("--batch-size", "4", "--epochs", "2", "--log-every-n-steps", "6", "--max-bad-steps", "4",
             "--save-every-n-steps", "7", "--debug-nan-steps", "6")
    code, every = _run(toy, tmp_path / "every", monkeypatch, defer=False, extra=extra)
    assert code == 0 and set(every) == {1}
    code, deferred = _run(toy, tmp_path / "deferred", monkeypatch, defer=True, extra=extra)
    assert code == 0
    steps = len(every)
    assert steps == 18 and sum(deferred) == steps and max(deferred) == 4  # 4 = min(log every, max bad)
    rows = _rows(tmp_path / "deferred")
    assert rows == _rows(tmp_path / "every")
    assert [r["step"] for r in rows if r["skipped_step"] == "1"] == ["6"]  # a bad step in a window is still logged
    a, b = (tmp_path / "every" / "checkpoints"), (tmp_path / "deferred" / "checkpoints")
    names = sorted(p.name for p in a.iterdir() if p.is_dir())
    assert names == sorted(p.name for p in b.iterdir() if p.is_dir()) and "step_00000007" in names
    for name in [*names, None]:
        where = (lambda d: d / name / "model.safetensors") if name else (lambda d: d.parent / "model.safetensors")
        x, y = load_file(str(where(a))), load_file(str(where(b)))
        assert all(torch.equal(x[k], y[k]) for k in x), name


def test_a_diverging_run_stops_within_twice_max_bad_steps_with_the_same_message(toy, tmp_path, monkeypatch, capsys):
    extra = ("--max-steps", "12", "--save-every-n-steps", "2", "--debug-nan-steps", "3,4,5", "--max-bad-steps", "3",
             "--log-every-n-steps", "100")
    errors = []
    for defer in (False, True):
        code, reads = _run(toy, tmp_path / str(defer), monkeypatch, defer=defer, extra=extra)
        assert code == 3
        errors.append(capsys.readouterr().err.replace(str(tmp_path / str(defer)), "OUT"))
        assert sum(reads) <= 2 * 3  # stopped within 2 x --max-bad-steps
        assert [r["step"] for r in _rows(tmp_path / str(defer))] == ["1", "3", "4", "5"]
        names = sorted(p.name for p in (tmp_path / str(defer) / "checkpoints").iterdir() if p.is_dir())
        assert names == ["step_00000002"]  # never a checkpoint from an unread or bad state
    assert errors[0] == errors[1] and "steps 3, 4, 5" in errors[0]
