"""adapters/objectives/powerclip.py: PowerCLIP-R / -S region masks, phrase trees built in the data workers, and the
objective = CLIP + lambda x NLA triplet from adapters.losses.nla on the model's own patch and token embeddings."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from adapters.losses.nla import PowerCLIPLoss, leaf_embeddings, node_embeddings, region_embeddings
from adapters.objectives.base import StepContext, step_numpy_rng
from adapters.objectives.powerclip import PowerCLIPObjective, random_region_masks, sample_masks
from extract.worlds import toyworld

CAPTIONS = ["a small red circle to the left of a blue square", "a green star", "two objects: a red circle and a "
            "large yellow triangle; the circle is above the triangle", "!!"]


@pytest.fixture(scope="module")
def parts():
    from train.pretrain.trainer import create_model

    model, _, _, tok = create_model("plugvlm-tiny", False, 0)
    return model, tok


def test_random_boxes_are_per_sample_and_rank_invariant():
    from extract.components.regions import random_grid_boxes

    ctx = StepContext(step=2, seed=1, global_batch=6)
    whole = random_region_masks(ctx, 6, (8, 8), 10)
    assert whole.shape == (6, 10, 64) and whole.any(-1).all()
    halves = [random_region_masks(ctx.with_batch(3 * r, 6), 3, (8, 8), 10) for r in range(2)]
    assert torch.equal(torch.cat(halves), whole)
    _, expected = random_grid_boxes((8, 8), 60, step_numpy_rng(ctx, "powerclip-boxes"))
    assert np.array_equal(whole.numpy(), expected.reshape(6, 10, 64))
    assert not torch.equal(random_region_masks(StepContext(step=3, seed=1, global_batch=6), 6, (8, 8), 10), whole)


def test_cached_masks_are_sampled_among_the_valid_ones():
    cached = torch.zeros(2, 5, 4, dtype=torch.bool)
    for k in range(5):
        cached[:, k, k % 4] = True
    valid = torch.tensor([[True, True, True, True, True], [False, True, False, True, False]])
    masks, ok = sample_masks(cached, valid, 3, torch.rand(2, 5, generator=torch.Generator().manual_seed(0)))
    assert ok.tolist()[0] == [True] * 3 and ok.tolist()[1] == [True, True, False]
    assert not masks[1, 2].any()  # an absent mask is empty, so it is invalid for region pooling too
    picked = {tuple(m.nonzero().flatten().tolist()) for m in masks[1, :2]}
    assert picked == {(1,), (3,)}
    many, ok = sample_masks(cached, valid, 7, torch.rand(2, 5))  # asking for more than the cache holds
    assert many.shape == (2, 7, 4) and ok.sum(1).tolist() == [5, 2]


def test_phrase_trees_are_extract_text_components(parts):
    from extract.components.text import TextComponentExtractor
    from extract.components.text_pack import pack
    from extract.models.tokens import tokenize_with_spans

    _, tok = parts
    obj = PowerCLIPObjective()
    extras = obj.prepare(CAPTIONS, ["a", "b", "c", "d"], tok)
    assert torch.equal(extras["text"], tok(CAPTIONS))
    spans = tokenize_with_spans(tok, CAPTIONS, 77)
    packed = pack(TextComponentExtractor(0, 0).extract(CAPTIONS, spans), 77, 0, 0, 16, 16)
    assert np.array_equal(extras["leaf_tokens"].numpy(), packed["leaf_tokens"])
    assert np.array_equal(extras["node_leaves"].numpy(), packed["node_leaves"])
    again = obj.prepare(CAPTIONS[::-1], list("dcba"), tok)  # served from the per-caption cache
    assert torch.equal(again["leaf_tokens"], extras["leaf_tokens"].flip(0))
    import pickle

    assert pickle.loads(pickle.dumps(obj)).trees._extractor is None  # workers build their own spaCy


def test_objective_is_clip_plus_nla_triplet_on_the_models_own_embeddings(parts):
    from adapters.objectives.towers import encode_image, encode_text

    model, tok = parts
    obj = PowerCLIPObjective(num_masks=6)
    obj.setup(model, {})
    batch = {"image": torch.randn(4, 3, 64, 64), **obj.prepare(CAPTIONS, list("abcd"), tok)}
    ctx = StepContext(step=1, seed=0, global_batch=4)
    feats = obj.features(model, batch, ctx)
    out = obj.loss(feats, ctx)
    image = encode_image(model, batch["image"], patches=True)
    text = encode_text(model, batch["text"], tokens=True)
    regions, rmask = region_embeddings(image.patches, random_region_masks(ctx, 4, (8, 8), 6))
    leaves, lvalid = leaf_embeddings(text.tokens, batch["leaf_tokens"])
    node_leaves = batch["node_leaves"] & lvalid[:, None, :]
    expected = PowerCLIPLoss(obj.loss_cfg)(torch.nn.functional.normalize(image.pooled, dim=-1),
                                           torch.nn.functional.normalize(text.pooled, dim=-1),
                                           model.logit_scale.exp(), regions, rmask,
                                           node_embeddings(leaves, node_leaves), node_leaves.any(-1),
                                           node_leaves.sum(-1).float())
    torch.testing.assert_close(out["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    assert float(out["triplet"]) > 0 and obj.loss_cfg.lam == 0.1 and obj.num_masks == 6
    out["loss"].backward()
    assert model.visual.transformer.resblocks[0].mlp.c_fc.weight.grad.abs().sum() > 0
    assert feats["regions"].shape == (4, 6, 64) and feats["nodes"].shape[:2] == (4, 16)
    assert int(feats["node_mask"][3].sum()) == 1  # "!!" is a single leaf: its tree is one node


def test_sam2_masks_come_from_an_extract_cache(parts, tmp_path):
    model, tok = parts
    with pytest.raises(ValueError, match=r"python -m extract .*--regions sam2"):
        PowerCLIPObjective(masks="sam2").setup(model, {})
    with pytest.raises(FileNotFoundError, match="--regions-cache .* does not exist"):
        PowerCLIPObjective(masks="sam2", regions_cache=str(tmp_path / "none")).setup(model, {})
    from extract.pipeline import build_cache

    world = tmp_path / "toy"
    toyworld.generate(world, 12, seed=0, workers=1)
    cache = build_cache(world, tmp_path / "masks", base="tiny", pretrained="none", components=["regions"],
                        regions="gt", num_regions=4, workers=0)
    obj = PowerCLIPObjective(masks="sam2", regions_cache=str(tmp_path / "masks"), num_masks=2)
    assert obj.needs_fixed_geometry and not PowerCLIPObjective().needs_fixed_geometry
    ids = cache.image_ids()
    obj.setup(model, {"image_ids": set(ids)})
    with pytest.raises(ValueError, match="no masks for 3 of the"):
        obj.setup(model, {"image_ids": set(ids) | {"x", "y", "z"}})
    extras = obj.prepare(CAPTIONS[:2] + CAPTIONS[:1], [ids[0], ids[1], "unknown"], tok)
    assert extras["cached_masks"].shape == (3, 4, 64) and not extras["cached_valid"][2].any()
    expected = cache.gather("region_masks", [0, 1]).reshape(2, 4, 64)
    assert np.array_equal(extras["cached_masks"][:2].numpy(), expected)
    batch = {"image": torch.randn(3, 3, 64, 64), **extras}
    masks = obj.region_masks(model, batch, StepContext(global_batch=3))
    assert masks.shape == (3, 2, 64) and not masks[2].any()
    for row in range(2):  # every picked mask is one of the image's cached masks
        cached = {tuple(m.tolist()) for m in extras["cached_masks"][row][extras["cached_valid"][row]]}
        assert all(tuple(m.tolist()) in cached for m in masks[row] if m.any())
