"""Zero-shot: CLIP's prompt ensemble, score averaging for non-ensembling scorers, top-k with ties, readers."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from adapters.scoring import BackboneScorer, CacheReadable
from train.eval.zeroshot import (IMAGENET_TEMPLATES, class_representations, class_scores, read_classification,
                            read_label_file, topk_accuracy)


class _Toy(CacheReadable):
    """A scorer whose text embedding is a fixed vector per word count, to check the maths by hand."""

    name = "toy"
    preprocess = None
    device = torch.device("cpu")

    def encode_texts(self, texts):
        return {"embed": torch.tensor([[float(len(t)), 1.0] for t in texts])}

    def score(self, image_reps, text_reps):
        return image_reps["embed"] @ text_reps["embed"].T


def test_topk_ties_count_against_the_model():
    scores = torch.tensor([[1., 1., 0.], [0., 2., 1.], [3., 2., 1.], [0., 0., 0.]])
    labels = torch.tensor([0, 1, 2, 2])
    acc = topk_accuracy(scores, labels, ks=(1, 2))
    # row 0: tie with class 1 -> rank 2; row 1: rank 1; row 2: rank 3; row 3: all tied -> rank 3
    assert acc["top1"] == 25.0 and acc["top2"] == 50.0
    assert acc["mean_per_class_top1"] == pytest.approx((0 + 100 + 0) / 3)


def test_topk_non_finite_scores_rank_last_and_are_counted():
    nan, inf = float("nan"), float("inf")
    scores = torch.tensor([[nan, 0., 1.], [2., nan, 1.], [inf, 0., 1.], [nan, nan, nan]])
    labels = torch.tensor([0, 0, 0, 1])
    acc = topk_accuracy(scores, labels, ks=(1, 2))
    # row 0: NaN true class -> last (3); row 1: a NaN rival does not beat 2. -> 1; row 2: +inf is not finite
    # -> last; row 3: all NaN -> last. An all-NaN model would get top-1 = 100 if NaN compared as "not >= x".
    assert acc["top1"] == 25.0 and acc["top2"] == 25.0
    assert acc["nonfinite_scores"] == 6 and acc["n_scores"] == 12
    assert topk_accuracy(torch.full((4, 3), nan), labels, ks=(1,))["top1"] == 0.0
    assert topk_accuracy(torch.eye(3), torch.arange(3), ks=(1,))["nonfinite_scores"] == 0


def test_topk_warns_when_k_covers_every_class():
    assert "top2 is 100%" in topk_accuracy(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]), ks=(1, 2))["warning"]
    assert "warning" not in topk_accuracy(torch.randn(4, 3), torch.tensor([0, 1, 2, 1]), ks=(1, 2))


def test_ensemble_is_clips_normalised_mean_and_fallback_averages_scores():
    class Bb:  # a backbone stand-in for BackboneScorer.ensemble
        preprocess = None
        device = torch.device("cpu")

    sc = BackboneScorer(Bb())
    emb = torch.nn.functional.normalize(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    got = sc.ensemble({"embed": emb}, groups)["embed"]
    want = torch.stack([torch.nn.functional.normalize(emb[:3].mean(0), dim=0),
                        torch.nn.functional.normalize(emb[3:].mean(0), dim=0)])
    torch.testing.assert_close(got, want)

    toy = _Toy()
    reps, g = class_representations(toy, ["ab", "abcd"], ["{}", "x {}"])
    assert g.tolist() == [0, 0, 1, 1]
    s = class_scores(toy, {"embed": torch.tensor([[1.0, 0.0]])}, reps, g)
    # class "ab": texts "ab" (2) and "x ab" (4) -> mean 3; class "abcd": 4 and 6 -> 5
    assert s.tolist() == [[3.0, 5.0]]


def test_templates_are_clips_80():
    assert len(IMAGENET_TEMPLATES) == 80 and len(set(IMAGENET_TEMPLATES)) == 80
    assert all("{}" in t for t in IMAGENET_TEMPLATES)


def test_readers(tmp_path):
    for cls, n in (("n01", 2), ("n02", 1)):
        (tmp_path / "folder" / cls).mkdir(parents=True)
        for k in range(n):
            Image.new("RGB", (8, 8)).save(tmp_path / "folder" / cls / f"{k}.png")
    (tmp_path / "names.json").write_text(json.dumps({"0": ["n01", "tench"], "1": ["n02", "goldfish"]}))
    data = read_classification(tmp_path / "folder", tmp_path / "names.json")
    assert data.classes == ["tench", "goldfish"] and data.labels == [0, 0, 1]
    (tmp_path / "names.txt").write_text("zero\none\ntwo\n")
    assert read_label_file(tmp_path / "names.txt") == ["zero", "one", "two"]
    table = tmp_path / "set.csv"
    table.write_text("filepath,label\nfolder/n01/0.png,2\nfolder/n02/0.png,0\nmissing.png,1\n")
    data = read_classification(table, tmp_path / "names.txt")
    assert data.classes == ["zero", "two"] and data.labels == [1, 0]
    assert len(data.skipped) == 1 and "missing.png" in data.skipped[0]["item_id"]
    (tmp_path / "bad.csv").write_text("path,label\nx,1\n")
    with pytest.raises(ValueError, match="filepath"):
        read_classification(tmp_path / "bad.csv")


def test_the_labels_flag_names_the_classes_of_a_zero_shot_folder(tmp_path):
    """`train.eval --zeroshot-data DIR --labels FILE` reads the class names from FILE (a comparison field of
    the same name once replaced the flag, and the README's command failed)."""
    from train.eval.evaluate import load_tasks, parse_args

    for cls in ("n01", "n02"):
        (tmp_path / "folder" / cls).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "folder" / cls / "0.png")
    (tmp_path / "names.txt").write_text("tench\ngoldfish\n")
    args = parse_args(["--zeroshot-data", str(tmp_path / "folder"), "--labels", str(tmp_path / "names.txt"),
                       "--tasks", "zeroshot", "--out", str(tmp_path / "out")])
    data, _templates = load_tasks(args)["zeroshot"]
    assert data.classes == ["tench", "goldfish"] and data.labels == [0, 1]
