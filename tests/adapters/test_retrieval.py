"""Retrieval metrics against a per-query brute force, on hand-made cases (ties, multi-caption images)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.references import brute_force
from adapters.eval.retrieval import feature_score_fn, ranks_from_scores, retrieval_metrics


def _fn(scores):
    s = torch.as_tensor(scores, dtype=torch.float32)
    return lambda rows: s[:, rows]


def test_hand_made_case_with_ties_and_two_captions_per_image():
    # images 0, 1, 2; captions 0, 1 -> image 0; 2, 3 -> image 1; 4 -> image 2
    cap = [0, 0, 1, 1, 2]
    s = np.array([[.9, .1, .5, .2, .3],
                  [.9, .2, .8, .2, .1],
                  [.1, .1, .8, .4, .3]])
    t2i, i2t = ranks_from_scores(_fn(s), 3, torch.tensor(cap))
    # caption 0: image 1 ties image 0 at .9 -> rank 2; caption 1: image 1 scores higher -> 2, image 2 ties
    # -> 3; caption 2: image 2 ties -> 2; caption 3: image 2 higher -> 3 (image 0 ties too); caption 4: 1 tie -> 2
    assert t2i.tolist() == [2, 3, 2, 3, 2]
    # image 0: best own .9; others >= .9: none -> 1. image 1: best own .8; caption 0 (.9) -> 2.
    # image 2: own .3; captions 0(.1) 1(.1) 2(.8) 3(.4) -> 3 others above -> 4
    assert i2t.tolist() == [1, 2, 3]
    ref_t, ref_i = brute_force(s, cap)
    assert t2i.tolist() == ref_t.tolist() and i2t.tolist() == ref_i.tolist()
    m = retrieval_metrics(_fn(s), 3, cap)
    assert m["text_to_image"]["R@1"] == 0.0 and m["text_to_image"]["R@5"] == 100.0
    assert m["image_to_text"]["R@1"] == pytest.approx(100 / 3)
    assert m["image_to_text"]["median_rank"] == 2.0


def test_constant_scorer_gets_no_credit_from_ties():
    m = retrieval_metrics(_fn(np.zeros((4, 8))), 4, [0, 0, 1, 1, 2, 2, 3, 3])
    assert m["text_to_image"]["R@1"] == 0.0 and m["image_to_text"]["R@1"] == 0.0
    assert m["text_to_image"]["mean_rank"] == 4.0  # all 3 others tie ahead


@pytest.mark.parametrize("chunk, max_bytes", [(7, 1 << 30), (7, 0), (1000, 0), (1, 1 << 30)])
def test_chunked_stored_and_streaming_equal_brute_force(chunk, max_bytes):
    rng = np.random.default_rng(0)
    n_img, n_txt = 23, 61
    cap = rng.integers(0, n_img, n_txt)
    cap[:3] = 5  # one image with three captions; some images have none
    s = rng.integers(0, 6, (n_img, n_txt)).astype(np.float32)  # small integers: many exact ties
    t2i, i2t = ranks_from_scores(_fn(s), n_img, torch.tensor(cap), chunk=chunk, max_bytes=max_bytes)
    ref_t, ref_i = brute_force(s, cap)
    np.testing.assert_array_equal(t2i.numpy(), ref_t)
    np.testing.assert_array_equal(i2t.numpy(), ref_i)
    m = retrieval_metrics(_fn(s), n_img, cap, chunk=chunk, max_bytes=max_bytes)
    assert m["images_without_captions"] == int((ref_i == 0).sum()) > 0
    assert m["image_to_text"]["n"] == int((ref_i > 0).sum())
    assert m["image_to_text"]["R@1"] == pytest.approx(100 * (ref_i[ref_i > 0] <= 1).mean())


def test_feature_score_fn_is_the_matmul():
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(5, 8, generator=g), torch.randn(9, 8, generator=g)
    fn = feature_score_fn(img, txt)
    torch.testing.assert_close(fn(slice(2, 6)), img @ txt[2:6].T)


def test_bad_inputs():
    with pytest.raises(ValueError, match="outside"):
        ranks_from_scores(_fn(np.zeros((2, 2))), 2, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="at least one"):
        ranks_from_scores(_fn(np.zeros((2, 0))), 2, torch.tensor([], dtype=torch.long))


# ------------------------------------------------------------------------------------- non-finite scores
def brute_force_nonfinite(scores: np.ndarray, caption_image) -> tuple[np.ndarray, np.ndarray]:
    """Per query, from the rule: a non-finite score is the worst, so a non-finite positive ranks behind every
    other candidate and a non-finite candidate never ranks ahead of a finite positive (ties against the model)."""
    n_images, n_texts = scores.shape

    def ahead(x, pos):
        return not np.isfinite(pos) or (np.isfinite(x) and x >= pos)

    t2i = np.array([1 + sum(ahead(scores[j, t], scores[caption_image[t], t]) for j in range(n_images)
                            if j != caption_image[t]) for t in range(n_texts)])
    i2t = np.zeros(n_images, dtype=np.int64)
    for i in range(n_images):
        mine = [t for t in range(n_texts) if caption_image[t] == i]
        if mine:
            finite = [scores[i, t] for t in mine if np.isfinite(scores[i, t])]
            best = max(finite) if finite else np.nan
            i2t[i] = 1 + sum(ahead(scores[i, t], best) for t in range(n_texts) if caption_image[t] != i)
    return t2i, i2t


def test_all_nan_scorer_gets_r1_zero_not_100_in_both_directions_chunked_or_whole():
    cap = [0, 0, 1, 2, 2, 3]
    nan = np.full((4, 6), np.nan)
    for max_bytes in (1 << 30, 0):  # the stored matrix and the two streaming passes
        m = retrieval_metrics(_fn(nan), 4, cap, chunk=4, max_bytes=max_bytes)
        assert m["text_to_image"]["R@1"] == 0.0 and m["image_to_text"]["R@1"] == 0.0
        assert m["text_to_image"]["mean_rank"] == 4.0  # last among 4 images
        assert m["image_to_text"]["n"] == 4  # no image is dropped for having only NaN scores
        assert m["nonfinite_scores"] == 24 and m["n_scores"] == 24


@pytest.mark.parametrize("chunk, max_bytes", [(7, 1 << 30), (7, 0), (1000, 0), (1, 1 << 30)])
def test_partly_non_finite_scores_rank_last_against_a_per_query_reference(chunk, max_bytes):
    rng = np.random.default_rng(1)
    n_img, n_txt = 11, 29
    cap = rng.integers(0, n_img, n_txt)
    cap[cap == 4] = 5
    cap[:3] = 4  # image 4 has exactly three captions; all of them are NaN below
    s = rng.integers(0, 4, (n_img, n_txt)).astype(np.float32)  # ties too
    s[rng.random(s.shape) < 0.2] = np.nan
    s[4, :3] = np.nan
    s[rng.random(s.shape) < 0.03] = np.inf
    s[rng.random(s.shape) < 0.03] = -np.inf
    t2i, i2t = ranks_from_scores(_fn(s), n_img, torch.tensor(cap), chunk=chunk, max_bytes=max_bytes)
    ref_t, ref_i = brute_force_nonfinite(s, cap)
    np.testing.assert_array_equal(t2i.numpy(), ref_t)
    np.testing.assert_array_equal(i2t.numpy(), ref_i)
    assert i2t[4] == 1 + n_txt - 3  # every caption of another image ranks ahead of image 4's NaN ones
    m = retrieval_metrics(_fn(s), n_img, cap, chunk=chunk, max_bytes=max_bytes)
    assert m["nonfinite_scores"] == int((~np.isfinite(s)).sum()) and m["n_scores"] == n_img * n_txt
    # the whole-matrix library ranks (ComAlign / PowerCLIP fitting) agree
    from adapters.eval.ranking import image_to_text_ranks, text_to_image_ranks

    st = torch.from_numpy(s)
    assert text_to_image_ranks(st, torch.tensor(cap)).tolist() == ref_t.tolist()
    assert image_to_text_ranks(st, torch.tensor(cap)).tolist() == ref_i.tolist()


def test_finite_scores_report_zero_non_finite():
    m = retrieval_metrics(_fn(np.eye(3)), 3, [0, 1, 2])
    assert m["nonfinite_scores"] == 0 and m["text_to_image"]["R@1"] == 100.0


def test_small_split_warning_for_one_image_and_not_for_a_normal_split():
    one = retrieval_metrics(_fn(np.ones((1, 5))), 1, [0] * 5)
    assert one["text_to_image"]["R@1"] == 100.0  # true by construction: the warning says so
    assert "only 1 image" in one["warning"] and "100%" in one["warning"]
    n = 120
    normal = retrieval_metrics(_fn(np.eye(n)), n, list(range(n)))
    assert "warning" not in normal


# ------------------------------------------------------------------------------------- one direction at a time
@pytest.mark.parametrize("max_bytes", [1 << 30, 0])
def test_one_direction_equals_that_half_of_both_and_t2i_alone_reads_the_matrix_once(max_bytes):
    """A directional scorer asks each of its two matrices for one direction (train.eval.evaluate): each half equals the
    same direction of the two-direction run, multi-positive figures included, and text->image alone makes one pass
    over the caption chunks even when streaming (image->text needs the second)."""
    from adapters.eval.retrieval import retrieval_queries

    rng = np.random.default_rng(4)
    n_img, n_txt = 13, 37
    cap = torch.tensor(rng.integers(0, n_img, n_txt))
    s = rng.integers(0, 4, (n_img, n_txt)).astype(np.float32)
    s[rng.random(s.shape) < 0.05] = np.nan
    truth = torch.from_numpy(rng.random((n_img, n_txt)) < 0.2)
    calls = []

    def fn(rows):
        calls.append(rows)
        return torch.from_numpy(s[:, rows])

    both = retrieval_queries(fn, n_img, cap, chunk=8, max_bytes=max_bytes, truth=truth)
    calls.clear()
    t2i = retrieval_queries(fn, n_img, cap, chunk=8, max_bytes=max_bytes, truth=truth, directions=("t2i",))
    assert len(calls) == 5  # ceil(37 / 8) chunks, once
    i2t = retrieval_queries(fn, n_img, cap, chunk=8, max_bytes=max_bytes, truth=truth, directions=("i2t",))
    assert t2i.i2t is None and i2t.t2i is None and t2i.multi.i2t_first is None and i2t.multi.t2i_ap is None
    assert torch.equal(t2i.t2i, both.t2i) and torch.equal(i2t.i2t, both.i2t)
    assert torch.equal(t2i.multi.t2i_first, both.multi.t2i_first)
    assert torch.equal(i2t.multi.i2t_first, both.multi.i2t_first)
    np.testing.assert_array_equal(t2i.multi.t2i_ap.numpy(), both.multi.t2i_ap.numpy())
    np.testing.assert_array_equal(i2t.multi.i2t_ap.numpy(), both.multi.i2t_ap.numpy())
    assert t2i.nonfinite == i2t.nonfinite == both.nonfinite == int(np.isnan(s).sum())
    with pytest.raises(ValueError, match="directions must be among"):
        retrieval_queries(fn, n_img, cap, directions=("i2i",))
