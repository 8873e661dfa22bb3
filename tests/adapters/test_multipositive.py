"""Multi-positive retrieval (any-true R@k, mAP) against a hand-computed example and a per-query reference, in every
chunked / stored / streaming configuration of adapters.eval.retrieval, and the toy world's truth against satisfies()."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from adapters.eval.multipositive import ranked_truth, summary, toyworld_truth
from fixtures.references import reference
from adapters.eval.retrieval import retrieval_queries


def _fn(scores):
    s = torch.as_tensor(scores, dtype=torch.float32)
    return lambda rows: s[:, rows]


# 3 images, 3 captions (caption t belongs to image t). Caption 0 is also true of image 2, caption 2 of image 0.
HAND_S = np.array([[.2, .9, .5],
                   [.8, .4, .5],
                   [.6, .1, .3]])
HAND_TRUTH = np.array([[1, 0, 1],
                       [0, 1, 0],
                       [1, 0, 1]], dtype=bool)


def test_hand_computed_example():
    q = retrieval_queries(_fn(HAND_S), 3, torch.arange(3), truth=torch.from_numpy(HAND_TRUTH))
    m = q.multi
    # caption 0: i1 .8 (false) > i2 .6 (true) > i0 .2 (true): true images at positions 2 and 3, AP (1/2 + 2/3) / 2
    # caption 1: i0 .9 (false) > i1 .4 (true): position 2, AP 1/2
    # caption 2: i0 .5 (true) ties i1 .5 (false): the false one ranks first (ties against the model); i2 .3 true
    #            sits behind i1: positions 2 and 3, AP 7/12
    assert m.t2i_first.tolist() == [2, 2, 2] and m.t2i_true.tolist() == [2, 1, 2]
    np.testing.assert_allclose(m.t2i_ap.numpy(), [7 / 12, 1 / 2, 7 / 12])
    assert q.t2i.tolist() == [3, 2, 3]  # strict: only the own image counts
    # image 0 ranks c1 .9 (false), c2 .5 (true), c0 .2 (true): positions 2, 3; image 1: c0 .8, c2 .5 false, c1 .4
    # true: position 3; image 2: c0 .6, c2 .3 true, c1 .1 false: positions 1, 2, AP 1
    assert m.i2t_first.tolist() == [2, 3, 1] and m.i2t_true.tolist() == [2, 1, 2]
    np.testing.assert_allclose(m.i2t_ap.numpy(), [7 / 12, 1 / 3, 1.0])
    t2i = summary(m.t2i_first, m.t2i_ap, m.t2i_true, strict=q.t2i)
    assert t2i["R@1"] == 0.0 and t2i["R@5"] == 100.0 and t2i["strict R@1"] == 0.0
    assert t2i["mAP"] == pytest.approx(100 * 20 / 36) and t2i["true_per_query"] == pytest.approx(5 / 3)
    i2t = summary(m.i2t_first, m.i2t_ap, m.i2t_true)
    assert i2t["R@1"] == pytest.approx(100 / 3) and i2t["mAP"] == pytest.approx(100 * 23 / 36)
    # a subset: the captions 1 and 2 alone
    assert summary(m.t2i_first, m.t2i_ap, m.t2i_true, torch.tensor([False, True, True]))["mAP"] == \
        pytest.approx(100 * (1 / 2 + 7 / 12) / 2)


def test_non_finite_scores_rank_last():
    nan, inf = float("nan"), float("inf")
    s = np.array([[nan, .5], [.1, inf], [.2, .3]])  # caption 0's own image scores NaN, caption 1 has an inf rival
    truth = np.array([[1, 0], [0, 1], [0, 0]], dtype=bool)
    q = retrieval_queries(_fn(s), 3, torch.tensor([0, 1]), truth=torch.from_numpy(truth))
    # caption 0: its only true image is NaN -> -inf, behind both finite false ones; caption 1: its own image is
    # +inf -> -inf, behind .5 and .3
    assert q.multi.t2i_first.tolist() == [3, 3] and q.t2i.tolist() == [3, 3]
    assert q.nonfinite == 2
    np.testing.assert_allclose(q.multi.t2i_ap.numpy(), [1 / 3, 1 / 3])


@pytest.mark.parametrize("chunk, max_bytes", [(7, 1 << 30), (7, 0), (1000, 0), (1, 1 << 30)])
def test_chunked_stored_and_streaming_equal_the_reference(chunk, max_bytes):
    rng = np.random.default_rng(1)
    n_img, n_txt = 19, 53
    cap = rng.integers(0, n_img, n_txt)
    cap[cap == 3] = 4  # image 3 has no caption of its own
    s = rng.integers(0, 5, (n_img, n_txt)).astype(np.float32)  # small integers: many exact ties
    s[rng.random(s.shape) < 0.05] = np.nan
    truth = rng.random((n_img, n_txt)) < 0.15
    truth[3] = False  # an image no caption of another image is true of
    q = retrieval_queries(_fn(s), n_img, torch.tensor(cap), chunk=chunk, max_bytes=max_bytes,
                          truth=torch.from_numpy(truth))
    full = truth.copy()
    full[cap, np.arange(n_txt)] = True  # a caption is true of its own image
    for got, want in zip((q.multi.t2i_first, q.multi.t2i_ap, q.multi.t2i_true), reference(s.T, full.T)):
        np.testing.assert_allclose(got.numpy(), want)
    for got, want in zip((q.multi.i2t_first, q.multi.i2t_ap, q.multi.i2t_true), reference(s, full)):
        np.testing.assert_allclose(got.numpy(), want)
    assert (q.multi.i2t_true == 0).any()  # images without any true caption: rank 0, AP NaN, left out of means
    # a truth given as a function of the chunk gives the same figures
    fn = retrieval_queries(_fn(s), n_img, torch.tensor(cap), chunk=chunk, max_bytes=max_bytes,
                           truth=lambda rows: torch.from_numpy(truth[:, rows]))
    assert torch.equal(fn.multi.i2t_first, q.multi.i2t_first) and torch.equal(fn.multi.t2i_ap, q.multi.t2i_ap)


def test_one_true_candidate_is_the_strict_rank():
    rng = np.random.default_rng(2)
    s = rng.normal(size=(11, 11)).astype(np.float32)
    q = retrieval_queries(_fn(s), 11, torch.arange(11), truth=torch.zeros(11, 11, dtype=torch.bool))
    assert torch.equal(q.multi.t2i_first, q.t2i) and torch.equal(q.multi.i2t_first, q.i2t)
    np.testing.assert_allclose(q.multi.t2i_ap.numpy(), 1 / q.t2i.double().numpy())


def test_ranked_truth_is_the_sorting_form_of_the_reference():
    rng = np.random.default_rng(3)
    s = rng.integers(0, 3, (6, 9)).astype(np.float32)
    t = rng.random((6, 9)) < 0.4
    for got, want in zip(ranked_truth(torch.from_numpy(s), torch.from_numpy(t)), reference(s, t)):
        np.testing.assert_allclose(got.numpy(), want)


def test_toyworld_truth_is_satisfies(tmp_path):
    from extract.worlds import toyworld

    toyworld.generate(tmp_path, n=60, seed=3, workers=1)
    scenes = {str(s["image_id"]): s for s in toyworld.load(tmp_path)["scenes"] if s["split"] == "train"}
    image_ids = list(scenes)
    captions = [(str(c["id"]), c) for s in scenes.values() for c in s["captions"]]
    truth = toyworld_truth(scenes, image_ids, [cid for cid, _ in captions])
    want = np.array([[toyworld.satisfies(scenes[i], c["struct"]) for _, c in captions] for i in image_ids])
    np.testing.assert_array_equal(truth.matrix.numpy(), want)
    own = np.array([image_ids.index(str(int(cid) // toyworld.CAPTION_SLOTS)) for cid, _ in captions])
    assert want[own, np.arange(len(captions))].all()  # every caption is true of its own scene
    one_object = np.array(truth.kinds) == "one-object"
    assert want[:, one_object].sum(0).max() > 1  # some one-object caption is true of several scenes
    groups = truth.caption_groups()
    assert list(groups)[:3] == ["one-object", "relation", "long"]
    two = [s for s in scenes.values() if len(s["objects"]) == 2]
    assert groups["one-object in 2-object images"].sum() == 2 * len(two) > 0  # each names one of its 2 objects
    assert sum(groups[f"{n}-object images"].sum() for n in range(1, 5)) == len(captions)
    with pytest.raises(ValueError, match="not in the toy world"):
        toyworld_truth(scenes, image_ids + ["999999"], [])


def test_the_benchmark_times_multi_positive_retrieval(capsys):
    from train.bench.retrieval import main

    assert main(["--images", "40", "--captions-per-image", "2", "--dim", "8", "--chunk", "16",
                 "--true-per-caption", "3"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("+ multi-positive (3 more true images per caption)") == 2
