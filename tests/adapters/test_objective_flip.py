"""adapters/objectives/flip.py: FLIP drops a random 50% of the patches, per sample, reproducibly."""
from __future__ import annotations

import argparse

import pytest
import torch

from adapters.objectives.base import StepContext, batch_random
from adapters.objectives.towers import encode_image, keep_count, random_keep
from adapters.registry import PRETRAIN


@pytest.fixture(scope="module")
def model():
    from train.pretrain.trainer import create_model

    return create_model("plugvlm-tiny", False, 0)[0]


def test_flip_sees_half_the_patches_chosen_by_the_step_seed(model):
    images = torch.randn(4, 3, 64, 64)
    texts = torch.zeros(4, 77, dtype=torch.long)
    texts[:, 0], texts[:, 1] = 49406, 49407
    flip = PRETRAIN.get("flip")(mask_ratio=0.5)
    ctx = StepContext(step=3, seed=2, global_batch=4)
    feats = flip.features(model, {"image": images, "text": texts}, ctx)
    keep = random_keep(batch_random(ctx, "flip-drop", 4, 64), keep_count(64, 0.5))
    assert keep.shape == (4, 32) and len({tuple(k.tolist()) for k in keep}) == 4  # each image its own patches
    expected = torch.nn.functional.normalize(encode_image(model, images, keep=keep).pooled, dim=-1)
    assert torch.equal(feats["image_features"], expected)
    again = flip.features(model, {"image": images, "text": texts}, ctx)["image_features"]
    other = flip.features(model, {"image": images, "text": texts}, StepContext(step=4, seed=2, global_batch=4))
    assert torch.equal(again, expected) and not torch.allclose(other["image_features"], expected)
    # the second half of the batch on a second rank gets the same patches as here
    half = flip.features(model, {"image": images[2:], "text": texts[2:]}, ctx.with_batch(2, 4))["image_features"]
    torch.testing.assert_close(half, expected[2:], rtol=0, atol=1e-6)
    clip = PRETRAIN.get("clip")().features(model, {"image": images, "text": texts}, ctx)["image_features"]
    no_drop = PRETRAIN.get("flip")(mask_ratio=0.0).features(model, {"image": images, "text": texts}, ctx)
    torch.testing.assert_close(no_drop["image_features"], clip, rtol=0, atol=1e-6)


def test_flip_flags():
    p = argparse.ArgumentParser()
    PRETRAIN.get("flip").add_args(p)
    flip = PRETRAIN.get("flip").from_args(p.parse_args(["--mask-ratio", "0.75"]))
    assert flip.config() == {"mask_ratio": 0.75}
    with pytest.raises(ValueError, match="mask-ratio"):
        PRETRAIN.get("flip")(mask_ratio=1.0)
