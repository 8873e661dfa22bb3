"""PowerCLIP loss batches of random unit vectors (PowerCLIP supplement App. C) and the loss computed two ways, with
the NLAs and with the exact similarities: what ``train.eval.nla_report`` compares and ``train.bench.nla`` times."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from adapters.losses.contrastive import clip_loss, triplet_rows
from adapters.losses.nla import PowerCLIPLoss, PowerCLIPLossConfig, pair_scale, r2t_exact


# --------------------------------------------------------------------------------------------- batches
def random_tree(n_leaves: int, gen: torch.Generator, max_nodes: int | None = None) -> torch.Tensor:
    """A random binary constituency-style tree over ``n_leaves`` ordered leaves: node_leaves [K, P] (bool).

    Built bottom-up by merging a random pair of adjacent spans until one remains, so every node is a
    contiguous span and K = 2P - 1 (leaves first, the root last); ``max_nodes`` keeps the first K nodes.
    """
    spans = [(p, p + 1) for p in range(n_leaves)]
    nodes = list(spans)
    while len(spans) > 1:
        k = int(torch.randint(len(spans) - 1, (1,), generator=gen))
        merged = (spans[k][0], spans[k + 1][1])
        spans[k:k + 2] = [merged]
        nodes.append(merged)
    nodes = nodes[:max_nodes] if max_nodes else nodes
    out = torch.zeros(len(nodes), n_leaves, dtype=torch.bool)
    for j, (a, b) in enumerate(nodes):
        out[j, a:b] = True
    return out


def make_batch(b: int, m: int, k: int, d: int, *, seed: int = 0, device: str | torch.device = "cpu",
               requires_grad: bool = True) -> dict[str, torch.Tensor]:
    """A PowerCLIP loss batch of random unit vectors: global features [b, d], regions [b, M, d] (unit),
    nodes [b, K, d] = sums of unit leaf embeddings over a random binary tree (K nodes from ceil((K+1)/2)
    leaves), node sizes [b, K]; every region and node valid. Leaf tensors require grad when asked."""
    g = torch.Generator().manual_seed(seed)
    p = (k + 2) // 2
    tree = random_tree(p, g, max_nodes=k)  # [K', P], K' = min(K, 2P - 1) = K
    leaves = F.normalize(torch.randn(b, p, d, generator=g), dim=-1)
    out = {"image_features": F.normalize(torch.randn(b, d, generator=g), dim=-1),
           "text_features": F.normalize(torch.randn(b, d, generator=g), dim=-1),
           "regions": F.normalize(torch.randn(b, m, d, generator=g), dim=-1),
           "region_mask": torch.ones(b, m, dtype=torch.bool),
           "nodes": torch.einsum("kp,bpd->bkd", tree.float(), leaves),
           "node_mask": torch.ones(b, len(tree), dtype=torch.bool),
           "node_sizes": tree.sum(-1).float().expand(b, -1).contiguous()}
    out = {key: v.to(device) for key, v in out.items()}
    if requires_grad:
        for key in ("image_features", "text_features", "regions", "nodes"):
            out[key].requires_grad_()
    return out


# ------------------------------------------------------------------------------------------------ losses
def exact_loss(batch: dict[str, torch.Tensor], cfg: PowerCLIPLossConfig, logit_scale: float = 100.0) -> torch.Tensor:
    """The PowerCLIP objective of :class:`adapters.losses.nla.PowerCLIPLoss` (one rank) with the exact similarities
    in place of the NLAs: T2R by its closed form ``mean_B sum_m relu(Q_{m,B})`` (= ``t2r_exact``, tested),
    R2T by enumerating the 2^M subsets (``r2t_exact``; memory B^2 2^M K under autograd). The naive baseline
    of PowerCLIP Fig. 9, made as cheap as exactness allows."""
    b = batch
    clip = clip_loss(b["image_features"], b["text_features"], logit_scale)
    q = torch.einsum("imd,jkd->ijmk", b["regions"].float(), b["nodes"].float())  # [Bi, Bj, M, K]
    rm, nm = b["region_mask"][:, None, :], b["node_mask"][None, :, :]
    relu = (q.clamp_min(0) * rm[..., None]).sum(-2)  # [Bi, Bj, K]
    nmf = nm.float()
    t2r = (relu * nmf).sum(-1) / nmf.sum(-1).clamp_min(1)
    r2t = r2t_exact(q, rm, nm)
    s = cfg.w_t2r * t2r + cfg.w_r2t * r2t
    if cfg.normalize:
        s = s / pair_scale(b["region_mask"], b["node_mask"], b.get("node_sizes"))
    pos = torch.arange(len(s), device=s.device)
    return clip + cfg.lam * (triplet_rows(s, pos, cfg.margin, hardest=cfg.hardest)
                             + triplet_rows(s.T, pos, cfg.margin, hardest=cfg.hardest))


def nla_loss(batch: dict[str, torch.Tensor], cfg: PowerCLIPLossConfig, logit_scale: float = 100.0) -> torch.Tensor:
    b = batch
    return PowerCLIPLoss(cfg)(b["image_features"], b["text_features"], logit_scale, b["regions"], b["region_mask"],
                              b["nodes"], b["node_mask"], b.get("node_sizes"))["loss"]


LOSSES: dict[str, Callable] = {"nla": nla_loss, "exact": exact_loss}


def loss_step(kind: str, batch: dict[str, torch.Tensor], cfg: PowerCLIPLossConfig) -> float:
    """One forward + backward of the ``kind`` loss; returns the loss value. Gradients are cleared first."""
    for v in batch.values():
        if v.grad is not None:
            v.grad = None
    loss = LOSSES[kind](batch, cfg)
    loss.backward()
    return float(loss.detach())
