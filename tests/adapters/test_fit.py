"""The inference fits' objective (adapters/eval/fit.py): what ComAlign's fusion weights and PowerCLIP's beta are
fitted by on the held-out split."""
from __future__ import annotations

import pytest
import torch

from adapters.eval.fit import fit_objective, own_caption_map
from adapters.eval.ranking import mean_recall

OWNER = torch.tensor([0, 0, 0, 1, 1, 1])                 # two images, three captions each
ALL_FIRST = torch.tensor([[3.0, 2.9, 2.8, 0, 0, 0], [0, 0, 0, 3.0, 2.9, 2.8]])
ONE_FIRST = torch.tensor([[3.0, -1, -1, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 3.0, -1, -1]])


def test_the_image_to_text_fit_also_weighs_every_own_caption():
    """Recall alone cannot tell an image whose long caption comes first and its other captions last from one whose
    captions all come first; the image -> text objective can (the mAP of the image's own captions)."""
    assert mean_recall(ONE_FIRST, OWNER, "i2t") == mean_recall(ALL_FIRST, OWNER, "i2t") == 100.0
    assert fit_objective(ALL_FIRST, OWNER, "i2t") == 100.0
    assert fit_objective(ONE_FIRST, OWNER, "i2t") < 90.0
    assert own_caption_map(ONE_FIRST, OWNER) < 70.0 and own_caption_map(ALL_FIRST, OWNER) == 100.0
    assert fit_objective(ONE_FIRST, OWNER, "t2i") == mean_recall(ONE_FIRST, OWNER, "t2i")  # text -> image: recall


def test_both_directions_is_the_mean_of_each_and_other_directions_are_refused():
    for scores in (ALL_FIRST, ONE_FIRST):
        both = fit_objective(scores, OWNER, "both")
        assert both == pytest.approx(0.5 * (fit_objective(scores, OWNER, "t2i") + fit_objective(scores, OWNER, "i2t")))
    with pytest.raises(ValueError, match="t2i, i2t, both"):
        fit_objective(ALL_FIRST, OWNER, "sideways")
