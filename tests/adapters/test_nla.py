"""adapters/losses/nla.py against the PowerCLIP proofs and against independent references.

- exact T2R / R2T against a pure itertools powerset enumeration and T2R's closed form (max_A Q_{A,B} = sum_m relu(Q_{m,B}));
- Theorem 1 (Lemma A.1): 0 <= NLA-T1 - T2R <= tau M log 2;
- eq. 76: NLA-T2 inside [Lambda(a) - tau Z_a, Lambda(a) + tau a log K], Lambda recomputed here from the
  exact powerset max (eq. 45, 47), and eq. 78: Lambda(0) <= R2T <= Lambda(1), the alpha = 0 / 1 NLAs
  bracketing R2T as tau -> 0;
- masking equals dropping the padded entries, for every function; no valid node -> 0;
- gradients finite down to tau = 1e-3 with |Q| up to M K (also under bf16 / fp16 autocast), gradcheck;
- the fused, chunked pair similarities against per-pair loops, its custom backward against autograd and
  gradcheck; the PowerCLIP loss against a hand-written composition.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.losses import nla
from adapters.losses.nla import (MAX_EXACT_REGIONS, NLAConfig, PowerCLIPLoss, PowerCLIPLossConfig, combined_similarity,
                          exact_pair_similarities, leaf_embeddings, log_cosh, nla_t1, nla_t2, nla_t2_bounds,
                          node_embeddings, pair_scale, pair_similarities, r2t_exact, region_embeddings, t2r_exact,
                          zeta)

LOG2 = math.log(2.0)
SETTINGS = settings(max_examples=30, deadline=None)


# ------------------------------------------------------------------------------------------------ helpers
def _case(seed: int, n: int, m: int, k: int, scale: float, p_valid: float = 0.7):
    """q [n, M, K] in double with |Q| up to ``scale``, random (non-prefix) region / node masks."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.rand(n, m, k, generator=g, dtype=torch.float64) * 2 - 1) * scale
    rmask = torch.rand(n, m, generator=g) < p_valid
    nmask = torch.rand(n, k, generator=g) < p_valid
    return q, rmask, nmask


def _subset_matrix(m: int) -> np.ndarray:
    """All 2^m subsets as 0/1 rows, by itertools (independent of the library's bit enumeration)."""
    return np.array(list(itertools.product([0.0, 1.0], repeat=m)), dtype=np.float64).reshape(2 ** m, m)


def _ref_item(q: np.ndarray) -> dict[str, float | np.ndarray]:
    """Exact quantities of one item whose padding is already dropped: q [Mv, Kv] (numpy, double)."""
    mv, kv = q.shape
    if kv == 0:
        return {"t2r": 0.0, "r2t": 0.0, "maxA": np.zeros(0), "qbar": np.zeros(0)}
    qab = _subset_matrix(mv) @ q  # [2^Mv, Kv]: Q_{A,B} (eq. 19)
    return {"t2r": qab.max(0).mean(), "r2t": qab.max(1).mean(), "maxA": qab.max(0), "qbar": q.sum(0)}


def _lam_ref(ref: dict, alpha: float) -> float:
    """Lambda(alpha) = max_B [(1 - alpha)/2 Qbar_B + alpha max_A Q_{A,B}] (eq. 45, 47)."""
    if len(ref["qbar"]) == 0:
        return 0.0
    return float(((1 - alpha) / 2 * ref["qbar"] + alpha * ref["maxA"]).max())


def _dropped(q: torch.Tensor, rmask: torch.Tensor, nmask: torch.Tensor, i: int) -> torch.Tensor:
    return q[i][rmask[i]][:, nmask[i]]


shapes = st.tuples(st.integers(1, 3), st.integers(1, 8), st.integers(1, 6))


# ------------------------------------------------------------------------------------------------- exact
def test_exact_against_itertools_enumeration():
    q, rmask, nmask = _case(0, 12, 6, 5, scale=3.0)
    t2r, r2t = t2r_exact(q, rmask, nmask), r2t_exact(q, rmask, nmask)
    for i in range(len(q)):
        ref = _ref_item(_dropped(q, rmask, nmask, i).numpy())
        assert t2r[i].item() == pytest.approx(ref["t2r"], abs=1e-12)
        assert r2t[i].item() == pytest.approx(ref["r2t"], abs=1e-12)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, log_scale=st.floats(-2, 2))
def test_t2r_exact_equals_closed_form(seed, shape, log_scale):
    """max_A Q_{A,B} = sum_m relu(Q_{m,B}) , so T2R = mean_B sum_m relu Q."""
    n, m, k = shape
    q, rmask, nmask = _case(seed, n, m, k, scale=m * k * 10 ** log_scale / 100)
    relu = (q.clamp_min(0) * rmask[..., None]).sum(1)  # [n, K]
    kv = nmask.sum(-1)
    closed = torch.where(kv > 0, (relu * nmask).sum(-1) / kv.clamp_min(1), torch.zeros(n, dtype=q.dtype))
    torch.testing.assert_close(t2r_exact(q, rmask, nmask), closed, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ Theorem 1
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, tau=st.sampled_from([1e-3, 1e-2, 0.1, 1.0]),
       rel=st.floats(0.0, 1.0))
def test_theorem1_nla_t1_within_tau_m_log2(seed, shape, tau, rel):
    """Lemma A.1: softplus >= relu termwise, and the gap per node is at most tau M log 2."""
    n, m, k = shape
    q, rmask, nmask = _case(seed, n, m, k, scale=max(rel * m * k, 1e-3))
    gap = nla_t1(q, tau, rmask, nmask) - t2r_exact(q, rmask, nmask)
    bound = tau * rmask.sum(-1).double() * LOG2  # M = valid regions
    assert (gap >= -1e-9).all()
    assert (gap <= bound + 1e-9).all()
    # ... and the bound is approached when every Q is 0 (softplus(0) = log 2): it is tight.
    zero = nla_t1(torch.zeros_like(q), tau, rmask, nmask) - t2r_exact(torch.zeros_like(q), rmask, nmask)
    torch.testing.assert_close(zero, torch.where(nmask.any(-1), bound, torch.zeros_like(bound)))


# ----------------------------------------------------------------------------------- eq. 76 and eq. 78
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, tau=st.sampled_from([1e-3, 1e-2, 0.1, 1.0]),
       alpha=st.floats(0.0, 1.0), rel=st.floats(0.01, 1.0))
def test_eq76_nla_t2_within_bounds(seed, shape, tau, alpha, rel):
    n, m, k = shape
    q, rmask, nmask = _case(seed, n, m, k, scale=rel * m * k)
    s = nla_t2(q, tau, alpha, rmask, nmask)
    lower, lam, upper = nla_t2_bounds(q, tau, alpha, rmask, nmask)
    tol = 1e-9 * (1 + m * k)
    assert (s >= lower - tol).all() and (s <= upper + tol).all()
    for i in range(n):  # Lambda and both bounds recomputed from the exact powerset max
        ref = _ref_item(_dropped(q, rmask, nmask, i).numpy())
        mv, kv = int(rmask[i].sum()), int(nmask[i].sum())
        lam_i = _lam_ref(ref, alpha)
        assert lam[i].item() == pytest.approx(lam_i, abs=1e-9)
        if kv == 0:
            assert s[i].item() == 0.0
            continue
        assert lam_i - tau * (alpha * mv * LOG2 + (1 - alpha) * math.log(kv)) - tol <= s[i].item()
        assert s[i].item() <= lam_i + tau * alpha * math.log(kv) + tol


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, rel=st.floats(0.01, 1.0))
def test_eq78_alpha_0_and_1_bracket_r2t(seed, shape, rel):
    """Lambda(0) <= R2T <= Lambda(1) (Jensen, eq. 78); the alpha = 0 / 1 NLAs converge to them as tau -> 0."""
    n, m, k = shape
    q, rmask, nmask = _case(seed, n, m, k, scale=rel * m * k)
    r2t = r2t_exact(q, rmask, nmask)
    mv = rmask.sum(-1).double()
    kv = nmask.sum(-1).clamp_min(1).double()
    tol = 1e-9 * (1 + m * k)
    for i in range(n):
        ref = _ref_item(_dropped(q, rmask, nmask, i).numpy())
        assert _lam_ref(ref, 0.0) - tol <= r2t[i].item() <= _lam_ref(ref, 1.0) + tol
    for tau in (1e-1, 1e-2, 1e-3, 1e-5):
        lo, hi = nla_t2(q, tau, 0.0, rmask, nmask), nla_t2(q, tau, 1.0, rmask, nmask)
        # alpha = 0: nla <= Lambda(0) <= R2T for every tau; alpha = 1: nla >= Lambda(1) - tau M log 2 >= R2T - ...
        assert (lo <= r2t + tol).all()
        assert (hi >= r2t - tau * mv * LOG2 - tol).all()
        gap = torch.maximum((lo - nla_t2_bounds(q, tau, 0.0, rmask, nmask)[1]).abs(),
                            (hi - nla_t2_bounds(q, tau, 1.0, rmask, nmask)[1]).abs())
        assert (gap <= tau * (mv * LOG2 + kv.log()) + tol).all()  # eq. 76: |S - Lambda| -> 0 with tau


# --------------------------------------------------------------------------------- masking == dropping
FUNCS = {
    "t2r_exact": lambda q, r, n: t2r_exact(q, r, n),
    "r2t_exact": lambda q, r, n: r2t_exact(q, r, n),
    "nla_t1": lambda q, r, n: nla_t1(q, 0.01, r, n),
    "nla_t2": lambda q, r, n: nla_t2(q, 0.01, 0.75, r, n),
    "nla_t2_a0": lambda q, r, n: nla_t2(q, 0.003, 0.0, r, n),
    "nla_t2_a1": lambda q, r, n: nla_t2(q, 0.1, 1.0, r, n),
    "bounds_lower": lambda q, r, n: nla_t2_bounds(q, 0.01, 0.4, r, n)[0],
    "bounds_lambda": lambda q, r, n: nla_t2_bounds(q, 0.01, 0.4, r, n)[1],
    "bounds_upper": lambda q, r, n: nla_t2_bounds(q, 0.01, 0.4, r, n)[2],
}


@pytest.mark.parametrize("name", sorted(FUNCS))
@pytest.mark.parametrize("garbage", [1e4, float("inf"), float("nan")])
def test_masking_equals_dropping(name, garbage):
    f = FUNCS[name]
    q, rmask, nmask = _case(3, 24, 6, 5, scale=4.0, p_valid=0.6)
    rmask[0], nmask[1] = True, True  # one item without padding, one with no region, one with no node
    rmask[2], nmask[3] = False, False
    pad = ~(rmask[:, :, None] & nmask[:, None, :])
    sign = torch.randint(0, 2, q.shape, generator=torch.Generator().manual_seed(4)) * 2 - 1
    noisy = torch.where(pad, torch.full_like(q, garbage) * sign, q)
    got = f(noisy, rmask, nmask)
    assert torch.isfinite(got).all()
    for i in range(len(q)):
        kept = _dropped(q, rmask, nmask, i)
        want = torch.zeros(()) if kept.shape[1] == 0 else f(kept, None, None)
        assert got[i].item() == pytest.approx(want.item(), abs=1e-12), (name, i, kept.shape)
    assert (got[3] == 0).all()  # no valid node: 0


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_masked_gradients_equal_dropped_gradients(name):
    f = FUNCS[name]
    q, rmask, nmask = _case(5, 10, 5, 4, scale=3.0, p_valid=0.6)
    nmask[0] = False
    q = torch.where(~(rmask[:, :, None] & nmask[:, None, :]), q * 100, q).requires_grad_()
    f(q, rmask, nmask).sum().backward()
    assert torch.isfinite(q.grad).all()
    valid = rmask[:, :, None] & nmask[:, None, :]
    assert (q.grad[~valid] == 0).all()  # padding never receives gradient
    for i in range(len(q)):
        kept = _dropped(q.detach(), rmask, nmask, i).requires_grad_()
        if kept.shape[1] == 0:
            continue
        f(kept, None, None).backward()
        torch.testing.assert_close(q.grad[i][rmask[i]][:, nmask[i]], kept.grad, rtol=1e-9, atol=1e-12)


def test_batch_dims_broadcast_masks():
    """Masks [..., M] / [..., K] may broadcast against q [..., M, K] (the pair layout [bi, bj, M, K])."""
    q, rmask, nmask = _case(8, 12, 4, 3, scale=2.0)
    q = q.view(3, 4, 4, 3)
    rm, nm = rmask.view(3, 4, 4)[:, :1].expand(3, 4, 4), nmask.view(3, 4, 3)[:1].expand(3, 4, 3)
    for f in FUNCS.values():
        torch.testing.assert_close(f(q, rm[:, :1], nm[:1]), f(q, rm, nm))


# ------------------------------------------------------------------------------------- numerics / grads
@pytest.mark.parametrize("tau", [1e-3, 1e-2, 0.1])
@pytest.mark.parametrize("m,k", [(1, 1), (10, 16), (16, 8)])
def test_gradients_finite_extreme_inputs(tau, m, k):
    """|Q| up to M K (every leaf similarity +-1, every node holding K leaves), ties and exact zeros."""
    g = torch.Generator().manual_seed(m * k)
    q = (torch.randint(-1, 2, (4, m, k), generator=g) * m * k).float()
    q[1] = torch.rand(m, k, generator=g) * 2 * m * k - m * k
    q[2] = 0.0
    q[3] = m * k
    q.requires_grad_()
    rmask = torch.ones(4, m, dtype=torch.bool)
    rmask[1, 0] = False
    fns = [lambda x: nla_t1(x, tau), lambda x: t2r_exact(x, rmask), lambda x: r2t_exact(x, rmask)]
    fns += [lambda x, a=a: nla_t2(x, tau, a, rmask) for a in (0.0, 0.75, 1.0)]
    for f in fns:
        q.grad = None
        out = f(q)
        out.sum().backward()
        assert out.dtype == torch.float32 and torch.isfinite(out).all() and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_autocast_computes_in_fp32(amp_dtype):
    """Q / tau reaches 2.6e5 at tau = 1e-3, beyond fp16's 65504: the NLAs must leave autocast and upcast."""
    m, k, tau = 16, 16, 1e-3
    g = torch.Generator().manual_seed(1)
    leaves = torch.randn(3, m, k, generator=g).sign().to(amp_dtype) * (m * k)  # |Q| = M K exactly
    leaves.requires_grad_()
    with torch.autocast("cpu", dtype=amp_dtype):
        outs = [nla_t1(leaves, tau), nla_t2(leaves, tau, 0.75), t2r_exact(leaves), r2t_exact(leaves)]
    ref = [nla_t1(leaves.float(), tau), nla_t2(leaves.float(), tau, 0.75), t2r_exact(leaves.float()),
           r2t_exact(leaves.float())]
    for out, want in zip(outs, ref):
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        torch.testing.assert_close(out, want)
    sum(o.sum() for o in outs).backward()
    assert torch.isfinite(leaves.grad.float()).all()


def test_pair_similarities_under_autocast_equals_fp32():
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(8, 16)
    x_r, x_n = torch.randn(5, 4, 8, generator=g), torch.randn(6, 3, 8, generator=g)
    rm, nm = torch.ones(5, 4, dtype=torch.bool), torch.ones(6, 3, dtype=torch.bool)
    cfg = NLAConfig(1e-3, 1e-3, 0.75)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        regions, nodes = lin(x_r), lin(x_n)  # bf16 activations, as a head under autocast produces
        assert regions.dtype == torch.bfloat16
        t2r, r2t = pair_similarities(regions, rm, nodes, nm, cfg)
    assert t2r.dtype == r2t.dtype == torch.float32
    want = pair_similarities(regions.float(), rm, nodes.float(), nm, cfg)
    torch.testing.assert_close((t2r, r2t), want)
    (t2r.sum() + r2t.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in lin.parameters())


def test_log_cosh_and_zeta_stable():
    x = torch.tensor([-1e6, -50.0, -1.0, 0.0, 1e-3, 3.0, 1e6], dtype=torch.float64, requires_grad=True)
    y = log_cosh(x)
    torch.testing.assert_close(y[2:6], torch.log(torch.cosh(x[2:6])))
    torch.testing.assert_close(y[[0, -1]], x.detach()[[0, -1]].abs() - LOG2)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.tanh(x.detach()))
    torch.testing.assert_close(zeta(x.detach(), 0.3), x.detach() + 0.3 * y.detach())


def test_gradcheck_nla_t1_and_t2():
    q, rmask, nmask = _case(11, 3, 4, 3, scale=0.5)
    rmask[:, 0], nmask[:, 0] = True, True
    q.requires_grad_()
    for tau in (0.05, 0.5):
        assert torch.autograd.gradcheck(lambda x: nla_t1(x, tau, rmask, nmask), (q,))
        for alpha in (0.0, 0.75, 1.0):
            assert torch.autograd.gradcheck(lambda x: nla_t2(x, tau, alpha, rmask, nmask), (q,))


def test_invalid_arguments_are_refused():
    q = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="tau"):
        nla_t1(q, 0.0)
    with pytest.raises(ValueError, match="tau"):
        nla_t2(q, -1.0, 0.5)
    with pytest.raises(ValueError, match="alpha"):
        nla_t2(q, 0.1, 1.5)
    with pytest.raises(ValueError, match=r"\[\.\.\., M, K\]"):
        nla_t1(torch.zeros(3), 0.1)


def test_exact_refuses_more_than_16_regions():
    ok = torch.randn(MAX_EXACT_REGIONS, 2)
    torch.testing.assert_close(t2r_exact(ok), ok.clamp_min(0).sum(0).mean())  # 2^16 subsets still fine
    q = torch.zeros(1, MAX_EXACT_REGIONS + 1, 2)
    for f in (t2r_exact, r2t_exact):
        with pytest.raises(ValueError, match=r"M = 17 > 16.*nla_t1"):
            f(q)
    with pytest.raises(ValueError, match="M = 17"):
        exact_pair_similarities(torch.zeros(1, 17, 4), torch.ones(1, 17), torch.zeros(1, 2, 4), torch.ones(1, 2))


# ------------------------------------------------------------------------------ embeddings -> pair scores
def _embeddings(seed: int, bi: int, bj: int, m: int, k: int, d: int, dtype=torch.float64, empty_text=True):
    g = torch.Generator().manual_seed(seed)
    regions = F.normalize(torch.randn(bi, m, d, generator=g, dtype=dtype), dim=-1)
    nodes = torch.randn(bj, k, d, generator=g, dtype=dtype) * 0.7
    rmask = torch.rand(bi, m, generator=g) < 0.75
    nmask = torch.rand(bj, k, generator=g) < 0.75
    rmask[0], nmask[0] = True, True  # a full image, a full text
    nmask[-1] = False if empty_text else nmask[-1] | (torch.arange(k) == 0)  # (a text without nodes)
    regions = torch.where(rmask[..., None], regions, torch.full_like(regions, 1e3))  # garbage in padding
    nodes = torch.where(nmask[..., None], nodes, torch.full_like(nodes, -1e3))
    return regions, rmask, nodes, nmask


def _loop_pairs(regions, rmask, nodes, nmask, f):
    """Per-pair reference: slice each pair's valid rows, build its q and call f(q) -> (t2r, r2t)."""
    out = torch.zeros(2, len(regions), len(nodes), dtype=regions.dtype)
    for i in range(len(regions)):
        for j in range(len(nodes)):
            q = regions[i][rmask[i]] @ nodes[j][nmask[j]].T
            if q.shape[1]:
                out[0, i, j], out[1, i, j] = f(q)
    return out[0], out[1]


CFGS = [NLAConfig(), NLAConfig(0.05, 0.02, 0.3), NLAConfig(0.01, 0.01, 0.0), NLAConfig(1e-3, 0.1, 1.0)]


@pytest.mark.parametrize("cfg", CFGS, ids=str)
def test_pair_similarities_chunked_fused_reference_and_loop_agree(cfg):
    regions, rmask, nodes, nmask = _embeddings(0, 7, 6, 5, 4, 16)
    want = _loop_pairs(regions, rmask, nodes, nmask,
                       lambda q: (nla_t1(q, cfg.tau_t1), nla_t2(q, cfg.tau_t2, cfg.alpha)))
    for fused in (True, False):
        for chunk in (1, 3, 7, 100):
            got = pair_similarities(regions, rmask, nodes, nmask, cfg, chunk_size=chunk, fused=fused)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert (want[0][:, -1] == 0).all() and (want[1][:, -1] == 0).all()


def test_exact_pair_similarities_against_loop():
    regions, rmask, nodes, nmask = _embeddings(1, 4, 5, 6, 3, 8)
    want = _loop_pairs(regions, rmask, nodes, nmask, lambda q: (t2r_exact(q), r2t_exact(q)))
    torch.testing.assert_close(exact_pair_similarities(regions, rmask, nodes, nmask), want)


@pytest.mark.parametrize("cfg", CFGS, ids=str)
def test_fused_backward_matches_autograd_reference(cfg):
    """The custom backward of the fused path against plain autograd through nla_t1 / nla_t2, with and
    without checkpointing, and weighted upstream gradients (as a loss produces)."""
    regions, rmask, nodes, nmask = _embeddings(2, 6, 5, 4, 3, 8)
    gw = torch.randn(2, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for fused, ckpt in ((True, None), (False, True), (False, False)):
        r, n = regions.clone().requires_grad_(), nodes.clone().requires_grad_()
        t2r, r2t = pair_similarities(r, rmask, n, nmask, cfg, chunk_size=2, fused=fused, checkpoint=ckpt)
        ((t2r * gw[0]).sum() + (r2t * gw[1]).sum()).backward()
        assert (r.grad[~rmask] == 0).all() and (n.grad[~nmask] == 0).all()
        grads.append((r.grad, n.grad))
    # The reference's softplus is exactly linear above q / tau = 20 (gradient 1, not sigmoid(20)): ~1e-9.
    for other in grads[1:]:
        torch.testing.assert_close(grads[0], other, rtol=1e-7, atol=1e-7)


def test_gradcheck_fused_pair_similarities():
    regions, rmask, nodes, nmask = _embeddings(4, 4, 3, 3, 3, 5)
    regions = torch.where(rmask[..., None], regions, torch.zeros_like(regions)).requires_grad_()
    nodes = torch.where(nmask[..., None], nodes, torch.zeros_like(nodes)).requires_grad_()
    for cfg in (NLAConfig(0.3, 0.3, 0.75), NLAConfig(0.2, 0.5, 0.4), NLAConfig(0.1, 0.1, 0.0)):
        assert torch.autograd.gradcheck(
            lambda r, n: pair_similarities(r, rmask, n, nmask, cfg, chunk_size=3), (regions, nodes))


def test_pair_similarities_memory_bounded_by_chunk(monkeypatch):
    """Only chunk_size image rows ever reach the [bi, bj, M, K] work."""
    seen = []
    real = nla._SoftplusSum.forward

    def spy(ctx, regions, *rest):
        seen.append(regions.shape[0])
        return real(ctx, regions, *rest)

    monkeypatch.setattr(nla._SoftplusSum, "forward", staticmethod(spy))
    regions, rmask, nodes, nmask = _embeddings(5, 10, 4, 3, 3, 8, torch.float32)
    pair_similarities(regions, rmask, nodes, nmask, chunk_size=4)
    assert seen == [4, 4, 2]


def test_region_leaf_node_embeddings_against_loops():
    g = torch.Generator().manual_seed(6)
    patches, tokens = torch.randn(2, 9, 4, generator=g), torch.randn(2, 7, 4, generator=g)
    rmask = torch.rand(2, 3, 9, generator=g) < 0.4
    rmask[1, 2] = False  # an empty region
    leaf_tokens = torch.rand(2, 4, 7, generator=g) < 0.5
    leaf_tokens[0, 3] = False
    node_leaves = torch.rand(2, 5, 4, generator=g) < 0.5
    reg, rvalid = region_embeddings(patches, rmask)
    leaves, lvalid = leaf_embeddings(tokens, leaf_tokens)
    nodes = node_embeddings(leaves, node_leaves)
    for b in range(2):
        for m in range(3):
            sel = patches[b][rmask[b, m]]
            assert rvalid[b, m] == (len(sel) > 0)
            want = F.normalize(sel.mean(0), dim=0) if len(sel) else torch.zeros(4)
            torch.testing.assert_close(reg[b, m], want)
        for p in range(4):
            sel = tokens[b][leaf_tokens[b, p]]
            want = F.normalize(sel.mean(0), dim=0) if len(sel) else torch.zeros(4)
            torch.testing.assert_close(leaves[b, p], want)
            assert lvalid[b, p] == (len(sel) > 0)
        for kk in range(5):
            torch.testing.assert_close(nodes[b, kk], leaves[b][node_leaves[b, kk]].sum(0))
    # Q_{m,B} = sum of leaf similarities (eq. 18), by bilinearity
    q = reg[0] @ nodes[0].T
    s0 = reg[0] @ leaves[0].T
    torch.testing.assert_close(q, s0 @ node_leaves[0].float().T)


# ------------------------------------------------------------------------------------------------- loss
def _ref_loss(img, txt, scale, regions, rmask, nodes, nmask, sizes, cfg: PowerCLIPLossConfig):
    """clip + lam (triplet(S) + triplet(S^T)) written out by hand from per-pair NLAs."""
    b = len(img)
    t2r, r2t = _loop_pairs(regions, rmask, nodes, nmask,
                           lambda q: (nla_t1(q, cfg.nla.tau_t1), nla_t2(q, cfg.nla.tau_t2, cfg.nla.alpha)))
    s = cfg.w_t2r * t2r + cfg.w_r2t * r2t
    if cfg.normalize:
        for i in range(b):
            for j in range(b):
                size = sizes[j][nmask[j]].mean() if nmask[j].any() else torch.tensor(1.0)
                s[i, j] = s[i, j] / (max(int(rmask[i].sum()), 1) * max(float(size), 1.0))
    logits = scale * img @ txt.T
    clip = 0.0
    for i in range(b):
        clip = clip - 0.5 * (logits[i, i] - torch.logsumexp(logits[i], 0)) / b
        clip = clip - 0.5 * (logits[i, i] - torch.logsumexp(logits[:, i], 0)) / b
    trip = 0.0
    for mat in (s, s.T):
        for r in range(b):
            negs = [mat[r, c] for c in range(b) if c != r]
            if cfg.semihard:  # the hardest negative below the positive, else the easiest one
                below = [n for n in negs if n < mat[r, r]]
                negs = [max(below)] if below else [min(negs)]
            hinges = [torch.clamp(cfg.margin - mat[r, r] + n, min=0) for n in negs]
            trip = trip + (max(hinges) if cfg.hardest else sum(hinges)) / b
    return clip + cfg.lam * trip, clip, trip


@pytest.mark.parametrize("hardest, semihard", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("normalize", [True, False])
def test_powerclip_loss_against_hand_written(hardest, semihard, normalize):
    b, m, k, d = 5, 4, 3, 8
    regions, rmask, nodes, nmask = _embeddings(7, b, b, m, k, d, empty_text=False)
    g = torch.Generator().manual_seed(8)
    img = F.normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=-1)
    txt = F.normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=-1)
    sizes = torch.randint(1, 4, (b, k), generator=g).double()
    cfg = PowerCLIPLossConfig(lam=0.3, margin=0.05, w_t2r=0.7, w_r2t=0.3, hardest=hardest, semihard=semihard,
                              normalize=normalize, nla=NLAConfig(0.02, 0.01, 0.6), chunk_size=2)
    got = PowerCLIPLoss(cfg)(img, txt, 10.0, regions, rmask, nodes, nmask, sizes)
    loss, clip, trip = _ref_loss(img, txt, 10.0, regions, rmask, nodes, nmask, sizes, cfg)
    if semihard:  # the semi-hard pick differs from the hardest one in this batch (the test would not see it else)
        hard = _ref_loss(img, txt, 10.0, regions, rmask, nodes, nmask, sizes, dataclasses.replace(cfg, semihard=False))
        assert abs(float(hard[2] - trip)) > 1e-3
    # clip_loss runs its cross-entropy in fp32 (as open_clip) and pair_scale is fp32: 1e-7 relative
    torch.testing.assert_close(got["loss"], loss.to(got["loss"].dtype), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["clip"], clip.to(got["clip"].dtype), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["triplet"], trip.to(got["triplet"].dtype), rtol=1e-7, atol=1e-9)
    scale = pair_scale(rmask, nmask, sizes)
    assert scale.shape == (b, b) and (scale >= 1).all()
    s = combined_similarity(regions, rmask, nodes, nmask, cfg, sizes)
    assert s.shape == (b, b)


def test_powerclip_loss_with_tiny_tau_matches_exact_t2r():
    """Theorem 1 at the loss level: with T2R only and tau -> 0, the NLA triplet equals the exact one."""
    b = 6
    regions, rmask, nodes, nmask = _embeddings(9, b, b, 5, 4, 8, empty_text=False)
    cfg = PowerCLIPLossConfig(w_t2r=1.0, w_r2t=0.0, nla=NLAConfig(1e-6, 1e-6, 0.75), normalize=False, margin=0.1)
    img = txt = F.normalize(torch.ones(b, 8, dtype=torch.float64), dim=-1)
    got = PowerCLIPLoss(cfg)(img, txt, 1.0, regions, rmask, nodes, nmask)["triplet"]
    from adapters.losses.contrastive import triplet_rows

    s = exact_pair_similarities(regions, rmask, nodes, nmask)[0]
    pos = torch.arange(b)
    want = triplet_rows(s, pos, 0.1) + triplet_rows(s.T, pos, 0.1)
    assert got.item() == pytest.approx(want.item(), abs=4 * 1e-6 * 5 * LOG2 + 1e-9)  # 2 sides x 2 directions


def test_powerclip_loss_gradients_reach_every_input():
    b, m, k, d = 4, 3, 3, 8
    regions, rmask, nodes, nmask = _embeddings(10, b, b, m, k, d, torch.float32, empty_text=False)
    regions = torch.where(rmask[..., None], regions, torch.zeros_like(regions)).requires_grad_()
    nodes = torch.where(nmask[..., None], nodes, torch.zeros_like(nodes)).requires_grad_()
    img = F.normalize(torch.randn(b, d), dim=-1).requires_grad_()
    txt = F.normalize(torch.randn(b, d), dim=-1).requires_grad_()
    out = PowerCLIPLoss(PowerCLIPLossConfig(hardest=False, margin=5.0))(img, txt, 10.0, regions, rmask, nodes,
                                                                         nmask)
    out["loss"].backward()
    for t in (img, txt, regions, nodes):
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_nla_t2_has_its_exact_values():
    """Pinned, not only bounded: at Q = 0 every subset scores zeta(0) = 0, so NLA-T2 = tau * alpha * log K; and a
    small case computed by hand with math's own functions (a slipped temperature or sign moves it)."""
    import math

    for tau, alpha, k in ((0.01, 0.75, 5), (0.5, 0.0, 3), (0.1, 1.0, 7)):
        got = nla_t2(torch.zeros(4, k, dtype=torch.float64), tau, alpha)
        assert float(got) == pytest.approx(tau * alpha * math.log(k), abs=1e-12)
    q = torch.tensor([[0.4, -0.2, 0.1], [0.3, 0.5, -0.6]], dtype=torch.float64)  # M = 2 regions, K = 3 nodes
    tau, alpha = 0.5, 0.75

    def zeta(x):
        return x + alpha * math.log(math.cosh(x))

    sums = [sum(zeta(float(q[m, b]) / (2 * tau)) for m in range(2)) for b in range(3)]
    expected = tau * (math.log(sum(math.exp(v) for v in sums)) - (1 - alpha) * math.log(3))
    assert float(nla_t2(q, tau, alpha)) == pytest.approx(expected, abs=1e-12)
    assert float(nla_t2(q, tau, alpha)) == pytest.approx(0.6032641123, abs=1e-9)  # the figure itself
