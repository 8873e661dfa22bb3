"""CLIP_benchmark evaluates a plugvlm model through our loader and agrees with train.eval's retrieval."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from extract.worlds import toyworld
from extract.data.sources import ToyWorldSource
from train.eval.clip_benchmark import ScorerAsCLIP, build_parser, main
from train.eval.evaluate import main as evaluate_main

pytest.importorskip("clip_benchmark")


def test_same_retrieval_numbers_as_clip_benchmark(tmp_path):
    toyworld.generate(tmp_path / "world", n=60, seed=3, workers=1)
    records = ToyWorldSource(tmp_path / "world", "train").records()[:24]
    root = tmp_path / "flickr"
    root.mkdir()
    pairs = []
    for r in records:
        name = f"{r.image_id}.jpg"
        Image.open(r.source).convert("RGB").save(root / name, quality=95)
        pairs += [(name, c.text) for c in r.captions]
    # CLIP_benchmark's Flickr reader: a header line, then "image.jpg,caption"; ours: a filepath,title CSV
    (root / "captions.txt").write_text("image,caption\n" + "".join(f"{n},{t}\n" for n, t in pairs))
    (root / "pairs.csv").write_text("filepath,title\n" + "".join(f'{n},"{t}"\n' for n, t in pairs))

    out = tmp_path / "cb.json"
    main(["eval", "--model_type", "plugvlm", "--model", "tiny", "--pretrained", "none", "--dataset", "flickr30k",
          "--dataset_root", str(root), "--annotation_file", str(root / "captions.txt"), "--task",
          "zeroshot_retrieval", "--recall_k", "1", "5", "10", "--no_amp", "--num_workers", "0",
          "--batch_size", "7", "--output", str(out)])
    theirs = json.loads(out.read_text())["metrics"]

    assert evaluate_main(["--model", "tiny", "--pretrained", "none", "--tasks", "retrieval", "--retrieval-data",
                          str(root / "pairs.csv"), "--out", str(tmp_path / "ours")]) == 0
    ours = json.loads((tmp_path / "ours" / "results.json").read_text())["results"]["tiny:none"]["retrieval"]
    assert ours["images"] == len(records) and ours["captions"] == len(pairs)
    for k in (1, 5, 10):
        assert ours["text_to_image"][f"R@{k}"] == pytest.approx(100 * theirs[f"image_retrieval_recall@{k}"], abs=1e-4)
        assert ours["image_to_text"][f"R@{k}"] == pytest.approx(100 * theirs[f"text_retrieval_recall@{k}"], abs=1e-4)
    assert 0 < ours["text_to_image"]["R@10"] < 100  # a case where the numbers can disagree


def test_non_dot_product_scorers_are_refused():
    from adapters.scoring import CacheReadable

    class Other(CacheReadable):  # a scorer with a second stage: more than a dot product
        name = "comalign-like"

    with pytest.raises(ValueError, match="python -m train.eval"):
        ScorerAsCLIP(Other())


def test_the_command_word_is_ours_and_the_rest_goes_to_clip_benchmark_untouched(capsys):
    args = build_parser().parse_args(["eval", "--model_type", "plugvlm", "--recall_k", "1", "5", "--help"])
    assert args.command == "eval" and args.options == ["--model_type", "plugvlm", "--recall_k", "1", "5", "--help"]
    for argv, message in ((["evl"], "invalid choice: 'evl'"), ([], "a command is required: eval or build"),
                          (["--no-such-flag"], "unrecognized arguments: --no-such-flag")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "usage:" not in err and message in err, (argv, err)
