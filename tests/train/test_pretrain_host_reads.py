"""A step that never waits for the device: with fused AdamW, CLIP's, FLIP's, PowerCLIP's and CLIP-PGS's steps read
no tensor's value on the host where the host runs ahead of the device (CUDA; ``runs_ahead``, made true here), so
the engine may read their metrics every few steps (test_pretrain_reads.py). CLIP-PGS pads its kept patches to the
most an image may keep instead of asking for the batch's largest, and that gives the same loss and gradients."""
from __future__ import annotations

import pytest
import torch

from fixtures.host_reads import HostReadError, no_host_reads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
CAPTIONS = ["a red circle to the left of a blue square", "a green star", "a small yellow triangle above a purple "
            "hexagon", "a white square", "a blue star on a red square", "a purple circle"]


def _trainer(method: str, **options):
    from train.pretrain.dist import Dist
    from train.pretrain.options import PretrainOptions, build_objective
    from train.pretrain.trainer import Trainer, create_model

    model, _, _, tok = create_model("plugvlm-tiny", False, 0)
    objective = build_objective(method)
    objective.setup(model, {})
    g = torch.Generator().manual_seed(2)
    # drawings, whose patches are mostly alike: four squares on a plain ground mask the most they may (keep 32 of
    # 64), two of four coloured quarters may keep more
    images = torch.randn(len(CAPTIONS), 3, 1, 1, generator=g).expand(-1, -1, 64, 64).clone()
    images[:, :, 16:40, 16:40] += 1.5
    images[4:] = torch.nn.functional.interpolate(torch.randn(2, 3, 2, 2, generator=g), size=64, mode="nearest")
    batch = {"image": images, "text": tok(CAPTIONS)}
    batch.update(objective.prepare(CAPTIONS, [str(i) for i in range(len(CAPTIONS))], tok))
    trainer = Trainer(PretrainOptions(data="unused", method=method, **options), Dist(), model, objective)
    return trainer, batch, trainer.context(3, 0, 1).with_batch(0, len(CAPTIONS))


@pytest.fixture
def ahead(monkeypatch):
    """The CUDA choices on the CPU: objectives behave as where the host runs ahead."""
    from adapters.objectives import clip_pgs

    monkeypatch.setattr(clip_pgs, "runs_ahead", lambda device: True)


@pytest.mark.parametrize("method", ["clip", "flip", "powerclip", "clip-pgs"])
def test_the_step_reads_nothing_back_with_fused_adamw(method, ahead):
    trainer, batch, ctx = _trainer(method, fused_adamw="on")
    assert trainer.defers
    with no_host_reads():
        readout = trainer.step_async([batch], ctx, 1e-3)
    from train.pretrain.trainer import read_steps

    (metrics, ok), = read_steps([readout])
    assert ok and metrics["loss"] > 0
    trainer, batch, ctx = _trainer(method, fused_adamw="off")  # the foreach kernel asks the host whether to step
    assert not trainer.defers
    with pytest.raises(HostReadError), no_host_reads():
        trainer.step_async([batch], ctx, 1e-3)


def test_clip_pgs_padded_to_the_bound_gives_the_loss_and_gradients_of_the_batchs_largest(monkeypatch):
    from adapters.objectives import clip_pgs

    runs = {}
    seen = []
    real = clip_pgs.pgs_select

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(tuple(out[0].shape))
        return out

    monkeypatch.setattr(clip_pgs, "pgs_select", recorded)
    for bound in (False, True):
        monkeypatch.setattr(clip_pgs, "runs_ahead", lambda device, b=bound: b)
        trainer, batch, _ = _trainer("clip-pgs")
        ctx = trainer.context(11, 0, 1).with_batch(0, len(CAPTIONS))  # a step whose seeds give 40 and 36 of 64
        losses = trainer.forward_backward([batch], ctx)
        runs[bound] = losses["loss"], {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                                       if p.grad is not None}
    n = 64  # plugvlm-tiny: 64 px, 8 px patches
    assert seen[1] == (len(CAPTIONS), n - (n - clip_pgs.keep_count(n, 0.3)))  # the bound: 44 of 64
    assert 32 < seen[0][1] < seen[1][1]  # counts differ (both pad), and the batch's largest is below the bound
    (l0, g0), (l1, g1) = runs[False], runs[True]
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 40
    for name in g0:
        scale = float(g0[name].abs().max()) + 1e-8
        torch.testing.assert_close(g1[name] / scale, g0[name] / scale, rtol=0, atol=1e-5, msg=name)
