"""python -m train.adapter --unfreeze on the tiny backbone and a 60-scene toy world: the backbone trains (and does not
in the default mode), Long-CLIP's first 20 positions stay fixed, the run folder alone rebuilds the fine-tuned model in
a fresh process with identical scores, --resume reaches the weights of an uninterrupted run, the live arrays are the
cache's arrays, and heads that cannot be trained through the backbone are refused by name."""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adapters.checkpoint import CheckpointError, read_meta
from adapters.registry import ADAPTERS
from fixtures import warm
from fixtures.toy import world_root
from extract.models.backbone import load_backbone
from extract.data.sources import Skip
from extract.models.long_context import stretch_positions
from train.adapter.engine import main, parse_args
from train.adapter.live import (LIVE_KEYS, LiveModel, PairCollate, PairDataset, Pairs, backbone_param_groups,
                                batch_loader, live_splits, unfreeze_support)

ROOT = Path(__file__).resolve().parents[2]
LONG = ("a small red circle to the left of a large blue square above a small green triangle next to a large gray "
        "hexagon below a small yellow star right of a large purple cross, and a small orange circle above a large "
        "white square to the left of a small red triangle next to a large blue hexagon below a small green star")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return world_root(tmp_path_factory, "unfreeze-toy", 60)  # 48 train / 6 val / 6 test images


def argv(root: Path, out: Path, *extra: str) -> list[str]:
    return ["--method", "smartclip", "--data", str(root / "world"), "--out", str(out), "--cache-dir",
            str(root / "cache"), "--workers", "0", "--batch-size", "24", "--extract-batch-size", "64",
            "--eval-batch-size", "256", "--epochs", "2", *extra]


@pytest.fixture(scope="module")
def run(world) -> Path:
    """SmartCLIP --unfreeze --context-length 248, 2 epochs, with the final table."""
    out = world / "run"
    if not (out / "summary.json").is_file():
        assert main(argv(world, out, "--unfreeze", "--context-length", "248")) == 0
    return out


def _tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------------------------- the run
@pytest.mark.slow
def test_unfreeze_trains_the_backbone_and_keeps_the_first_20_positions(run):
    original = load_backbone("tiny").model.state_dict()
    tuned = load_file(str(run / "backbone.safetensors"))
    assert set(tuned) == set(original)  # open_clip's own key names: open_clip.load_checkpoint reads the file
    changed = [k for k in original if k != "positional_embedding" and not torch.equal(tuned[k], original[k])]
    assert "visual.conv1.weight" in changed and "token_embedding.weight" in changed
    assert len(changed) > len(original) // 2
    pos = tuned["positional_embedding"]
    assert pos.shape == (248, original["positional_embedding"].shape[1])
    assert torch.equal(pos[:20], original["positional_embedding"][:20])  # frozen by the hook, no weight decay
    stretched = stretch_positions(original["positional_embedding"], 248)
    assert not torch.equal(pos[20:], stretched[20:])  # the stretched positions did train

    meta = read_meta(run / "adapter.safetensors")
    assert meta["backbone"]["file"] == "backbone.safetensors" and meta["backbone"]["context_length"] == 248
    from extract.models.weights import file_sha256

    assert meta["backbone"]["weights_sha256"] == file_sha256(run / "backbone.safetensors")
    assert meta["args"]["unfreeze"] and meta["extraction"]["live"]
    rows = _csv(run / "metrics.csv")
    assert max(float(r["lr"]) for r in rows) == pytest.approx(1e-3)  # head_lr and backbone_lr from the class
    assert max(float(r["lr_backbone"]) for r in rows) == pytest.approx(1e-6)
    state = read_meta(run / "checkpoints" / "last.safetensors")
    assert state["modules"] == ["backbone"]
    lrs = sorted({g["initial_lr"] for g in state["state"]["param_groups"]})
    assert len(lrs) == 2 and lrs[1] / lrs[0] == pytest.approx(1e3)  # head and backbone groups
    n_opt = len({k.split(".")[1] for k in _tensors(run / "checkpoints" / "last.safetensors", "optimizer.")})
    n_params = sum(1 for _ in ADAPTERS.get("smartclip").from_config({}, 64).parameters()) + len(original)
    assert n_opt == n_params - 1  # Adam state for every parameter but the unused logit_scale


@pytest.mark.slow
def test_epochs_are_evaluated_and_the_final_table_compares_the_frozen_base(run):
    history = json.loads((run / "history.json").read_text())
    assert [h["model"] for h in history] == ["base", "smartclip", "smartclip"]
    assert all("retrieval T2I R@1" in h and "toyworld all" in h for h in history)
    assert history[1] != history[2]  # re-encoded by the backbone as it trained
    results = json.loads((run / "eval" / "results.json").read_text())["results"]
    assert list(results) == ["tiny", "text only (tiny)", "tiny fine-tuned + smartclip"]  # the text-only floor too
    for name in ("tiny", "tiny fine-tuned + smartclip"):
        assert results[name]["retrieval"]["images"] == 6 and "toyworld" in results[name]["compositional"]
    assert results["tiny"] != results["tiny fine-tuned + smartclip"]


@pytest.mark.slow
def test_the_run_folder_alone_rebuilds_the_model_in_a_fresh_process(run, world, tmp_path):
    from adapters.load import load_scorer

    moved = tmp_path / "moved"
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("checkpoints", "tb", "eval"))
    images = sorted((world / "world" / "images").glob("*.png"))[:4]
    texts = ["a small red circle", "a blue square to the left of a green star", LONG]
    code = ("import json, sys\n"
            "from PIL import Image\n"
            "from adapters.load import load_scorer\n"
            "s = load_scorer(sys.argv[1])\n"
            "paths, texts = json.loads(sys.argv[2]), json.loads(sys.argv[3])\n"
            "i = s.encode_pil([Image.open(p).convert('RGB') for p in paths], paths)\n"
            "scores = s.score(i, s.encode_texts(texts)).tolist()\n"
            "print(json.dumps({'context': s.backbone.context_length, 'scores': scores}))\n")
    # a process of its own that has never held this model (forked warm: torch and open_clip imported already)
    rc, out, err = warm.run(["-c", code, str(moved / "adapter.safetensors"), json.dumps([str(p) for p in images]),
                             json.dumps(texts)], cwd=ROOT)
    assert rc == 0, err[-3000:]
    theirs = json.loads(out.strip().splitlines()[-1])
    scorer = load_scorer(str(run / "adapter.safetensors"))
    assert theirs["context"] == scorer.backbone.context_length == 248
    i = scorer.encode_pil([Image.open(p).convert("RGB") for p in images], [str(p) for p in images])
    t = scorer.encode_texts(texts)
    assert scorer.score(i, t).tolist() == theirs["scores"]  # bit for bit
    assert not scorer.backbone.tokenize([LONG]).truncated.any()  # over 77 tokens, within 248
    # the fine-tuned weights are what scores: a changed file is refused by its SHA-256
    weights = load_file(str(moved / "backbone.safetensors"))
    weights["visual.proj"] = weights["visual.proj"] + 1e-3
    save_file(weights, str(moved / "backbone.safetensors"))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_scorer(str(moved / "adapter.safetensors"))


@pytest.mark.slow
def test_run_files_follow_the_umask_and_a_damaged_backbone_is_named(run, tmp_path):
    from adapters.load import load_scorer
    from extract.common.files import current_umask
    from extract.common.tensorfile import DamagedFileError

    files = [run / "adapter.safetensors", run / "backbone.safetensors", run / "checkpoints" / "last.safetensors"]
    mode = oct(0o666 & ~current_umask())
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: mode for p in files}
    moved = tmp_path / "moved"
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("checkpoints", "tb", "eval"))
    raw = bytearray((moved / "backbone.safetensors").read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little") + 512  # in the tensor data, past the JSON header
    raw[start:start + 64] = bytes(b ^ 0xFF for b in raw[start:start + 64])
    (moved / "backbone.safetensors").write_bytes(bytes(raw))
    with pytest.raises(DamagedFileError, match=f"{moved / 'backbone.safetensors'} is damaged"):
        load_scorer(str(moved / "adapter.safetensors"))


@pytest.mark.slow
def test_resume_reaches_the_weights_of_the_uninterrupted_run(run, world, tmp_path):
    out = tmp_path / "resumed"
    args = argv(world, out, "--unfreeze", "--context-length", "248", "--no-final-eval")
    assert main([*args, "--stop-after-steps", "5"]) == 0  # mid-epoch: data order, both param groups, RNG
    stopped = read_meta(out / "checkpoints" / "last.safetensors")
    assert (stopped["epoch"], stopped["batch"], stopped["step"]) == (0, 5, 5)
    assert main([*args, "--resume"]) == 0
    a, b = _tensors(run / "checkpoints" / "last.safetensors"), _tensors(out / "checkpoints" / "last.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("backbone.") for k in a)
    for k in a:
        if not k.startswith("rng."):
            assert torch.equal(a[k], b[k]), k
    assert load_file(str(out / "backbone.safetensors")).keys() == load_file(str(run / "backbone.safetensors")).keys()
    for k, v in load_file(str(run / "backbone.safetensors")).items():
        assert torch.equal(v, load_file(str(out / "backbone.safetensors"))[k]), k
    assert len(_csv(out / "metrics.csv")) == len(_csv(run / "metrics.csv"))


def test_the_default_mode_leaves_the_backbone_untouched(world, tmp_path, monkeypatch):
    import extract.models.backbone as eb

    loaded = []
    real = eb.load_backbone

    def spy(*a, **k):
        loaded.append(real(*a, **k))
        return loaded[-1]

    monkeypatch.setattr(eb, "load_backbone", spy)
    out = tmp_path / "cached"
    assert main(argv(world, out, "--epochs", "1", "--no-final-eval")) == 0
    fresh = real("tiny").model.state_dict()
    for k, v in loaded[0].model.state_dict().items():
        assert torch.equal(v, fresh[k]), k
    assert not any(p.requires_grad for p in loaded[0].model.parameters())
    meta = read_meta(out / "adapter.safetensors")
    assert "backbone" not in meta and not (out / "backbone.safetensors").exists()
    assert meta["args"]["lr"] == 1e-3  # the class's head_lr in this mode too


# --------------------------------------------------------------------------------------------- pieces
@pytest.mark.slow
def test_hard_negatives_are_tokenized_per_batch_and_trained_through_the_backbone(world, tmp_path):
    """--unfreeze --hard-negatives: each caption's negatives (drawn once, from the training captions) are tokenized
    with its batch, so the backbone being trained encodes them (NegCLIP's fine-tuning); the term is logged."""
    from train.adapter.negatives import LiveNegatives, draw_negatives

    pairs, rows, _ = live_splits(parse_args(argv(world, world / "x", "--unfreeze")), world / "world")
    drawn = draw_negatives(pairs.texts, rows, ("replace-obj", "swap-att"), seed=0)
    bb = load_backbone("tiny")
    batch = LiveNegatives(drawn, bb.tokenizer, bb.context_length).batch(rows[:6])
    assert batch["neg:ids"].shape == (6, 2, bb.context_length) and batch["neg:attention_mask"].shape[:2] == (6, 2)
    assert batch["neg_valid"].tolist() == (drawn.rows[rows[:6]] >= 0).tolist() and batch["neg_valid"].any()
    i, k = [int(v[0]) for v in np.nonzero(batch["neg_valid"].numpy())]
    alone = bb.tokenize([drawn.texts[drawn.rows[rows[i], k]]])
    assert torch.equal(batch["neg:ids"][i, k], alone.ids[0])

    out = tmp_path / "hn"
    assert main(argv(world, out, "--unfreeze", "--hard-negatives", "all", "--epochs", "1", "--no-final-eval")) == 0
    log = _csv(out / "metrics.csv")
    assert log and all(float(r["hard_negatives"]) > 0 for r in log)
    assert json.loads((out / "config.json").read_text())["hard_negatives"].count(",") == 4


def test_live_arrays_are_the_arrays_the_cache_and_the_scorer_compute(world):
    """What the head trains on through the backbone equals what evaluation and serving feed it."""
    from adapters.adapter_scorer import LiveExtractor
    from train.adapter.live import extraction_args

    backbone = load_backbone("tiny")
    pairs = Pairs.open(world / "world", "train")
    rows = [int(np.nonzero(pairs.caption_image == i)[0][-1]) for i in range(5)]  # one caption per image
    batch = next(iter(batch_loader(pairs, [np.asarray(rows)], backbone, 0)))
    args = parse_args(argv(world, world / "x", "--unfreeze"))
    extractor = LiveExtractor(backbone, extraction_args(args, world / "world"), annotations=world / "world")
    model = LiveModel(backbone, ADAPTERS.get("smartclip").from_config({}, backbone.embed_dim)).eval()
    with torch.no_grad():
        live_i = model.image_arrays({"pixels": batch["pixels"]})
        live_t = model.text_arrays({"ids": batch["ids"], "attention_mask": batch["attention_mask"]})
    records = [pairs.records[int(pairs.caption_image[r])] for r in rows]
    ref_i = extractor.image_arrays([pairs.source.load(r).image for r in records], [r.image_id for r in records])
    ref_t = extractor.text_arrays([pairs.texts[r] for r in rows])
    assert set(live_i) | set(live_t) == {"image_embed", "text_embed", "token_embed", "token_mask"} <= LIVE_KEYS
    np.testing.assert_array_equal(live_t["token_mask"].numpy(), ref_t["token_mask"])
    for key, live, ref in (("image_embed", live_i, ref_i), ("text_embed", live_t, ref_t)):
        np.testing.assert_allclose(live[key].numpy(), ref[key].astype(np.float32), atol=2e-3, err_msg=key)  # fp16
    valid = ref_t["token_mask"]  # the padding after a caption's end is masked by every reader: whatever was computed
    np.testing.assert_allclose(live_t["token_embed"].numpy()[valid], ref_t["token_embed"][valid].astype(np.float32),
                               atol=2e-3, err_msg="token_embed")


def test_gradient_accumulation_through_the_backbone_gives_the_whole_batch_gradient(world):
    """--accum-steps with --unfreeze: gradient caching re-encodes each micro-batch through the backbone; the
    backbone's and the head's gradients equal those of the whole batch at once."""
    from accelerate import Accelerator

    from extract.models.long_context import extend_backbone_context
    from train.adapter.engine import AdapterRun, compute_gradients

    ctx = AdapterRun(Accelerator(cpu=True), 0, 1, torch.device("cpu"), None)
    pairs = Pairs.open(world / "world", "train")
    rows = np.asarray([int(np.nonzero(pairs.caption_image == i)[0][-1]) for i in range(12)])
    grads = []
    for accum in (1, 3):
        backbone = extend_backbone_context(load_backbone("tiny"), 248).unfreeze()
        torch.manual_seed(0)
        model = LiveModel(backbone, ADAPTERS.get("smartclip").from_config({"mask_init_logit": 0.0}, 64)).train()
        batch = next(iter(batch_loader(pairs, [rows], backbone, 0)))
        out = compute_gradients(model, {"pixels": batch["pixels"]},
                                {"ids": batch["ids"], "attention_mask": batch["attention_mask"]}, accum, ctx)
        assert torch.isfinite(out["loss"])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "backbone.model.visual.conv1.weight" in grads[0]
    assert grads[0]["backbone.model.positional_embedding"][:20].abs().max() == 0  # kept positions: no gradient
    for k in grads[0]:
        # float32 summation order differs between the two: tolerance relative to the tensor's scale (|g| ~ 1e3 here,
        # from logit scale 100 x lambda_align 10)
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-5 * float(grads[0][k].abs().max()), rtol=0, msg=k)


def test_an_undecodable_image_drops_its_pair_and_is_reported(world, tmp_path):
    src = sorted((world / "world" / "images").glob("*.png"))[:3]
    for k, path in enumerate(src):
        shutil.copy(path, tmp_path / f"{k}.png")
    (tmp_path / "1.png").write_bytes(b"not a png")
    table = tmp_path / "pairs.csv"
    table.write_text("filepath,title\n0.png,a red circle\n1.png,a blue square\n2.png,a green star\n")
    backbone = load_backbone("tiny")
    pairs = Pairs.open(table)
    data = PairDataset(pairs, backbone.preprocess)
    assert isinstance(data[1], Skip) and data[1].id == pairs.records[1].image_id
    batch = PairCollate(backbone.tokenizer, backbone.context_length)([data[k] for k in range(3)])
    assert batch["rows"].tolist() == [0, 2] and batch["pixels"].shape == (2, 3, 64, 64)
    assert len(batch["skips"]) == 1
    tok = backbone.tokenize(["a red circle", "a green star"])
    assert torch.equal(batch["ids"], tok.ids)
    assert batch["attention_mask"].shape[1] == int(tok.attention_mask.sum(1).max())


def test_held_out_split_of_a_csv_keeps_all_captions_of_held_out_images(world):
    table = world / "world" / "train.csv"
    args = argparse.Namespace(data=str(table), val_data=None, val_fraction=0.25, seed=0, image_root=None,
                              extract_options={})
    train, rows, val = live_splits(args, None)
    held = {r.image_id for r in val.records}
    assert len(held) == round(0.25 * train.num_images)
    trained = {train.records[int(train.caption_image[r])].image_id for r in rows}
    assert not held & trained and len(held) + len(trained) == train.num_images
    assert sum(len(r.captions) for r in val.records) == len(val.texts)
    assert len(rows) + len(val.texts) == len(train.texts)


def test_backbone_groups_keep_decay_off_gains_biases_scales_and_positions():
    model = load_backbone("tiny").unfreeze().model
    decay, no_decay = backbone_param_groups(model, 0.1, 1e-6)
    names = {id(p): n for n, p in model.named_parameters()}
    off = {names[id(p)] for p in no_decay["params"]}
    on = {names[id(p)] for p in decay["params"]}
    assert {"positional_embedding", "visual.positional_embedding", "logit_scale", "visual.class_embedding",
            "ln_final.weight", "ln_final.bias"} <= off
    assert {"visual.conv1.weight", "token_embedding.weight", "text_projection"} <= on
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0 and decay["lr"] == no_decay["lr"] == 1e-6
    assert len(on) + len(off) == sum(1 for _ in model.parameters())


def test_heads_that_cannot_train_through_the_backbone_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--method", "comalign", "--data", "x", "--out", "y", "--unfreeze"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    supported = [n for n in ADAPTERS.names() if unfreeze_support(ADAPTERS.get(n)) is None]
    assert supported == ["powerclip", "smartclip"]
    assert "'comalign'" in err and "supports_unfreeze" in err and "support --unfreeze: powerclip, smartclip" in err
    for bad, message in ((["--context-length", "248"], "only applies with --unfreeze"),
                         (["--unfreeze", "--cache", "c"], "--cache"),
                         (["--unfreeze", "--extract-precision", "fp16"], "fp32")):
        with pytest.raises(SystemExit):
            parse_args(["--method", "smartclip", "--data", "x", "--out", "y", *bad])
        assert message in capsys.readouterr().err


def test_learning_rates_and_batch_default_to_the_head_class(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["--data", "x", "--out", "y"]
    cls = ADAPTERS.get("smartclip")
    a = parse_args(["--method", "smartclip", *base, "--unfreeze"])
    assert (a.lr, a.backbone_lr, a.batch_size) == (cls.head_lr, cls.backbone_lr, cls.unfreeze_batch_size)
    a = parse_args(["--method", "smartclip", *base, "--unfreeze", "--lr", "0.01", "--backbone-lr", "1e-5"])
    assert (a.lr, a.backbone_lr) == (0.01, 1e-5)
    monkeypatch.setenv("WORLD_SIZE", "8")  # torchrun: the class's batch is the global one
    assert parse_args(["--method", "smartclip", *base, "--unfreeze"]).batch_size == cls.unfreeze_batch_size // 8
    a = parse_args(["--method", "comalign", *base])
    assert (a.lr, a.batch_size, a.unfreeze) == (5e-4, 256, False)  # no head_lr: the loop's default


# --------------------------------------------------------------------------------------------- several processes
@pytest.mark.slow
def test_two_processes_fine_tune_like_one_process_on_the_global_batch(world, tmp_path):
    """torchrun, 2 CPU processes (gloo) x 16 pairs = one process x 32: the head gathers the global batch, the
    backbone's gradients are averaged over ranks, so both reach the same backbone and head weights."""
    import socket

    common = argv(world, tmp_path / "x", "--unfreeze", "--stop-after-steps", "3", "--device", "cpu")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(port), "-m", "train.adapter", *common, "--batch-size", "16",
                          "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert main([*common, "--batch-size", "32", "--out", str(tmp_path / "one")]) == 0
    a = _tensors(tmp_path / "one" / "checkpoints" / "last.safetensors")
    b = _tensors(tmp_path / "two" / "checkpoints" / "last.safetensors")
    for k in a:
        if k.startswith("head."):
            torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-4, msg=k)
    # Backbone updates are ~lr = 1e-6 per step, so compare the updates themselves, to 2 % of one step (fp32 rounding
    # of weight + update is ~1e-9). Attention key biases are left out: their true gradient is zero (softmax ignores
    # a shift shared by all keys), so Adam turns summation-order noise into steps of +-lr there.
    original = load_backbone("tiny").model.state_dict()
    moved = 0
    for k, w in original.items():
        ua, ub = a["backbone." + k] - w, b["backbone." + k] - w
        if k.endswith("attn.in_proj_bias"):
            d = len(w) // 3
            ua, ub = torch.cat([ua[:d], ua[2 * d:]]), torch.cat([ub[:d], ub[2 * d:]])
        torch.testing.assert_close(ub, ua, atol=2e-8, rtol=0, msg=k)
        moved += int(ua.abs().max() > 1e-7)
    assert moved > len(original) // 2
    la = [float(r["loss"]) for r in _csv(tmp_path / "one" / "metrics.csv")]
    lb = [float(r["loss"]) for r in _csv(tmp_path / "two" / "metrics.csv")]
    assert lb == pytest.approx(la, rel=1e-5)


def test_bucketed_gradient_all_reduce_reassembles_every_parameter(monkeypatch):
    """Gradients are averaged in buckets (an unfrozen ViT-L would not fit twice); with small buckets every
    parameter still gets its own averaged gradient back, in shape (one gloo rank: the average is the gradient)."""
    import socket

    import torch.distributed as dist

    import train.adapter.step as ta

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(ta, "_BUCKET_ELEMENTS", 100)
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((7, 9), (3,), (250,), (10, 10), (1,), (40,))]
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        params.append(torch.nn.Parameter(torch.zeros(4)))  # no gradient: left alone
        ta._all_reduce_grads(params, 1)
        for p, gr in zip(params, grads):
            assert torch.equal(p.grad, gr)
        assert params[-1].grad is None
    finally:
        dist.destroy_process_group()
