import argparse
import json

import pytest

from extract.config import parse_with_config, save_config


def _parser():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--out-dir", default="x")
    return p


def test_yaml_sets_defaults_and_cli_overrides(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("n: 5\nout-dir: from_yaml\n")
    a = parse_with_config(_parser(), ["--config", str(cfg)])
    assert (a.n, a.out_dir) == (5, "from_yaml")
    b = parse_with_config(_parser(), ["--config", str(cfg), "--n", "7"])
    assert (b.n, b.out_dir) == (7, "from_yaml")
    path = save_config(b, tmp_path / "run" / "config.json")
    assert json.loads(path.read_text())["n"] == 7


def test_unknown_key_and_missing_file_fail(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("nn: 5\n")
    with pytest.raises(SystemExit):
        parse_with_config(_parser(), ["--config", str(cfg)])
    assert "unknown key(s) nn" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_with_config(_parser(), ["--config", str(tmp_path / "none.yaml")])
    assert "no such file" in capsys.readouterr().err


def test_example_configs_parse():
    from pathlib import Path

    from extract.toyworld import parse_args as toy_args
    from train.demo import parse_args as demo_args

    examples = Path(__file__).resolve().parent.parent / "examples"
    assert demo_args(["--config", str(examples / "demo.yaml")]).n == 2000
    toy = toy_args(["--config", str(examples / "toyworld.yaml")])
    assert ("red", "circle") in toy.holdout and toy.n == 10000


def test_training_example_configs_parse():
    from pathlib import Path

    from train.adapter import parse_args as adapter_args
    from train.pretrain import parse_args as pretrain_args

    examples = Path(__file__).resolve().parent.parent / "examples"
    a = adapter_args(["--config", str(examples / "adapter_comalign_vitb32.yaml")])
    assert (a.method, a.base, a.schedule) == ("comalign", "ViT-B-32", "step")
    p = pretrain_args(["--config", str(examples / "pretrain_powerclip_r.yaml")])
    assert (p.method, p.masks, p.num_masks, p.model, p.grad_checkpointing) == ("powerclip", "random", 10, "ViT-B-16", True)
