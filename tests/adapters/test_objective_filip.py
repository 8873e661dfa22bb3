"""adapters/objectives/filip.py: token-wise late interaction against a loop reference, padding masked, chunks
exact (values and gradients), and the FILIP scorer used for evaluation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapters.objectives.filip import FILIPScorer, filip_loss, filip_similarities


def _reference(img, img_mask, txt, txt_mask):
    bi, bj = len(img), len(txt)
    s_i, s_t = [[None] * bj for _ in range(bi)], [[None] * bj for _ in range(bi)]
    for i in range(bi):
        for j in range(bj):
            x = img[i][img_mask[i]]
            y = txt[j][txt_mask[j]]
            sim = x @ y.T
            s_i[i][j] = sim.max(dim=1).values.mean()  # each image token: its best text token
            s_t[i][j] = sim.max(dim=0).values.mean()  # each text token: its best image token
    return (torch.stack([torch.stack(r) for r in s_i]).double(), torch.stack([torch.stack(r) for r in s_t]).double())


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(5, 7, 8, generator=g), dim=-1)
    txt = F.normalize(torch.randn(6, 9, 8, generator=g), dim=-1)
    img_mask = torch.ones(5, 7, dtype=torch.bool)
    img_mask[1, 4:] = False
    txt_mask = torch.rand(6, 9, generator=g) > 0.4
    txt_mask[:, 1] = True
    return img, img_mask, txt, txt_mask


def test_similarities_match_the_definition_and_ignore_padding():
    img, im, txt, tm = _inputs()
    s_i, s_t = filip_similarities(img, im, txt, tm)
    r_i, r_t = _reference(img, im, txt, tm)
    torch.testing.assert_close(s_i.double(), r_i, rtol=0, atol=1e-6)
    torch.testing.assert_close(s_t.double(), r_t, rtol=0, atol=1e-6)
    # padding holding anything (here: large values that would win every max) changes nothing
    txt2, img2 = txt.clone(), img.clone()
    txt2[~tm] = 50.0
    img2[~im] = 50.0
    a, b = filip_similarities(img2, im, txt2, tm)
    assert torch.equal(a, s_i) and torch.equal(b, s_t)
    # gradients too: a padded token gets none, and the maxima send theirs to the right tokens
    w1, w2 = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    grads = []
    for fn in (filip_similarities, _reference):
        x, y = img.double().clone().requires_grad_(), txt.double().clone().requires_grad_()
        a, b = fn(x, im, y, tm)
        ((a * w1).sum() + (b * w2).sum()).backward()
        grads.append((x.grad, y.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=1e-6)
    assert grads[0][1][~tm].abs().max() == 0


def test_chunks_give_the_same_values_and_gradients():
    img, im, txt, tm = _inputs(1)
    grads = []
    for chunk in (64, 2):
        x, y = img.clone().requires_grad_(), txt.clone().requires_grad_()
        s_i, s_t = filip_similarities(x, im, y, tm, chunk=chunk)
        (s_i * torch.arange(6.0)).sum().add((s_t ** 2).sum()).backward()
        grads.append((s_i.detach(), s_t.detach(), x.grad, y.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_loss_is_symmetric_infonce_on_both_directions():
    img, _, txt, tm = _inputs(2)
    img, txt, tm = img[:5], txt[:5], tm[:5]
    im = torch.ones(5, 7, dtype=torch.bool)
    scale = torch.tensor(7.0)
    s_i, s_t = _reference(img, im, txt, tm)
    labels = torch.arange(5)
    expected = 0.5 * (F.cross_entropy(7.0 * s_i, labels) + F.cross_entropy(7.0 * s_t.T, labels))
    torch.testing.assert_close(filip_loss(img, im, txt, tm, scale).double(), expected, rtol=1e-6, atol=1e-6)


def test_filip_objective_masks_start_of_text_and_padding():
    from adapters.objectives.base import StepContext
    from adapters.registry import PRETRAIN
    from train.pretrain.trainer import create_model

    model, _, _, tok = create_model("plugvlm-tiny", False, 0)
    obj = PRETRAIN.get("filip")()
    ids = tok(["a red circle", "two blue squares"])
    feats = obj.features(model, {"image": torch.randn(2, 3, 64, 64), "text": ids}, StepContext())
    assert feats["text_mask"].sum(1).tolist() == [4, 4] and not feats["text_mask"][:, 0].any()
    assert feats["patch_tokens"].shape == (2, 64, 64)
    torch.testing.assert_close(feats["patch_tokens"].norm(dim=-1), torch.ones(2, 64))
    loss = obj.loss(feats, StepContext())
    loss["loss"].backward()
    assert model.visual.conv1.weight.grad is not None and model.token_embedding.weight.grad is not None


def test_scorer_is_directional_late_interaction():
    from extract.models.backbone import load_backbone

    scorer = FILIPScorer(load_backbone("tiny"))
    images = torch.randn(3, 3, 64, 64)
    ir = scorer.encode_images(images)
    tr = scorer.encode_texts(["a red circle", "a small blue square", "!"])
    s_i = scorer.score_directed(ir, tr, "i2t")
    s_t = scorer.score_directed(ir, tr, "t2i")
    ones = torch.ones(3, 64, dtype=torch.bool)
    r_i, r_t = _reference(ir["patches"], ones, tr["tokens"], tr["mask"])
    torch.testing.assert_close(s_i.double(), r_i, rtol=0, atol=1e-5)
    torch.testing.assert_close(s_t.double(), r_t, rtol=0, atol=1e-5)
    torch.testing.assert_close(scorer.score(ir, tr), (s_i + s_t) / 2)
    assert scorer.directional and not tr["mask"][:, 0].any()
    with pytest.raises(ValueError):
        scorer.score_directed(ir, tr, "both")
