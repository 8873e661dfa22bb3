"""train/pretrain_checkpoint.py: safetensors + JSON checkpoints that resume exactly and are written atomically."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from extract.weights import SIDECAR_FORMAT, checkpoint_sidecar
from train import pretrain_checkpoint as ck


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.AdamW([{"params": list(model.parameters())[:2], "weight_decay": 0.0},
                             {"params": list(model.parameters())[2:], "weight_decay": 0.2}], lr=1e-2, betas=(0.9, 0.98))
    return model, opt, names


def _train(model, opt, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_resumed_optimizer_continues_exactly(tmp_path):
    model, opt, names = _model_and_optimizer(0)
    _train(model, opt, 3, seed=1)
    path = ck.save_checkpoint(tmp_path / "ck", "step_00000003", model, opt, names, None, {"step": 3}, {"method": "t"})
    _train(model, opt, 4, seed=2)

    fresh, fresh_opt, _ = _model_and_optimizer(99)  # other weights and an empty optimizer
    state = ck.load_checkpoint(path, fresh, fresh_opt, names, None)
    assert state["step"] == 3 and state["optimizer"]["names"] == names
    _train(fresh, fresh_opt, 4, seed=2)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_opt.param_groups[1]["weight_decay"] == 0.2 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.98)
    with pytest.raises(ValueError, match="other parameters"):
        ck.load_checkpoint(path, fresh, fresh_opt, list(reversed(names)), None)


def test_checkpoint_files_describe_themselves(tmp_path):
    model, opt, names = _model_and_optimizer(0)
    _train(model, opt, 1, seed=0)
    path = ck.save_checkpoint(tmp_path / "ck", "epoch_0001", model, opt, names, None, {"step": 1},
                              {"model": "m", "method": "clip"})
    assert sorted(p.name for p in path.iterdir()) == ["model.json", "model.safetensors", "state.json",
                                                     "state.safetensors"]
    weights = load_file(str(path / "model.safetensors"))
    assert weights.keys() == model.state_dict().keys()
    side = checkpoint_sidecar(path / "model.safetensors")
    assert side["format"] == SIDECAR_FORMAT and side["method"] == "clip"
    tensors = load_file(str(path / "state.safetensors"))
    assert "rng/torch_cpu" in tensors and any(k.startswith("optimizer/0.weight/") for k in tensors)
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    (tmp_path / "other.safetensors").write_bytes(b"")
    assert checkpoint_sidecar(tmp_path / "other.safetensors") is None


def test_latest_pointer_partial_folders_and_pruning(tmp_path):
    model, opt, names = _model_and_optimizer(0)
    out = tmp_path / "run"
    assert ck.find_resume(out, "latest") is None
    for step in (2, 4, 6):
        ck.save_checkpoint(out / "checkpoints", f"step_{step:08d}", model, opt, names, None, {"step": step}, {})
    assert ck.find_resume(out, "latest").name == "step_00000006"
    # a run killed while writing leaves a temporary folder: never resumed from, removed by the next run
    partial = out / "checkpoints" / "step_00000008.tmp-12345"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert ck.find_resume(out, "latest").name == "step_00000006"
    assert ck.clean_partial(out / "checkpoints") == 1 and not partial.exists()
    assert ck.prune_steps(out / "checkpoints", 2) == ["step_00000002"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step_00000004", "step_00000006"]
    assert ck.find_resume(out, str(out / "checkpoints" / "step_00000004" / "model.safetensors")).name == "step_00000004"
    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        ck.find_resume(out, str(tmp_path / "nowhere"))
    (out / "checkpoints" / "latest").write_text("step_00000099\n")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ck.find_resume(out, "latest")
