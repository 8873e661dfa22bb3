"""serve.search: the two-stage search (FAISS first stage, the model's own re-ranking from the feature cache) against
brute-force references, filters and paging, the served recall against train.eval.evaluate --cache (the exactness check)
for the bare backbone and every adapter (ComAlign, SmartCLIP, PowerCLIP) and a FILIP checkpoint, model mismatch,
bad queries, and FILIP's first stage and re-ranking.

The setup is shared with tests/serve/test_serve_query.py and tests/train/test_evaluate.py and made once per session: the
120-scene toy world and trained ComAlign of tests/train/test_adapter.py, and two flat index directories of the world's test
split built by serve.index (one for the adapter, one for the bare backbone).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from serve.recall import recall_table, served_recall
from serve.search import QueryError, Searcher, cache_keys, encode_arrays

from fixtures.serve import QUERY, serve_setup


# --------------------------------------------------------------------------------------------- shared setup
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return serve_setup(tmp_path_factory)


@pytest.fixture(scope="module")
def adapter(setup):
    return Searcher.open(setup.adapter_index)


@pytest.fixture(scope="module")
def backbone(setup):
    return Searcher.open(setup.backbone_index)


def _all_reps(searcher, side: str):
    """Every item of ``side`` of the collection, encoded from its parts' caches, one batch each (the reference)."""
    from adapters.scoring import cat_reps
    from extract.cache import FeatureCache

    parts = []
    for part in searcher.manifest.get("parts") or [{"cache": searcher.manifest["cache"]}]:
        cache = FeatureCache.open(part["cache"]["path"])
        n = cache.num_images if side == "image" else cache.num_captions
        keys = cache_keys(searcher.scorer, side)
        parts.append(encode_arrays(searcher.scorer, {k: cache.gather(k, np.arange(n)) for k in keys}, side))
    return cat_reps(parts)


def _assert_ordered_by(rows, scores, reference, tol=1e-5):
    """``rows`` carry ``scores`` equal to ``reference[rows]`` and are in descending reference order (pairs closer
    than ``tol`` may come either way: the reference is computed in other batches)."""
    ref = np.asarray(reference, dtype=np.float64)
    np.testing.assert_allclose(scores, ref[rows], rtol=0, atol=tol)
    assert all(ref[a] >= ref[b] - tol for a, b in zip(rows, rows[1:])), (rows, ref[rows])


# --------------------------------------------------------------------------------------------- the two stages
def _query_scores(searcher):
    """[N] scores of QUERY against every image of ``searcher``'s collection: first stage and the scorer's own."""
    scorer = searcher.scorer
    images = _all_reps(searcher, "image")
    q = scorer.encode_texts([QUERY])
    first = (scorer.first_stage_image(images, "t2i") @ scorer.first_stage_text(q, "t2i")[0]).numpy()
    return first, scorer.score_directed(images, q, "t2i")[:, 0].numpy()


@pytest.mark.slow
def test_first_stage_is_the_flat_search_and_reranking_is_the_scorers_own_order(adapter, setup):
    assert adapter.has_second_stage and adapter.num_images == 12 and adapter.num_captions == 53
    first, own = _query_scores(adapter)

    plain = adapter.search_text(QUERY, k=12)
    rows = [h.row for h in plain]
    assert sorted(rows) == list(range(12)) and plain.rerank is None
    _assert_ordered_by(rows, [h.score for h in plain], first)
    assert [h.rank_before for h in plain] == [h.rank_after for h in plain] == list(range(1, 13))

    for k, K in ((12, 12), (4, 6)):
        hits = adapter.search_text(QUERY, k=k, rerank=K)
        candidates = rows[:K]  # the first stage's top K ...
        assert {h.row for h in hits} <= set(candidates) and hits.rerank == K and len(hits) == k
        assert [h.rank_before for h in hits] == [candidates.index(h.row) + 1 for h in hits]
        # ... re-ordered by the scorer's own t2i score, which each hit carries
        _assert_ordered_by([h.row for h in hits], [h.rerank_score for h in hits], own)
        best = sorted(candidates, key=lambda r: -own[r])[:k]
        assert [h.row for h in hits] == best or np.allclose(own[[h.row for h in hits]], own[best], atol=1e-5)
        assert [h.rank_after for h in hits] == list(range(1, k + 1))
        assert all(h.score == pytest.approx(first[h.row], abs=1e-5) for h in hits)


@pytest.mark.slow
def test_an_image_query_reranks_captions_with_the_i2t_score(adapter, setup):
    from PIL import Image

    scorer = adapter.scorer
    path = str(setup.world / "images" / "000008.png")
    captions = _all_reps(adapter, "text")
    q = scorer.encode_pil([Image.open(path).convert("RGB")], [path])
    first = (scorer.first_stage_text(captions, "i2t") @ scorer.first_stage_image(q, "i2t")[0]).numpy()
    own = scorer.score_directed(q, captions, "i2t")[0].numpy()
    full = adapter.search_image(path, k=53)
    _assert_ordered_by([h.row for h in full], [h.score for h in full], first)
    hits = adapter.search_image(path, k=5, rerank=20)
    top20 = [h.row for h in full][:20]
    assert {h.row for h in hits} <= set(top20)
    _assert_ordered_by([h.row for h in hits], [h.rerank_score for h in hits], own)
    assert np.allclose(sorted(own[top20], reverse=True)[:5], [h.rerank_score for h in hits], atol=1e-5)
    hit = hits[0]
    assert hit.kind == "text" and hit.text == hit.metadata["text"] and hit.id == hit.metadata["caption_id"]
    assert hit.path.endswith(".png") and Path(hit.path).is_file()  # a caption hit names its image's file


@pytest.mark.slow
def test_a_bare_backbone_has_no_second_stage_and_its_first_stage_is_its_score(backbone):
    scorer = backbone.scorer
    assert not backbone.has_second_stage and backbone.caches is None
    hits = backbone.search_text(QUERY, k=5, rerank=50)
    assert hits.rerank is None and any("no second stage" in n and "rerank=50 ignored" in n for n in hits.notes)
    assert all(h.rerank_score is None and h.rank_before == h.rank_after for h in hits)
    images = _all_reps(backbone, "image")
    cosine = scorer.score(images, scorer.encode_texts([QUERY]))[:, 0].numpy()
    _assert_ordered_by([h.row for h in hits], [h.score for h in hits], cosine)
    assert sorted(cosine, reverse=True)[:5] == pytest.approx([h.score for h in hits], abs=1e-5)


# --------------------------------------------------------------------------------------------- filters and paging
def _reference(full, predicate):
    """The unfiltered full ranking filtered by ``predicate`` on the metadata row: what a filter must return."""
    return [h.row for h in full if predicate(h.metadata)]


@pytest.mark.slow
@pytest.mark.parametrize("subset_rows", [4096, 0])  # 0: never score the kept rows directly, always over-fetch
def test_filters_and_pages_match_a_brute_force_reference(adapter, setup, monkeypatch, subset_rows):
    import serve.search as search

    monkeypatch.setattr(search, "SUBSET_ROWS", subset_rows)
    path = str(setup.world / "images" / "000008.png")
    full = adapter.search_image(path, k=53)
    ids = sorted({h.metadata["image_id"] for h in full})
    cases = [({"image_id": ids[0]}, lambda m: m["image_id"] == ids[0]),
             ({"image_id": ids[:3]}, lambda m: m["image_id"] in ids[:3]),
             ({"image_id": set(ids[:6]), "image_row": [0, 1, 2, 3]},
              lambda m: m["image_id"] in ids[:6] and m["image_row"] in (0, 1, 2, 3)),
             (lambda m: "red" in m["text"], lambda m: "red" in m["text"]),
             ({"image_id": "no such id"}, lambda m: False)]
    for where, predicate in cases:
        expected = _reference(full, predicate)
        for k in (1, 2, 50):
            got = adapter.search_image(path, k=k, where=where)
            assert [h.row for h in got] == expected[:k], (where, k)
            assert [h.rank_before for h in got] == list(range(1, len(got) + 1))
            assert got.considered == min(len(expected), k)
            if len(expected) < k:
                assert any("pass the filter" in n for n in got.notes)
        pages = [adapter.search_image(path, k=3, where=where, offset=o) for o in range(0, len(expected) + 3, 3)]
        assert [h.row for p in pages for h in p] == expected
        assert [h.rank_after for p in pages for h in p] == list(range(1, len(expected) + 1))
        # re-ranked pages: one candidate list (the filtered top 20), paged
        reranked = adapter.search_image(path, k=20, rerank=20, where=where)
        assert {h.row for h in reranked} == set(expected[:20])
        paged = [h.row for o in range(0, 20, 5) for h in adapter.search_image(path, k=5, rerank=20, where=where,
                                                                              offset=o)]
        assert paged == [h.row for h in reranked]


def test_filters_on_images_and_list_columns(adapter):
    full = adapter.search_text(QUERY, k=12)
    some = full[5].metadata
    caption = some["captions"][0]
    got = adapter.search_text(QUERY, k=3, where={"captions": caption})  # a list column: holds the value
    assert [h.row for h in got] == _reference(full, lambda m: caption in m["captions"])[:3]
    got = adapter.search_text(QUERY, k=12, where={"row": [str(some["row"]), 0]})  # values read as the column's type
    assert [h.row for h in got] == _reference(full, lambda m: m["row"] in (some["row"], 0))
    with pytest.raises(QueryError, match="has columns row, image_id, path"):
        adapter.search_text(QUERY, where={"colour": "red"})
    with pytest.raises(QueryError, match="column row holds"):
        adapter.search_text(QUERY, where={"row": "first"})
    with pytest.raises(QueryError, match="mapping of column"):
        adapter.search_text(QUERY, where=["image_id=3"])


def test_parse_where():
    from serve.sides import parse_where

    assert parse_where(["image_id=3", "image_id=5", "text=a=b"]) == {"image_id": ["3", "5"], "text": ["a=b"]}
    for bad in ("image_id", "=3"):
        with pytest.raises(QueryError, match="COLUMN=VALUE"):
            parse_where([bad])


# --------------------------------------------------------------------------------------------- exactness
def _rank_recalls(ranks, n):
    r = np.asarray(ranks, dtype=np.float64)
    return [float((r <= k).mean() * 100) for k in range(1, n + 1)]


def test_served_recall_equals_evaluate_from_the_cache(adapter, backbone, setup, tmp_path):
    """With a flat index and K covering the collection, served R@k is train.eval.evaluate --cache's exactly, for the
    adapter (re-ranked) and the bare backbone (first stage alone); every rank agrees, not just R@1/5/10."""
    from adapters.eval.ranking import image_to_text_ranks, text_to_image_ranks
    from train.eval.evaluate import main

    live = json.loads((setup.run / "eval" / "results.json").read_text())["results"]  # the run's final table: live
    caption_image = torch.from_numpy(setup.cache.caption_image_index())
    for searcher, name, model, cache, rerank in ((adapter, "tiny + comalign", setup.run, setup.cache, 100),
                                                 (backbone, "tiny", "tiny", setup.backbone_cache, None)):
        out = tmp_path / name  # each model evaluated from the cache its index was built from
        assert main(["--model", str(model), "--tasks", "retrieval", "--cache", str(cache.path), "--annotations",
                     str(setup.world), "--out", str(out)]) == 0
        ev = json.loads((out / "results.json").read_text())["results"][name]["retrieval"]
        served = served_recall(searcher, rerank)
        for d in ("text_to_image", "image_to_text"):
            for k in ("R@1", "R@5", "R@10"):
                assert served[d][k] == ev[d][k], (name, d, k)
                # live evaluation (fp32 images re-encoded) is within a query or two of the fp16 cache
                n = live[name]["retrieval"]["captions" if d == "text_to_image" else "images"]
                assert abs(live[name]["retrieval"][d][k] - ev[d][k]) <= 2 * 100 / n + 1e-9
        # every rank: served R@k for k = 1..n against the ranks of the full matrix of the cached arrays
        scorer = searcher.scorer
        images, captions = _all_reps(searcher, "image"), _all_reps(searcher, "text")
        t2i = scorer.score_directed(images, captions, "t2i") if rerank else scorer.score(images, captions)
        i2t = scorer.score_directed(images, captions, "i2t") if rerank else t2i
        everything = served_recall(searcher, rerank, ks=range(1, 54))
        assert everything["text_to_image"]["R@12"] == 100.0
        want_t2i = _rank_recalls(text_to_image_ranks(t2i, caption_image), 53)
        want_i2t = _rank_recalls(image_to_text_ranks(i2t, caption_image), 53)
        assert [everything["text_to_image"][f"R@{k}"] for k in range(1, 54)] == pytest.approx(want_t2i, abs=1e-9)
        assert [everything["image_to_text"][f"R@{k}"] for k in range(1, 54)] == pytest.approx(want_i2t, abs=1e-9)
    assert served_recall(adapter, 100)["text_to_image"]["rerank"] == 12  # clamped to the 12 images


def _served_models() -> tuple[str, ...]:
    """Every registered adapter but the setup's ComAlign (a new method is covered when it registers), and FILIP."""
    from adapters.registry import ADAPTERS

    return (*(name for name in ADAPTERS.names() if name != "comalign"), "filip")


SERVED_MODELS = _served_models()  # besides the setup's ComAlign and bare backbone


def served_model(setup, method: str) -> tuple[str, Path]:
    """Session-wide: ``method`` trained one epoch on the setup's world (an adapter: ``train.adapter``; "filip": the
    tiny backbone pre-trained with ``train.pretrain``) and the flat index of the world's test split built for it by
    ``serve.index``: (the model as ``--model`` takes it, the index directory). Seconds each on the tiny backbone."""
    from serve.index import IndexOptions, build_index

    run = setup.root / f"{method}-1-epoch"
    if method == "filip":
        from train.pretrain.options import PretrainOptions
        from train.pretrain.engine import pretrain

        if not (run / "model.json").is_file():  # written after the weights
            pretrain(PretrainOptions(method="filip", model="tiny", data=str(setup.world), epochs=1, batch_size=32,
                                     seed=0, out=str(run), workers=0, eval_every_n_epochs=0, save_every_n_steps=0,
                                     tensorboard=False, device="cpu"))
        model = run / "model.safetensors"
    else:
        from train.adapter.engine import AdapterOptions, train

        if not (run / "summary.json").is_file():
            train(AdapterOptions(method=method, data=str(setup.world), out=str(run),
                                 cache_dir=str(setup.root / "cache"), workers=0, extract_batch_size=64, batch_size=48,
                                 eval_batch_size=256, epochs=1, final_eval=False))
        model = run
    index = setup.root / f"index-{method}"
    if not (index / "manifest.json").is_file():
        build_index(IndexOptions(model=str(model), data=str(setup.world), out=str(index), kind="flat",
                                 cache_dir=str(setup.root / "serve-cache"), workers=0))
    return str(model), index


@pytest.mark.slow
@pytest.mark.parametrize("method", SERVED_MODELS)
def test_every_models_served_recall_equals_evaluate_from_the_cache(setup, tmp_path, method):
    """The exactness check for the other adapters and a FILIP checkpoint: with a flat index and K covering the
    collection, served R@1/5/10 are train.eval.evaluate --cache's on the cache the index was built from, and R@k for
    every k is the ranks of the scorer's full matrices of the cached arrays (ComAlign and the backbone: above)."""
    from adapters.eval.ranking import image_to_text_ranks, text_to_image_ranks
    from serve.search import directed_score
    from train.eval.evaluate import main

    model, index = served_model(setup, method)
    searcher = Searcher.open(index)
    assert searcher.has_second_stage and searcher.num_images == 12 and searcher.num_captions == 53
    cache = searcher.manifest["cache"]["path"]
    assert main(["--model", model, "--tasks", "retrieval", "--cache", cache, "--annotations", str(setup.world),
                 "--out", str(tmp_path / "eval")]) == 0
    (ev,) = (r["retrieval"] for r in json.loads((tmp_path / "eval" / "results.json").read_text())["results"].values())
    served = served_recall(searcher, 53)
    for d in ("text_to_image", "image_to_text"):
        assert served[d]["n"] == ev[d]["n"]
        for k in ("R@1", "R@5", "R@10"):
            assert served[d][k] == ev[d][k], (method, d, k, served[d][k], ev[d][k])
    scorer = searcher.scorer
    images, captions = _all_reps(searcher, "image"), _all_reps(searcher, "text")
    caption_image = torch.from_numpy(np.asarray(searcher.collection("text").column("image_row"), dtype=np.int64))
    everything = served_recall(searcher, 53, ks=range(1, 54))
    want_t2i = _rank_recalls(text_to_image_ranks(directed_score(scorer, images, captions, "t2i"), caption_image), 53)
    want_i2t = _rank_recalls(image_to_text_ranks(directed_score(scorer, images, captions, "i2t"), caption_image), 53)
    assert [everything["text_to_image"][f"R@{k}"] for k in range(1, 54)] == pytest.approx(want_t2i, abs=1e-9)
    assert [everything["image_to_text"][f"R@{k}"] for k in range(1, 54)] == pytest.approx(want_i2t, abs=1e-9)


def test_a_filip_checkpoint_is_indexed_and_reranked_by_its_late_interaction(setup):
    """serve.index reads FILIP's patch and token embeddings from a cache extracted with them; the first stage is
    the mean of the unit tokens (an approximation, said in the notes of a search without re-ranking), and the
    re-ranked order is FILIP's own s^T (a text's images) / s^I (an image's captions) of the candidates."""
    from adapters.objectives.filip import FILIPScorer
    from extract.cache import FeatureCache
    from PIL import Image

    _, index = served_model(setup, "filip")
    searcher = Searcher.open(index)
    scorer = searcher.scorer
    assert isinstance(scorer, FILIPScorer) and searcher.manifest["model"]["kind"] == "pretrain"
    cache = FeatureCache.open(searcher.manifest["cache"]["path"])
    assert {"patch_tokens", "token_embed", "token_mask"} <= set(cache.keys)  # --components patches,tokens
    first, own = _query_scores(searcher)
    plain = searcher.search_text(QUERY, k=12)
    rows = [h.row for h in plain]
    _assert_ordered_by(rows, [h.score for h in plain], first)
    assert any("only approximates FILIP's late-interaction score" in n for n in plain.notes)
    for k, K in ((12, 12), (4, 6)):
        hits = searcher.search_text(QUERY, k=k, rerank=K)
        assert not any("approximates" in n for n in hits.notes)
        candidates = rows[:K]
        assert {h.row for h in hits} <= set(candidates) and hits.rerank == K
        assert [h.rank_before for h in hits] == [candidates.index(h.row) + 1 for h in hits]
        _assert_ordered_by([h.row for h in hits], [h.rerank_score for h in hits], own)
        best = sorted(candidates, key=lambda r: -own[r])[:k]
        assert np.allclose(own[[h.row for h in hits]], own[best], atol=1e-5)
    # an image query: its captions re-ranked by s^I
    path = str(setup.world / "images" / "000008.png")
    captions = _all_reps(searcher, "text")
    qi = scorer.encode_images(scorer.preprocess(Image.open(path).convert("RGB"))[None])
    own_i = scorer.score_directed(qi, captions, "i2t")[0].numpy()
    full = [h.row for h in searcher.search_image(path, k=53)]
    hits = searcher.search_image(path, k=5, rerank=20)
    assert {h.row for h in hits} <= set(full[:20])
    _assert_ordered_by([h.row for h in hits], [h.rerank_score for h in hits], own_i)
    assert np.allclose(sorted(own_i[full[:20]], reverse=True)[:5], [h.rerank_score for h in hits], atol=1e-5)


def test_a_collection_of_two_parts_reranks_each_from_its_own_cache(setup, tmp_path):
    """serve.index --add appends a source with its own cache: stage 2 reads each candidate from its part's cache."""
    import shutil

    from serve.index import IndexOptions, build_index

    two = tmp_path / "two-parts"
    shutil.copytree(setup.adapter_index, two)
    build_index(IndexOptions(model=str(setup.run), data=str(setup.world), split="val", out=str(two), add=True,
                             kind="flat", cache_dir=str(setup.root / "serve-cache"), workers=0))
    searcher = Searcher.open(two)
    assert len(searcher.caches) == 2 and searcher.num_images == 24
    scorer = searcher.scorer
    own = scorer.score_directed(_all_reps(searcher, "image"), scorer.encode_texts([QUERY]), "t2i")[:, 0].numpy()
    hits = searcher.search_text(QUERY, k=24, rerank=24)
    assert {h.metadata["part"] for h in hits} == {0, 1}
    _assert_ordered_by([h.row for h in hits], [h.rerank_score for h in hits], own)
    captions = searcher.search_image(str(setup.world / "images" / "000008.png"), k=5, rerank=200)
    assert captions.rerank == searcher.num_captions and len(captions) == 5
    recall = served_recall(searcher, 100)
    assert recall["text_to_image"]["n"] == searcher.num_captions and recall["image_to_text"]["n"] == 24


def test_served_recall_with_live_queries_and_the_table(adapter, backbone):
    # live queries (each caption and image file encoded as a user's query) against the cached collection
    cached, live = served_recall(backbone, None), served_recall(backbone, None, queries="live")
    for d, n in (("text_to_image", 53), ("image_to_text", 12)):
        assert live[d]["n"] == cached[d]["n"] == n
        for k in ("R@1", "R@5", "R@10"):
            assert abs(live[d][k] - cached[d][k]) <= 2 * 100 / n + 1e-9
    table = recall_table(adapter, (5, 100), evaluation={"text_to_image": {"R@1": 1, "R@5": 2, "R@10": 3},
                                                        "image_to_text": {"R@1": 4, "R@5": 5, "R@10": 6}})
    lines = table.splitlines()
    assert lines[0] == "| | T2I R@1 | T2I R@5 | T2I R@10 | I2T R@1 | I2T R@5 | I2T R@10 |"
    assert [line.split(" |")[0] for line in lines[2:]] == ["| served, first stage", "| served, re-ranked K=5",
                                                           "| served, re-ranked K=100", "| train.eval"]
    assert lines[-1] == "| train.eval | 1.00 | 2.00 | 3.00 | 4.00 | 5.00 | 6.00 |"
    assert len(recall_table(backbone).splitlines()) == 3  # no second stage: the first stage alone


# --------------------------------------------------------------------------------------------- the model
def test_a_model_other_than_the_indexs_is_refused_naming_both(setup):
    from serve.layout import ModelMismatchError

    with pytest.raises(ModelMismatchError, match=r"tiny \+ comalign.*not tiny \(fingerprint"):
        Searcher.open(setup.adapter_index, "tiny")
    with pytest.raises(ModelMismatchError, match=r"built with tiny .*not tiny \+ comalign"):
        Searcher.open(setup.backbone_index, str(setup.run), annotations=str(setup.world))
    with pytest.raises(ModelMismatchError, match="built with tiny"):  # other weights of the same architecture
        Searcher.open(setup.backbone_index, "tiny-coca", pretrained="none")


# --------------------------------------------------------------------------------------------- bad queries
def test_bad_queries_are_refused_or_noted(adapter, setup):
    from PIL import Image

    for bad, message in (("", "empty query"), ("   \n", "empty query"), (None, "query is not text"),
                         (12, "query is not text"), ("1 2 3", "no letters"), ("a\x00b", "binary data")):
        with pytest.raises(QueryError, match=message):
            adapter.search_text(bad)
    long = ("a red circle to the left of a blue square and " * 250)[:2_000]
    hits = adapter.search_text(long, k=3, rerank=5)
    assert len(hits) == 3 and any("longer than the model's 77-token text context" in n for n in hits.notes)
    with pytest.raises(QueryError, match="query of 10,000 characters refused"):
        adapter.search_text(long * 5)
    for k in (0, -1, 1.5, True, "3"):
        with pytest.raises(QueryError, match="k must be a whole number >= 1"):
            adapter.search_text(QUERY, k=k)
    with pytest.raises(QueryError, match="rerank must be a whole number >= 1"):
        adapter.search_text(QUERY, rerank=0)
    with pytest.raises(QueryError, match="offset must be a whole number >= 0"):
        adapter.search_text(QUERY, offset=-1)
    clamped = adapter.search_text(QUERY, k=1000, rerank=5000)
    assert len(clamped) == 12 and clamped.k == 12 and clamped.rerank == 12
    assert {"k=1000 is more than the 12 images in the collection: clamped to 12",
            "rerank=5000 is more than the 12 images in the collection: clamped to 12"} <= set(clamped.notes)
    raised = adapter.search_text(QUERY, k=5, rerank=3, offset=2)
    assert raised.rerank == 7 and any("raised to offset + k = 7" in n for n in raised.notes)
    assert adapter.search_text(QUERY, k=5, offset=20).notes[-1] == "offset 20 is past the last of the 12 hits: no hits"
    from io import BytesIO

    bomb = BytesIO()
    Image.new("1", (12000, 12000)).save(bomb, "PNG")  # 144 Mpx from a few kB: refused from the header
    for image, message in ((b"\xff\xd8 this is not really a JPEG " * 8, "corrupt or unrecognised"),
                           (b"filepath,title\na CSV file\n", "corrupt or unrecognised"), (bomb.getvalue(),
                                                                                           "decompression bomb"),
                           (str(setup.root / "missing.png"), "file not found"), (b"", "empty file"),
                           (3.5, "a path, encoded bytes or a PIL image")):
        with pytest.raises(QueryError, match=message):
            adapter.search_image(image)
    pil = Image.open(setup.world / "images" / "000008.png")
    assert [h.row for h in adapter.search_image(pil, k=3)] == \
        [h.row for h in adapter.search_image(str(setup.world / "images" / "000008.png"), k=3)]


# --------------------------------------------------------------------------------------------- FILIP's first stage
def test_filip_first_stage_is_the_mean_of_its_unit_tokens(tiny_toy_cache):
    from adapters.objectives.filip import FILIPScorer
    from extract.models.backbone import load_backbone
    from PIL import Image

    scorer = FILIPScorer(load_backbone("tiny", "none"))
    texts = ["a red circle", "a small blue square to the left of a large green star"]
    t = scorer.encode_texts(texts)
    vt = scorer.first_stage_text(t, "t2i")
    assert torch.equal(vt, scorer.first_stage_text(t, "i2t"))
    for j in range(len(texts)):  # the reference: the mean of the real tokens (no start-of-text, no padding)
        real = t["tokens"][j][t["mask"][j]]
        assert real.shape[0] == int(t["mask"][j].sum()) < t["tokens"].shape[1]
        ref = real.mean(0) / real.mean(0).norm()
        assert torch.allclose(vt[j], ref, atol=1e-6)
    cache = tiny_toy_cache(["patches", "tokens"])
    rows = np.arange(4)
    images = encode_arrays(scorer, {k: cache.gather(k, rows) for k in cache_keys(scorer, "image")}, "image")
    vi = scorer.first_stage_image(images, "i2t")
    ref = images["patches"].mean(1)
    assert torch.allclose(vi, ref / ref.norm(dim=-1, keepdim=True), atol=1e-6)
    # the cached arrays give what live encoding gives, to fp16 rounding
    from extract.data.sources import ToyWorldSource

    world = Path(json.loads((cache.path / "config.json").read_text())["data"])
    records = {r.image_id: r for r in ToyWorldSource(world, "train").records()}
    pils = [Image.open(records[i].source).convert("RGB") for i in cache.image_ids()[:4]]
    live = scorer.encode_images(torch.stack([scorer.preprocess(p) for p in pils]))
    assert torch.allclose(images["patches"], live["patches"], atol=5e-3)
    caps = encode_arrays(scorer, {k: cache.gather(k, rows) for k in cache_keys(scorer, "text")}, "text")
    captions = {c.id: c.text for r in records.values() for c in r.captions}
    live_t = scorer.encode_texts([captions[c] for c in cache.caption_ids()[:4]])
    assert torch.equal(caps["mask"], live_t["mask"])  # padded to the context, as live encoding
    # a shard trimmed to a shorter longest caption gives the same width and scores (batches of two shards concatenate)
    width = int(cache.gather("token_mask", rows).sum(1).max())
    short = encode_arrays(scorer, {k: cache.gather(k, rows)[:, :width] for k in cache_keys(scorer, "text")}, "text")
    assert short["tokens"].shape == caps["tokens"].shape and torch.equal(short["mask"], caps["mask"])
    assert torch.equal(scorer.score_directed(images, short, "t2i"), scorer.score_directed(images, caps, "t2i"))
    assert torch.allclose(scorer.first_stage_text(caps), scorer.first_stage_text(live_t), atol=5e-3)



def test_a_query_vector_is_checked_before_any_cast():
    """serve.search.query_vector, the one rule of every vector query (Python API, HTTP, serve.query): a list of
    numbers of the index's width, finite, within float32's range (checked in float64: no overflow warning), with a
    direction (a zero vector or one whose float32 norm underflows would rank every item the same)."""
    import warnings

    from serve.search import query_vector

    good = query_vector([0.6, 0.8])
    assert good.dtype == np.float32 and good.shape == (1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any numpy warning would fail here
        for vector, message in (([0.0, 0.0], "no direction"), ([1e-30, 1e-30], "no direction"),
                                ([1e-46, 0.0], "no direction"), ([1e308, 0.0], "beyond float32's range"),
                                ([10 ** 400, 0], "beyond float32's range"), ([float("nan"), 1.0], "non-finite"),
                                ([float("-inf"), 1.0], "non-finite"), (["a", "b"], "a list of numbers"),
                                ([[1.0], [2.0, 3.0]], "a list of numbers")):
            with pytest.raises(QueryError, match=message):
                query_vector(vector, 2)
        with pytest.raises(QueryError, match="a query vector of 3 numbers: the index holds 2-d"):
            query_vector([1.0, 2.0, 3.0], 2)
    np.testing.assert_array_equal(query_vector([1e-3, 0.0]), np.float32([[1e-3, 0.0]]))  # small, with a direction


def test_the_python_api_refuses_a_vector_without_direction(adapter):
    width = adapter.collection("image").index.d
    with pytest.raises(QueryError, match="no direction"):
        adapter.search_vector(np.zeros(width), "image")
    with pytest.raises(QueryError, match="no direction"):
        adapter.search_vector([1e-30] * width, "text")
    assert len(adapter.search_vector(np.ones(width), "image", k=3)) == 3


@pytest.mark.slow
@pytest.mark.parametrize("method", ("backbone", "comalign", *SERVED_MODELS))
def test_every_scorer_load_scorer_returns_takes_every_call_of_the_protocol(setup, method):
    """A user who swaps an adapter for its base (or a pre-trained model) keeps the calls: encode_pil (decoded images of
    any mode, ids optional), encode_images, encode_texts, score, score_directed and both first stages work on every
    scorer load_scorer returns; where no component needs the decoded image, encode_pil is encode_images of the
    preprocessed images."""
    from PIL import Image

    from adapters.load import load_scorer

    model = {"backbone": "tiny", "comalign": str(setup.run)}.get(method) or served_model(setup, method)[0]
    scorer = load_scorer(model, annotations=setup.world)
    files = sorted((setup.world / "images").glob("*.png"))[:3]
    pils = [Image.open(f).convert("L" if k == 0 else "RGB") for k, f in enumerate(files)]  # a greyscale one too
    ids = [str(int(f.stem)) for f in files]
    images = scorer.encode_pil(pils, ids)
    texts = scorer.encode_texts(["a red circle", "a blue square to the left of a green star"])
    for direction in ("t2i", "i2t"):
        assert scorer.score_directed(images, texts, direction).shape == (3, 2)
        assert scorer.first_stage_image(images, direction).shape[0] == 3
        assert scorer.first_stage_text(texts, direction).shape[0] == 2
    assert torch.isfinite(scorer.score(images, texts)).all()
    if not getattr(getattr(scorer, "extractor", None), "needs_pixels", False):
        tensors = torch.stack([scorer.preprocess(im.convert("RGB")) for im in pils])
        again = scorer.encode_images(tensors) if method in ("backbone", "filip") else scorer.encode_images(tensors, ids)
        torch.testing.assert_close(scorer.score(again, texts), scorer.score(images, texts))
    if method in ("backbone", "filip"):  # ids are for an adapter's ground-truth boxes: the others take none
        torch.testing.assert_close(scorer.score(scorer.encode_pil(pils), texts), scorer.score(images, texts))
