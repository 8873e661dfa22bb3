"""adapters/objectives/clip_pgs.py: CLIP-PGS's patch generation-to-selection (paper §3.2): Sinkhorn gives a doubly
stochastic matrix, Sobel finds outlines, the masking ratio stays within its bounds, outlines are kept and
redundant background goes first."""
from __future__ import annotations

import pytest
import torch

from adapters.objectives.base import StepContext
from adapters.objectives.towers import keep_count
from adapters.objectives.clip_pgs import PGSConfig, pgs_select, pixel_patches, sinkhorn, sobel_patch_edges
from adapters.registry import PRETRAIN

GRID, PATCH = (8, 8), (8, 8)


def _square_image() -> torch.Tensor:
    """A 64 px black image with a red square on patches rows 2-4, cols 2-4 (pixels 16..39)."""
    img = torch.full((1, 3, 64, 64), -1.5)
    img[:, 0, 16:40, 16:40] = 1.5
    return img


def test_sinkhorn_is_doubly_stochastic():
    s = torch.randn(3, 10, 10, generator=torch.Generator().manual_seed(0)).clamp(-1, 1)
    p = sinkhorn(s, eps=0.5, iters=100)
    torch.testing.assert_close(p.sum(-1), torch.ones(3, 10), rtol=0, atol=1e-4)
    torch.testing.assert_close(p.sum(-2), torch.ones(3, 10), rtol=0, atol=1e-5)
    assert (p >= 0).all()
    few = sinkhorn(s, eps=0.05, iters=3)
    torch.testing.assert_close(few.sum(-2), torch.ones(3, 10), rtol=0, atol=1e-5)  # columns exact after the last pass
    big = sinkhorn(torch.ones(1, 4, 4) * 50, eps=0.01, iters=2)  # no overflow in log space
    assert torch.isfinite(big).all()


def test_sobel_marks_the_outline():
    e = sobel_patch_edges(_square_image(), GRID, PATCH).view(8, 8)
    assert e.max() == 1.0
    assert e[3, 3] == 0 and e[0, 0] == 0 and e[7, 7] == 0  # inside the square and far background: flat
    assert e[2, 3] > 0.5 and e[3, 1] > 0.5 and e[4, 5] > 0.5  # patches on the square's border
    assert pixel_patches(_square_image(), PATCH).shape == (1, 64, 192)


def test_pixel_patches_match_unfold():
    # the reshape is the fast path; F.unfold (one im2col per image on CUDA) is the reference, remainders included
    for shape, patch in (((2, 3, 32, 32), (4, 4)), ((1, 3, 35, 30), (8, 6))):
        images = torch.randn(*shape).to(torch.bfloat16)
        reference = torch.nn.functional.unfold(images.float(), kernel_size=patch, stride=patch).transpose(1, 2)
        assert torch.equal(pixel_patches(images, patch), reference)


def test_outlines_are_kept_and_background_is_masked_first():
    img = _square_image()
    feats = torch.randn(1, 64, 16)
    noise = torch.rand(1, 64)
    noise[0, [0, 7, 63]] = -1.0  # seeds on the background
    keep, padding, n_masked = pgs_select(img, feats, noise, PGSConfig(0.3, 0.5), alpha=0.0, grid=GRID, patch=PATCH)
    assert padding is None and int(n_masked) == 64 - keep_count(64, 0.5)  # plenty of background: upper bound
    masked = set(range(64)) - set(keep[0].tolist())
    square = {r * 8 + c for r in range(2, 5) for c in range(2, 5)}
    outline = set(torch.nonzero(sobel_patch_edges(img, GRID, PATCH)[0] >= 0.5).flatten().tolist())
    assert len(outline) == 20 and masked and not masked & (square | outline)  # 5x5 ring but corners, + 4 inner
    assert 3 * 8 + 3 in keep[0].tolist()


def test_ratio_bounds_hold_for_every_image():
    torch.manual_seed(0)
    images = torch.randn(6, 3, 64, 64)
    feats = torch.randn(6, 64, 16)
    noise = torch.rand(6, 64)
    lo, hi = 64 - keep_count(64, 0.3), 64 - keep_count(64, 0.5)
    for cfg in (PGSConfig(0.3, 0.5, sim_threshold=0.2), PGSConfig(0.3, 0.5, sim_threshold=5.0)):
        keep, padding, n_masked = pgs_select(images, feats, noise, cfg, alpha=0.5, grid=GRID, patch=PATCH)
        assert ((n_masked >= lo) & (n_masked <= hi)).all()
        k = 64 - n_masked
        assert keep.shape[1] == int(k.max())
        for row, pad, kept in zip(keep, padding if padding is not None else [None] * 6, k):
            real = row[~pad] if pad is not None else row
            assert len(real) == kept and len(set(real.tolist())) == kept
    never = PGSConfig(0.3, 0.5, sim_threshold=100.0)  # no candidate: the lower bound is what gets masked
    _, _, n_masked = pgs_select(images, feats, noise, never, alpha=0.5, grid=GRID, patch=PATCH)
    assert (n_masked == lo).all()
    keep, padding, n_masked = pgs_select(images, feats, noise, PGSConfig(0.5, 0.5), alpha=1.0, grid=GRID, patch=PATCH)
    assert padding is None and keep.shape == (6, 32) and (n_masked == 32).all()  # CLIP-PGS_0.5: FLIP's count


def test_objective_trains_on_selected_patches():
    from train.pretrain.trainer import create_model

    model, _, _, tok = create_model("plugvlm-tiny", False, 0)
    obj = PRETRAIN.get("clip-pgs")(PGSConfig(0.3, 0.5))
    assert obj.cfg.alpha_at(0.0) == 0.0 and obj.cfg.alpha_at(0.5) == 0.5 and PGSConfig(alpha=0.3).alpha_at(0.9) == 0.3
    batch = {"image": torch.randn(4, 3, 64, 64), "text": tok(["a", "b", "c", "d"])}
    feats = obj.features(model, batch, StepContext(global_batch=4, progress=0.25))
    assert feats["image_features"].shape == (4, 64) and ((feats["mask_ratio"] >= 0.29) & (feats["mask_ratio"] <= 0.5)).all()
    out = obj.loss(feats, StepContext())
    out["loss"].backward()
    assert 0.29 <= float(out["mask_ratio"]) <= 0.5 and model.visual.conv1.weight.grad is not None
    with pytest.raises(ValueError, match="pgs-min-ratio"):
        PGSConfig(0.6, 0.5)


def test_the_compiled_selection_chooses_as_the_eager_one_and_compiles_once_for_every_alpha():
    """--compile compiles the selection (pgs_order); aot_eager runs its captured graph without inductor's C++, so
    the choice must be the same patches; alpha, a new value every epoch, must not make a new graph."""
    from adapters.objectives.clip_pgs import compiled_order

    g = torch.Generator().manual_seed(4)
    images = torch.nn.functional.interpolate(torch.randn(6, 3, 2, 2, generator=g), size=64, mode="nearest")
    feats, noise = torch.randn(6, 64, 16, generator=g), torch.rand(6, 64, generator=g)
    torch._dynamo.reset()
    fn = compiled_order("aot_eager", "default")
    counts = set()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for alpha in (0.0, 0.25, 0.5, 1.0):
            eager = pgs_select(images, feats, noise, PGSConfig(0.3, 0.5), alpha, GRID, PATCH, pad_to_bound=True)
            fast = pgs_select(images, feats, noise, PGSConfig(0.3, 0.5), alpha, GRID, PATCH, pad_to_bound=True,
                              order_fn=fn)
            assert all(torch.equal(a, b) for a, b in zip(eager, fast)), alpha
            counts |= set((64 - eager[2]).tolist())
    assert len(counts) > 2  # images keep different counts: the padding is exercised too


def test_compile_reaches_the_selection_through_the_trainer_and_hard_negatives():
    from train.pretrain.options import PretrainOptions
    from train.pretrain.engine import with_hard_negatives

    obj = with_hard_negatives(PRETRAIN.get("clip-pgs")(PGSConfig()), PretrainOptions(data="unused",
                                                                                     hard_negatives="all"))
    obj.compile("aot_eager", "reduce-overhead")
    assert obj.inner.compiled == ("aot_eager", "reduce-overhead")
    import pickle

    assert pickle.loads(pickle.dumps(obj.inner)).compiled == ("aot_eager", "reduce-overhead")  # workers get it
