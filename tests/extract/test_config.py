import argparse
import json

import pytest

from extract.common.config import parse_with_config, save_config


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

    from extract.worlds.toyworld import parse_args as toy_args
    from train.demo import parse_args as demo_args

    examples = Path(__file__).resolve().parents[2] / "examples"
    assert demo_args(["--config", str(examples / "demo.yaml")]).n == 2000
    toy = toy_args(["--config", str(examples / "toyworld.yaml")])
    assert ("red", "circle") in toy.holdout and toy.n == 10000


def test_training_example_configs_parse():
    from pathlib import Path

    from train.adapter.engine import parse_args as adapter_args
    from train.pretrain.options import parse_args as pretrain_args

    examples = Path(__file__).resolve().parents[2] / "examples"
    a = adapter_args(["--config", str(examples / "adapter_comalign_vitb32.yaml")])
    assert (a.method, a.base, a.schedule) == ("comalign", "ViT-B-32", "step")
    p = pretrain_args(["--config", str(examples / "pretrain_powerclip_r.yaml")])
    assert (p.method, p.method_options["masks"], p.method_options["num_masks"], p.model, p.grad_checkpointing) == (
        "powerclip", "random", 10, "ViT-B-16", True)


# --------------------------------------------------------------------------------------------- config values are checked
def _training_parser():
    from extract.common.config import nonnegative_float, positive_float, positive_int

    p = argparse.ArgumentParser(prog="prog")
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--epochs", type=positive_int, default=10)
    p.add_argument("--wd", type=nonnegative_float, default=0.1)
    p.add_argument("--schedule", default="cosine", choices=["cosine", "step", "constant"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--benchmark", action="append", default=[])
    p.add_argument("--pretrained", default=None)
    return p


@pytest.mark.parametrize("text, expected", [
    ("lr: true\n", "key 'lr': --lr expects a value as on the command line, got True"),
    ("schedule: linear\n", "key 'schedule': invalid choice: 'linear'"),
    ("epochs: -3\n", "key 'epochs': expected an integer >= 1, got -3"),
    ("epochs: 0\n", "key 'epochs': expected an integer >= 1, got 0"),
    ("epochs: 2.5\n", "key 'epochs': expected an integer >= 1, got '2.5'"),
    ("precision: fp64\n", "key 'precision': invalid choice: 'fp64'"),
    ("lr: .nan\n", "key 'lr': expected a number > 0, got 'nan'"),
    ("wd: -0.1\n", "key 'wd': expected a number >= 0, got -0.1"),
    ("quick: 1\n", "key 'quick': --quick is a switch: expected true or false, got 1"),
    ("lr: [1, 2]\n", "key 'lr': --lr takes one value, got a list"),
    ("epochs:\n", "key 'epochs': needs a value"),
    ("lr: 1e-4\nepochs: [3\n", "not valid YAML: while parsing a flow sequence (line 2"),
    ("- lr\n- 3\n", "expected a mapping of option: value, got list"),
])
def test_config_values_pass_the_command_line_checks(tmp_path, capsys, text, expected):
    """Each bad value stops with the flag's own check, naming the file and the key: no training with lr 1.0,
    no KeyError or YAML traceback."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_with_config(_training_parser(), ["--config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {cfg}" in err and expected in err, err
    assert "Traceback" not in err


def test_the_same_values_fail_on_the_command_line(capsys):
    for argv in (["--epochs", "-3"], ["--schedule", "linear"], ["--lr", "0"], ["--precision", "fp64"]):
        with pytest.raises(SystemExit):
            _training_parser().parse_args(argv)
        assert "error: argument" in capsys.readouterr().err


def test_good_config_values_convert_as_on_the_command_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 1e-4\nepochs: 3\nwd: 0\nschedule: step\ntensorboard: false\nquick: true\n"
                   "benchmark: [a=x, b=y]\npretrained: null\n")
    a = parse_with_config(_training_parser(), ["--config", str(cfg)])
    assert (a.lr, a.epochs, a.wd, a.schedule, a.tensorboard, a.quick) == (1e-4, 3, 0.0, "step", False, True)
    assert isinstance(a.lr, float) and isinstance(a.epochs, int)
    assert a.benchmark == ["a=x", "b=y"] and a.pretrained is None
    b = parse_with_config(_training_parser(), ["--config", str(cfg), "--no-tensorboard", "--epochs", "7"])
    assert (b.epochs, b.tensorboard) == (7, False)
