"""python -m train.evaluate on the toy world with a bare tiny backbone, checked against direct computation."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from extract import toyworld
from extract.backbone import load_backbone
from extract.data import ToyWorldSource
from train.benchmarks import read_toyworld
from train.evaluate import item_correct, main

from test_retrieval import brute_force  # the per-query reference


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("world")
    toyworld.generate(out, n=200, seed=0, workers=1)
    return out


@pytest.fixture(scope="module")
def report(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    assert main(["--data", str(world), "--out", str(out), "--model", "tiny", "--pretrained", "none",
                 "--batch-size", "16"]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_reports_are_written(report):
    out, rep = report
    assert set(rep["results"]) == {"tiny:none"}
    res = rep["results"]["tiny:none"]
    assert {"retrieval", "zeroshot", "compositional", "linear_probe"} <= set(res)
    assert rep["config"]["data"]
    md = (out / "results.md").read_text()
    assert "retrieval T2I R@1" in md and "zero-shot top-1" in md and "toyworld all" in md
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_retrieval_matches_brute_force(world, report):
    _, rep = report
    got = rep["results"]["tiny:none"]["retrieval"]
    bb = load_backbone("tiny", "none")
    records = ToyWorldSource(world, "test").records()
    with torch.no_grad():
        img = bb.encode_images(torch.stack([bb.preprocess(Image.open(r.source).convert("RGB")) for r in records]))
        caps = [(c.text, i) for i, r in enumerate(records) for c in r.captions]
        txt = bb.encode_texts([t for t, _ in caps])
    s = (img.embedding @ txt.embedding.T).numpy()
    t2i, i2t = brute_force(s, [i for _, i in caps])
    for k in (1, 5, 10):
        assert got["text_to_image"][f"R@{k}"] == pytest.approx(100 * (t2i <= k).mean(), abs=1e-6)
        assert got["image_to_text"][f"R@{k}"] == pytest.approx(100 * (i2t[i2t > 0] <= k).mean(), abs=1e-6)
    assert got["captions"] == len(caps)


def test_compositional_per_type_matches_direct_computation(world, report):
    _, rep = report
    got = rep["results"]["tiny:none"]["compositional"]["toyworld"]["per_type"]
    bench = read_toyworld(world, split="test")
    bb = load_backbone("tiny", "none")
    right: dict[str, list[bool]] = {}
    with torch.no_grad():
        for item in bench.items:
            im = bb.encode_images(bb.preprocess(Image.open(item.images[0]).convert("RGB"))[None]).embedding
            s = (im @ bb.encode_texts(list(item.texts)).embedding.T)[0]
            right.setdefault(item.subtype, []).append(bool(s[0] > s[1:].max()))
    for sub, oks in right.items():
        assert got[sub]["n"] == len(oks)
        assert got[sub]["acc"] == pytest.approx(100 * np.mean(oks), abs=1e-6)
    assert got["all"]["n"] == len(bench.items)


def test_item_correctness_rules():
    assert item_correct("text", torch.tensor([[2., 1., 1.5]]))["acc"]
    assert not item_correct("text", torch.tensor([[2., 2., 1.]]))["acc"]  # a tie is wrong
    assert item_correct("image", torch.tensor([[2.], [1.]]))["acc"]
    # Winoground, s[image, caption]: i0 prefers c0 (.5 > .4), i1 prefers c1 (.7 > .6): text right; but c0
    # prefers i1 (.6 > .5): image wrong, so the group is wrong
    s = torch.tensor([[.5, .4], [.6, .7]])
    assert item_correct("group", s) == {"text": True, "image": False, "group": False}
    s = torch.tensor([[.9, .5], [.6, .4]])  # i1 prefers c0: text wrong; c1 prefers i0 (.5 > .4): image wrong
    assert item_correct("group", s) == {"text": False, "image": False, "group": False}
    s = torch.tensor([[.9, .5], [.3, .8]])
    assert item_correct("group", s) == {"text": True, "image": True, "group": True}


def test_side_by_side_and_malformed_benchmark_fails_before_models(world, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "examples.jsonl"
    bad.write_text('{"id": 0, "image_0": "a", "image_1": "b", "caption_0": "x", "caption_1": "y", '
                   '"tag": "t", "secondary_tag": "", "num_main_preds": 1, "collapsed_tag": "Object"}\n{broken\n')

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the benchmark file was checked")
    monkeypatch.setattr("train.evaluate.load_scorer", refuse)
    assert main(["--data", str(world), "--benchmark", f"winoground={bad}", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "examples.jsonl" in err and "line 2" in err
    monkeypatch.undo()
    out = tmp_path / "two"
    assert main(["--data", str(world), "--tasks", "compositional", "--model", "tiny", "--model", "tiny",
                 "--pretrained", "none", "--pretrained", "none", "--out", str(out)]) == 0
    header = (out / "results.md").read_text().splitlines()[0]
    assert header.count("tiny:none") == 2


def test_retrieval_from_the_feature_cache_matches_live_encoding(world, report, tmp_path):
    from extract.pipeline import build_cache

    build_cache(world, tmp_path / "cache", split="test", components=["patches"], workers=0, pretrained="none")
    out = tmp_path / "cached"
    assert main(["--data", str(world), "--tasks", "retrieval", "--cache", str(tmp_path / "cache"), "--model", "tiny",
                 "--pretrained", "none", "--out", str(out)]) == 0
    cached = json.loads((out / "results.json").read_text())["results"]["tiny:none"]["retrieval"]
    live = report[1]["results"]["tiny:none"]["retrieval"]
    assert cached["images"] == live["images"] and cached["captions"] == live["captions"]
    # exactly the brute force over the cached (fp16) features ...
    from extract.cache import FeatureCache

    cache = FeatureCache.open(tmp_path / "cache")
    img = cache.gather("image_embed", np.arange(cache.num_images)).astype(np.float32)
    txt = cache.gather("text_embed", np.arange(cache.num_captions)).astype(np.float32)
    t2i, i2t = brute_force(img @ txt.T, cache.caption_image_index())
    for k in (1, 5, 10):
        assert cached["text_to_image"][f"R@{k}"] == pytest.approx(100 * (t2i <= k).mean(), abs=1e-6)
        assert cached["image_to_text"][f"R@{k}"] == pytest.approx(100 * (i2t[i2t > 0] <= k).mean(), abs=1e-6)
    # ... and within fp16 rounding of live fp32 encoding: near-ties of the random model may flip a query or two
    for d, n in (("text_to_image", live["captions"]), ("image_to_text", live["images"])):
        for k in ("R@1", "R@5", "R@10"):
            assert abs(cached[d][k] - live[d][k]) <= 2 * 100 / n + 1e-9
    # a cache built by other weights is refused, naming the difference
    assert main(["--tasks", "retrieval", "--cache", str(tmp_path / "cache"), "--model", "tiny-coca",
                 "--pretrained", "none", "--out", str(tmp_path / "x")]) == 2


def test_zeroshot_without_labelled_images_is_skipped_not_a_crash():
    from train.evaluate import headline, run_zeroshot
    from train.zeroshot import ClassificationSet

    empty = ClassificationSet("toyworld:test", [], [], [])
    out = run_zeroshot(object(), empty, ("a {}.",), batch_size=4)  # never touches the scorer
    assert "skipped" in out and "no labelled images" in out["skipped"]
    assert not any(k.startswith("zero-shot") for k in headline({"zeroshot": out}))
