"""python -m train.eval on the toy world with a bare tiny backbone, checked against direct computation."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from adapters.scoring import CacheReadable
from extract.worlds import toyworld
from extract.models.backbone import load_backbone
from extract.data.sources import ToyWorldSource
from train.eval.datasets import read_toyworld
from train.eval.evaluate import item_correct, main

from fixtures.references import brute_force  # the per-query reference


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The session's 120-scene toy world (tests/fixtures/toy.py), shared with the serving tests and the adapters'."""
    from fixtures.toy import toy_root

    return toy_root(tmp_path_factory) / "world"


@pytest.fixture(scope="module")
def report(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    assert main(["--data", str(world), "--out", str(out), "--model", "tiny", "--pretrained", "none",
                 "--batch-size", "16"]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_reports_are_written(report):
    out, rep = report
    assert list(rep["results"]) == ["tiny:none", "text only (tiny:none)"]  # the model, then the text-only floor
    res = rep["results"]["tiny:none"]
    assert {"retrieval", "zeroshot", "compositional", "linear_probe"} <= set(res)
    assert set(res["compositional"]) == {"toyworld", "toyworld-controlled"}
    floor = rep["results"]["text only (tiny:none)"]
    assert set(floor) >= {"compositional", "text_only_fit"} and "retrieval" not in floor
    assert floor["compositional"]["toyworld-controlled"]["per_type"]["all"]["text"] == 25.0  # blind: one of four
    assert rep["config"]["data"]
    md = (out / "results.md").read_text()
    assert "retrieval T2I R@1" in md and "zero-shot top-1" in md and "toyworld all" in md
    assert "toyworld-controlled all text" in md and "toyworld-controlled all group" in md
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_side_by_side_and_malformed_benchmark_fails_before_models(world, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "examples.jsonl"
    bad.write_text('{"id": 0, "image_0": "a", "image_1": "b", "caption_0": "x", "caption_1": "y", '
                   '"tag": "t", "secondary_tag": "", "num_main_preds": 1, "collapsed_tag": "Object"}\n{broken\n')

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the benchmark file was checked")
    monkeypatch.setattr("train.eval.evaluate.load_scorer", refuse)
    assert main(["--data", str(world), "--benchmark", f"winoground={bad}", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "examples.jsonl" in err and "line 2" in err
    monkeypatch.undo()
    out = tmp_path / "two"
    assert main(["--data", str(world), "--tasks", "compositional", "--model", "tiny", "--model", "tiny",
                 "--pretrained", "none", "--pretrained", "none", "--out", str(out)]) == 0
    header = (out / "results.md").read_text().splitlines()[0]
    assert header == "| metric | tiny:none | text only (tiny:none) | tiny:none' |"


@pytest.mark.slow
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
    from train.eval.evaluate import run_zeroshot
    from train.eval.report import headline
    from train.eval.zeroshot import ClassificationSet

    empty = ClassificationSet("toyworld:test", [], [], [])
    out = run_zeroshot(object(), empty, ("a {}.",), batch_size=4)  # never touches the scorer
    assert "skipped" in out and "no labelled images" in out["skipped"]
    assert not any(k.startswith("zero-shot") for k in headline({"zeroshot": out}))


# ------------------------------------------------------------------------------------- non-finite scores
class NanScorer(CacheReadable):
    """A model whose every embedding is NaN (a diverged adapter): it must score 0, never 100."""

    name = "nan-model"

    def preprocess(self, image):
        return torch.zeros(3, 2, 2)

    def encode_images(self, batch):
        return {"embed": torch.full((len(batch), 4), float("nan"))}

    def encode_texts(self, texts):
        return {"embed": torch.full((len(texts), 4), float("nan"))}

    def score(self, image_reps, text_reps):
        return image_reps["embed"] @ text_reps["embed"].T


def test_item_correctness_with_non_finite_scores():
    nan = float("nan")
    assert not item_correct("text", torch.tensor([[nan, 1.]]))["acc"]  # a NaN true score is wrong
    assert item_correct("text", torch.tensor([[1., nan, 0.]]))["acc"]  # a NaN negative does not beat 1.
    assert not item_correct("text", torch.tensor([[float("inf"), 1.]]))["acc"]  # inf is not finite either
    assert item_correct("image", torch.tensor([[1.], [nan]]))["acc"]
    assert not item_correct("image", torch.tensor([[nan], [nan]]))["acc"]
    assert item_correct("group", torch.full((2, 2), nan)) == {"text": False, "image": False, "group": False}
    s = torch.tensor([[.9, nan], [.3, .8]])  # i0's NaN rival caption and c1's NaN rival image lose
    assert item_correct("group", s) == {"text": True, "image": True, "group": True}


def test_all_nan_scorer_gets_zero_retrieval_from_encoded_reps():
    from adapters.eval.retrieval import retrieval_from_reps

    reps = {"embed": torch.full((3, 4), float("nan"))}
    out = retrieval_from_reps(NanScorer(), reps, {"embed": torch.randn(6, 4)}, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert out["text_to_image"]["R@1"] == 0.0 and out["image_to_text"]["R@1"] == 0.0
    assert out["nonfinite_scores"] == 18 == out["n_scores"]

    class Directional(NanScorer):  # NaN only when texts rank images
        directional = True

        def score_directed(self, image_reps, text_reps, direction):
            s = torch.eye(3)[:, [0, 0, 1, 1, 2, 2]]
            return s * float("nan") if direction == "t2i" else s

    out = retrieval_from_reps(Directional(), reps, reps, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert out["text_to_image"]["R@1"] == 0.0 and out["image_to_text"]["R@1"] == 100.0
    assert out["nonfinite_scores"] == 18 and out["n_scores"] == 36
    assert "only 3 images" in out["warning"]


def test_nan_model_end_to_end_scores_zero_and_warns_once_per_task(world, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("train.eval.evaluate.load_scorer", lambda *a, **k: NanScorer())
    assert main(["--data", str(world), "--out", str(tmp_path), "--batch-size", "64"]) == 0
    printed = capsys.readouterr().out.splitlines()
    res = json.loads((tmp_path / "results.json").read_text())["results"]["nan-model"]
    r = res["retrieval"]
    assert r["text_to_image"]["R@1"] == 0.0 and r["image_to_text"]["R@1"] == 0.0
    assert r["nonfinite_scores"] == r["n_scores"] == r["images"] * r["captions"] > 0
    assert res["zeroshot"]["top1"] == 0.0 and res["zeroshot"]["nonfinite_scores"] > 0
    assert res["compositional"]["toyworld"]["per_type"]["all"]["acc"] == 0.0
    # the linear probe cannot fit NaN embeddings: a skipped entry naming the model, not a crash
    probe = res["linear_probe"]
    assert "nan-model" in probe["skipped"] and probe["nonfinite_embeddings"] == probe["train"] + probe["test"]
    expected = {"retrieval": f"warning: nan-model gave {r['n_scores']} non-finite retrieval scores "
                             f"(of {r['n_scores']}); they rank last",
                "zero-shot": "non-finite zero-shot scores", "compositional": "non-finite compositional scores",
                "probe": "warning: linear probe skipped: nan-model gave"}
    for task, text in expected.items():
        assert sum(text in line for line in printed) == 1, (task, printed)
    assert sum("warning: retrieval: only" in line for line in printed) == 1  # the small test split
    assert res["warnings"] and all(w in (tmp_path / "results.md").read_text() for w in res["warnings"])


def test_linear_probe_with_non_finite_embeddings_is_a_named_skip(world):
    from train.eval.evaluate import _toy_counting, run_linear_probe

    class Partly(NanScorer):  # finite embeddings except for the first image of each batch
        def encode_images(self, batch):
            x = torch.randn(len(batch), 4)
            x[0, 1] = float("inf")
            return {"embed": x}

    train_set, test_set = _toy_counting(world, "train"), _toy_counting(world, "test")
    out = run_linear_probe(Partly(), train_set, test_set, batch_size=1000, seed=0)
    assert out["nonfinite_embeddings"] == 2 and "nan-model gave 2 non-finite image embedding" in out["skipped"]


@pytest.mark.slow
def test_an_adapter_is_evaluated_from_a_cache_extracted_with_its_settings(tmp_path_factory, tmp_path, capsys):
    """--model ADAPTER --cache CACHE scores the head on the cached arrays (checked against the head applied to them
    directly, per query); a cache extracted with other settings is refused, naming both."""
    from adapters.load import load_scorer
    from extract.cache import FeatureCache
    from extract.pipeline import build_cache
    from fixtures.serve import serve_setup

    s = serve_setup(tmp_path_factory)  # ComAlign on a 120-scene toy world, its test split cached with its settings
    assert main(["--model", str(s.run), "--tasks", "retrieval", "--cache", str(s.cache.path), "--annotations",
                 str(s.world), "--out", str(tmp_path / "ok")]) == 0
    got = json.loads((tmp_path / "ok" / "results.json").read_text())["results"]["tiny + comalign"]["retrieval"]
    scorer = load_scorer(str(s.run), annotations=str(s.world))
    cache = FeatureCache.open(s.cache.path)
    reps = {side: scorer.encode_arrays({k: cache.gather(k, np.arange(n)) for k in scorer.cache_keys(side)}, side)
            for side, n in (("image", cache.num_images), ("text", cache.num_captions))}
    caption_image = cache.caption_image_index()
    t2i, _ = brute_force(scorer.score_directed(reps["image"], reps["text"], "t2i").numpy(), caption_image)
    _, i2t = brute_force(scorer.score_directed(reps["image"], reps["text"], "i2t").numpy(), caption_image)
    assert got["images"] == 12 and got["captions"] == cache.num_captions and got["cache"] == str(cache.path)
    for k in (1, 5, 10):
        assert got["text_to_image"][f"R@{k}"] == pytest.approx(100 * (t2i <= k).mean(), abs=1e-6)
        assert got["image_to_text"][f"R@{k}"] == pytest.approx(100 * (i2t[i2t > 0] <= k).mean(), abs=1e-6)
    capsys.readouterr()
    other = build_cache(s.world, tmp_path / "other", split="test", components=["patches"], workers=0)
    assert main(["--model", str(s.run), "--tasks", "retrieval", "--cache", str(other.path), "--annotations",
                 str(s.world), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert f"--cache {other.path}" in err and "than tiny + comalign was trained on" in err
    assert "components: ['entities', 'relations'] -> ['patches']" in err


@pytest.mark.slow
def test_an_adapter_evaluated_live_computes_each_batch_together(tmp_path_factory, tmp_path, monkeypatch):
    """An evaluation's images and captions come in batches fixed by its data and --batch-size: an adapter's live
    extraction computes each batch together there (AdapterScorer.encode_pil_bulk / encode_texts_bulk), as the cache
    computes its shards, never each item alone (what serving pays: a third to an eighth of the speed); the figures are
    those of the items alone (the same ranks on this world)."""
    import adapters.adapter_scorer as scorer_module
    from adapters.adapter_scorer import AdapterScorer, LiveExtractor
    from adapters.live_memo import ArrayMemo
    from fixtures.serve import serve_setup

    s = serve_setup(tmp_path_factory)  # ComAlign on a 120-scene toy world, ground-truth boxes
    argv = ["--model", str(s.run), "--tasks", "retrieval", "--data", str(s.world), "--annotations", str(s.world)]
    with monkeypatch.context() as served:  # each item alone, as serving computes it
        served.setattr(AdapterScorer, "encode_pil_bulk", AdapterScorer.encode_pil)
        served.setattr(AdapterScorer, "encode_texts_bulk", AdapterScorer.encode_texts)
        assert main([*argv, "--out", str(tmp_path / "alone")]) == 0
    alone = json.loads((tmp_path / "alone" / "results.json").read_text())["results"]["tiny + comalign"]["retrieval"]

    def refuse(*args, **kwargs):
        raise AssertionError("an evaluation item was computed alone")

    monkeypatch.setattr(scorer_module, "MEMO", ArrayMemo())  # nothing remembered from the run above
    monkeypatch.setattr(LiveExtractor, "_image_alone", refuse)
    monkeypatch.setattr(LiveExtractor, "_caption_alone", refuse)
    assert main([*argv, "--out", str(tmp_path / "bulk")]) == 0
    bulk = json.loads((tmp_path / "bulk" / "results.json").read_text())["results"]["tiny + comalign"]["retrieval"]
    assert bulk["images"] == 12 and bulk["text_to_image"] == alone["text_to_image"]
    assert bulk["image_to_text"] == alone["image_to_text"]


@pytest.mark.slow
def test_an_adapter_on_coco_files_with_integer_ids_and_a_box_file_that_leaves_an_image_out(tmp_path_factory, tmp_path,
                                                                                            capsys):
    """--retrieval-data a COCO captions file and --annotations a COCO instances file (both keyed by int ids), the
    instances naming two of the three images: counted and refused under the default --max-missing-boxes 0, run and
    counted in the log where the user allows a third; the captions file given as boxes is refused, saying what is
    expected."""
    from fixtures.serve import serve_setup

    s = serve_setup(tmp_path_factory)  # ComAlign on a 120-scene toy world (ground-truth boxes)
    scenes = json.loads((s.world / "annotations.json").read_text())["scenes"][:3]
    images = [{"id": 1000 + k, "file_name": sc["file_name"], "width": sc["width"], "height": sc["height"]}
              for k, sc in enumerate(scenes)]
    captions = {"images": images, "annotations": [{"id": 7000 + k, "image_id": 1000 + k,
                                                   "caption": sc["captions"][0]["text"]} for k, sc in enumerate(scenes)]}
    boxes = {"images": images[:2], "categories": [{"id": 1, "name": "shape"}],
             "annotations": [{"id": j, "image_id": 1000 + k, "category_id": 1,
                              "bbox": [o["box"][0], o["box"][1], o["box"][2] - o["box"][0], o["box"][3] - o["box"][1]]}
                             for k, sc in enumerate(scenes[:2]) for j, o in enumerate(sc["objects"])]}
    (tmp_path / "captions.json").write_text(json.dumps(captions))
    (tmp_path / "instances.json").write_text(json.dumps(boxes))
    argv = ["--model", str(s.run), "--tasks", "retrieval", "--retrieval-data", str(tmp_path / "captions.json"),
            "--image-root", str(s.world), "--annotations", str(tmp_path / "instances.json")]
    capsys.readouterr()
    assert main(argv + ["--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "retrieval images: 1 of 3 images (33.33%) have no entry in" in err and "(COCO instances)" in err
    assert "more than --max-missing-boxes 0 allows" in err and "000002.png" in err
    assert main(argv + ["--out", str(tmp_path / "ok"), "--max-missing-boxes", "0.4"]) == 0
    out = capsys.readouterr().out
    assert "boxes: retrieval images: 1 of 3 images (33.33%) have no entry" in out
    assert "within --max-missing-boxes 0.4: they get no boxes" in out
    got = json.loads((tmp_path / "ok" / "results.json").read_text())["results"]["tiny + comalign"]["retrieval"]
    assert got["images"] == 3
    argv[-1] = str(tmp_path / "captions.json")
    assert main(argv + ["--out", str(tmp_path / "captions")]) == 2
    assert "captions.json is a COCO captions file (its annotations have captions, no bbox)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- multi-positive, intervals
@pytest.mark.slow
def test_multi_positive_retrieval_matches_the_reference(world, report):
    """The toy world's multi-positive section: any-true R@1 and mAP of the live run equal the per-query reference
    on the directly computed score matrix and satisfies() truth, overall and per caption kind."""
    from fixtures.references import reference

    mp = report[1]["results"]["tiny:none"]["retrieval"]["multi_positive"]
    bb = load_backbone("tiny", "none")
    records = ToyWorldSource(world, "test").records()
    scenes = {str(s["image_id"]): s for s in toyworld.load(world)["scenes"]}
    caption = {str(c["id"]): c for s in scenes.values() for c in s["captions"]}
    with torch.no_grad():
        img = bb.encode_images(torch.stack([bb.preprocess(Image.open(r.source).convert("RGB")) for r in records]))
        caps = [(c.id, i) for i, r in enumerate(records) for c in r.captions]
        txt = bb.encode_texts([caption[c]["text"] for c, _ in caps])
    s = (img.embedding @ txt.embedding.T).numpy()
    truth = np.array([[toyworld.satisfies(scenes[r.image_id], caption[c]["struct"]) for c, _ in caps] for r in records])
    first, ap, n_true = reference(s.T, truth.T)
    assert mp["text_to_image"]["R@1"] == pytest.approx(100 * (first <= 1).mean(), abs=1e-9)
    assert mp["text_to_image"]["mAP"] == pytest.approx(100 * ap.mean(), abs=1e-9)
    assert mp["text_to_image"]["true_per_query"] == pytest.approx(n_true.mean()) and n_true.max() > 1
    kinds = np.array([caption[c]["kind"] for c, _ in caps])
    for kind in ("one-object", "relation", "long"):
        assert mp["text_to_image_by"][kind]["mAP"] == pytest.approx(100 * ap[kinds == kind].mean(), abs=1e-9)
    first, ap, n_true = reference(s, truth)
    assert mp["image_to_text"]["mAP"] == pytest.approx(100 * ap[n_true > 0].mean(), abs=1e-9)
    md = (report[0] / "results.md").read_text()
    assert "retrieval T2I any-true R@1" in md and "T2I mAP [one-object in 2-object images]" in md


@pytest.mark.slow
def test_side_by_side_deltas_and_per_query_figures(world, tmp_path):
    """Two identical models: every delta is exactly 0 with a zero-width interval, nothing is marked; and each
    table figure with per-query values is 100 x the mean of those values (what the bootstrap resamples)."""
    from train.eval.evaluate import EvaluateOptions, evaluate
    from train.eval.report import headline

    rep = evaluate(EvaluateOptions(model=["tiny", "tiny"], pretrained=["none", "none"], data=str(world),
                                   tasks="retrieval,zeroshot,compositional", out=str(tmp_path), bootstrap=200,
                                   text_only=False))
    first, second = rep["table"]["columns"]
    assert rep["table"]["reference"] == first == "tiny:none" and second == "tiny:none'"
    flat = headline(rep["results"][first])
    queries = rep["per_query"][first]
    assert {"retrieval T2I R@1", "retrieval I2T mAP", "zero-shot top-1", "toyworld swap-obj"} <= set(queries.metrics)
    for metric in queries.metrics:
        assert queries.figure(metric) == pytest.approx(flat[metric], abs=1e-9), metric
    cells = rep["table"]["metrics"][second]
    for metric, cell in cells.items():
        assert cell["delta"] == 0.0 and cell["delta_ci"] == [0.0, 0.0] and not cell["significant"], metric
        assert cell["ci"][0] <= cell["mean"] <= cell["ci"][1]
    md = (tmp_path / "results.md").read_text()
    assert "(+0.00 [+0.00, +0.00])" in md and " *)" not in md and "95% paired bootstrap interval" in md
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["table"]["metrics"][second]["retrieval T2I R@1"]["delta_ci"] == [0.0, 0.0]


def test_captions_the_model_cannot_tell_apart_are_a_tie_which_is_wrong(world):
    """A long caption and a negative that differ only past the 77-token context are the same input to the model:
    they share one encoding (BackboneScorer.text_input_keys), score exactly alike and the item counts as wrong, however
    the other texts are batched; a negative that differs inside the context is scored on its own."""
    from adapters.scoring import BackboneScorer
    from train.eval.datasets import Benchmark, Item
    from train.eval.evaluate import run_compositional

    scorer = BackboneScorer(load_backbone("tiny", "none"), "tiny")
    image = str(sorted((world / "images").glob("*.png"))[0])
    long = "a small red circle to the left of a large blue square and " * 12
    cut, kept = (long + "a red star", long + "a blue star"), ("a red star", "a blue star")
    assert scorer.text_input_keys(cut)[0] == scorer.text_input_keys(cut)[1]
    assert len(set(scorer.text_input_keys(kept))) == 2
    encoded = []
    original = scorer.encode_texts
    scorer.encode_texts = lambda texts: encoded.extend(texts) or original(texts)
    bench = Benchmark("toyworld", "text", [Item("cut", (image,), cut, "swap-obj"), Item("kept", (image,), kept, "x")])
    for batch_size in (1, 3):
        encoded.clear()
        out = run_compositional(scorer, bench, batch_size)
        assert out["per_type"]["swap-obj"]["acc"] == 0.0  # a tie is wrong, every time
        assert sorted(encoded) == sorted([cut[0], *kept])  # the cut pair encoded once


def test_only_heads_that_read_tokens_alone_merge_captions_truncation_made_equal(tmp_path_factory):
    """SmartCLIP reads the caption's tokens only, so captions equal after truncation are one input to it; ComAlign
    parses the whole caption with spaCy, so they stay apart."""
    from adapters.adapter_scorer import AdapterScorer
    from adapters.registry import ADAPTERS
    from adapters.scoring import token_keys

    long = "a small red circle to the left of a large blue square and " * 12
    cut = [long + "a red star", long + "a blue star"]
    bb = load_backbone("tiny", "none")
    assert ADAPTERS.get("smartclip").text_from_tokens and not ADAPTERS.get("comalign").text_from_tokens
    for method, merged in (("smartclip", True), ("comalign", False)):
        scorer = AdapterScorer.__new__(AdapterScorer)  # only the head class and the backbone are read
        scorer.head, scorer.backbone = ADAPTERS.get(method), bb
        keys = scorer.text_input_keys(cut)
        assert (keys[0] == keys[1]) is merged
        assert keys == (token_keys(bb, cut) if merged else cut)


def test_no_data_option_evaluates_on_the_embedded_toy_world(world, tmp_path, monkeypatch, capsys):
    """`python -m train.eval` alone evaluates on the embedded default (as train.adapter.engine trains on it), instead
    of writing an empty table."""
    import shutil

    calls = []

    def ensure(*args, say=print, **kwargs):  # the embedded world, stood in for by the small one of this module
        calls.append(args)
        shutil.copytree(world, tmp_path / "runs" / "toy", dirs_exist_ok=True)
        return toyworld.DEFAULT_PATH

    monkeypatch.setattr(toyworld, "ensure", ensure)
    monkeypatch.chdir(tmp_path)
    assert main(["--tasks", "retrieval", "--out", "eval"]) == 0
    out = capsys.readouterr().out
    assert calls and "data: the embedded toy world runs/toy (no --data given)" in out
    assert "| retrieval T2I R@1 |" in out
