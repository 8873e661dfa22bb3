"""ComAlign head: FGM against a per-pair loop, the loss against a literal reading of eq. 6-9, identity at init,
padding invariance, the train=image|text ablation, chunked scoring, and the fusion-weight fit."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from adapters.registry import ADAPTERS
from adapters.heads.comalign import ComAlign, fgm_pair, sinusoidal_positions

D, E, R = 32, 5, 4


def _batch(n: int, seed: int, p_valid: float = 0.6, empty_rows: tuple[int, ...] = ()) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)

    def comps(k):
        x = F.normalize(torch.randn(n, k, D, generator=g), dim=-1)
        v = torch.rand(n, k, generator=g) < p_valid
        v[:, 0] = True
        for r in empty_rows:
            v[r] = False
        return x * v[..., None], v  # padding is zeros in the cache

    ie, iv = comps(E)
    ir, irv = comps(R)
    te, tv = comps(E)
    tr, trv = comps(R)
    img = {"image_embed": F.normalize(torch.randn(n, D, generator=g), dim=-1), "ventity_embed": ie, "ventity_valid": iv,
           "vrelation_embed": ir, "vrelation_valid": irv}
    txt = {"text_embed": F.normalize(torch.randn(n, D, generator=g), dim=-1), "entity_embed": te, "entity_valid": tv,
           "relation_embed": tr, "relation_valid": trv}
    return img, txt


def _head(**cfg) -> ComAlign:
    torch.manual_seed(0)
    return ADAPTERS.get("comalign").from_config({"heads": 4, **cfg}, D)


def _fgm_loop(x, xv, y, yv):
    """FGM(x, y) per the paper's eq. 2, item by item; empty sets give 0."""
    xs, ys = x[xv], y[yv]
    if len(xs) == 0 or len(ys) == 0:
        return 0.0
    return float((xs @ ys.T).max(dim=1).values.mean().detach())


def test_registered_with_its_cache_needs():
    cls = ADAPTERS.get("comalign")
    assert cls is ComAlign and cls.components == ("entities", "relations") and cls.directional
    assert {"ventity_embed", "vrelation_valid", "image_embed"} <= set(cls.image_keys)
    assert {"entity_embed", "relation_valid", "text_embed"} <= set(cls.text_keys)


def test_fgm_matches_per_pair_loop_with_padding_and_empty_sets():
    img, txt = _batch(5, 0, empty_rows=(2,))
    x, xv, y, yv = img["ventity_embed"], img["ventity_valid"], txt["entity_embed"], txt["entity_valid"]
    yv[3] = False  # an empty text set too
    x = x + 5.0 * (~xv[..., None])  # garbage in padded slots must not matter
    xy, yx = fgm_pair(x, xv, y, yv)
    for i in range(5):
        for j in range(5):
            assert xy[i, j].item() == pytest.approx(_fgm_loop(x[i], xv[i], y[j], yv[j]), abs=1e-6)
            assert yx[i, j].item() == pytest.approx(_fgm_loop(y[j], yv[j], x[i], xv[i]), abs=1e-6)


def test_untrained_residual_head_is_the_identity():
    head = _head().eval()
    img, txt = _batch(4, 1)
    reps = head.encode_image(img)
    torch.testing.assert_close(reps["entity"], img["ventity_embed"], atol=1e-6, rtol=0)
    torch.testing.assert_close(reps["global"], img["image_embed"], atol=1e-6, rtol=0)
    t = head.encode_text(txt)
    torch.testing.assert_close(t["global"], t["base"], atol=1e-6, rtol=0)
    # so the global similarity of an untrained head is the base model's cosine
    torch.testing.assert_close(head.similarities(reps, t)["global"], img["image_embed"] @ txt["text_embed"].T,
                               atol=1e-6, rtol=0)


def test_masked_keys_do_not_influence_outputs():
    head = _head(dropout=0.0, residual=False).eval()
    img, _ = _batch(3, 3)
    changed = {k: v.clone() for k, v in img.items()}
    invalid = ~img["ventity_valid"]
    changed["ventity_embed"][invalid] = F.normalize(torch.randn(int(invalid.sum()), D), dim=-1)
    a, b = head.encode_image(img), head.encode_image(changed)
    valid = img["ventity_valid"]
    torch.testing.assert_close(a["entity"][valid], b["entity"][valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(a["global"], b["global"], atol=1e-5, rtol=0)


def _reference_loss(head: ComAlign, ir, tr) -> float:
    """Eq. 6-9 row by row: per term, CE over the batch for each image (I2T) and each text (T2I), rows without
    evidence (own or positive set empty) skipped; L = (sum_c w_c L^c_I2T + sum_c w_c L^c_T2I) / 2."""
    scale = math.exp(min(head.logit_scale.item(), math.log(100)))
    ir, tr = ({k: v.detach() for k, v in r.items()} for r in (ir, tr))
    n = len(ir["global"])
    total = 0.0
    for term, w in head.loss_weights().items():
        for direction in ("i2t", "t2i"):
            losses = []
            for a in range(n):
                if term == "global":
                    logits = [float(ir["global"][a] @ tr["global"][b]) if direction == "i2t"
                              else float(tr["global"][a] @ ir["global"][b]) for b in range(n)]
                else:
                    if not (ir[f"{term}_valid"][a].any() and tr[f"{term}_valid"][a].any()):
                        continue
                    if direction == "i2t":  # image a ranks texts by FGM(image a, text b)
                        logits = [_fgm_loop(ir[term][a], ir[f"{term}_valid"][a], tr[term][b], tr[f"{term}_valid"][b])
                                  for b in range(n)]
                    else:  # text a ranks images by FGM(text a, image b)
                        logits = [_fgm_loop(tr[term][a], tr[f"{term}_valid"][a], ir[term][b], ir[f"{term}_valid"][b])
                                  for b in range(n)]
                logits = torch.tensor(logits, dtype=torch.float64) * scale
                losses.append(float(torch.logsumexp(logits, 0) - logits[a]))
            total += w * (sum(losses) / max(len(losses), 1)) / 2
    return total


def test_loss_matches_literal_reading_of_the_equations():
    head = _head(dropout=0.0, relation_weight=0.5, global_weight=2.0, logit_scale_init=10.0)
    img, txt = _batch(6, 4, empty_rows=(1,))
    ir, tr = head.encode_image(img), head.encode_text(txt)
    out = head.loss(ir, tr)
    assert out["loss"].item() == pytest.approx(_reference_loss(head, ir, tr), rel=1e-5)
    out["loss"].backward()
    assert head.logit_scale.grad is not None
    assert all(p.grad is not None for p in head.image_encoder.parameters())


def test_train_image_only_passes_text_components_through():
    head = _head(train="image", dropout=0.0)
    assert head.text_encoder is None and head.image_encoder is not None
    img, txt = _batch(4, 5)
    t = head.encode_text(txt)
    torch.testing.assert_close(t["entity"], txt["entity_embed"], atol=1e-6, rtol=0)
    head.loss(head.encode_image(img), t)["loss"].backward()
    assert all(p.grad is not None for p in head.image_encoder.parameters())
    text_only = _head(train="text")
    assert text_only.image_encoder is None and text_only.text_encoder is not None
    with pytest.raises(ValueError, match="train must be"):
        _head(train="neither")


def test_directional_scores_and_chunking():
    head = _head().eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    img, txt = _batch(7, 6)
    ir, tr = head.encode_image(img), head.encode_text(txt)
    sims = head.similarities(ir, tr)
    w_t, w_i = head.fusion_t2i, head.fusion_i2t
    t2i = head.score_directed(ir, tr, "t2i")
    i2t = head.score_directed(ir, tr, "i2t")
    torch.testing.assert_close(t2i, w_t[0] * sims["entity_t2i"] + w_t[1] * sims["relation_t2i"] + w_t[2] * sims["global"]
                               + w_t[3] * sims["base"])
    torch.testing.assert_close(i2t, w_i[0] * sims["entity_i2t"] + w_i[1] * sims["relation_i2t"] + w_i[2] * sims["global"]
                               + w_i[3] * sims["base"] + w_i[4] * (sims["entity_t2i"] + sims["relation_t2i"]))
    assert not torch.allclose(t2i, i2t)
    torch.testing.assert_close(head.score_directed(ir, tr, "i2t", chunk_elements=1), i2t)  # one image per chunk
    torch.testing.assert_close(head.score(ir, tr), (t2i + i2t) / 2)


def test_fit_inference_improves_held_out_recall_and_respects_disabled_terms():
    head = _head(relation_weight=0.0).eval()
    img, txt = _batch(12, 7)
    # a held-out split where the base embedding carries the match: captions are noisy copies of their image
    txt["text_embed"] = F.normalize(img["image_embed"] + 0.3 * torch.randn(12, D), dim=-1)
    ir, tr = head.encode_image(img), head.encode_text(txt)
    assert head.fusion_t2i[1] == 0 and head.fusion_i2t[1] == 0  # relation left out of inference (Table III)
    fitted = head.fit_inference(ir, tr, torch.arange(12))
    assert fitted["t2i_objective_after"] >= fitted["t2i_objective_before"]
    assert fitted["i2t_objective_after"] >= fitted["i2t_objective_before"]
    assert fitted["t2i_relation"] == 0 and fitted["i2t_relation"] == 0
    assert head.fusion_t2i.tolist() == [fitted[f"t2i_{k}"] for k in ("entity", "relation", "global", "base")]
    again = head.fit_inference(ir, tr, torch.arange(12))  # already optimal on the grid: nothing changes
    assert again["t2i_objective_after"] == fitted["t2i_objective_after"]


def test_positional_code_is_vaswanis():
    pe = sinusoidal_positions(5, 8)
    assert pe[3, 0].item() == pytest.approx(math.sin(3))
    assert pe[3, 1].item() == pytest.approx(math.cos(3))
    assert pe[2, 2].item() == pytest.approx(math.sin(2 / 10000 ** (2 / 8)))


def test_relation_geometry_is_canonical_and_starts_as_the_papers_form():
    from adapters.heads.comalign import RelationGeometry, pair_geometry

    boxes = torch.tensor([[[40.0, 10, 60, 30], [0, 10, 20, 30], [10, 40, 30, 60]]])  # 0 right of 1; 2 below
    feats, first, second = pair_geometry(boxes, torch.tensor([[[0, 1], [1, 0], [1, 2]]]))
    # (0, 1) and (1, 0) are one pair: listed in either order, the same left-to-right features
    assert torch.equal(feats[0, 0], feats[0, 1]) and first[0, :2].tolist() == [1, 1] and second[0, :2].tolist() == [0, 0]
    assert feats[0, 0, 8].item() > 0.5 and abs(feats[0, 0, 9].item()) < 1e-6  # second is to the right, same height
    assert feats[0, 2, 9].item() > 0  # 2 is below 1 (y down)
    # a scaled image gives the same features (union-box frame)
    assert torch.allclose(pair_geometry(boxes * 3, torch.tensor([[[0, 1]]]))[0][0, 0], feats[0, 0])
    geo = RelationGeometry(8)
    rel, ent = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    out = geo(rel, ent, boxes, torch.tensor([[[0, 1], [1, 0], [1, 2]]]))
    torch.testing.assert_close(out, torch.nn.functional.normalize(rel, dim=-1))  # zero-initialised: identity
    for p in geo.parameters():
        torch.nn.init.normal_(p)
    out = geo(rel, ent, boxes, torch.tensor([[[0, 1], [1, 0], [1, 2]]]))
    # trained, it tells "1 left of 0" apart from "1 left of 2" even with equal union crops
    assert not torch.allclose(out[0, 0] - torch.nn.functional.normalize(rel[0, 0], dim=0),
                              out[0, 2] - torch.nn.functional.normalize(rel[0, 2], dim=0))


def test_comalign_with_relation_geometry_trains_a_step():
    head = ADAPTERS.get("comalign").from_config({"heads": 4, "relation_geometry": True}, 32)
    g = torch.Generator().manual_seed(0)
    n = 6
    boxes = torch.rand(n, 3, 2, generator=g) * 40
    img = {"image_embed": torch.randn(n, 32, generator=g), "ventity_embed": torch.randn(n, 3, 32, generator=g),
           "ventity_valid": torch.ones(n, 3, dtype=torch.bool), "vrelation_embed": torch.randn(n, 2, 32, generator=g),
           "vrelation_valid": torch.ones(n, 2, dtype=torch.bool),
           "ventity_boxes": torch.cat([boxes, boxes + 10], -1), "vrelation_pairs": torch.tensor([[0, 1], [1, 2]]).expand(n, 2, 2)}
    txt = {"text_embed": torch.randn(n, 32, generator=g), "entity_embed": torch.randn(n, 3, 32, generator=g),
           "entity_valid": torch.ones(n, 3, dtype=torch.bool), "relation_embed": torch.randn(n, 2, 32, generator=g),
           "relation_valid": torch.ones(n, 2, dtype=torch.bool)}
    out = head.loss(head.encode_image(img), head.encode_text(txt))
    out["loss"].backward()
    assert head.relation_geometry.geometry[-1].weight.grad.abs().sum() > 0
