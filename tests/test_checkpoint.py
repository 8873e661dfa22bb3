"""Adapter checkpoints: round trips (head, optimizer, scheduler, RNG), self-description, refusals of foreign files."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from adapters import checkpoint as ck
from adapters.registry import ADAPTERS

D = 32


def _head():
    torch.manual_seed(0)
    return ADAPTERS.get("comalign").from_config({"heads": 4, "layers": 1, "dropout": 0.1}, D)


def _batch(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = {"image_embed": torch.randn(n, D, generator=g), "ventity_embed": torch.randn(n, 3, D, generator=g),
           "ventity_valid": torch.ones(n, 3, dtype=torch.bool), "vrelation_embed": torch.randn(n, 2, D, generator=g),
           "vrelation_valid": torch.ones(n, 2, dtype=torch.bool)}
    txt = {"text_embed": torch.randn(n, D, generator=g), "entity_embed": torch.randn(n, 3, D, generator=g),
           "entity_valid": torch.ones(n, 3, dtype=torch.bool), "relation_embed": torch.randn(n, 2, D, generator=g),
           "relation_valid": torch.ones(n, 2, dtype=torch.bool)}
    return img, txt


def _step(head, opt, sched, seed):
    img, txt = _batch(seed=seed)
    head.loss(head.encode_image(img), head.encode_text(txt))["loss"].backward()  # dropout draws from the RNG
    opt.step()
    opt.zero_grad()
    sched.step()


def test_adapter_round_trip_rebuilds_from_the_file_alone(tmp_path):
    head = _head().eval()
    head.fusion_t2i.copy_(torch.tensor([0.5, 2.0, 1.0, 0.25]))  # fitted buffers travel with the weights
    path = ck.save_adapter(tmp_path / "a.safetensors", head, {"base": {"base": "tiny"}, "metrics": {"x": 1.5}})
    meta = ck.read_meta(path)
    assert meta["kind"] == "adapter" and meta["method"] == "comalign" and meta["embed_dim"] == D
    assert meta["config"]["layers"] == 1 and meta["metrics"] == {"x": 1.5}
    assert json.loads((tmp_path / "a.safetensors.json").read_text()) == meta
    again, meta2 = ck.load_adapter(path)
    assert meta2 == meta and not again.training
    for (k, a), (k2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    img, txt = _batch()
    with torch.no_grad():
        assert torch.equal(head.score(head.encode_image(img), head.encode_text(txt)),
                           again.score(again.encode_image(img), again.encode_text(txt)))


def test_training_state_round_trip_continues_identically(tmp_path):
    def fresh():
        head = _head().train()
        opt = torch.optim.AdamW(head.param_groups(0.1), lr=1e-3, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return head, opt, sched

    head, opt, sched = fresh()
    torch.manual_seed(1)
    for s in range(3):
        _step(head, opt, sched, s)
    ck.save_training_state(tmp_path / "state.safetensors", head, opt, sched, None, {"epoch": 1, "batch": 0, "step": 3})
    for s in range(3, 5):
        _step(head, opt, sched, s)
    expected = {k: v.clone() for k, v in head.state_dict().items()}

    torch.manual_seed(12345)  # a different RNG and untrained weights: everything must come from the file
    head2, opt2, sched2 = fresh()
    meta = ck.load_training_state(tmp_path / "state.safetensors", head2, opt2, sched2, None)
    assert (meta["epoch"], meta["step"]) == (1, 3)
    assert sched2.last_epoch == 3
    for s in range(3, 5):
        _step(head2, opt2, sched2, s)
    for k, v in head2.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_foreign_files_are_refused_with_a_reason(tmp_path):
    plain = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(plain))
    with pytest.raises(ck.CheckpointError, match="not a plugvlm adapter checkpoint.*--pretrained"):
        ck.read_meta(plain)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x80\x04not safetensors at all")
    with pytest.raises(ck.CheckpointError, match="not a safetensors file"):
        ck.read_meta(junk)
    with pytest.raises(FileNotFoundError):
        ck.read_meta(tmp_path / "missing.safetensors")
    assert not ck.is_checkpoint(plain) and not ck.is_checkpoint(junk)


def test_newer_format_and_unknown_method_are_explained(tmp_path):
    newer = tmp_path / "newer.safetensors"
    save_file({"w": torch.zeros(1)}, str(newer), metadata={"format": ck.FORMAT, "version": "99", "plugvlm": "{}"})
    with pytest.raises(ck.CheckpointError, match="version 99.*update plugvlm"):
        ck.read_meta(newer)
    other = ck.write(tmp_path / "other.safetensors", {"head.w": torch.zeros(1)},
                     {"method": "no-such-method", "config": {}, "embed_dim": 8})
    with pytest.raises(ck.CheckpointError, match="no-such-method.*comalign"):
        ck.load_adapter(other)


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path):
    head = _head()
    meta = {**ck.describe_head(head), "config": {**head.config_dict(), "layers": 2}}  # claims 2 layers, holds 1
    path = ck.write(tmp_path / "bad.safetensors", {f"head.{k}": v for k, v in head.state_dict().items()}, meta)
    with pytest.raises(ck.CheckpointError, match="do not fit comalign"):
        ck.load_adapter(path)


def test_an_inference_checkpoint_cannot_be_resumed(tmp_path):
    head = _head()
    path = ck.save_adapter(tmp_path / "a.safetensors", head, {})
    opt = torch.optim.AdamW(head.parameters())
    with pytest.raises(ck.CheckpointError, match="--resume needs"):
        ck.load_training_state(path, head, opt, None, None)
