"""python -m train.pretrain: the engine, its checkpoints, and its reliability checks (two processes
equal one, kill -9 and resume equal an uninterrupted run, NaN steps skipped then a clean abort)."""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from extract.worlds import toyworld
from fixtures import warm

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "_pretrain_ddp_worker.py"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py; the subprocesses too


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "world"
    toyworld.generate(out, 64, seed=0, workers=1)
    return out


def _argv(toy: Path, out: Path, *extra: str) -> list[str]:
    return ["--data", str(toy), "--out", str(out), "--batch-size", "8", "--workers", "0", "--no-tensorboard",
            "--eval-every-n-epochs", "0", *extra]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MKL_CBWR="AUTO,STRICT", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


# --------------------------------------------------------------------------------------------- pieces
def test_cosine_schedule_is_open_clip_trains():
    from open_clip_train.scheduler import cosine_lr as theirs

    from train.pretrain.trainer import cosine_lr

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    adjust = theirs(opt, 1e-3, 7, 50)
    for step in (0, 3, 6, 7, 20, 49):
        assert cosine_lr(1e-3, 7, 50, step) == pytest.approx(adjust(step), rel=1e-12)


def test_weight_decay_groups_follow_open_clip():
    from train.pretrain.trainer import create_model, param_groups

    model = create_model("plugvlm-tiny", False, 0)[0]
    groups, names = param_groups(model, 0.2)
    no_decay = set(names[:len(groups[0]["params"])])
    assert groups[0]["weight_decay"] == 0.0 and groups[1]["weight_decay"] == 0.2
    assert {"logit_scale", "visual.class_embedding", "ln_final.weight", "ln_final.bias"} <= no_decay
    assert "visual.positional_embedding" not in no_decay and "token_embedding.weight" not in no_decay
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_ranks_come_from_torchrun_or_slurm_variables(monkeypatch):
    from train.pretrain.dist import init_distributed, world_info_from_env

    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    assert world_info_from_env() == (0, 0, 1)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert world_info_from_env() == (1, 3, 8)
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's variables win, as in open_clip_train.distributed
    assert world_info_from_env()[0] == 0
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        init_distributed("cpu")


def test_accumulated_step_gives_the_big_batch_gradient(toy):
    """--accum-freq 2 with cached features = one micro-batch of twice the size (clip and powerclip)."""
    from train.pretrain.dist import Dist
    from train.pretrain.trainer import create_model, Trainer
    from train.pretrain.options import build_objective, parse_args
    from train.pretrain.data import SeededTransform, build_train_data

    for method in ("clip", "powerclip"):
        grads = []
        for batch, accum in ((8, 1), (4, 2)):
            args = parse_args(_argv(toy, toy.parent / "unused", "--method", method, "--batch-size", str(batch),
                                    "--accum-freq", str(accum)))
            model, _, eval_tf, tok = create_model("plugvlm-tiny", False, 1)
            objective = build_objective(args.method, args.method_options)
            objective.setup(model, {})
            trainer = Trainer(args, Dist(), model, objective)
            data = build_train_data(str(toy), batch_size=batch, rank=0, world_size=1, accum_freq=accum, seed=0,
                                    tokenizer=tok, objective=objective, transform=SeededTransform(eval_tf, False),
                                    workers=0)
            micro = next(iter(data.epoch_batches(0, 0)))
            assert len(micro) == accum
            losses = trainer.forward_backward(micro, trainer.context(0, 0, 1))
            grads.append((float(losses["loss"]), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (l1, g1), (l2, g2) = grads
        assert l1 == pytest.approx(l2, rel=1e-5), method
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=f"{method}: {name}")


# --------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_run_writes_open_clip_checkpoints_that_load_everywhere(toy, tmp_path):
    import open_clip

    from adapters.scoring import BackboneScorer

    from adapters.load import load_scorer
    from extract.models.backbone import load_backbone
    from train.pretrain.engine import main

    out = tmp_path / "run"
    assert main(_argv(toy, out, "--epochs", "2", "--tensorboard", "--eval-every-n-epochs", "2",
                      "--log-every-n-steps", "1", "--save-every-n-steps", "2", "--keep-checkpoints", "0")) == 0
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    # step 6 ends epoch 1: its checkpoint is epoch_0001, not a step one
    assert ckpts == ["epoch_0001", "epoch_0002", "step_00000002", "step_00000004", "step_00000008", "step_00000010"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "epoch_0002"
    desc = json.loads((out / "model.json").read_text())
    assert desc["format"] == "plugvlm-pretrain" and desc["model"] == "plugvlm-tiny" and desc["method"] == "clip"
    assert desc["model_cfg"] == open_clip.get_model_config("plugvlm-tiny") and desc["epoch"] == 2
    assert desc["step"] == 2 * (51 // 8) and "retrieval T2I R@1" in desc["metrics"]
    assert json.loads((out / "eval" / "epoch_0002.json").read_text()) == desc["metrics"]
    rows = (out / "log.csv").read_text().splitlines()
    assert rows[0].startswith("step,epoch,lr,loss,clip,logit_scale,grad_norm") and len(rows) == 1 + desc["step"]
    assert any((out / "tb").iterdir()) and (out / "config.json").is_file() and (out / "data_report.json").is_file()
    state = json.loads((out / "checkpoints" / "step_00000008" / "state.json").read_text())
    assert (state["step"], state["epoch"], state["step_in_epoch"]) == (8, 1, 2)

    weights = out / "model.safetensors"
    upstream, _, preprocess = open_clip.create_model_and_transforms("plugvlm-tiny", pretrained=str(weights))
    upstream.eval().requires_grad_(False)  # inference mode, as our frozen backbone (same attention kernels)
    ours = load_backbone("tiny", str(weights))
    images = torch.randn(3, 3, 64, 64)
    texts = ["a small red circle", "a blue square to the left of a green star", "x"]
    with torch.no_grad():
        assert torch.equal(upstream.encode_image(images, normalize=True), ours.encode_images(images).embedding)
        ids = open_clip.get_tokenizer("plugvlm-tiny")(texts)
        assert torch.equal(upstream.encode_text(ids, normalize=True), ours.model.encode_text(ids, normalize=True))
        # the backbone's own text path runs on the real columns only (extract.models.backbone.trimmed_text_length)
        torch.testing.assert_close(ours.encode_texts(texts).embedding, upstream.encode_text(ids, normalize=True),
                                   rtol=1e-5, atol=1e-6)
    final = load_file(str(weights))
    assert final.keys() == upstream.state_dict().keys()
    assert isinstance(load_scorer("tiny", str(weights)), BackboneScorer)
    # the checkpoint names its architecture: the file or the run folder alone is a --model for evaluation
    for alone in (str(weights), str(out)):
        scorer = load_scorer(alone)
        with torch.no_grad():
            assert torch.equal(scorer.encode_images(images)["embed"], ours.encode_images(images).embedding)


COMPILED = ("--compile", "--compile-backend", "aot_eager")  # the compiled path without inductor's C++ build
#: (tag, method, flags) of each one-step run compared between two processes and one, per test below
DDP_RUNS = {"eager": [(m, m, ()) for m in ("clip", "powerclip", "filip")],
            "compiled": [(f"{m}-compiled", m, COMPILED) for m in ("clip", "powerclip")]}


@pytest.fixture(scope="module")
def ddp_steps(toy, tmp_path_factory) -> Path:
    """Every run of DDP_RUNS under one ``torchrun --nproc_per_node 2`` launch (a launch costs three interpreters and a
    gloo group: one per configuration cost 10 s more of the suite), and the same runs in this one process."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        from _pretrain_ddp_worker import run
    finally:
        sys.path.remove(str(WORKER.parent))
    out = tmp_path_factory.mktemp("ddp")
    runs = [list(r) for group in DDP_RUNS.values() for r in group]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(toy), str(out), "16", json.dumps(runs)],
                          env=_env(), cwd=str(out), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run(str(toy), out, 16, runs)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DDP_RUNS))
def test_two_processes_give_one_process_loss_and_gradients(ddp_steps, kind):
    """torchrun --nproc_per_node 2 (gloo) on a global batch of 16 == one process on the same 16 samples, for the
    gathered-feature losses (clip, powerclip, filip): the mean of the ranks' losses and DDP's gradients; with the
    towers compiled too (DDP wraps the model whose blocks are compiled in place)."""
    for tag, method, _ in DDP_RUNS[kind]:
        one = load_file(str(ddp_steps / f"{tag}-world1.safetensors"))
        two = load_file(str(ddp_steps / f"{tag}-world2.safetensors"))
        assert one.keys() == two.keys() and len(one) > 60
        torch.testing.assert_close(two["loss"], one["loss"], rtol=1e-6, atol=1e-6)
        for name in one:
            scale = float(one[name].abs().max()) + 1e-8
            torch.testing.assert_close(two[name] / scale, one[name] / scale, rtol=0, atol=1e-5, msg=f"{tag} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), (*COMPILED, "--fused-adamw", "on")], ids=["eager", "compiled-fused"])
def test_kill9_then_resume_latest_equals_an_uninterrupted_run(toy, tmp_path, extra):
    """compiled-fused: the GPU's step (compiled towers, fused AdamW, metrics read every few steps)."""
    from train.pretrain.engine import main

    args = ["--epochs", "2", "--save-every-n-steps", "2", "--keep-checkpoints", "0", "--method", "flip", *extra]
    victim_out = tmp_path / "killed"
    cmd = ["-m", "train.pretrain", *_argv(toy, victim_out, *args)]
    victim = warm.start(cmd, env=_env(), cwd=ROOT)  # a process of its own, forked warm (tests/fixtures/warm.py)
    latest = victim_out / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while not latest.is_file() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the subprocess, not waiting for an effect
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = json.loads((victim_out / "checkpoints" / latest.read_text().strip() / "state.json").read_text())
    assert killed_at["step"] < 2 * (51 // 8) and not (victim_out / "model.safetensors").exists()

    code, out, err = warm.run(cmd + ["--resume", "latest"], env=_env(), cwd=ROOT)
    assert code == 0, err[-3000:]
    assert f"resumed from {victim_out / 'checkpoints'}" in out

    reference = tmp_path / "uninterrupted"  # in this process, one thread as the subprocesses: same reductions
    assert main(_argv(toy, reference, *args)) == 0
    a, b = load_file(str(victim_out / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


def test_nan_steps_are_skipped_then_the_run_stops_with_checkpoints_intact(toy, tmp_path, capsys):
    """Skipped steps change nothing; no checkpoint is written right after one (step_2 and step_4
    once held blown-up weights and were called intact); console, log.csv and checkpoint names count steps alike."""
    from train.pretrain.engine import main

    out = tmp_path / "nan"
    base = _argv(toy, out, "--max-steps", "4", "--save-every-n-steps", "2", "--keep-checkpoints", "0",
                 "--log-every-n-steps", "100")
    assert main(base + ["--debug-nan-steps", "3,4", "--max-bad-steps", "3"]) == 0
    rows = [r.split(",") for r in (out / "log.csv").read_text().splitlines()]
    col = rows[0].index("skipped_step")
    assert {int(r[0]): int(r[col]) for r in rows[1:]} == {1: 0, 3: 1, 4: 1}  # logged: first step and bad ones
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["step_00000002"]  # step 4 came after a bad step
    before, after = load_file(str(ck / "step_00000002" / "model.safetensors")), \
        load_file(str(out / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # skipped steps changed nothing
    printed = capsys.readouterr().out
    assert "step 3: skipped (non-finite loss or gradient" in printed and "step 4: skipped (non-finite" in printed
    assert "not writing checkpoint step_00000004" in printed

    out2 = tmp_path / "nan2"
    code = main(_argv(toy, out2, "--max-steps", "8", "--save-every-n-steps", "2", "--keep-checkpoints", "0",
                      "--debug-nan-steps", "3,4,5", "--max-bad-steps", "3", "--log-every-n-steps", "100"))
    err = capsys.readouterr().err
    assert code == 3 and "3 non-finite steps in a row" in err and "steps 3, 4, 5" in err
    assert "--resume latest" in err
    assert f"the last good checkpoint is kept: {out2 / 'checkpoints' / 'step_00000002'}" in err
    names = sorted(p.name for p in (out2 / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step_00000002"]
    for name in names:  # every checkpoint written before the abort is complete and loadable
        assert json.loads((out2 / "checkpoints" / name / "state.json").read_text())["step"] == int(name[5:])
        load_file(str(out2 / "checkpoints" / name / "model.safetensors"))
    rows = [r.split(",") for r in (out2 / "log.csv").read_text().splitlines()]
    assert [int(r[0]) for r in rows[1:]] == [1, 3, 4, 5]  # the last bad step reaches the log before the abort
    assert not (out2 / "model.safetensors").exists()


def test_a_run_that_never_has_a_good_checkpoint_says_so(toy, tmp_path, capsys):
    from train.pretrain.engine import main

    out = tmp_path / "none"
    code = main(_argv(toy, out, "--max-steps", "6", "--save-every-n-steps", "2", "--debug-nan-steps", "2,3",
                      "--max-bad-steps", "2"))
    err = capsys.readouterr().err
    assert code == 3 and "no good checkpoint was saved yet" in err and "--resume" not in err
    assert not (out / "checkpoints").exists() or not any(p.is_dir() for p in (out / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_resnet_tower_trains_with_clip_filip_powerclip_and_is_refused_by_patch_choosers(toy, tmp_path, capsys):
    from train.pretrain.engine import main

    assert main(_argv(toy, tmp_path / "rn", "--model", "plugvlm-tiny-rn", "--max-steps", "2",
                      "--hard-negatives", "all")) == 0
    assert json.loads((tmp_path / "rn" / "model.json").read_text())["model"] == "plugvlm-tiny-rn"
    for method in ("powerclip", "filip"):  # they embed the 4x4 map's positions as patches
        assert main(_argv(toy, tmp_path / method, "--model", "plugvlm-tiny-rn", "--method", method,
                          "--max-steps", "2")) == 0
        rows = list(csv.DictReader((tmp_path / method / "log.csv").open()))
        assert rows and all(math.isfinite(float(r["loss"])) for r in rows)
        assert json.loads((tmp_path / method / "model.json").read_text())["step"] == 2
    assert main(_argv(toy, tmp_path / "flip", "--model", "plugvlm-tiny-rn", "--method", "flip",
                      "--max-steps", "2")) != 0
    assert "needs a ViT image tower; ModifiedResNet is not one" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--epochs", "-1"), ("--epochs", "0"), ("--lr", "-1e-3"), ("--batch-size", "0")])
def test_settings_that_would_train_nothing_are_refused(toy, tmp_path, capsys, flag, value):
    """--epochs -1 once exited 0 and saved an untrained model."""
    from train.pretrain.options import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(_argv(toy, tmp_path / "run", flag, value))
    assert e.value.code == 2 and f"argument {flag}: expected" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_options_built_in_python_get_the_command_lines_checks(tmp_path, monkeypatch):
    """pretrain(PretrainOptions(epochs=0)) is refused as --epochs 0 is, before anything is written."""
    from train.pretrain.options import PretrainOptions
    from train.pretrain.engine import pretrain

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="epochs: expected an integer >= 1, got 0"):
        pretrain(PretrainOptions(epochs=0))
    with pytest.raises(ValueError, match="lr: expected a number > 0"):
        pretrain(PretrainOptions(lr=-1e-3, out=str(tmp_path / "x")))
    with pytest.raises(ValueError, match=r"method_options\['num_masks'\] \(powerclip\): invalid int value: 'x'"):
        pretrain(PretrainOptions(method="powerclip", method_options={"num_masks": "x"}))
    with pytest.raises(ValueError, match=r"--mask-ratio must lie in \[0, 1\), got 1.5"):  # the objective's own check
        pretrain(PretrainOptions(method="flip", method_options={"mask_ratio": 1.5}))
    with pytest.raises(ValueError, match="unknown key\\(s\\) mask_ration; accepted: .*mask_ratio"):
        pretrain(PretrainOptions(method="flip", method_options={"mask_ration": 0.1}))
    with pytest.raises(ValueError, match="unknown --eval-tasks bogus"):
        PretrainOptions(eval_tasks="retrieval,bogus")
    assert not any(tmp_path.iterdir())  # no toy world, no run folder


def test_method_options_from_the_command_line_and_from_python_agree(toy):
    from train.pretrain.options import build_objective, parse_args, PretrainOptions, resolve_method_options

    cli = parse_args(["--method", "flip", "--mask-ratio", "0.75", "--num-masks", "4"])
    assert cli.method_options == {"mask_ratio": 0.75, "num_masks": 4}  # another method's flag, set: kept, unused
    py = PretrainOptions(method="flip", method_options={"mask_ratio": 0.75})
    assert resolve_method_options("flip", cli.method_options) == resolve_method_options("flip", py.method_options) \
        == {"mask_ratio": 0.75}
    assert build_objective("flip", py.method_options).config() == {"mask_ratio": 0.75}
    assert build_objective("powerclip", cli.method_options).config()["num_masks"] == 4


def test_the_promised_command_trains_on_the_embedded_toy_world(tmp_path, monkeypatch, capsys):
    """`python -m train.pretrain --method ...` with no --data and no --out: the default toy world (made small
    here) is generated, the run lands in runs/pretrain-MODEL-METHOD with the toy-world epochs, the first lines say
    so, and the output reads well in a log; that folder is not overwritten by a run with other settings."""
    from extract.worlds import toyworld
    from train.pretrain.options import parse_args, TOY_EPOCHS
    from train.pretrain.engine import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(toyworld, "DEFAULT_N", 40)
    assert main(["--method", "clip", "--max-steps", "2", "--batch-size", "8", "--workers", "0",
                 "--no-tensorboard"]) == 0
    captured = capsys.readouterr()
    out = tmp_path / "runs" / "pretrain-tiny-clip"
    assert json.loads((tmp_path / "runs" / "toy" / "meta.json").read_text())["n"] == 40
    assert (out / "model.safetensors").is_file() and (out / "log.csv").is_file()
    config = json.loads((out / "config.json").read_text())
    assert (config["data"], config["epochs"], config["out"]) == (str(Path("runs") / "toy"), TOY_EPOCHS, str(Path(
        "runs") / "pretrain-tiny-clip"))
    first = captured.out.splitlines()[:6]
    assert any("embedded toy world" in line for line in first), first
    assert any(f"epochs: {TOY_EPOCHS}" in line for line in first), first
    assert parse_args(["--config", str(out / "config.json")]).lr == 1e-3  # the resolved options work as --config
    lines = (captured.out + captured.err).splitlines()
    assert max(map(len, lines)) <= 300
    warnings = [line for line in lines if "warning" in line.lower()]
    assert len(warnings) == len(set(warnings)), warnings

    # another run's settings into the same default folder: refused, nothing touched; --quiet keeps only the error
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["-q", "--method", "clip", "--max-steps", "2", "--batch-size", "8", "--workers", "0",
                 "--no-tensorboard", "--lr", "5e-4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{Path('runs') / 'pretrain-tiny-clip'} holds another run (lr: 0.001 there, 0.0005 now)" in captured.err
    assert "--out NEW_FOLDER" in captured.err and "--resume" in captured.err
    # --resume with no checkpoint to continue (none was due in 2 steps) would be a new run: refused alike
    assert main(["-q", "--method", "clip", "--max-steps", "2", "--batch-size", "8", "--workers", "0",
                 "--no-tensorboard", "--lr", "5e-4", "--resume", "latest"]) == 2
    assert "holds another run" in capsys.readouterr().err
    assert (out / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_keep_checkpoints_keeps_the_newest_the_best_and_latest(toy, tmp_path, monkeypatch):
    """--keep-checkpoints 1 with step and epoch checkpoints and an evaluation each epoch: at the end only the last
    epoch's checkpoint (latest) and the best-evaluated one are left, and checkpoints/best names it."""
    import train.pretrain.engine as pt

    scores = iter([50.0, 10.0, 20.0])  # mean R@1 per epoch: epoch 1 is the best

    def fake_eval(weights, arch, opts, device, tasks=None):
        assert Path(weights).is_file()  # evaluated while it exists, before any pruning
        r1 = next(scores)
        return {"retrieval T2I R@1": r1, "retrieval I2T R@1": r1, "zero-shot top-1": 0.0}

    monkeypatch.setattr(pt, "evaluate_checkpoint", fake_eval)
    out = tmp_path / "keep"
    summary = pt.pretrain(pt.parse_args(_argv(toy, out, "--epochs", "3", "--save-every-n-steps", "2",
                                              "--keep-checkpoints", "1", "--eval-every-n-epochs", "1")))
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["epoch_0001", "epoch_0003"]
    assert (ck / "latest").read_text().strip() == "epoch_0003" and (ck / "best").read_text().strip() == "epoch_0001"
    assert summary["best"] == str(ck / "epoch_0001") and summary["step"] == 3 * (51 // 8)
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["epoch_0001.json", "epoch_0002.json",
                                                                "epoch_0003.json"]

    # without an evaluation, just the newest N
    out2 = tmp_path / "keep2"
    pt.pretrain(pt.PretrainOptions(data=str(toy), out=str(out2), batch_size=8, workers=0, tensorboard=False,
                                   epochs=2, save_every_n_steps=2, keep_checkpoints=2, eval_every_n_epochs=0))
    assert sorted(p.name for p in (out2 / "checkpoints").iterdir() if p.is_dir()) == ["epoch_0002", "step_00000010"]
