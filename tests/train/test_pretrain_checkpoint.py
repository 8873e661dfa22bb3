"""train/pretrain/checkpoint.py: safetensors + JSON checkpoints that resume exactly and are written atomically."""
from __future__ import annotations

import json
import os
import stat

import open_clip
import pytest
import torch
from safetensors.torch import load_file

from extract.common import tensorfile
from extract.models.backbone import register_configs, load_backbone
from extract.models.weights import SIDECAR_FORMAT, checkpoint_sidecar
from train.pretrain import checkpoint as ck
from fixtures.bad_inputs import flip_tensor_bytes as _flip


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
    assert ck.prune(out / "checkpoints", 2) == ["step_00000002"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step_00000004", "step_00000006"]
    assert ck.find_resume(out, str(out / "checkpoints" / "step_00000004" / "model.safetensors")).name == "step_00000004"
    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        ck.find_resume(out, str(tmp_path / "nowhere"))
    (out / "checkpoints" / "latest").write_text("step_00000099\n")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ck.find_resume(out, "latest")


def test_pruning_orders_step_and_epoch_checkpoints_by_training_position_and_spares_latest_and_best(tmp_path):
    model, opt, names = _model_and_optimizer(0)
    ckpt_dir = tmp_path / "checkpoints"
    for name, step in (("step_00000002", 2), ("epoch_0001", 3), ("step_00000005", 5), ("epoch_0002", 6)):
        ck.save_checkpoint(ckpt_dir, name, model, opt, names, None, {"step": step}, {})
    (ckpt_dir / "unrelated").mkdir()  # not a checkpoint name: never touched
    assert ck.prune(ckpt_dir, 0) == [] and ck.prune(ckpt_dir, 5) == []  # 0 keeps all
    ck.mark_best(ckpt_dir, "epoch_0001")
    assert ck.prune(ckpt_dir, 1, keep_also=["step_00000005"]) == ["step_00000002"]
    assert sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir()) == ["epoch_0001", "epoch_0002", "step_00000005",
                                                                       "unrelated"]
    (ckpt_dir / ck.LATEST).write_text("step_00000005\n")  # e.g. a resumed run pointed back at it
    assert ck.prune(ckpt_dir, 1) == []  # epoch_0002 is the newest, step_00000005 latest, epoch_0001 best
    assert ck.prune(ckpt_dir, 1, keep_also=[None]) == [] and (ckpt_dir / ck.BEST).read_text() == "epoch_0001\n"


# --------------------------------------------------------------------------------------------- integrity


DAMAGED = "is damaged: its tensor data do not match the digest written when it was saved"


@pytest.mark.parametrize("name", ["model.safetensors", "state.safetensors"])
def test_a_damaged_checkpoint_file_is_refused_before_anything_is_restored(tmp_path, name):
    model, opt, names = _model_and_optimizer(0)
    _train(model, opt, 2, seed=1)
    path = ck.save_checkpoint(tmp_path / "ck", "step_00000002", model, opt, names, None, {"step": 2}, {})
    _flip(path / name, at=4)
    fresh, fresh_opt, _ = _model_and_optimizer(99)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(tensorfile.DamagedFileError, match=f"{path / name} {DAMAGED}"):
        ck.load_checkpoint(path, fresh, fresh_opt, names, None)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def _tiny(seed=0):
    register_configs()
    torch.manual_seed(seed)
    return open_clip.create_model("plugvlm-tiny").eval()


def test_pretrained_weights_are_verified_where_the_backbone_loads_them(tmp_path):
    model = _tiny()
    path = ck.save_final(tmp_path, model, {"model": "plugvlm-tiny", "quick_gelu": False})
    bb = load_backbone("tiny", str(path))  # a sound file loads, through open_clip
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in bb.model.state_dict().items())
    _flip(path, at=1000)
    with pytest.raises(tensorfile.DamagedFileError, match=f"{path} {DAMAGED}"):
        load_backbone("tiny", str(path))
    with torch.no_grad():
        model.visual.proj[0, 0] = float("nan")
    path = ck.save_final(tmp_path, model, {"model": "plugvlm-tiny", "quick_gelu": False})
    with pytest.raises(tensorfile.NonFiniteError, match=f"{path} holds non-finite weights: tensor 'visual.proj'"):
        load_backbone("tiny", str(path))
    nan_ckpt = ck.save_checkpoint(tmp_path / "ck", "step_00000001", model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  [n for n, _ in model.named_parameters()], None, {"step": 1}, {})
    with pytest.raises(tensorfile.NonFiniteError, match="tensor 'visual.proj'"):
        ck.load_checkpoint(nan_ckpt, _tiny(1), None, [], None)


def test_a_run_exported_in_fp16_loads_as_the_same_model_to_fp16_precision(tmp_path, capsys):
    register_configs()
    torch.manual_seed(0)
    model = open_clip.create_model("plugvlm-tiny-rn").eval()  # BatchNorm's integer counter stays an integer
    ck.save_final(tmp_path / "run", model, {"format": SIDECAR_FORMAT, "model": "plugvlm-tiny-rn", "quick_gelu": False})
    assert ck.main([str(tmp_path / "run"), str(tmp_path / "half"), "--command", "python -m train.pretrain ..."]) == 0
    assert "fp16" in capsys.readouterr().out
    half = load_file(tmp_path / "half" / "model.safetensors")
    assert half["visual.conv1.weight"].dtype == torch.float16
    assert half["visual.bn1.num_batches_tracked"].dtype == torch.int64
    desc = json.loads((tmp_path / "half" / "model.json").read_text())
    assert desc["dtype"] == "float16" and desc["command"] == "python -m train.pretrain ..."
    bb = load_backbone("tiny-rn", str(tmp_path / "half" / "model.safetensors"))
    for k, v in bb.model.state_dict().items():
        torch.testing.assert_close(v, model.state_dict()[k], rtol=1e-3, atol=1e-4, check_dtype=True)
    _flip(tmp_path / "half" / "model.safetensors", at=1000)
    with pytest.raises(tensorfile.DamagedFileError):
        load_backbone("tiny-rn", str(tmp_path / "half" / "model.safetensors"))


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask022", "umask027"])
def test_checkpoint_files_follow_the_umask(tmp_path, umask, mode):
    model, opt, names = _model_and_optimizer(0)
    _train(model, opt, 1, seed=0)
    old = os.umask(umask)
    try:
        folder = ck.save_checkpoint(tmp_path / "ck", "step_00000001", model, opt, names, None, {"step": 1}, {})
        final = ck.save_final(tmp_path, model, {})
    finally:
        os.umask(old)
    files = [*folder.iterdir(), tmp_path / "ck" / ck.LATEST, final, final.with_suffix(".json")]
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: oct(mode) for p in files}
