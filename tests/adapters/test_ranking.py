"""adapters.eval.ranking (in-memory, for the library) against a per-query loop and the evaluation suite's
chunked ranks (adapters.eval.retrieval), on matrices with ties and several captions per image."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from adapters.eval.ranking import image_to_text_ranks, mean_recall, text_to_image_ranks
from adapters.eval.retrieval import ranks_from_scores


def loop_ranks(scores: np.ndarray, owner: list[int]):
    n_img, n_txt = scores.shape
    t2i = [1 + sum(scores[j, t] >= scores[owner[t], t] for j in range(n_img) if j != owner[t]) for t in range(n_txt)]
    i2t = []
    for i in range(n_img):
        mine = [t for t in range(n_txt) if owner[t] == i]
        if not mine:
            i2t.append(0)
            continue
        best = max(scores[i, t] for t in mine)
        i2t.append(1 + sum(scores[i, t] >= best for t in range(n_txt) if owner[t] != i))
    return t2i, i2t


@pytest.mark.parametrize("seed", range(4))
def test_ranks_equal_a_loop_and_the_chunked_evaluation(seed):
    g = np.random.default_rng(seed)
    scores = g.integers(0, 4, size=(7, 13)).astype(np.float32)  # few levels: many ties
    owner = [0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 5, 5, 5]  # image 6 has no caption
    s, o = torch.from_numpy(scores), torch.tensor(owner)
    t2i, i2t = text_to_image_ranks(s, o), image_to_text_ranks(s, o)
    ref_t, ref_i = loop_ranks(scores, owner)
    assert t2i.tolist() == ref_t and i2t.tolist() == ref_i
    ev_t, ev_i = ranks_from_scores(lambda rows: s[:, rows], 7, o, chunk=4)
    assert ev_t.tolist() == t2i.tolist() and ev_i.tolist() == i2t.tolist()


def test_mean_recall_values_and_ties_against_the_model():
    owner = torch.tensor([0, 1, 2])
    assert mean_recall(torch.eye(3), owner, ks=(1,)) == 100.0
    assert mean_recall(torch.zeros(3, 3), owner, ks=(1,)) == 0.0  # a constant scorer gets no credit
    s = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # caption 2 prefers image 0
    assert mean_recall(s, owner, "t2i", ks=(1,)) == pytest.approx(200 / 3)
    assert mean_recall(s, owner, "i2t", ks=(1, 2)) == pytest.approx((200 / 3 + 100) / 2)
    with pytest.raises(ValueError, match="direction"):
        mean_recall(s, owner, "sideways")


# ------------------------------------------------------------------------------------- non-finite scores
def test_rank_safe_makes_every_non_finite_value_the_worst_and_counts_them():
    from adapters.eval.ranking import rank_safe

    s = torch.tensor([[1.0, float("nan"), -2.0], [float("inf"), float("-inf"), 0.5]])
    safe, n = rank_safe(s)
    assert n == 3
    assert safe.tolist() == [[1.0, float("-inf"), -2.0], [float("-inf"), float("-inf"), 0.5]]
    finite = torch.randn(3, 4)
    same, n = rank_safe(finite)
    assert same is finite and n == 0  # the common case costs no copy
    assert rank_safe(torch.arange(4))[1] == 0  # integers are finite
    # the fast path checks the sum: finite values whose sum overflows must still count as finite
    big = torch.tensor([[3e38, 3e38, -1.0], [3e38, float("nan"), 3e38]])
    assert not torch.isfinite(big[0].sum())
    safe, n = rank_safe(big)
    assert n == 1 and safe[0].tolist() == big[0].tolist() and safe[1, 1] == float("-inf")
    row = big[:1]
    assert rank_safe(row)[0] is row and rank_safe(row)[1] == 0
    assert rank_safe(torch.tensor([65000., 65000.], dtype=torch.float16))[1] == 0  # fp16 sum overflows too


def loop_positive_ranks(scores: np.ndarray, positive: list[int]) -> list[int]:
    """Per query, from the rule itself: a candidate ranks ahead of the positive when the positive is not
    finite, or when it is finite and >= the positive (a non-finite candidate never beats a finite positive)."""
    out = []
    for q, p in enumerate(positive):
        row, pos = scores[q], scores[q, p]
        ahead = sum(1 for c in range(len(row)) if c != p and (not np.isfinite(pos) or
                                                              (np.isfinite(row[c]) and row[c] >= pos)))
        out.append(1 + ahead)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_positive_ranks_put_non_finite_positives_last_against_a_loop(seed):
    from adapters.eval.ranking import positive_ranks

    g = np.random.default_rng(seed)
    scores = g.integers(0, 3, size=(9, 6)).astype(np.float32)
    scores[g.random(scores.shape) < 0.3] = np.nan
    scores[0, 1], scores[1, 2] = np.inf, -np.inf
    positive = g.integers(0, 6, size=9).tolist()
    positive[0], positive[1] = 1, 2  # an +inf and a -inf positive: both rank last
    ranks, n = positive_ranks(torch.from_numpy(scores), torch.tensor(positive), dim=1)
    assert ranks.tolist() == loop_positive_ranks(scores, positive)
    assert n == int((~np.isfinite(scores)).sum())
    assert ranks[0] == ranks[1] == 6
    # candidates along dim 0: the transposed problem gives the same ranks
    ranks_t, _ = positive_ranks(torch.from_numpy(scores.T.copy()), torch.tensor(positive), dim=0)
    assert ranks_t.tolist() == ranks.tolist()


def test_all_nan_scores_get_no_credit_in_either_direction():
    owner = torch.tensor([0, 0, 1, 2, 3])
    nan = torch.full((4, 5), float("nan"))
    assert text_to_image_ranks(nan, owner).tolist() == [4] * 5  # last among 4 images
    assert image_to_text_ranks(nan, owner).tolist() == [4, 5, 5, 5]  # last among the captions of others
    assert mean_recall(nan, owner, ks=(1,)) == 0.0


def test_an_image_whose_own_scores_are_all_nan_ranks_last_and_is_not_dropped():
    owner = torch.tensor([0, 0, 1, 2])
    s = torch.eye(3)[:, owner] + 0.0  # every caption with its own image at 1, others 0
    s[0, 0] = s[0, 1] = float("nan")  # image 0's own captions are NaN
    assert image_to_text_ranks(s, owner).tolist() == [3, 1, 1]  # 2 captions of others, both ahead
    assert text_to_image_ranks(s, owner).tolist() == [3, 3, 1, 1]


def test_small_split_warning():
    from adapters.eval.ranking import small_split_warning

    one = small_split_warning(1)
    assert "only 1 image" in one and "R@1/5/10 are 100%" in one
    assert "R@10 is 100%" in small_split_warning(10)
    assert "random scorer" in small_split_warning(20) and "R@10 = 50%" in small_split_warning(20)
    assert small_split_warning(100) is None and small_split_warning(5000) is None
    assert "R@5 = 20%" in small_split_warning(25, ks=(1, 5)) and small_split_warning(50, ks=(1, 5)) is None
    # zero-shot: only the by-construction rule (10 classes is a real benchmark, not a tiny split)
    assert small_split_warning(10, (1, 5), what="classes", metric="top", min_per_k=0) is None
    assert "top5 is 100%" in small_split_warning(5, (1, 5), what="classes", metric="top", min_per_k=0)
