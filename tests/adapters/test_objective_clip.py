"""adapters/objectives/clip.py: the CLIP objective is open_clip's forward and open_clip's ClipLoss."""
from __future__ import annotations

import pytest
import torch

from adapters.objectives.base import StepContext
from adapters.registry import PRETRAIN


@pytest.fixture(scope="module")
def model():
    from train.pretrain.trainer import create_model

    return create_model("plugvlm-tiny", False, 0)[0]


def test_clip_features_and_loss_are_open_clips(model):
    import open_clip
    from open_clip.loss import ClipLoss

    objective = PRETRAIN.get("clip")()
    objective.setup(model, {})
    images = torch.randn(6, 3, 64, 64)
    texts = open_clip.get_tokenizer("plugvlm-tiny")([f"a {c} circle" for c in "abcdef"])
    feats = objective.features(model, {"image": images, "text": texts}, StepContext())
    image_f, text_f, scale = model(images, texts)
    assert torch.equal(feats["image_features"], image_f) and torch.equal(feats["text_features"], text_f)
    assert torch.equal(feats["logit_scale"], scale)
    ours = objective.loss(feats, StepContext())
    theirs = ClipLoss()(image_f, text_f, scale)
    torch.testing.assert_close(ours["loss"], theirs, rtol=1e-6, atol=1e-6)
    assert set(ours) == {"loss", "clip"} and not ours["clip"].requires_grad
    assert PRETRAIN.get("clip").name == "clip" and objective.describe() == "clip"
