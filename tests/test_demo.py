"""The demo runs end to end on a small toy world and reports what it did."""
import json

import torch

from train.demo import main, recall_at_1


def test_recall_at_1_hand_case():
    img = torch.eye(3)
    # captions 0,1 belong to image 0; caption 2 to image 1 (but points at image 2); caption 3 to image 2
    txt = torch.tensor([[1.0, 0, 0], [0.9, 0.1, 0], [0, 0.2, 0.8], [0, 0, 1.0]])
    r = recall_at_1(img, txt, torch.tensor([0, 0, 1, 2]))
    assert r["t2i_r1"] == 0.75
    # image 0 -> caption 0 (own), image 1 -> caption 2 (own, 0.2 beats 0.1), image 2 -> caption 3 (own)
    assert r["i2t_r1"] == 1.0


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["--out", str(out), "--n", "60", "--workers", "0", "--batch-size", "16"]) == 0
    printed = capsys.readouterr().out
    assert "[3/3]" in printed and "retrieval R@1" in printed and "hard negatives" in printed
    report = json.loads((out / "demo_report.json").read_text())
    coco = json.loads((out / "toyworld" / "test_coco.json").read_text())
    assert report["images"] == len(coco["images"]) and report["captions"] == len(coco["annotations"])
    assert set(report["hard_negatives"]) <= {"replace-att", "replace-obj", "replace-rel", "swap-att", "swap-obj", "add-obj"}
    assert json.loads((out / "config.json").read_text())["n"] == 60


def test_demo_without_weights_says_what_to_supply(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--n", "20", "--base", "ViT-B-32"]) == 2
    assert "--pretrained /path/to/" in capsys.readouterr().out
