"""adapters/objectives/towers.py and _base.py: the forwards with patch choice and token outputs replay open_clip
exactly; step randomness does not depend on how a batch is split."""
from __future__ import annotations

import pytest
import torch

from adapters.objectives.base import StepContext, batch_random, split_features
from adapters.objectives.towers import (UnsupportedModelError, check_model, encode_image, encode_text, keep_count,
                                       random_keep, token_mask)


@pytest.fixture(scope="module")
def model():
    from train.pretrain.trainer import create_model

    return create_model("plugvlm-tiny", False, 0)[0].eval()


@pytest.fixture(scope="module")
def tok():
    import open_clip

    return open_clip.get_tokenizer("plugvlm-tiny")


def test_full_forward_is_open_clips(model, tok):
    images = torch.randn(3, 3, 64, 64)
    ids = tok(["a red circle", "a small blue square to the left of a green star", ""])
    with torch.no_grad():
        out = encode_image(model, images, patches=True)
        assert torch.equal(out.pooled, model.encode_image(images))
        text = encode_text(model, ids, tokens=True)
        assert torch.equal(text.pooled, model.encode_text(ids))
        eot = ids.argmax(-1)
        # the global embedding is the end-of-text token's (one GEMM over all tokens: rounding may differ)
        torch.testing.assert_close(text.tokens[torch.arange(3), eot], text.pooled, rtol=0, atol=1e-6)
        # the patch embeddings are the ones python -m extract caches from the same weights
        from extract.models.backbone import FrozenBackbone
        from extract.models.weights import ResolvedWeights

        frozen = FrozenBackbone(model, tok, None, None, ResolvedWeights("random"))
        torch.testing.assert_close(out.patches, frozen.encode_images(images).patches, rtol=0, atol=1e-6)
    model.requires_grad_(True)


def test_patch_choice_matches_open_clips_patch_dropout(model):
    from open_clip.transformer import PatchDropout

    images = torch.randn(4, 3, 64, 64)
    n = 64
    visual = model.visual
    visual.patch_dropout = PatchDropout(0.5)
    visual.train()
    try:
        torch.manual_seed(5)
        theirs = model.encode_image(images)
        torch.manual_seed(5)  # PatchDropout keeps the top-k of torch.randn over the patches
        keep = torch.randn(4, n).topk(keep_count(n, 0.5), dim=-1).indices
        ours = encode_image(model, images, keep=keep).pooled
    finally:
        visual.patch_dropout = torch.nn.Identity()
        visual.eval()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert keep_count(64, 0.5) == 32 and keep_count(196, 0.5) == 98 and keep_count(3, 0.9) == 1


def test_padding_hidden_from_attention_changes_nothing(model):
    images = torch.randn(2, 3, 64, 64)
    keep = random_keep(torch.rand(2, 64), 20)
    with torch.no_grad():
        plain = encode_image(model, images, keep=keep).pooled
        junk = torch.randint(0, 64, (2, 7))
        padded = torch.cat([keep, junk], dim=1)
        mask = torch.zeros(2, 27, dtype=torch.bool)
        mask[:, 20:] = True
        hidden = encode_image(model, images, keep=padded, key_padding=mask).pooled
        seen = encode_image(model, images, keep=padded).pooled
    torch.testing.assert_close(hidden, plain, rtol=0, atol=1e-5)
    assert not torch.allclose(seen, plain, atol=1e-3)  # the same junk tokens, visible, do change it


def test_token_mask_and_model_check(model, tok):
    ids = tok(["a red circle", "!"])  # id 0 is "!": padding is found from end-of-text, not from zeros
    mask = token_mask(ids)
    assert mask.sum(1).tolist() == [5, 3] and token_mask(ids, include_sot=False).sum(1).tolist() == [4, 2]
    check_model(model)
    import open_clip

    from extract.models.backbone import register_configs

    register_configs()
    with pytest.raises(UnsupportedModelError, match="attentional pooler|text"):
        check_model(open_clip.create_model("plugvlm-tiny-coca"))


def test_a_resnet_tower_serves_every_objective_that_does_not_choose_patches():
    from extract.models.backbone import load_backbone
    from train.pretrain.trainer import create_model

    rn = create_model("plugvlm-tiny-rn", False, 0)[0].eval()
    check_model(rn, chooses_patches=False)  # CLIP, FILIP, PowerCLIP (and each with hard negatives)
    with pytest.raises(UnsupportedModelError, match="needs a ViT image tower; ModifiedResNet is not one .it chooses"):
        check_model(rn)  # FLIP, CLIP-PGS
    images = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        assert torch.equal(encode_image(rn, images).pooled, rn.encode_image(images))
        # with patches: the same global embedding, and the 4x4 map's tokens exactly as python -m extract caches
        # them (its backbone reads the map from a hook on open_clip's own forward, not from this replay)
        bb = load_backbone("tiny-rn")
        out = encode_image(bb.model, images, patches=True)
        assert torch.equal(out.pooled, bb.model.encode_image(images))
        assert out.patches.shape == (2, 16, 64)
        torch.testing.assert_close(out.patches, bb.encode_images(images).patches, rtol=0, atol=0)
    with pytest.raises(UnsupportedModelError, match="no patch tokens to keep"):
        encode_image(rn, images, keep=torch.zeros(2, 3, dtype=torch.long))


def test_step_randomness_is_per_sample_not_per_rank():
    one = StepContext(step=4, seed=1, global_batch=8)
    whole = batch_random(one, "x", 8, 5)
    halves = [batch_random(one.with_batch(4 * r, 8), "x", 4, 5) for r in range(2)]
    assert torch.equal(torch.cat(halves), whole)
    assert not torch.equal(batch_random(StepContext(step=5, seed=1, global_batch=8), "x", 8, 5), whole)
    assert not torch.equal(batch_random(one, "y", 8, 5), whole)
    per, shared = split_features({"a": torch.zeros(3, 2), "s": torch.tensor(1.0)})
    assert list(per) == ["a"] and list(shared) == ["s"]


def test_gradient_checkpointing_changes_memory_not_gradients():
    from train.pretrain.trainer import create_model

    images, ids = torch.randn(2, 3, 64, 64), torch.randint(1, 400, (2, 77))
    ids[:, 10] = 49407
    grads = []
    for ckpt in (False, True):
        model = create_model("plugvlm-tiny", False, 0)[0]
        model.set_grad_checkpointing(ckpt)
        keep = random_keep(torch.rand(2, 64, generator=torch.Generator().manual_seed(0)), 40)
        loss = encode_image(model, images, keep=keep, patches=True).patches.square().mean() \
            + encode_text(model, ids, tokens=True).tokens.square().mean()
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_trimmed_text_tower_equals_the_full_one():
    """encode_text(trim=True), the fast path the hard negatives take, against open_clip's own encode_text."""
    import open_clip

    from adapters.objectives.towers import encode_text
    from train.pretrain.trainer import create_model

    model = create_model("plugvlm-tiny", False, 0)[0].eval()
    ids = open_clip.get_tokenizer("plugvlm-tiny")(["a small red circle", "a blue square to the left of a green "
                                                   "star and a large white hexagon", ""])
    with torch.no_grad():
        trimmed = encode_text(model, ids, trim=True).pooled
        torch.testing.assert_close(trimmed, model.encode_text(ids), rtol=1e-5, atol=1e-6)
        assert torch.equal(encode_text(model, ids).pooled, model.encode_text(ids))
