"""PowerCLIP's powerset alignment: exact T2R / R2T, the non-linear aggregators (NLAs) and the loss.

Notation (PowerCLIP supplement App. A.1): an image has M region embeddings r_m, a
text has K tree nodes B with embeddings p_B (the sum of the node's leaf-phrase embeddings), and
``q[..., m, B] = Q_{m,B} = <r_m, p_B>``. A region subset A scores ``Q_{A,B} = sum_{m in A} Q_{m,B}``.

- T2R (eq. 21-22): ``(1/K) sum_B max_A Q_{A,B}``; R2T (eq. 42-43): ``2^-M sum_A max_B Q_{A,B}``.
- NLA-T1 (Def. 1, Theorem 1): ``(1/K) sum_B sum_m tau softplus(Q_{m,B} / tau)``, within ``tau M log 2``
  of T2R (Lemma A.1).
- NLA-T2 (Def. 2, eq. 73-75): ``tau [logsumexp_B sum_m zeta_a(Q_{m,B} / 2 tau) - (1 - a) log K]`` with
  ``zeta_a(x) = x + a log cosh x``, inside eq. 76's bounds around ``Lambda(a)``; ``a = 0`` / ``a = 1``
  bracket R2T as tau -> 0 (eq. 78).

Masks: ``region_mask [..., M]`` and ``node_mask [..., K]`` (bool, True = real) broadcast against ``q``.
Padding never counts: padded regions add nothing to any sum (also not ``tau log 2`` of softplus(0)),
padded nodes are never a max / logsumexp candidate, and M and K are the valid counts. An item with no
valid node scores 0 for every similarity here (there is nothing to align).

Everything is computed in at least fp32 with autocast off: ``Q / tau`` reaches 10^5 for tau = 1e-3, which
fp16 cannot hold, and the literal layer form ``tau log(K^(a-1) sum_B exp(...))`` overflows even in fp32,
so NLA-T2 is evaluated in this log-space form, which stays finite for tau = 0.01 (it is the same function:
``tau log(K^(a-1) sum_B exp(x_B)) = tau [logsumexp_B x_B - (1 - a) log K]``).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_EXACT_REGIONS = 16
_LOG2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------- helpers
@contextmanager
def _full_precision(x: Tensor):
    """Autocast off on x's device (the NLAs need fp32 range, see module docstring)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        yield


def _prepare(q: Tensor, region_mask: Tensor | None, node_mask: Tensor | None):
    """q in >= fp32; masks as bool broadcast to q's [..., M, K]. Returns (q, rmask [..., M, K],
    nmask [..., M, K], node_ok [..., K], k_valid [...], m_valid [...]); the last three are taken from the
    masks themselves so that M = 0 or K = 0 (every entry dropped) still works."""
    if q.dim() < 2:
        raise ValueError(f"q must be [..., M, K], got shape {tuple(q.shape)}")
    dtype = torch.promote_types(q.dtype, torch.float32)
    q = q.to(dtype)
    shape = q.shape
    rm = (torch.ones(shape[:-1], dtype=torch.bool, device=q.device) if region_mask is None
          else region_mask.to(device=q.device, dtype=torch.bool))
    nm = (torch.ones((*shape[:-2], shape[-1]), dtype=torch.bool, device=q.device) if node_mask is None
          else node_mask.to(device=q.device, dtype=torch.bool))
    node_ok = nm.expand((*shape[:-2], shape[-1]))  # [..., K]
    k_valid = node_ok.sum(-1)  # [...]
    m_valid = rm.expand(shape[:-1]).sum(-1)  # [...]
    rmask = rm.unsqueeze(-1).expand(shape)  # [..., M, K]
    nmask = nm.unsqueeze(-2).expand(shape)  # [..., M, K]
    return q, rmask, nmask, node_ok, k_valid, m_valid


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, and 0 where den == 0 (an item without valid nodes)."""
    return torch.where(den > 0, num / den.clamp_min(1).to(num.dtype), torch.zeros_like(num))


def log_cosh(x: Tensor) -> Tensor:
    """log cosh x without overflow: |x| + log1p(exp(-2|x|)) - log 2 (its derivative is tanh x)."""
    a = x.abs()
    return a + F.softplus(-2.0 * a) - _LOG2


def zeta(x: Tensor, alpha: float) -> Tensor:
    """zeta_alpha(x) = x + alpha log cosh x (Def. 2 with Act = tanh, eq. 66)."""
    return x + alpha * log_cosh(x)


# ------------------------------------------------------------------------------------------------ exact
def _subsets(m: int, device, dtype, start: int, stop: int) -> Tensor:
    """Rows start..stop-1 of the powerset of m regions as a 0/1 matrix [stop-start, m] (bit k = region k)."""
    codes = torch.arange(start, stop, device=device)
    bits = torch.arange(m, device=device)
    return ((codes[:, None] >> bits) & 1).to(dtype)


def _check_exact(q: Tensor) -> int:
    m = q.shape[-2]
    if m > MAX_EXACT_REGIONS:
        raise ValueError(f"exact powerset similarities enumerate 2^M subsets; M = {m} > {MAX_EXACT_REGIONS} "
                         f"would need 2^{m} = {2 ** m:,} of them. Use nla_t1 / nla_t2 (linear in M) instead.")
    return m


def _powerset_chunks(q: Tensor, rmask: Tensor, chunk: int):
    """Yield Q_{A,B} [..., C, K] for consecutive chunks of the 2^M subsets (padded regions zeroed: a zero
    region leaves max_A unchanged and pairs each subset with an equal twin, so means are unchanged too)."""
    m = q.shape[-2]
    qz = torch.where(rmask, q, torch.zeros_like(q))
    total = 1 << m
    for start in range(0, total, chunk):
        sub = _subsets(m, q.device, q.dtype, start, min(total, start + chunk))  # [C, M]
        yield torch.matmul(sub, qz)  # [..., C, K]


def t2r_exact(q: Tensor, region_mask: Tensor | None = None, node_mask: Tensor | None = None,
              *, chunk: int = 4096) -> Tensor:
    """Exact T2R (eq. 21-22) by enumerating all 2^M region subsets (the empty one included).

    q: [..., M, K] with M <= 16; masks as in the module docstring. Returns [...].
    """
    with _full_precision(q):
        _check_exact(q)
        q, rmask, nmask, node_ok, k_valid, m_valid = _prepare(q, region_mask, node_mask)
        best = None
        for qab in _powerset_chunks(q, rmask, chunk):
            top = qab.amax(dim=-2)  # [..., K]
            best = top if best is None else torch.maximum(best, top)
        best = torch.where(node_ok, best, torch.zeros_like(best))
        return _safe_div(best.sum(-1), k_valid)


def r2t_exact(q: Tensor, region_mask: Tensor | None = None, node_mask: Tensor | None = None,
              *, chunk: int = 4096) -> Tensor:
    """Exact R2T (eq. 42-43): mean over all 2^M region subsets of the best node's score.

    q: [..., M, K] with M <= 16; masks as in the module docstring. Returns [...].
    """
    with _full_precision(q):
        m = _check_exact(q)
        q, rmask, nmask, node_ok, k_valid, m_valid = _prepare(q, region_mask, node_mask)
        if q.shape[-1] == 0:  # no node at all: 0 by convention (and no max over an empty set)
            return q.sum(dim=(-2, -1)) * 0.0
        total = None
        for qab in _powerset_chunks(q, rmask, chunk):
            o = qab.masked_fill(~node_ok.unsqueeze(-2), float("-inf")).amax(dim=-1)  # [..., C]
            o = torch.where(torch.isfinite(o), o, torch.zeros_like(o))
            part = o.sum(-1)
            total = part if total is None else total + part
        return torch.where(k_valid > 0, total / float(1 << m), torch.zeros_like(total))


# -------------------------------------------------------------------------------------------------- NLA
def nla_t1(q: Tensor, tau: float, region_mask: Tensor | None = None, node_mask: Tensor | None = None) -> Tensor:
    """NLA-T1 (Def. 1, softplus): soft T2R, ``|nla_t1 - t2r_exact| <= tau * M * log 2`` (Theorem 1).

    q: [..., M, K]; returns [...]. Linear in M (PowerCLIP §4.2).
    """
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    with _full_precision(q):
        q, rmask, nmask, node_ok, k_valid, m_valid = _prepare(q, region_mask, node_mask)
        # F.softplus(x, beta) = log(1 + exp(beta x)) / beta, linear above beta x = 20 (error < 1e-8 tau).
        s = F.softplus(q, beta=1.0 / tau)
        s = torch.where(rmask & nmask, s, torch.zeros_like(s))
        return _safe_div(s.sum(dim=(-2, -1)), k_valid)


def nla_t2(q: Tensor, tau: float, alpha: float, region_mask: Tensor | None = None,
           node_mask: Tensor | None = None) -> Tensor:
    """NLA-T2 (Def. 2, tanh): ``tau [logsumexp_B sum_m zeta_alpha(Q_{m,B}/(2 tau)) - (1 - alpha) log K]``.

    Within eq. 76: ``Lambda(alpha) - tau (alpha M log 2 + (1 - alpha) log K) <= nla_t2 <= Lambda(alpha)
    + tau alpha log K`` with ``Lambda(alpha) = max_B [(1 - alpha)/2 sum_m Q_{m,B} + alpha sum_m relu Q_{m,B}]``.
    q: [..., M, K]; returns [...]. alpha in [0, 1] (paper: 0.75).
    """
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    with _full_precision(q):
        q, rmask, nmask, node_ok, k_valid, m_valid = _prepare(q, region_mask, node_mask)
        z = zeta(q / (2.0 * tau), alpha)
        z = torch.where(rmask, z, torch.zeros_like(z)).sum(-2)  # [..., K]; zeta(0) = 0 but masks are explicit
        z = z.masked_fill(~node_ok, float("-inf"))
        lse = torch.logsumexp(z, dim=-1)
        logk = torch.log(k_valid.clamp_min(1).to(q.dtype))
        out = tau * (lse - (1.0 - alpha) * logk)
        return torch.where(k_valid > 0, out, torch.zeros_like(out))


def nla_t2_bounds(q: Tensor, tau: float, alpha: float, region_mask: Tensor | None = None,
                  node_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(lower, Lambda(alpha), upper) of eq. 76, for tests and the report. Shapes [...]."""
    with _full_precision(q):
        q, rmask, nmask, node_ok, k_valid, m_valid = _prepare(q, region_mask, node_mask)
        qz = torch.where(rmask, q, torch.zeros_like(q))
        gamma = (1.0 - alpha) / 2.0 * qz.sum(-2) + alpha * qz.clamp_min(0).sum(-2)  # [..., K] (eq. 45)
        lam = (gamma.masked_fill(~node_ok, float("-inf")).amax(-1) if q.shape[-1]
               else gamma.sum(-1) * 0.0)  # no node at all
        lam = torch.where(k_valid > 0, lam, torch.zeros_like(lam))
        m_valid = m_valid.to(q.dtype)
        logk = torch.log(k_valid.clamp_min(1).to(q.dtype))
        lower = lam - tau * (alpha * m_valid * _LOG2 + (1.0 - alpha) * logk)
        upper = lam + tau * alpha * logk
        # No valid node: nla_t2 is 0 by convention, so the bounds collapse onto it.
        lower = torch.where(k_valid > 0, lower, torch.zeros_like(lower))
        return lower, lam, upper


# ------------------------------------------------------------------------------------ embeddings -> Q
def _pooled(x: Tensor, weights: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """normalise(mean of the rows of x selected by each weight row): x [B, N, d], weights [B, G, N]."""
    w = weights.to(x.dtype)
    count = w.sum(-1, keepdim=True)
    mean = torch.bmm(w, x) / count.clamp_min(1)
    return F.normalize(mean, dim=-1, eps=eps), count.squeeze(-1) > 0


def region_embeddings(patches: Tensor, region_masks: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """r_m = normalise(mean of the patch tokens inside region m) (PowerCLIP §3.2, eq. 2).

    patches [B, N, d]; region_masks [B, M, N] (bool or 0/1, flattened patch grid). Returns
    (regions [B, M, d] unit length, valid [B, M]); an empty mask gives a zero row and valid False.
    """
    return _pooled(patches, region_masks, eps)


def leaf_embeddings(tokens: Tensor, leaf_tokens: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Leaf phrase embedding = normalise(mean of its token embeddings) (PowerCLIP §3.3).

    tokens [B, L, d]; leaf_tokens [B, P, L] (bool / 0/1: token t belongs to leaf p). Returns
    (leaves [B, P, d] unit length, valid [B, P]).
    """
    return _pooled(tokens, leaf_tokens, eps)


def node_embeddings(leaves: Tensor, node_leaves: Tensor) -> Tensor:
    """p_B = sum of the node's leaf embeddings (PowerCLIP §3.3), so Q_{m,B} sums leaf similarities (eq. 18).

    leaves [B, P, d]; node_leaves [B, K, P] (bool / 0/1). Returns [B, K, d] (not normalised, by design).
    """
    return torch.bmm(node_leaves.to(leaves.dtype), leaves)


# ----------------------------------------------------------------------------------- batched pair scores
@dataclass(frozen=True)
class NLAConfig:
    """The NLA settings (paper §5.1: softplus / tanh, tau small, alpha 0.75)."""

    tau_t1: float = 0.01
    tau_t2: float = 0.01
    alpha: float = 0.75


def _pair_block(regions: Tensor, region_mask: Tensor, nodes: Tensor, node_mask: Tensor,
                cfg: NLAConfig) -> tuple[Tensor, Tensor]:
    """Reference path: T2R and R2T NLAs for every (image, text) pair of a block via :func:`nla_t1` /
    :func:`nla_t2` on the materialised q [bi, bj, M, K] (plain autograd). [bi, bj] each."""
    bi, m, d = regions.shape
    bj, k, _ = nodes.shape
    # One GEMM: [bi*M, d] x [d, bj*K], then view as [bi, bj, M, K] (no copy of the big tensor).
    q = (regions.reshape(bi * m, d) @ nodes.reshape(bj * k, d).T).view(bi, m, bj, k).permute(0, 2, 1, 3)
    rm = region_mask[:, None, :]  # [bi, 1, M]
    nm = node_mask[None, :, :]  # [1, bj, K]
    return nla_t1(q, cfg.tau_t1, rm, nm), nla_t2(q, cfg.tau_t2, cfg.alpha, rm, nm)


class _SoftplusSum(torch.autograd.Function):
    """``U[i, j, B] = sum_m w[i, m] tau softplus(<r_im, p_jB> / tau)`` for each tau, the one [.., M, K]-sized
    quantity both NLAs need (see :func:`pair_similarities`). Memory-lean on purpose: the backward keeps only
    the embeddings and recomputes q with one GEMM (the cost of checkpointing without its second forward),
    and the [bi, M, bj*K] temporaries are updated in place.

    regions [bi, M, d] (rows with w = 0 must be zero), w [bi, M] (0/1), nodes [bj, K, d]; returns one
    [bi, bj, K] tensor per tau. First-order only (``once_differentiable``).
    """

    @staticmethod
    def forward(ctx, regions: Tensor, w: Tensor, nodes: Tensor, taus: tuple[float, ...]):
        bi, m, d = regions.shape
        bj, k, _ = nodes.shape
        ctx.save_for_backward(regions, w, nodes)
        ctx.taus = taus
        q = torch.matmul(regions, nodes.reshape(bj * k, d).T)  # [bi, M, bj*K], contiguous
        out = []
        for tau in taus:
            s = F.softplus(q, beta=1.0 / tau)  # tau softplus(q / tau); exactly linear above q / tau = 20
            # sum over m weighted by the region mask: a batched [1, M] x [M, bj*K] product reads s once.
            out.append(torch.matmul(w.unsqueeze(1), s).view(bi, bj, k))
            del s
        return tuple(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        regions, w, nodes = ctx.saved_tensors
        bi, m, d = regions.shape
        bj, k, _ = nodes.shape
        flat_nodes = nodes.reshape(bj * k, d)
        q = torch.matmul(regions, flat_nodes.T)  # recomputed, [bi, M, bj*K]
        g = None
        for tau, gu in zip(ctx.taus, grads):
            if gu is None:
                continue
            gu = gu.reshape(bi, 1, bj * k)
            # d(tau softplus(q / tau)) / dq = sigmoid(q / tau); the last term reuses q's storage.
            if g is None:
                g = torch.sigmoid(q / tau).mul_(gu)
            else:
                g.add_(q.mul_(1.0 / tau).sigmoid_().mul_(gu))
        if g is None:
            return None, None, None, None
        # G [bi, M, bj*K] is dU/dq; padded regions (w = 0) take no part: weight them out of both products.
        g2 = g.view(bi * m, bj * k)
        d_regions = d_nodes = None
        if ctx.needs_input_grad[0]:
            d_regions = (g2 @ flat_nodes).view(bi, m, d) * w.unsqueeze(-1)
        if ctx.needs_input_grad[2]:
            d_nodes = (g2.T @ (regions * w.unsqueeze(-1)).reshape(bi * m, d)).view(bj, k, d)
        return d_regions, None, d_nodes, None


def _pair_block_fused(regions: Tensor, region_mask: Tensor, nodes: Tensor, node_mask: Tensor,
                      cfg: NLAConfig) -> tuple[Tensor, Tensor]:
    """Fast path of one block: both NLAs from ``U^tau[i, j, B] = sum_m tau softplus(Q_{m,B} / tau)`` and
    ``Qbar[i, j, B] = sum_m Q_{m,B}``, using ``log cosh x = softplus(2x) - x - log 2``, so that
    ``sum_m zeta_a(Q_{m,B} / 2 tau) = (1 - a) Qbar_B / (2 tau) + a U_B / tau - a M log 2`` (Def. 2, eq. 66):

    - T1 = (1/K) sum_B U^{tau1}_B                                        (Def. 1)
    - T2 = tau2 [logsumexp_B ((1 - a) Qbar_B / (2 tau2) + a U^{tau2}_B / tau2) - a M log 2 - (1 - a) log K]

    The only [bi, bj, M, K]-sized work is one GEMM and one softplus per distinct tau (two passes when
    tau1 = tau2, the paper's setting) instead of a dozen elementwise passes; everything else is [bi, bj, K].
    Padded regions / nodes must already be zero (:func:`pair_similarities` zeroes them once, so garbage in
    padding, even inf, cannot leak into a product). Same results as :func:`_pair_block` up to float rounding
    (tested).
    """
    rmask, nmask = region_mask.to(torch.bool), node_mask.to(torch.bool)
    w = rmask.to(regions.dtype)  # [bi, M]
    bj, k, d = nodes.shape
    a, tau1, tau2 = cfg.alpha, cfg.tau_t1, cfg.tau_t2
    taus = (tau1,) if (tau1 == tau2 or a == 0.0) else (tau1, tau2)
    us = _SoftplusSum.apply(regions, w, nodes, taus)
    u1 = us[0]
    u2 = us[-1] if a != 0.0 else None
    k_valid = nmask.sum(-1).to(regions.dtype)  # [bj]
    m_valid = w.sum(-1)  # [bi]
    nm = nmask.unsqueeze(0)  # [1, bj, K]
    t2r = _safe_div(torch.where(nm, u1, torch.zeros_like(u1)).sum(-1), k_valid.unsqueeze(0))
    qbar = (regions.sum(1) @ nodes.reshape(bj * k, d).T).view(-1, bj, k)  # sum_m Q_{m,B}: [bi, bj, K]
    z = ((1.0 - a) / (2.0 * tau2)) * qbar
    if u2 is not None:
        z = z + (a / tau2) * u2
    lse = torch.logsumexp(z.masked_fill(~nm, float("-inf")), dim=-1)  # [bi, bj]
    logk = torch.log(k_valid.clamp_min(1)).unsqueeze(0)
    r2t = tau2 * (lse - a * _LOG2 * m_valid.unsqueeze(1) - (1.0 - a) * logk)
    r2t = torch.where(k_valid.unsqueeze(0) > 0, r2t, torch.zeros_like(r2t))
    return t2r, r2t


def pair_similarities(regions: Tensor, region_mask: Tensor, nodes: Tensor, node_mask: Tensor,
                      cfg: NLAConfig = NLAConfig(), *, chunk_size: int = 64,
                      checkpoint: bool | None = None, fused: bool = True) -> tuple[Tensor, Tensor]:
    """T2R and R2T (NLA-T1 / NLA-T2) matrices [Bi, Bj] for every image against every text.

    regions [Bi, M, d] (unit rows), region_mask [Bi, M]; nodes [Bj, K, d], node_mask [Bj, K].
    Peak memory is bounded by ``chunk_size`` image rows at a time (about two chunk_size x Bj x M x K float
    tensors, plus [Bi, Bj, K]-sized ones for the logsumexp), never the whole Bi x Bj x M x K tensor.

    ``fused=True`` (default): :func:`_pair_block_fused`, whose backward recomputes each chunk's q from the
    embeddings (so training keeps the bound). ``fused=False``: the reference path (:func:`nla_t1` /
    :func:`nla_t2` on q under plain autograd), where ``checkpoint`` (default: when gradients are needed)
    recomputes each chunk in the backward pass (``torch.utils.checkpoint``) and ``checkpoint=False`` keeps
    every chunk's temporaries. Both paths agree up to float rounding (tested).
    """
    with _full_precision(regions):
        dtype = torch.promote_types(torch.promote_types(regions.dtype, nodes.dtype), torch.float32)
        regions, nodes = regions.to(dtype), nodes.to(dtype)
        region_mask = region_mask.to(torch.bool)
        node_mask = node_mask.to(torch.bool)
        if checkpoint is None:
            checkpoint = torch.is_grad_enabled() and (regions.requires_grad or nodes.requires_grad)
        block = _pair_block_fused if fused else _pair_block
        if fused:  # zero the padding once (not per chunk: each chunk's backward keeps its inputs alive)
            zero = torch.zeros((), dtype=dtype, device=regions.device)
            regions = torch.where(region_mask.unsqueeze(-1), regions, zero)
            nodes = torch.where(node_mask.unsqueeze(-1), nodes, zero)
        t2r, r2t = [], []
        for s in range(0, regions.shape[0], max(1, chunk_size)):
            args = (regions[s:s + chunk_size], region_mask[s:s + chunk_size], nodes, node_mask)
            if not fused and checkpoint and regions.shape[0] > chunk_size:
                a, b = torch.utils.checkpoint.checkpoint(block, *args, cfg, use_reentrant=False)
            else:
                a, b = block(*args, cfg)
            t2r.append(a)
            r2t.append(b)
        return torch.cat(t2r), torch.cat(r2t)


def exact_pair_similarities(regions: Tensor, region_mask: Tensor, nodes: Tensor,
                            node_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The exact counterpart of :func:`pair_similarities` (2^M subsets; M <= 16), for tests and analysis."""
    q = torch.einsum("imd,jkd->ijmk", regions.double(), nodes.double())
    rm, nm = region_mask[:, None, :], node_mask[None, :, :]
    return t2r_exact(q, rm, nm), r2t_exact(q, rm, nm)


# ------------------------------------------------------------------------------------------------- loss
@dataclass(frozen=True)
class PowerCLIPLossConfig:
    """PowerCLIP's objective: ``clip + lam * (triplet(S) + triplet(S^T))`` (paper §3.3 eq. 8, §4.4 eq. 16).

    ``S = w_t2r * T2R + w_r2t * R2T`` (the paper's combining formula was lost in conversion; the mean, the
    default, keeps each term's scale). T2R and R2T grow with the number of regions M and with
    the node sizes (T2R <= M * mean node size), so with ``normalize`` the triplet sees
    ``S_ij / (M_i * mean node size_j)`` and ``margin`` is on that unit scale; without it the margin is on S's
    raw scale. lam = 0.1, M = 10, softplus / tanh, alpha = 0.75 are the paper's (§5.1, App. F).
    Negatives of the triplet (eq. 9): the hardest (``hardest``, VSE++, the paper's), the hardest below the
    positive (``hardest`` and ``semihard``, see :func:`adapters.losses.contrastive.triplet_rows`), or the sum over all.
    """

    lam: float = 0.1
    margin: float = 0.2
    w_t2r: float = 0.5
    w_r2t: float = 0.5
    hardest: bool = True
    semihard: bool = False
    normalize: bool = True
    nla: NLAConfig = NLAConfig()
    chunk_size: int = 64


def combined_similarity(regions: Tensor, region_mask: Tensor, nodes: Tensor, node_mask: Tensor,
                        cfg: PowerCLIPLossConfig, node_sizes: Tensor | None = None) -> Tensor:
    """S [Bi, Bj] as the triplet loss sees it (weights and normalisation of ``cfg`` applied)."""
    t2r, r2t = pair_similarities(regions, region_mask, nodes, node_mask, cfg.nla, chunk_size=cfg.chunk_size)
    s = cfg.w_t2r * t2r + cfg.w_r2t * r2t
    if cfg.normalize:
        s = s / pair_scale(region_mask, node_mask, node_sizes).to(s.dtype)
    return s


def pair_scale(region_mask: Tensor, node_mask: Tensor, node_sizes: Tensor | None = None) -> Tensor:
    """M_i * (mean leaf count of text j's valid nodes), at least 1: [Bi, Bj]. Without node_sizes, M_i."""
    m = region_mask.to(torch.float32).sum(-1).clamp_min(1)
    if node_sizes is None:
        size = torch.ones(node_mask.shape[0], device=m.device)
    else:
        nm = node_mask.to(torch.float32)
        size = ((node_sizes.to(torch.float32) * nm).sum(-1) / nm.sum(-1).clamp_min(1)).clamp_min(1)
    return m[:, None] * size[None, :].to(m.device)


class PowerCLIPLoss(torch.nn.Module):
    """CLIP contrastive + lam x bidirectional row-wise triplet loss on the NLA similarity, on one or many
    ranks (see :mod:`adapters.losses.contrastive` for the two gather modes).

    forward(image_features [b, D], text_features [b, D] (normalised), logit_scale, regions [b, M, d],
    region_mask [b, M], nodes [b, K, d], node_mask [b, K], node_sizes [b, K] | None) -> dict with ``loss``
    (the objective) and its parts ``clip``, ``triplet`` (detached, for logs). Pair i of the local batch is
    the positive; on many ranks the global batch is the rank-ordered concatenation.
    """

    def __init__(self, cfg: PowerCLIPLossConfig = PowerCLIPLossConfig(), *, rank: int = 0, world_size: int = 1,
                 local_loss: bool = True, gather_with_grad: bool = True):
        super().__init__()
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad

    def forward(self, image_features, text_features, logit_scale, regions, region_mask, nodes, node_mask,
                node_sizes=None) -> dict[str, Tensor]:
        from adapters.losses.contrastive import clip_loss

        cfg, r, w = self.cfg, self.rank, self.world_size
        contrastive = clip_loss(image_features, text_features, logit_scale, rank=r, world_size=w,
                                local_loss=self.local_loss, gather_with_grad=self.gather_with_grad)
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.lam != 0):
            # lam = 0 (the CLIP-only control): the powerset term is computed for the log only, outside the graph, so
            # the gradient is CLIP's alone (a 0 x term would still back-propagate, and 0 x inf is nan)
            triplet = self._triplet(regions, region_mask, nodes, node_mask, node_sizes)
        loss = contrastive + cfg.lam * triplet if cfg.lam != 0 else contrastive
        return {"loss": loss, "clip": contrastive.detach(), "triplet": triplet.detach()}

    def _triplet(self, regions, region_mask, nodes, node_mask, node_sizes) -> Tensor:
        from adapters.losses.contrastive import gather, local_rows, triplet_rows

        cfg, r, w = self.cfg, self.rank, self.world_size
        g = lambda x: gather(x, r, w, with_grad=self.gather_with_grad)  # noqa: E731
        if node_sizes is None:
            node_sizes = torch.ones(node_mask.shape, device=nodes.device)
        all_regions, all_rmask = g(regions), g(region_mask.to(torch.uint8)).bool()
        all_nodes, all_nmask, all_sizes = g(nodes), g(node_mask.to(torch.uint8)).bool(), g(node_sizes.float())
        if w > 1 and self.local_loss:
            # Rows: my images against every text; columns: every image against my texts (S^T's rows).
            pos = local_rows(len(regions), r, w, regions.device)
            rows = combined_similarity(regions, region_mask, all_nodes, all_nmask, cfg, all_sizes)
            cols = combined_similarity(all_regions, all_rmask, nodes, node_mask, cfg, node_sizes).T
        else:
            pos = torch.arange(len(all_regions), device=regions.device)
            rows = combined_similarity(all_regions, all_rmask, all_nodes, all_nmask, cfg, all_sizes)
            cols = rows.T
        return (triplet_rows(rows, pos, cfg.margin, hardest=cfg.hardest, semihard=cfg.semihard)
                + triplet_rows(cols, pos, cfg.margin, hardest=cfg.hardest, semihard=cfg.semihard))
