"""The step's fast paths equal the eager step on CPU: --compile (the towers torch.compiled in place) and fused
AdamW give the same loss, gradients and updates as the plain path, for every objective, and checkpoints keep their
parameter names. The DDP and resume tests of test_pretrain.py also run with --compile."""
from __future__ import annotations

import pytest
import torch

METHODS = ["clip", "flip", "clip-pgs", "powerclip", "filip"]
CAPTIONS = ["a red circle to the left of a blue square", "a green star", "a small yellow triangle above a purple "
            "hexagon", "a white square"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _trainer(method: str, **options):
    from train.pretrain.dist import Dist
    from train.pretrain.options import build_objective, PretrainOptions
    from train.pretrain.trainer import create_model, Trainer

    model, _, _, tok = create_model("plugvlm-tiny", False, 0)
    objective = build_objective(method)
    objective.setup(model, {})
    args = PretrainOptions(data="unused", method=method, **options)
    g = torch.Generator().manual_seed(1)
    batch = {"image": torch.randn(len(CAPTIONS), 3, 64, 64, generator=g), "text": tok(CAPTIONS)}
    extra = objective.prepare(CAPTIONS, [str(i) for i in range(len(CAPTIONS))], tok)
    batch.update(extra)
    return Trainer(args, Dist(), model, objective), batch


def _gradients(method: str, **options) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    trainer, batch = _trainer(method, **options)
    losses = trainer.forward_backward([batch], trainer.context(3, 0, 1).with_batch(0, len(CAPTIONS)))
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return losses["loss"], grads, list(trainer.model.state_dict())


def _assert_same(method, eager, fast, atol):
    (l0, g0, k0), (l1, g1, k1) = eager, fast
    assert k1 == k0  # compiled in place: the checkpoint's names do not change
    torch.testing.assert_close(l1, l0, rtol=atol, atol=atol, msg=method)
    assert g1.keys() == g0.keys() and len(g0) > 40
    for name in g0:
        scale = float(g0[name].abs().max()) + 1e-8
        torch.testing.assert_close(g1[name] / scale, g0[name] / scale, rtol=0, atol=atol, msg=f"{method} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_compiled_step_gives_the_eager_loss_and_gradients(method):
    """aot_eager: dynamo's capture and AOT autograd's joint graph, the path inductor compiles, without the C++
    build (the next test runs inductor itself)."""
    _assert_same(method, _gradients(method), _gradients(method, compile=True, compile_backend="aot_eager"), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_inductor_on_cpu_gives_the_eager_loss_and_gradients(mode):
    """The real backend, generated C++ included (about a minute to compile here): CLIP's step, both towers. On a CPU
    reduce-overhead compiles what default does (its CUDA graphs are CUDA's): the mode reaches inductor and breaks
    nothing; the graphs themselves wait for a GPU."""
    _assert_same("clip", _gradients("clip"), _gradients("clip", compile=True, compile_mode=mode), 1e-4)


def test_compile_mode_reaches_every_tower_and_cuda_graphs_mark_every_step(monkeypatch):
    from train.pretrain import trainer as trainer_module

    modes = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: modes.append(kw["mode"]))
    trainer, batch = _trainer("clip", compile=True, compile_mode="reduce-overhead")
    assert modes == ["reduce-overhead", "reduce-overhead"] and not trainer.graphs  # two towers; no graphs on CPU
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(trainer_module, "uses_cuda_graphs", lambda mode, device: mode == "reduce-overhead")
    trainer, batch = _trainer("clip", compile=True, compile_mode="reduce-overhead")
    for step in range(3):
        trainer.step([batch], trainer.context(step, 0, 1).with_batch(0, len(CAPTIONS)), 1e-3)
    assert trainer.graphs and len(marks) == 3  # one new graph step per optimizer step
    modes.clear()
    _trainer("clip", compile=True)
    assert modes == [None, None]  # "default" is torch.compile's own default
    from train.pretrain.options import PretrainOptions

    with pytest.raises(ValueError, match="mode of inductor"):
        PretrainOptions(data="unused", compile_mode="reduce-overhead")  # without --compile
    with pytest.raises(ValueError, match="mode of inductor"):
        PretrainOptions(data="unused", compile=True, compile_backend="aot_eager", compile_mode="max-autotune")


def test_fused_adamw_takes_the_foreach_steps_and_skips_the_same_bad_one():
    """The second of four steps has a NaN loss: the foreach path asks the host and does not step; the fused kernel
    is told on the device (found_inf) and leaves every tensor and its step count as they were."""
    runs = []
    for fused in ("off", "on"):
        trainer, batch = _trainer("clip", fused_adamw=fused, lr=1e-3, warmup=0, debug_nan_steps="2")
        assert bool(trainer.optimizer.defaults["fused"]) == (fused == "on")
        oks = []
        for step in range(4):
            ctx = trainer.context(step, 0, 1).with_batch(0, len(CAPTIONS))
            metrics, ok = trainer.step([batch], ctx, 1e-3)
            oks.append(ok)
            assert isinstance(metrics["loss"], float) and isinstance(ok, bool)
        assert oks == [True, False, True, True]
        assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {3}
        runs.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    # Each step moves a weight by about lr. Rounding differs between the kernels, and Adam divides a gradient by
    # its own scale, so a gradient that is rounding noise (the attention's key bias: softmax ignores a shift)
    # moves by lr either way in a direction the noise picks: 1% of the 3 steps' travel bounds them all.
    for name in runs[0]:
        torch.testing.assert_close(runs[1][name], runs[0][name], rtol=0, atol=0.01 * 3 * 1e-3, msg=name)
    differ = [n for n in runs[0] if not torch.allclose(runs[1][n], runs[0][n], rtol=1e-5, atol=1e-6)]
    assert all("in_proj_bias" in n for n in differ), differ


def test_a_resumed_optimizer_keeps_the_kernel_it_was_saved_with():
    """torch's load_state_dict restores each group's flags, so a checkpoint of a foreach run resumed with fused on
    (a CPU run continued on a GPU) steps with foreach, and the bad-step skip follows the kernel it has."""
    saved, batch = _trainer("clip", fused_adamw="off", debug_nan_steps="2")
    ctx = saved.context(0, 0, 1).with_batch(0, len(CAPTIONS))
    assert saved.step([batch], ctx, 1e-3)[1]
    resumed, _ = _trainer("clip", fused_adamw="on", debug_nan_steps="2")
    resumed.model.load_state_dict(saved.model.state_dict())
    resumed.optimizer.load_state_dict(saved.optimizer.state_dict())
    assert not resumed.optimizer.param_groups[0].get("fused")
    oks = [resumed.step([batch], resumed.context(k, 0, 1).with_batch(0, len(CAPTIONS)), 1e-3)[1] for k in (1, 2)]
    assert oks == [False, True]
