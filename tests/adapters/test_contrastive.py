"""adapters/losses/contrastive.py: CLIP loss and row-wise triplet loss against hand-written references, and a real
two-process gloo run showing that the multi-rank losses (clip_loss and PowerCLIPLoss) give one process's
loss and parameter gradients on the whole batch (loss: mean over ranks; gradients: mean over ranks, as DDP
averages them)."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from adapters.losses.contrastive import clip_loss, gather, local_rows, triplet_rows
from adapters.losses.nla import NLAConfig, PowerCLIPLoss, PowerCLIPLossConfig


# ------------------------------------------------------------------------------------------ references
def _ref_clip(img, txt, scale, bias=0.0):
    """Symmetric InfoNCE written out: -log softmax of the diagonal, per row and per column."""
    logits = (scale * img @ txt.T + bias).double()
    b = len(img)
    total = 0.0
    for i in range(b):
        total -= logits[i, i] - torch.log(torch.exp(logits[i]).sum())
        total -= logits[i, i] - torch.log(torch.exp(logits[:, i]).sum())
    return total / (2 * b)


def _ref_triplet(scores, positives, margin, hardest):
    rows = []
    for r in range(scores.shape[0]):
        p = int(positives[r])
        hinges = [max(0.0, margin - float(scores[r, p]) + float(scores[r, c]))
                  for c in range(scores.shape[1]) if c != p]
        rows.append((max(hinges) if hardest else sum(hinges)) if hinges else 0.0)
    return sum(rows) / len(rows)


# --------------------------------------------------------------------------------------- single process
@pytest.mark.parametrize("bias", [None, -2.5])
@pytest.mark.parametrize("local_loss", [True, False])
def test_clip_loss_against_reference(bias, local_loss):
    g = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(7, 16, generator=g), dim=-1)
    txt = F.normalize(torch.randn(7, 16, generator=g), dim=-1)
    scale = torch.tensor(14.3)
    got = clip_loss(img, txt, scale, local_loss=local_loss, logit_bias=bias)
    want = _ref_clip(img, txt, scale, 0.0 if bias is None else bias)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert got.dtype == torch.float32


def test_clip_loss_perfect_alignment_goes_to_zero_and_is_symmetric():
    e = torch.eye(5)
    assert clip_loss(e, e, 100.0).item() < 1e-20
    g = torch.Generator().manual_seed(1)
    a, b = F.normalize(torch.randn(6, 8, generator=g), dim=-1), F.normalize(torch.randn(6, 8, generator=g), dim=-1)
    assert clip_loss(a, b, 10.0).item() == pytest.approx(clip_loss(b, a, 10.0).item(), rel=1e-6)


@pytest.mark.parametrize("hardest", [True, False])
@pytest.mark.parametrize("margin", [0.0, 0.2, 3.0])
def test_triplet_rows_against_loop(hardest, margin):
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(6, 9, generator=g, dtype=torch.float64)
    positives = torch.randperm(9, generator=g)[:6]  # positives anywhere (the local rows of a gathered batch)
    got = triplet_rows(scores, positives, margin, hardest=hardest)
    assert got.item() == pytest.approx(_ref_triplet(scores, positives, margin, hardest), abs=1e-12)


def test_triplet_hardest_gradient_reaches_only_the_hardest_negative():
    scores = torch.tensor([[1.0, 0.9, 0.2], [0.0, 0.5, 0.4]], requires_grad=True)
    triplet_rows(scores, torch.tensor([0, 1]), 0.5, hardest=True).backward()
    want = torch.tensor([[-0.5, 0.5, 0.0], [0.0, -0.5, 0.5]])
    torch.testing.assert_close(scores.grad, want)


def test_triplet_single_item_is_zero():
    s = torch.tensor([[0.3]], requires_grad=True)
    for hardest in (True, False):
        out = triplet_rows(s, torch.tensor([0]), 0.2, hardest=hardest)
        assert out.item() == 0.0
        out.backward()
        assert torch.isfinite(s.grad).all()


def test_gather_and_local_rows_on_one_rank():
    x = torch.randn(3, 2, requires_grad=True)
    assert gather(x) is x and gather(x, with_grad=False) is x
    assert local_rows(3, 2, 4, "cpu").tolist() == [6, 7, 8]


# ------------------------------------------------------------------------------------------- two ranks
B, DIN, D, M, K = 8, 6, 8, 3, 4
MODES = {  # name -> (loss, local_loss, gather_with_grad, expected gradient factor vs one process)
    "clip_local": ("clip", True, True, 1.0),
    "clip_global": ("clip", False, True, 1.0),
    "clip_global_nograd": ("clip", False, False, 0.5),  # open_clip's cheap mode: features get 1 / world
    "power_local": ("power", True, True, 1.0),
    "power_global": ("power", False, True, 1.0),
}


def _batch():
    """Raw inputs of the whole batch: the same on every rank (seeded), with padded regions and nodes."""
    g = torch.Generator().manual_seed(123)
    x = {"img": torch.randn(B, DIN, generator=g), "txt": torch.randn(B, DIN, generator=g),
         "reg": torch.randn(B, M, DIN, generator=g), "node": torch.randn(B, K, DIN, generator=g),
         "rmask": torch.rand(B, M, generator=g) < 0.7, "nmask": torch.rand(B, K, generator=g) < 0.7,
         "sizes": torch.randint(1, 4, (B, K), generator=g).float()}
    x["rmask"][:, 0] = x["nmask"][:, 0] = True
    return x


def _model():
    torch.manual_seed(7)
    return torch.nn.ModuleDict({"img": torch.nn.Linear(DIN, D), "txt": torch.nn.Linear(DIN, D),
                                "reg": torch.nn.Linear(DIN, D), "node": torch.nn.Linear(DIN, D)})


def _loss(model, x, scale, mode, rank, world):
    kind, local_loss, with_grad, _ = MODES[mode]
    img = F.normalize(model["img"](x["img"]), dim=-1)
    txt = F.normalize(model["txt"](x["txt"]), dim=-1)
    if kind == "clip":
        return clip_loss(img, txt, scale, rank=rank, world_size=world, local_loss=local_loss,
                         gather_with_grad=with_grad)
    cfg = PowerCLIPLossConfig(lam=0.5, margin=0.3, hardest=False, nla=NLAConfig(0.05, 0.05, 0.75), chunk_size=3)
    loss = PowerCLIPLoss(cfg, rank=rank, world_size=world, local_loss=local_loss, gather_with_grad=with_grad)
    regions = F.normalize(model["reg"](x["reg"]), dim=-1)
    nodes = model["node"](x["node"])
    return loss(img, txt, scale, regions, x["rmask"], nodes, x["nmask"], x["sizes"])["loss"]


def _run(mode, rank=0, world=1):
    """(loss averaged over ranks, parameter gradients averaged over ranks) for this rank's half."""
    model = _model()
    log_scale = torch.nn.Parameter(torch.tensor(2.0))
    x = _batch()
    if world > 1:
        n = B // world
        x = {k: v[rank * n:(rank + 1) * n] for k, v in x.items()}
    loss = _loss(model, x, log_scale.exp(), mode, rank, world)
    loss.backward()
    params = [*model.parameters(), log_scale]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
    loss = loss.detach().clone()
    if world > 1:  # what DDP does with gradients, and what a logger does with the loss
        for t in [loss, *grads]:
            dist.all_reduce(t)
            t /= world
    return loss, grads


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for mode in MODES:
            loss, grads = _run(mode, rank, world)
            if rank == 0:
                np.savez(f"{out_dir}/{mode}.npz", *[g.numpy() for g in grads], loss=loss.numpy())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without running C++ static destructors: with torch 2.14's gloo, about one exit in ten aborts
    # there ("terminate called without an active exception", after all Python code has finished; see
    # pytorch/pytorch#190489). The results are written and every collective has completed by now; an
    # exception above still propagates normally through torch.multiprocessing.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_two_ranks_equal_one_process(two_rank_results, mode):
    factor = MODES[mode][3]
    got = np.load(two_rank_results / f"{mode}.npz")
    loss, grads = _run(mode)
    assert float(got["loss"]) == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    got_grads = [got[f"arr_{i}"] for i in range(len(grads))]
    assert any(np.abs(g).sum() > 0 for g in got_grads)
    # In the detached-gather mode only the feature paths lose the other ranks' share; the logit scale sees
    # the whole [B, B] loss on every rank, so its averaged gradient stays the single-process one.
    factors = [factor] * (len(grads) - 1) + [1.0]
    for a, b, f in zip(got_grads, grads, factors):
        np.testing.assert_allclose(a, f * b.numpy(), rtol=1e-4, atol=1e-6)
