"""train/pretrain/prefetch.py: the next step's batch is copied while the current step runs, the loader's batches
and order unchanged, and no batch is taken past the steps a run makes (the data report counts what trained)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from extract.worlds import toyworld

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_next_batch_is_copied_before_the_current_one_is_given_out():
    from train.pretrain.prefetch import one_ahead

    events: list[str] = []

    def loader():
        for k in range(4):
            events.append(f"take {k}")
            yield [{"image": torch.full((2,), float(k))}]

    def copy(micro):
        events.append(f"copy {int(micro[0]['image'][0])}")
        return [{"image": micro[0]["image"] + 0.5}]

    got = []
    for micro in one_ahead(loader(), copy, ready=lambda m: events.append(f"ready {int(m[0]['image'][0])}")):
        events.append(f"step {int(micro[0]['image'][0])}")
        got.append(float(micro[0]["image"][0]))
    assert got == [0.5, 1.5, 2.5, 3.5]  # every batch, in order, copied once
    assert events[:6] == ["take 0", "copy 0", "ready 0", "take 1", "copy 1", "step 0"]  # 1 copied before step 0
    assert events[-2:] == ["ready 3", "step 3"] and events.count("take 3") == 1
    assert list(one_ahead([], copy)) == []


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "world"
    toyworld.generate(out, 48, seed=0, workers=1)
    return out


def test_a_run_stopped_inside_an_epoch_takes_no_batch_past_its_last_step(toy, tmp_path, monkeypatch):
    from train.pretrain import engine
    from train.pretrain.data import TrainData

    taken = []
    real = TrainData.epoch_batches

    def counted(self, epoch, start_step):
        for micro in real(self, epoch, start_step):
            taken.append(epoch)
            yield micro

    monkeypatch.setattr(TrainData, "epoch_batches", counted)
    assert engine.main(["--data", str(toy), "--out", str(tmp_path / "run"), "--batch-size", "4", "--workers", "0",
                        "--no-tensorboard", "--eval-every-n-epochs", "0", "--max-steps", "12"]) == 0
    assert taken == [0] * 9 + [1] * 3  # 9 steps an epoch: the whole first, three of the second, not a fourth
