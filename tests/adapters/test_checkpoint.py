"""Adapter checkpoints: round trips (head, optimizer, scheduler, RNG), self-description, refusals of foreign files."""
from __future__ import annotations

import json
import logging
import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adapters import checkpoint as ck
from adapters.registry import ADAPTERS
from extract.common import tensorfile
from fixtures.bad_inputs import flip_tensor_bytes as _flip

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


def test_weights_of_another_shape_name_the_tensor_and_say_retrain(tmp_path):
    head = _head()
    state = head.state_dict()
    name = next(k for k, v in state.items() if v.ndim == 2)
    state[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1])  # as an older version wrote it
    path = ck.write(tmp_path / "old.safetensors", {f"head.{k}": v for k, v in state.items()}, ck.describe_head(head))
    with pytest.raises(ck.CheckpointError, match=f"{name} .*this version.*train the adapter again"):
        ck.load_adapter(path)


def test_an_inference_checkpoint_cannot_be_resumed(tmp_path):
    head = _head()
    path = ck.save_adapter(tmp_path / "a.safetensors", head, {})
    opt = torch.optim.AdamW(head.parameters())
    with pytest.raises(ck.CheckpointError, match="--resume needs"):
        ck.load_training_state(path, head, opt, None, None)


# --------------------------------------------------------------------------------------------- integrity


def _resumable(seed=0):
    head = _head().train()
    opt = torch.optim.AdamW(head.param_groups(0.1), lr=1e-3)
    _step(head, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), seed)
    return head, opt


def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path):
    head, opt = _resumable()
    adapter = ck.save_adapter(tmp_path / "a.safetensors", head, {})
    state = ck.save_training_state(tmp_path / "last.safetensors", head, opt, None, None, {"epoch": 0})
    rng = ck.save_atomic({"torch": torch.get_rng_state()}, tmp_path / "rng-rank1.safetensors")
    for path in (adapter, state, rng):
        with safe_open(str(path), framework="pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
            assert f.metadata()[tensorfile.DIGEST_KEY] == tensorfile.tensors_digest(saved)
        _flip(path, at=256)
    message = "is damaged: its tensor data do not match the digest written when it was saved; re-copy it"
    with pytest.raises(tensorfile.DamagedFileError, match=f"{adapter}.*{message}"):
        ck.load_adapter(adapter)
    fresh, fresh_opt = _resumable(seed=1)
    with pytest.raises(tensorfile.DamagedFileError, match=f"{state}.*{message}"):
        ck.load_training_state(state, fresh, fresh_opt, None, None)
    with pytest.raises(tensorfile.DamagedFileError, match=f"{rng}.*{message}"):
        ck.read_tensors(rng)
    assert ck.read_meta(adapter)["kind"] == "adapter"  # the description is still readable: the file is ours


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    head, opt = _resumable()
    with torch.no_grad():
        head.fusion_t2i[1] = float("nan")
        head.fusion_t2i[2] = float("inf")
    assert tensorfile.first_nonfinite(head.state_dict()) == "fusion_t2i"
    with pytest.raises(tensorfile.NonFiniteError, match="diverged head: tensor 'fusion_t2i' holds 1 NaN and 1 inf"):
        tensorfile.assert_finite(head.state_dict(), "diverged head")
    adapter = ck.save_adapter(tmp_path / "a.safetensors", head, {})  # written as is, with a valid digest
    state = ck.save_training_state(tmp_path / "last.safetensors", head, opt, None, None, {"epoch": 0})
    with pytest.raises(tensorfile.NonFiniteError, match=f"{adapter} holds non-finite weights: tensor 'head.fusion_t2i"):
        ck.load_adapter(adapter)
    with pytest.raises(tensorfile.NonFiniteError, match=f"{state} holds non-finite weights"):
        ck.load_training_state(state, *_resumable(seed=1), None, None)
    assert tensorfile.first_nonfinite({"n": torch.arange(3), "ok": torch.ones(2, dtype=torch.bfloat16)}) is None


def test_files_without_a_digest_load_as_before(tmp_path, caplog):
    foreign = tmp_path / "foreign.safetensors"  # someone else's file: NaN or not, it is theirs to judge
    save_file({"w": torch.tensor([1.0, float("nan")])}, str(foreign))
    tensors, meta = tensorfile.load_tensors(foreign)
    assert tensors["w"][0] == 1 and tensorfile.DIGEST_KEY not in meta
    assert tensorfile.verify_file(foreign) is False
    head = _head().eval()
    older = tmp_path / "older.safetensors"  # an adapter from a plugvlm without digests
    save_file({f"head.{k}": v.contiguous() for k, v in head.state_dict().items()}, str(older),
              metadata={"format": ck.FORMAT, "version": "1",
                        "plugvlm": json.dumps({"kind": "adapter", **ck.describe_head(head)})})
    with caplog.at_level(logging.WARNING, logger="extract.common.tensorfile"):
        again, _ = ck.load_adapter(older)
        ck.load_adapter(older)
    assert [r.getMessage() for r in caplog.records].count(
        f"{older} carries no tensor digest (written by an older plugvlm): loaded without an integrity check") == 1
    for k, v in head.state_dict().items():
        assert torch.equal(again.state_dict()[k], v)


def test_digest_covers_names_dtypes_shapes_and_bytes_in_any_order():
    a = {"x": torch.arange(6, dtype=torch.float32), "b": torch.tensor(True), "e": torch.zeros(0, 3),
         "h": torch.ones(2, dtype=torch.bfloat16), "s": torch.tensor(2.5)}
    d = tensorfile.tensors_digest(a)
    assert d == tensorfile.tensors_digest(dict(reversed(list(a.items()))))
    assert d == tensorfile.tensors_digest({**a, "x": torch.arange(12, dtype=torch.float32)[::2] / 2})  # views too
    renamed = {("z" if k == "x" else k): v for k, v in a.items()}
    for changed in (renamed, {**a, "x": a["x"].reshape(2, 3)}, {**a, "x": a["x"].double()}, {**a, "x": a["x"] + 1},
                    {k: v for k, v in a.items() if k != "e"}):
        assert tensorfile.tensors_digest(changed) != d


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask022", "umask027"])
def test_saved_files_follow_the_umask(tmp_path, umask, mode):
    head, opt = _resumable()
    old = os.umask(umask)
    try:
        paths = [ck.save_adapter(tmp_path / "a.safetensors", head, {}),
                 ck.save_training_state(tmp_path / "last.safetensors", head, opt, None, None, {"epoch": 0}),
                 ck.save_atomic({"torch": torch.get_rng_state()}, tmp_path / "rng-rank1.safetensors"),
                 tmp_path / "a.safetensors.json"]
        paths.append(tmp_path / ck.save_backbone_weights(tmp_path / "backbone.safetensors", head)["file"])
    finally:
        os.umask(old)
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in paths} == {p.name: oct(mode) for p in paths}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no temporary left


def test_the_detector_is_copied_only_as_it_was_when_the_boxes_were_found(tmp_path):
    """save_detector copies the detector file the training cache names into the run folder, with its digest; a file
    that changed since the cache was extracted is refused (the cached boxes are not its boxes); boxes from no file
    (ground truth, a config ultralytics ships) copy nothing; run_detector gives the copy back, checked."""
    from extract.models.weights import file_sha256

    weights = tmp_path / "det" / "best.pt"
    weights.parent.mkdir()
    weights.write_bytes(b"detector weights")
    run = tmp_path / "run"
    run.mkdir()

    def extraction(source="yolo", **named):
        return {"settings": {"boxes": {"source": source, "detector": {"weights": named}}}}

    entry = ck.save_detector(run, extraction(file=str(weights), sha256=file_sha256(weights)))["detector"]
    assert entry == {"file": "detector.pt", "sha256": file_sha256(weights), "trained_from": str(weights)}
    assert (run / "detector.pt").read_bytes() == b"detector weights"
    assert ck.run_detector(run / "adapter.safetensors", {"detector": entry}) == str(run / "detector.pt")
    assert ck.save_detector(run, extraction("gt", file=str(weights))) == {}
    assert ck.save_detector(run, extraction(config="yolov8n.yaml", init_seed=0)) == {}
    with pytest.raises(ck.CheckpointError, match="changed after the training cache was extracted"):
        ck.save_detector(run, extraction(file=str(weights), sha256="0" * 64))
    assert [p.name for p in run.iterdir()] == ["detector.pt"]  # no temporary file left behind
