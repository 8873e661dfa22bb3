"""Weights resolution: local first, download only when reachable, otherwise fail fast and say what to do."""

import open_clip
import pytest
import torch
from safetensors.torch import save_file

import extract.models.weights as weights
from extract.models.backbone import load_backbone, main, register_configs
from extract.models.weights_file import ArchitectureMismatchError, PickledObjectsError
from extract.models.weights import WeightsNotFoundError, resolve_weights


@pytest.mark.parametrize("base", ["ViT-B-32", "ViT-B-16", "ViT-L-14", "coca_ViT-B-32"])
def test_absent_tag_fails_fast_naming_file_and_remedy(base, monkeypatch):
    """Fast because it never reaches for the network: no connection is even attempted."""
    import socket

    tried = []

    def connect(self, address):
        tried.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", connect)
    with pytest.raises(WeightsNotFoundError) as e:
        load_backbone(base)
    assert tried == []
    msg = str(e.value)
    assert "--pretrained /path/to/" in msg and "huggingface-cli download" in msg and "open_clip_model.safetensors" in msg


def test_negclip_needs_its_file():
    with pytest.raises(WeightsNotFoundError, match="negclip.pth"):
        load_backbone("NegCLIP")


def test_missing_path_and_unknown_tag():
    with pytest.raises(WeightsNotFoundError, match="does not exist"):
        resolve_weights("ViT-B-32", "/nowhere/model.safetensors")
    with pytest.raises(WeightsNotFoundError, match="laion2b_s34b_b79k"):  # lists the real tags
        resolve_weights("ViT-B-32", "no-such-tag")


def test_unreachable_hub_is_probed_once_and_reported(monkeypatch):
    calls = []
    monkeypatch.setattr(weights, "probe_host", lambda host, *a, **k: calls.append(host) or "gaierror: no DNS")
    monkeypatch.setattr(open_clip, "download_pretrained", lambda *a, **k: pytest.fail("must not download"))
    with pytest.raises(WeightsNotFoundError, match="gaierror: no DNS"):
        resolve_weights("ViT-B-32", "openai", offline=False)
    assert calls == ["huggingface.co"]


def test_reachable_hub_downloads(monkeypatch, tmp_path):
    f = tmp_path / "open_clip_model.safetensors"
    f.write_bytes(b"x")
    monkeypatch.setattr(weights, "probe_host", lambda *a, **k: None)
    monkeypatch.setattr(open_clip, "download_pretrained", lambda cfg, cache_dir=None: str(f))
    r = resolve_weights("ViT-B-32", "openai", offline=False)
    assert r.kind == "tag" and r.path == f and r.tag_cfg["quick_gelu"]


def test_hub_cache_hit_needs_no_network(monkeypatch, tmp_path):
    snap = tmp_path / "models--timm--vit_base_patch32_clip_224.openai" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "open_clip_model.safetensors").write_bytes(b"x")
    (tmp_path / "models--timm--vit_base_patch32_clip_224.openai" / "refs").mkdir()
    (tmp_path / "models--timm--vit_base_patch32_clip_224.openai" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(weights, "probe_host", lambda *a, **k: pytest.fail("must not probe"))
    r = resolve_weights("ViT-B-32", "openai", cache_dir=str(tmp_path), offline=False)
    assert r.kind == "tag" and r.path.name == "open_clip_model.safetensors"


def _tiny_reference():
    register_configs()
    return open_clip.create_model("plugvlm-tiny").eval()


@pytest.mark.parametrize("fmt", ["safetensors", "training-pt", "torchscript"])
def test_local_checkpoint_formats_load_exactly(fmt, tmp_path):
    ref = _tiny_reference()
    if fmt == "safetensors":
        path = tmp_path / "tiny.safetensors"
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    elif fmt == "training-pt":  # open_clip / NegCLIP training checkpoints: DDP 'module.' keys under 'state_dict'
        path = tmp_path / "epoch_5.pt"
        torch.save({"epoch": 5, "state_dict": {"module." + k: v for k, v in ref.state_dict().items()}}, path)
    else:  # OpenAI's original .pt files are TorchScript archives
        path = tmp_path / "tiny.pt"
        torch.jit.script(ref).save(str(path))
    bb = load_backbone("tiny", str(path))
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(bb.encode_images(x).embedding, ref.encode_image(x, normalize=True))
    assert bb.describe(hash_weights=True)["weights_sha256"] == weights.file_sha256(path)


class Evil:  # any non-tensor class: unpickling it would run arbitrary code in a crafted file
    pass


def test_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {}, "payload": Evil()}, path)
    with pytest.raises(PickledObjectsError, match="Unsupported global: GLOBAL test_weights.Evil"):
        load_backbone("tiny", str(path))


def test_a_foreign_pickle_is_explained_with_a_conversion_that_works(tmp_path, capsys):
    import argparse

    ref = _tiny_reference()
    path = tmp_path / "run 1" / "epoch_32.pt"  # a training checkpoint with its arguments pickled alongside
    path.parent.mkdir()
    torch.save({"epoch": 32, "args": argparse.Namespace(lr=1e-3),
                "state_dict": {"module." + k: v for k, v in ref.state_dict().items()}}, path)
    assert main(["--base", "tiny", "--pretrained", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} is a PyTorch file (torch.save) that holds Python objects besides tensors "
                          "(torch's tensors-only loader refused it: Unsupported global: GLOBAL argparse.Namespace")
    assert "will not unpickle it: unpickling can run arbitrary code" in err and "Traceback" not in err
    snippet = err.split("pasted as they are):\n")[1].split("\nthen pass --pretrained ")[0]
    assert len(snippet.splitlines()) == 3
    exec(snippet, {})  # what the user runs where they trust the file
    converted = path.with_suffix(".safetensors")
    assert err.rstrip().endswith(f"then pass --pretrained {converted}")
    bb = load_backbone("tiny", str(converted))
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(bb.encode_images(x).embedding, ref.encode_image(x, normalize=True))


def test_wrong_architecture_is_named(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"visual.proj": torch.zeros(3, 3)}, path)
    with pytest.raises(ArchitectureMismatchError, match=r"other.safetensors does not fit architecture plugvlm-tiny: "
                       r"\d+ of the model's tensors missing \(.*\); 1 of another shape \(visual.proj \(3, 3\) in the "
                       r"file, \(64, 64\) in the model\)"):
        load_backbone("tiny", str(path))


def test_probe_host_on_loopback():
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    assert weights.probe_host("127.0.0.1", port, timeout=2) is None
    server.close()
    reason = weights.probe_host("127.0.0.1", port, timeout=2)  # nothing listens now: refused at once, not timed out
    assert reason is not None and "Refused" in reason and "timed out" not in reason


def test_a_model_built_for_a_weights_file_draws_no_random_weights_and_other_threads_still_do(monkeypatch):
    """load_backbone builds the model for a file without torch.nn.init's draws (the file replaces every parameter,
    strictly): the loaded model is the file, bit for bit; inside the block this thread's initialisers draw nothing,
    another thread's draw as ever, and afterwards they are torch's own again."""
    import threading

    from safetensors.torch import load_file

    from extract.models.backbone import backbone_aliases
    from extract.models.weights_file import weights_come_later

    original = torch.nn.init.normal_
    drawn = {}
    with weights_come_later():
        here = torch.nn.init.normal_(torch.zeros(8))

        def other():
            torch.manual_seed(0)
            drawn["other"] = torch.nn.init.normal_(torch.zeros(8))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    torch.manual_seed(0)
    assert torch.equal(here, torch.zeros(8)) and torch.equal(drawn["other"], torch.nn.init.normal_(torch.zeros(8)))
    assert torch.nn.init.normal_ is original
    import extract.models.backbone as backbone_module

    entered = []

    def recording():
        entered.append(1)
        return weights_come_later()

    monkeypatch.setattr(backbone_module, "weights_come_later", recording)
    tiny = [load_backbone("tiny").model.state_dict() for _ in range(2)]  # random weights: drawn, from a fixed seed
    assert not entered and all(torch.equal(tiny[0][k], tiny[1][k]) for k in tiny[0])
    assert tiny[0]["token_embedding.weight"].std() > 0.001
    backbone = load_backbone("toy-negclip")
    assert entered == [1]
    path = backbone.weights.path
    assert path is not None and str(path).endswith(".safetensors") and "toy-negclip" in backbone_aliases()
    file = load_file(str(path))
    state = backbone.model.state_dict()
    assert {k for k in state if "attn_mask" not in k} == set(file)
    assert all(torch.equal(state[k], file[k]) for k in file)
