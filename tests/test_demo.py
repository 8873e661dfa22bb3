"""The demo runs the main job end to end on a small toy world and reports what it did."""
import json

from adapters.registry import ADAPTERS
from train.demo import main


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["--out", str(out), "--n", "80", "--workers", "0", "--pretrain-epochs", "1", "--pretrain-batch-size", "16",
            "--epochs", "1", "--batch-size", "32"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "[4/4]" in printed and "frozen base vs base + adapter" in printed
    report = json.loads((out / "demo_report.json").read_text())
    assert report["pretrained"] == str(out / "base" / "model.safetensors")
    assert json.loads((out / "base" / "model.json").read_text())["method"] == "clip"
    results = json.loads((out / "adapters" / "results.json").read_text())
    # one column per model: the frozen base, then every registered adapter
    assert len(results["results"]) == 1 + len(ADAPTERS.names())
    assert json.loads((out / "config.json").read_text())["n"] == 80
    # a second run reuses the toy world and the base (same settings) instead of redoing them
    assert main(argv + ["--methods", ADAPTERS.names()[0]]) == 0
    printed = capsys.readouterr().out
    assert "reusing it" in printed and "reusing" in printed.split("[3/4]")[1].split("[4/4]")[0]


def test_demo_without_weights_says_what_to_supply(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--n", "20", "--base", "ViT-B-32"]) == 2
    assert "--pretrained /path/to/" in capsys.readouterr().out
