"""python -m train.adapter --method powerclip --unfreeze (issue 42): the powerset loss reaches the backbone. Region masks
and phrase trees are computed per batch from the data and equal the cache's; the backbone changes only with
--unfreeze; --lam 0 (the control) leaves the powerset term out of the gradient; --resume and two processes reach the
weights of the uninterrupted one-process run."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from adapters.adapter_scorer import LiveExtractor
from adapters.checkpoint import read_meta
from adapters.losses.contrastive import clip_loss
from adapters.losses.nla import PowerCLIPLoss, PowerCLIPLossConfig
from adapters.registry import ADAPTERS
from extract.models.backbone import load_backbone
from fixtures.toy import world_root
from train.adapter.engine import main, parse_args
from train.adapter.live import DataArrays, LiveModel, Pairs, batch_loader, extraction_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return world_root(tmp_path_factory, "unfreeze-powerclip", 40, seed=1)  # 32 train / 4 val / 4 test images


def argv(root: Path, out: Path, *extra: str) -> list[str]:
    return ["--method", "powerclip", "--base", "toy-negclip", "--data", str(root / "world"), "--out", str(out),
            "--cache-dir", str(root / "cache"), "--workers", "0", "--batch-size", "16", "--extract-batch-size", "64",
            "--eval-batch-size", "256", "--epochs", "1", "--no-final-eval", "--warmup-negatives-steps", "2",
            *extra]


@pytest.fixture(scope="module")
def run(world) -> Path:
    out = world / "run"
    if not (out / "adapter.safetensors").is_file():
        assert main(argv(world, out, "--unfreeze", "--backbone-lr", "1e-4", "--hard-negatives", "swap-att")) == 0
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("regions", ["random", "gt"])
def test_regions_and_trees_from_the_data_are_the_caches(world, regions):
    """What the loop computes per batch (DataArrays, through the run's live extractor) equals what the feature cache
    holds for the same images and captions (the extractor's own image / caption arrays, i.e. extract.pipeline)."""
    backbone = load_backbone("toy-negclip")
    args = parse_args(argv(world, world / "x", "--unfreeze", "--regions", regions))
    extractor = LiveExtractor(backbone, extraction_args(args, world / "world"), annotations=world / "world")
    data = DataArrays(extractor.builder, ADAPTERS.get("powerclip"))
    assert data.image_keys == ["region_masks", "region_valid"] and set(data.text_keys) == {"leaf_tokens",
                                                                                           "node_leaves", "n_nodes"}
    pairs = Pairs.open(world / "world", "train")
    rows = np.asarray([int(np.nonzero(pairs.caption_image == i)[0][-1]) for i in range(6)])
    batch = next(iter(batch_loader(pairs, [rows], backbone, 0)))
    records = [pairs.records[int(pairs.caption_image[r])] for r in rows]
    live_i = data.images([r.image_id for r in records], batch["sizes"], batch["raws"])
    live_t = data.texts([pairs.texts[r] for r in rows])
    ref_i = extractor.image_arrays([pairs.source.load(r).image for r in records], [r.image_id for r in records])
    ref_t = extractor.text_arrays([pairs.texts[r] for r in rows])
    for key, value in {**live_i, **live_t}.items():
        ref = {**ref_i, **ref_t}[key]
        np.testing.assert_array_equal(value.numpy(), ref, err_msg=key)
    assert live_i["region_valid"].any(1).all() and live_t["n_nodes"].min() > 0


@pytest.mark.slow
def test_unfreeze_trains_the_backbone_with_the_powerset_loss(run):
    original = load_backbone("toy-negclip").model.state_dict()
    tuned = load_file(str(run / "backbone.safetensors"))
    changed = [k for k in original if not torch.equal(tuned[k], original[k])]
    assert len(changed) > len(original) // 2  # the image tower (its patch states) and the text tower moved
    assert any(k.startswith("visual.") for k in changed) and "token_embedding.weight" in changed
    meta = read_meta(run / "adapter.safetensors")
    assert meta["args"]["unfreeze"] and meta["args"]["backbone_lr"] == 1e-4
    import csv

    with open(run / "metrics.csv", newline="") as f:
        log = list(csv.DictReader(f))
    assert log and all(float(r["triplet"]) > 0 and float(r["hard_negatives"]) > 0 for r in log)


def test_the_cached_mode_leaves_the_backbone_untouched(world, tmp_path, monkeypatch):
    import extract.models.backbone as eb

    loaded, real = [], eb.load_backbone
    monkeypatch.setattr(eb, "load_backbone", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    assert main(argv(world, tmp_path / "cached")) == 0
    fresh = real("toy-negclip").model.state_dict()
    for k, v in loaded[0].model.state_dict().items():
        assert torch.equal(v, fresh[k]), k
    assert not (tmp_path / "cached" / "backbone.safetensors").exists()


def test_lam_0_leaves_the_powerset_term_out_of_the_gradient():
    """The control (--lam 0): the loss is CLIP's alone and no gradient reaches the regions or the nodes (a 0 x term
    would still back-propagate); with lam > 0 both get one. The triplet is still logged."""
    torch.manual_seed(0)
    b, m, k, d = 4, 3, 2, 8
    img, txt = torch.randn(b, d).requires_grad_(), torch.randn(b, d).requires_grad_()
    regions, nodes = torch.randn(b, m, d).requires_grad_(), torch.randn(b, k, d).requires_grad_()
    masks = torch.ones(b, m, dtype=torch.bool), torch.ones(b, k, dtype=torch.bool)
    for lam in (0.0, 0.1):
        for t in (img, txt, regions, nodes):
            t.grad = None
        out = PowerCLIPLoss(PowerCLIPLossConfig(lam=lam))(torch.nn.functional.normalize(img, dim=-1),
                                                         torch.nn.functional.normalize(txt, dim=-1),
                                                         torch.tensor(10.0), regions, masks[0], nodes, masks[1])
        out["loss"].backward()
        assert out["triplet"] > 0 and img.grad is not None
        if lam == 0:
            assert regions.grad is None and nodes.grad is None
            expected = clip_loss(torch.nn.functional.normalize(img, dim=-1), torch.nn.functional.normalize(txt, dim=-1),
                                 torch.tensor(10.0))
            torch.testing.assert_close(out["loss"], expected)
        else:
            assert regions.grad.abs().sum() > 0 and nodes.grad.abs().sum() > 0


def test_a_segmenters_regions_ask_for_the_decoded_pixels(world):
    backbone = load_backbone("toy-negclip")
    args = parse_args(argv(world, world / "x", "--unfreeze", "--regions", "sam2", "--segmenter", "toy"))
    extractor = LiveExtractor(backbone, extraction_args(args, world / "world"), annotations=world / "world")
    data = DataArrays(extractor.builder, ADAPTERS.get("powerclip"))
    assert data.needs_pixels
    pairs = Pairs.open(world / "world", "train")
    rows = np.asarray([0, 1])
    batch = next(iter(batch_loader(pairs, [rows], backbone, 0, keep_pixels=True)))
    assert all(r is not None and r.ndim == 3 for r in batch["raws"])
    records = [pairs.records[int(pairs.caption_image[r])] for r in rows]
    live = data.images([r.image_id for r in records], batch["sizes"], batch["raws"])
    ref = extractor.image_arrays([pairs.source.load(r).image for r in records], [r.image_id for r in records])
    np.testing.assert_array_equal(live["region_masks"].numpy(), ref["region_masks"])


@pytest.mark.slow
def test_resume_reaches_the_weights_of_the_uninterrupted_run(world, tmp_path):
    args = ["--unfreeze", "--backbone-lr", "1e-4", "--epochs", "2"]
    assert main(argv(world, tmp_path / "whole", *args)) == 0
    out = tmp_path / "resumed"
    assert main(argv(world, out, *args, "--stop-after-steps", "3")) == 0
    assert main(argv(world, out, *args, "--resume")) == 0
    a, b = _tensors(tmp_path / "whole" / "checkpoints" / "last.safetensors"), _tensors(
        out / "checkpoints" / "last.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("backbone.") for k in a)
    for k in a:
        if not k.startswith("rng."):
            assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_two_processes_fine_tune_like_one_process(world, tmp_path):
    """torchrun, 2 gloo processes x 8 pairs = one process x 16: the powerset loss gathers regions and nodes, the
    backbone's gradients are averaged, so both reach the same weights."""
    common = argv(world, tmp_path / "x", "--unfreeze", "--backbone-lr", "1e-4", "--stop-after-steps", "2",
                  "--device", "cpu")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(port), "-m", "train.adapter", *common, "--batch-size", "8",
                          "--out", str(tmp_path / "two")], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert main([*common, "--batch-size", "16", "--out", str(tmp_path / "one")]) == 0
    a = _tensors(tmp_path / "one" / "checkpoints" / "last.safetensors")
    b = _tensors(tmp_path / "two" / "checkpoints" / "last.safetensors")
    original = load_backbone("toy-negclip").model.state_dict()
    moved = 0
    for k in a:
        if k.startswith("head."):
            torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)
        elif k.startswith("backbone."):
            # The updates (~lr = 1e-4 per step) agree to 5 % of one step. Attention key biases are left out: their
            # true gradient is zero (softmax ignores a shift shared by all keys), so Adam turns summation-order noise
            # into steps of +-lr there. BatchNorm keeps its statistics (FrozenBackbone.train), else each process's
            # batch statistics would make another model.
            name = k[len("backbone."):]
            ua, ub = a[k] - original[name], b[k] - original[name]
            if name.endswith("attn.in_proj_bias"):
                d = len(ua) // 3
                ua, ub = torch.cat([ua[:d], ua[2 * d:]]), torch.cat([ub[:d], ub[2 * d:]])
            if name.endswith("k_proj.bias"):
                continue
            torch.testing.assert_close(ub, ua, atol=5e-6, rtol=0, msg=k)
            moved += int(ua.abs().max() > 1e-6)
    assert moved > len(original) // 2


def test_hard_negatives_leave_the_powerset_similarity_to_the_powerset_term():
    """NegCLIP's extra columns rank by the global (CLIP) logits: with --lam 0 and hard negatives, no gradient reaches
    the regions or the nodes (they once went through the score's beta x S, so the control trained S as well); with
    lam > 0 the powerset term reaches them."""
    from train.adapter.negatives import PREFIX, NegativeLoss

    torch.manual_seed(0)
    b, m, k, kn, d = 4, 3, 2, 2, 8
    for lam in (0.0, 0.1):
        head = ADAPTERS.get("powerclip").from_config({"lam": lam, "warmup_negatives_steps": 0}, d).train()

        def leaf(*shape):
            return torch.randn(*shape).requires_grad_()

        image = {"global": torch.nn.functional.normalize(leaf(b, d), dim=-1), "regions": leaf(b, m, d),
                 "region_mask": torch.ones(b, m, dtype=torch.bool)}
        text = {"global": torch.nn.functional.normalize(leaf(b, d), dim=-1), "nodes": leaf(b, k, d),
                "node_mask": torch.ones(b, k, dtype=torch.bool), "node_sizes": torch.ones(b, k)}
        negative = {PREFIX + "global": torch.nn.functional.normalize(leaf(b, kn, d), dim=-1),
                    PREFIX + "nodes": leaf(b, kn, k, d), PREFIX + "node_mask": torch.ones(b, kn, k, dtype=torch.bool),
                    PREFIX + "node_sizes": torch.ones(b, kn, k), "neg_valid": torch.ones(b, kn, dtype=torch.bool)}
        out = NegativeLoss(head, 1.0, ("swap-att", "replace-obj")).loss(image, {**text, **negative})
        out["loss"].backward()
        assert out["hard_negatives"] > 0
        reached = [t.grad is not None and bool(t.grad.abs().sum() > 0)
                   for t in (image["regions"], text["nodes"], negative[PREFIX + "nodes"])]
        assert reached == ([False, False, False] if lam == 0 else [True, True, False]), (lam, reached)
