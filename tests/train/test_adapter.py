"""python -m train.adapter end to end on the tiny backbone and a 120-scene toy world: every registered method,
the final table, reload in a fresh process, exact resume, NaN handling, bad caches, failing fast without weights,
gradient accumulation against the whole batch; the promised command with no --data / --out (the embedded toy world,
made small here, and a claimed default run folder); the Python entry train(AdapterOptions(...)) with the CLI's checks.

The toy world, its caches and one trained ComAlign run are made once per session (under pytest's base temp
folder) and shared with tests/train/test_adapter_heldout.py and tests/adapters/test_adapter_scorer.py.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from adapters.checkpoint import load_adapter, read_meta
from extract.common import cli
from adapters.registry import ADAPTERS
from extract.cache import FeatureCache
from train.adapter.engine import AdapterOptions, AdapterRun, compute_gradients, main, parse_args, resolve, train

from fixtures import warm
from fixtures.toy import adapter_argv, toy_root, trained_comalign
from train.bad_steps import DIVERGED

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------- shared setup
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return toy_root(tmp_path_factory)


@pytest.fixture(scope="module")
def run(root):
    return trained_comalign(root)


def _head_state(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith("head.")}


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------------------------- the run
@pytest.mark.slow
def test_run_writes_checkpoint_logs_and_the_final_table(run):
    summary = json.loads((run / "summary.json").read_text())
    rows = _csv(run / "metrics.csv")
    assert len(rows) == summary["steps"] > 0 and all(r["skipped"] == "0" for r in rows)
    lrs = [float(r["lr"]) for r in rows]
    assert max(lrs) == pytest.approx(5e-4) and lrs[-1] < 0.05 * max(lrs)  # (warm-up and) cosine to ~0
    assert {"loss", "entity", "relation", "global"} <= set(rows[0])
    history = json.loads((run / "history.json").read_text())
    assert [h["model"] for h in history] == ["base", "comalign", "comalign"]
    assert "toyworld all" in history[1] and "retrieval T2I R@1" in history[1]
    assert list((run / "tb").glob("events.out.tfevents.*"))
    meta = read_meta(run / "adapter.safetensors")
    assert meta["method"] == "comalign" and meta["base"]["base"] == "tiny" and meta["base"]["weights_sha256"]
    assert meta["extraction"]["fingerprint"] == FeatureCache.open(meta["extraction"]["path"]).fingerprint
    assert set(meta["extraction"]["args"]["components"]) == {"entities", "relations"}
    assert meta["inference"]["t2i_objective_after"] >= meta["inference"]["t2i_objective_before"]
    assert meta["args"]["epochs"] == 2 and meta["step"] == summary["steps"]
    results = json.loads((run / "eval" / "results.json").read_text())["results"]
    assert list(results) == ["tiny", "text only (tiny)", "tiny + comalign"]  # the toy world's text-only floor too
    for name, res in results.items():
        if name.startswith("text only"):
            continue
        assert res["retrieval"]["images"] == 12 and "toyworld" in res["compositional"]
        assert {"replace-att", "swap-att", "all"} <= set(res["compositional"]["toyworld"]["per_type"])
    md = (run / "eval" / "results.md").read_text()
    assert "| metric | tiny | text only (tiny) | tiny + comalign |" in md and "toyworld swap-att" in md


@pytest.mark.slow
def test_checkpoint_reloads_in_a_fresh_process_with_identical_scores(run, root):
    from adapters.load import load_scorer

    images = sorted((root / "world" / "images").glob("*.png"))[:4]
    texts = ["a small red circle", "a blue square to the left of a green star", "a large gray hexagon"]
    code = (
        "import json, sys, torch\n"
        "from PIL import Image\n"
        "from adapters.load import load_scorer\n"
        "s = load_scorer(sys.argv[1], annotations=sys.argv[2])\n"
        "paths = json.loads(sys.argv[3]); texts = json.loads(sys.argv[4])\n"
        "i = s.encode_pil([Image.open(p).convert('RGB') for p in paths], paths)\n"
        "t = s.encode_texts(texts)\n"
        "print(json.dumps({d: s.score_directed(i, t, d).tolist() for d in ('t2i', 'i2t')}))\n")
    # a process of its own that has never held this model: it reads only the files (forked warm: torch and open_clip
    # imported already, nothing of this test's state)
    rc, out, err = warm.run(["-c", code, str(run), str(root / "world"), json.dumps([str(p) for p in images]),
                             json.dumps(texts)], cwd=ROOT)
    assert rc == 0, err
    theirs = json.loads(out.strip().splitlines()[-1])
    from PIL import Image

    scorer = load_scorer(str(run / "adapter.safetensors"), annotations=root / "world")
    i = scorer.encode_pil([Image.open(p).convert("RGB") for p in images], [str(p) for p in images])
    t = scorer.encode_texts(texts)
    for d in ("t2i", "i2t"):
        assert scorer.score_directed(i, t, d).tolist() == theirs[d]  # bit for bit


@pytest.mark.slow
def test_resume_continues_to_the_same_weights(run, root, tmp_path):
    out = tmp_path / "resumed"
    argv = adapter_argv(root, "comalign", out, "--epochs", "2", "--no-final-eval")
    assert main([*argv, "--stop-after-steps", "5"]) == 0  # mid-epoch: data order and RNG must be restored
    stopped = read_meta(out / "checkpoints" / "last.safetensors")
    assert (stopped["epoch"], stopped["batch"], stopped["step"]) == (0, 5, 5)
    assert not (out / "adapter.safetensors").exists()
    assert main([*argv, "--resume"]) == 0
    a, b = _head_state(run / "checkpoints" / "last.safetensors"), _head_state(out / "checkpoints" / "last.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for k, v in _head_state(run / "adapter.safetensors").items():  # fitted fusion weights too
        assert torch.equal(v, _head_state(out / "adapter.safetensors")[k]), k
    assert len(_csv(out / "metrics.csv")) == len(_csv(run / "metrics.csv"))


@pytest.mark.slow
def test_resume_refuses_other_settings(root, run, tmp_path, capsys):
    out = tmp_path / "copy"
    shutil.copytree(run / "checkpoints", out / "checkpoints")
    code = main([*adapter_argv(root, "comalign", out, "--epochs", "2", "--lr", "1e-3"), "--resume"])
    assert code == 2
    assert "lr: 0.0005 -> 0.001" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("method", ADAPTERS.names())
def test_every_registered_method_trains_and_reloads(method, root, tmp_path):
    from PIL import Image

    from adapters.load import load_scorer
    from train.adapter.heldout import encode_rows

    out = tmp_path / method
    summary = train(AdapterOptions(method=method, data=str(root / "world"), out=str(out), cache_dir=str(root / "cache"),
                                   workers=0, extract_batch_size=64, batch_size=48, eval_batch_size=256, epochs=1,
                                   final_eval=False))  # the Python entry: the same job as the command line
    assert summary["adapter"] == str(out / "adapter.safetensors") and "markdown" not in summary
    head, meta = load_adapter(out / "adapter.safetensors")
    assert meta["method"] == method and type(head) is ADAPTERS.get(method)
    assert all(torch.isfinite(p).all() for p in head.parameters())
    # the live pipeline (checkpoint alone) scores a test image like the head on the cached arrays of that image
    cache = FeatureCache.open(meta["extraction"]["path"])
    ids = cache.image_ids()[:2]
    files = [root / "world" / "images" / f"{int(i):06d}.png" for i in ids]
    scorer = load_scorer(str(out), annotations=root / "world")
    live_i = scorer.encode_pil([Image.open(f).convert("RGB") for f in files], [str(f) for f in files])
    cached_i = encode_rows(head, cache, np.arange(2), True, "cpu")
    texts = [json.loads((root / "world" / "annotations.json").read_text())["scenes"][0]["captions"][0]["text"]]
    live_t = scorer.encode_texts(texts)
    s_live, s_cached = scorer.score(live_i, live_t), head.score(cached_i, live_t)
    torch.testing.assert_close(s_live, s_cached, atol=2e-3, rtol=0)  # fp32 batch-size rounding before fp16 storage


# --------------------------------------------------------------------------------------------- bad input
def _nan_cache(cache_path: Path, dst: Path, images: int | None) -> Path:
    """A copy of a cache with NaN image embeddings for its first ``images`` images (None: all)."""
    shutil.copytree(cache_path, dst)
    for f in dst.glob("shard-*/image_embed.npy"):
        a = np.load(f)
        a[:images] = np.nan
        np.save(f, a)
    return dst


@pytest.mark.slow
def test_nan_steps_are_skipped_logged_and_abort_keeping_the_last_good_checkpoint(run, root, tmp_path, capsys):
    cache_path = Path(read_meta(run / "adapter.safetensors")["extraction"]["path"])
    some = _nan_cache(cache_path, tmp_path / "some-nan", 1)  # in about half the batches
    out = tmp_path / "some"
    assert main(adapter_argv(root, "comalign", out, "--epochs", "1", "--no-final-eval", "--cache", str(some),
                             "--max-bad-steps", "50")) == 0
    rows = _csv(out / "metrics.csv")
    skipped = [r for r in rows if r["skipped"] == "1"]
    assert skipped and len(skipped) < len(rows) and skipped[0]["reason"] == "non-finite loss"
    head, _ = load_adapter(out / "adapter.safetensors")
    assert all(torch.isfinite(p).all() for p in head.parameters())
    assert "skipped (non-finite loss)" in capsys.readouterr().out

    # all NaN: abort after --max-bad-steps in a row; the good training state stays as it was
    good = tmp_path / "good"
    assert main(adapter_argv(root, "comalign", good, "--epochs", "1", "--no-final-eval", "--stop-after-steps", "2")) == 0
    state = good / "checkpoints" / "last.safetensors"
    before = state.read_bytes()
    everything = _nan_cache(cache_path, tmp_path / "all-nan", None)
    code = main([*adapter_argv(root, "comalign", good, "--epochs", "1", "--no-final-eval", "--cache", str(everything),
                                "--max-bad-steps", "3", "--save-every", "1"), "--resume"])
    assert code == DIVERGED
    err = capsys.readouterr().err
    assert "3 non-finite steps in a row" in err and f"the last good checkpoint is kept: {state}" in err
    assert "Continue with --resume after" in err
    assert state.read_bytes() == before


@pytest.mark.slow
def test_divergence_before_any_good_state_does_not_claim_one(run, root, tmp_path, capsys):
    """The warning once named last.safetensors as "the last good state" when none existed."""
    cache_path = Path(read_meta(run / "adapter.safetensors")["extraction"]["path"])
    everything = _nan_cache(cache_path, tmp_path / "all-nan", None)
    out = tmp_path / "fresh"
    code = main(adapter_argv(root, "comalign", out, "--epochs", "1", "--no-final-eval", "--cache", str(everything),
                             "--max-bad-steps", "3", "--save-every", "1"))
    assert code == DIVERGED
    captured = capsys.readouterr()
    assert "no good state has been saved yet" in captured.out and "keeps the last good state" not in captured.out
    assert "no good checkpoint was saved yet" in captured.err
    assert "--resume" not in captured.err and "Start again after" in captured.err  # nothing to resume from
    assert not (out / "checkpoints" / "last.safetensors").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--epochs", "-1", "argument --epochs: expected an integer >= 1, got -1"),
    ("--epochs", "0", "argument --epochs: expected an integer >= 1, got 0"),
    ("--lr", "0", "argument --lr: expected a number > 0, got 0"),
    ("--val-fraction", "1.5", "argument --val-fraction: expected a number in [0, 1), got 1.5"),
    ("--val-fraction", "0", "--val-fraction must be in (0, 1) without --val-data, got 0"),
])
def test_settings_that_would_train_nothing_are_refused(root, tmp_path, capsys, flag, value, message):
    """--epochs -1 once exited 0 with an untrained model and a result table."""
    with pytest.raises(SystemExit) as e:
        parse_args(adapter_argv(root, "comalign", tmp_path / "run", flag, value))
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_batch_larger_than_the_training_set_fails_before_extraction(root, tmp_path, capsys):
    """The default batch of 256 on a small data set failed only after the whole extraction."""
    argv = ["--method", "comalign", "--data", str(root / "world"), "--out", str(tmp_path / "run"),
            "--cache-dir", str(tmp_path / "cache"), "--workers", "0", "--batch-size", "256"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the global batch (256) exceeds the 96 training images" in err and "before extraction" in err
    assert not (tmp_path / "cache").exists()  # nothing was extracted


def test_a_cache_of_another_backbone_or_without_the_components_is_refused(root, tmp_path, capsys):
    from extract.pipeline import build_cache

    other = build_cache(root / "world", tmp_path / "coca", base="tiny-coca", split="val", components=["entities"],
                        workers=0)
    code = main(adapter_argv(root, "comalign", tmp_path / "x", "--cache", str(other.path)))
    err = capsys.readouterr().err
    assert code == 2 and "tiny-coca" in err and "plugvlm-tiny-coca" in err and "plugvlm-tiny," in err
    bare = build_cache(root / "world", tmp_path / "bare", base="tiny", split="val", components=["tree"], workers=0)
    code = main(adapter_argv(root, "comalign", tmp_path / "y", "--cache", str(bare.path)))
    err = capsys.readouterr().err
    assert code == 2 and "needs ['entities', 'relations']" in err and "ventity_embed" in err


def test_unknown_method_lists_the_registered_ones(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--method", "nope", "--data", "x", "--out", "y"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and all(repr(n) in err for n in ADAPTERS.names())


def test_head_config_flags_come_from_the_registry(tmp_path):
    args = parse_args(["--method", "comalign", "--data", "x", "--out", "y", "--layers", "1", "--train", "image",
                       "--no-residual"])
    assert args.head_config == {"layers": 1, "train": "image", "residual": False}
    cfg = tmp_path / "c.yaml"
    cfg.write_text("method: comalign\nlayers: 3\nlr: 0.01\n")
    args = parse_args(["--config", str(cfg), "--data", "x", "--out", "y"])
    assert args.method == "comalign" and args.head_config == {"layers": 3} and args.lr == 0.01


def test_without_weights_it_fails_in_seconds_naming_them_before_building_anything(root, tmp_path, capsys, monkeypatch):
    """The README's command as typed: no --data, no --out. The weights check comes before the default toy world is
    generated, before any cache and before the run folder."""
    monkeypatch.chdir(tmp_path)
    code = main(["--base", "ViT-B-32", "--method", "comalign"])
    assert code == 2 and list(tmp_path.iterdir()) == []  # no toy world, no cache, no run folder
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err  # load_backbone's message, naming the fix
    assert "ViT-B-32" in err and "--pretrained" in err
    assert not (tmp_path / "runs").exists()  # no toy world, no cache, no run folder
    code = main(["--base", "ViT-B-32", "--method", "comalign", "--data", str(root / "world"), "--out",
                 str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")])
    assert code == 2 and not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_promised_command_trains_on_the_embedded_toy_world(tmp_path, monkeypatch, capsys):
    """`python -m train.adapter --method comalign` with no --data and no --out: the default toy world (made small
    here) is generated at runs/toy, the run lands in runs/tiny-comalign, the output reads well in a log (short lines,
    no repeated warning, the table once); that folder is not overwritten by a run with other settings."""
    from extract.worlds import toyworld

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(toyworld, "DEFAULT_N", 60)
    monkeypatch.setattr(cli, "_verbosity", cli.verbosity())  # -q below: restored afterwards  # 48 train / 6 val / 6 test images
    small = ["--epochs", "1", "--batch-size", "16", "--workers", "0", "--extract-batch-size", "64"]
    assert main(["--method", "comalign", *small]) == 0
    captured = capsys.readouterr()
    out = tmp_path / "runs" / "tiny-comalign"
    assert json.loads((tmp_path / "runs" / "toy" / "meta.json").read_text())["n"] == 60
    config = json.loads((out / "config.json").read_text())
    assert (config["data"], config["out"]) == (str(Path("runs") / "toy"), str(Path("runs") / "tiny-comalign"))
    assert (out / "adapter.safetensors").is_file() and (out / "eval" / "results.md").is_file()
    assert (tmp_path / "runs" / "cache").is_dir()  # the default --cache-dir, under the working directory
    first = captured.out.splitlines()[:3]
    assert first[0] == "no --data: training on the embedded toy world for 1 epoch" and first[1].startswith("toy world")
    lines = (captured.out + captured.err).splitlines()
    assert max(map(len, lines)) <= 300
    warnings = [line for line in lines if "warning" in line.lower()]
    assert len(warnings) == len(set(warnings)), warnings
    assert captured.out.count("| metric | tiny | text only (tiny) | tiny + comalign |") == 1  # the final table, once

    # without --epochs, on the toy world as on data the user names: until the held-out score stops improving
    # (train/adapter/stopping.py; tests/train/test_adapter_stopping.py)
    assert resolve(AdapterOptions(method="comalign")).epochs is None
    assert resolve(AdapterOptions(method="comalign", data="pairs.csv")).epochs is None

    # another run's settings into the same default folder: refused before any work, nothing touched
    before = (out / "adapter.safetensors").stat().st_mtime_ns
    assert main(["-q", "--method", "comalign", *small, "--lr", "1e-3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # --quiet: the toy world's and the run folder's status lines are silenced too
    assert f"{Path('runs') / 'tiny-comalign'} holds another run (lr: 0.0005 there, 0.001 now)" in captured.err
    assert (out / "adapter.safetensors").stat().st_mtime_ns == before


def test_the_python_entry_refuses_what_the_command_line_refuses(tmp_path):
    """train(AdapterOptions(...)) gets the flags' own checks before anything loads (--epochs 0
    once trained nothing and wrote a table); head and extraction options are checked like their generated flags."""
    base = dict(method="comalign", data=str(tmp_path / "nowhere"), out=str(tmp_path / "run"))
    for bad, message in (({"epochs": 0}, "epochs: expected an integer >= 1, got 0"),
                         ({"lr": -1.0}, "lr: expected a number > 0"),
                         ({"schedule": "linear"}, "schedule: invalid choice: 'linear'"),
                         ({"method": "nope"}, "--method 'nope': no such method; choose from comalign"),
                         ({"method": None}, "--method is required"),
                         ({"val_fraction": 0.0}, "--val-fraction must be in (0, 1)"),
                         ({"head_config": {"layerz": 1}}, "head_config: unknown key(s) layerz; accepted: dropout"),
                         ({"head_config": {"layers": "two"}}, "head_config['layers']: invalid int value: 'two'"),
                         ({"head_config": {"residual": "no"}}, "head_config['residual']: --no-residual is a switch"),
                         ({"extract_options": {"regions": "boxes"}}, "extract_options['regions']: invalid choice"),
                         ({"extract_options": {"split": "val"}}, "extract_options: unknown key(s) split"),
                         ({"unfreeze": True}, "methods that support --unfreeze: powerclip, smartclip")):
        with pytest.raises(ValueError) as e:
            train(AdapterOptions(**{**base, **bad}))
        assert message in str(e.value), (bad, str(e.value))
    assert not (tmp_path / "run").exists()
    opts = resolve(AdapterOptions(**base, head_config={"layers": 1}, components="tree", resume=True))
    assert (opts.lr, opts.batch_size, opts.resume, opts.head_config) == (5e-4, 256, "auto", {"layers": 1})
    assert opts.components == ["entities", "relations", "tree"] and resolve(opts) == opts  # idempotent
    cli_opts = parse_args(["--method", "comalign", "--data", base["data"], "--out", base["out"], "--layers", "1",
                           "--components", "tree", "--resume"])
    assert cli_opts == opts  # the command line parses into exactly what resolve makes of the Python call


# --------------------------------------------------------------------------------------------- accumulation
def test_gradient_accumulation_gives_the_whole_batch_gradient():
    from accelerate import Accelerator

    ctx = AdapterRun(Accelerator(cpu=True), 0, 1, torch.device("cpu"), None)
    g = torch.Generator().manual_seed(0)
    n, d = 12, 32
    img = {"image_embed": torch.randn(n, d, generator=g), "ventity_embed": torch.randn(n, 3, d, generator=g),
           "ventity_valid": torch.rand(n, 3, generator=g) > 0.3, "vrelation_embed": torch.randn(n, 2, d, generator=g),
           "vrelation_valid": torch.rand(n, 2, generator=g) > 0.3}
    txt = {"text_embed": torch.randn(n, d, generator=g), "entity_embed": torch.randn(n, 3, d, generator=g),
           "entity_valid": torch.rand(n, 3, generator=g) > 0.3, "relation_embed": torch.randn(n, 2, d, generator=g),
           "relation_valid": torch.rand(n, 2, generator=g) > 0.3}
    grads = []
    for accum in (1, 3):
        torch.manual_seed(0)
        head = ADAPTERS.get("comalign").from_config({"heads": 4, "dropout": 0.0, "residual": False}, d)
        out = compute_gradients(head, img, txt, accum, ctx)
        grads.append({k: p.grad.clone() for k, p in head.named_parameters()})
        assert torch.isfinite(out["loss"])
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------- two processes
@pytest.mark.slow
def test_two_processes_train_like_one_process_on_the_global_batch(root, tmp_path):
    """torchrun with 2 CPU processes (gloo), 24 pairs each, reaches the weights of one process with batch 48:
    each rank's loss sees the global batch (the head gathers), gradients are averaged."""
    common = ["--method", "comalign", "--data", str(root / "world"), "--cache-dir", str(root / "cache"), "--workers",
              "0", "--extract-batch-size", "64", "--epochs", "1", "--dropout", "0", "--stop-after-steps", "3",
              "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:  # a free loopback port for the process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(port), "-m", "train.adapter", *common, "--batch-size", "24", "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert main([*common, "--batch-size", "48", "--out", str(tmp_path / "one")]) == 0
    a = _head_state(tmp_path / "one" / "checkpoints" / "last.safetensors")
    b = _head_state(tmp_path / "two" / "checkpoints" / "last.safetensors")
    assert not torch.equal(a["head.image_encoder.out.weight"], torch.zeros_like(a["head.image_encoder.out.weight"]))
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4)
    la = [float(r["loss"]) for r in _csv(tmp_path / "one" / "metrics.csv")]
    lb = [float(r["loss"]) for r in _csv(tmp_path / "two" / "metrics.csv")]
    assert lb == pytest.approx(la, rel=1e-5)  # the logged loss is the global batch's on both


def test_per_rank_rng_files_are_verified(tmp_path):
    from extract.common.tensorfile import DamagedFileError
    from train.adapter.resume import load_rng_for_rank, save_rank_rng

    state = tmp_path / "checkpoints" / "last.safetensors"
    torch.manual_seed(7)
    save_rank_rng(state, 1)
    expected = torch.get_rng_state()
    assert torch.equal(load_rng_for_rank(state, 1), expected)
    rng = state.with_name("rng-rank1.safetensors")
    raw = bytearray(rng.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little") + 100  # in the tensor data, past the JSON header
    raw[start:start + 64] = bytes(b ^ 0xFF for b in raw[start:start + 64])
    rng.write_bytes(bytes(raw))
    with pytest.raises(DamagedFileError, match=f"{rng} is damaged"):
        load_rng_for_rank(state, 1)
