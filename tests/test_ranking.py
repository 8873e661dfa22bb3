"""adapters.ranking (in-memory, for the library) against a per-query loop and the evaluation suite's
chunked ranks (train.retrieval), on matrices with ties and several captions per image."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from adapters.ranking import image_to_text_ranks, mean_recall, text_to_image_ranks
from train.retrieval import ranks_from_scores


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
