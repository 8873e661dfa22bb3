"""One optimisation step of ``python -m train.adapter``: AdamW and the schedule, a batch's gradient (gradient
caching over ``--accum-steps`` micro-batches), averaged over ranks, checked and applied; and what the ranks share
besides (the logged loss, the stopping rule's decisions).

Gradient accumulation (``--accum-steps K``) splits each batch into K micro-batches for memory, with the
gradient of the whole batch: representations of every micro-batch are computed without gradients, the loss
is taken on the full batch, and each micro-batch is re-encoded with gradients and back-propagated against its
slice of the representation gradients (gradient caching, Gao et al. 2021, as open_clip's ``--accum-freq``);
the RNG state of each micro-batch's first pass is replayed, so even dropout sees the same masks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from adapters.heads.base import AdapterHead
from adapters.scoring import cat_reps
from train.adapter.stopping import Plateau


def make_optimizer(head: AdapterHead, args, backbone_model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """AdamW over the head's param groups at ``--lr`` (a group may carry its own lr) and, with ``backbone_model``
    (``--unfreeze``), the backbone's own groups at ``--backbone-lr`` after them."""
    groups = head.param_groups(args.weight_decay)
    if not groups:
        raise ValueError(f"{head.name}: nothing to train (every parameter is frozen with this config)")
    if backbone_model is not None:
        from train.adapter.live import backbone_param_groups

        groups = groups + backbone_param_groups(backbone_model, args.weight_decay, args.backbone_lr)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)


def make_scheduler(optimizer, args, total_steps: int, steps_per_epoch: int, plateau: Plateau | None = None):
    """Per optimizer step: warm-up + cosine to 0, StepLR every ``--step-epochs`` epochs, or constant; without
    ``--epochs``, ``plateau``'s warm-up, stable phase and cool-down (train.adapter.stopping)."""
    if plateau is not None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, plateau.lr_factor)
    if args.schedule == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, args.step_epochs * steps_per_epoch),
                                               gamma=args.gamma)
    warmup = min(args.warmup, max(total_steps // 10, 0)) if args.schedule == "cosine" else 0
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if args.schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class AdapterRun:
    accelerator: object
    rank: int
    world: int
    device: torch.device
    scaler: object | None

    def autocast(self):
        return self.accelerator.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()


def _rng_state(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _leaves(reps: dict) -> dict:
    return {k: v.detach().requires_grad_(True) if v.is_floating_point() else v for k, v in reps.items()}


def compute_gradients(head: AdapterHead, images: dict, texts: dict, accum: int, ctx: AdapterRun) -> dict:
    """Back-propagate the head's loss on one (local) batch; returns the loss dict. ``accum > 1``: gradient
    caching over micro-batches (module docstring), same gradient as ``accum = 1``. ``head``: anything with the
    head's ``encode_image`` / ``encode_text`` / ``loss`` (``train.adapter.live.LiveModel`` for --unfreeze), and
    ``images`` / ``texts`` dicts of tensors with the batch first."""
    if accum == 1:
        with ctx.autocast():
            out = head.loss(head.encode_image(images), head.encode_text(texts), rank=ctx.rank, world_size=ctx.world)
        ctx.backward(out["loss"])
        return out
    n = len(next(iter(images.values())))
    bounds = np.linspace(0, n, accum + 1).astype(int)
    parts = [(a, b, {k: v[a:b] for k, v in images.items()}, {k: v[a:b] for k, v in texts.items()})
             for a, b in zip(bounds[:-1], bounds[1:])]
    states, cached = [], []
    with torch.no_grad():
        for _, _, img, txt in parts:
            states.append(_rng_state(ctx.device))
            with ctx.autocast():
                cached.append((head.encode_image(img), head.encode_text(txt)))
    resume_state = _rng_state(ctx.device)
    image_reps = _leaves(cat_reps([c[0] for c in cached]))
    text_reps = _leaves(cat_reps([c[1] for c in cached]))
    with ctx.autocast():
        out = head.loss(image_reps, text_reps, rank=ctx.rank, world_size=ctx.world)
    ctx.backward(out["loss"])  # gradients of the representations (+ of parameters the loss uses directly)
    for (a, b, img, txt), state in zip(parts, states):
        _set_rng_state(state, ctx.device)
        with ctx.autocast():
            live = (head.encode_image(img), head.encode_text(txt))
        terms = [(v.float() * full[key].grad[a:b].float()).sum()
                 for reps, full in zip(live, (image_reps, text_reps)) for key, v in reps.items()
                 if v.requires_grad and full[key].grad is not None]
        if terms:
            torch.stack(terms).sum().backward()
    _set_rng_state(resume_state, ctx.device)
    return out


_BUCKET_ELEMENTS = 1 << 24  # 64 MB of fp32 per all-reduce: a head is one bucket, an unfrozen backbone a few


def _all_reduce_grads(params: list[torch.nn.Parameter], world: int) -> None:
    """Average gradients over ranks, one flat all-reduce per bucket of parameters (what DDP does), so an unfrozen
    ViT-L does not need a second full copy of its gradients at once."""
    import torch.distributed as dist

    # every rank runs the same code, so the same parameters have gradients everywhere
    params = [p for p in params if p.grad is not None]
    start = 0
    while start < len(params):
        end, size = start, 0
        while end < len(params) and (end == start or size + params[end].numel() <= _BUCKET_ELEMENTS):
            size += params[end].numel()
            end += 1
        bucket = params[start:end]
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in bucket:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        start = end


def _all_ranks(flag: bool, ctx: AdapterRun) -> bool:
    if ctx.world <= 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def mean_over_ranks(out: dict, ctx: AdapterRun) -> dict[str, float]:
    """The loss dict's values for the log: on several ranks their mean, which is the global batch's loss."""
    names = list(out)
    values = torch.stack([out[k].detach().float().reshape(()) for k in names])
    if ctx.world > 1:
        import torch.distributed as dist

        dist.all_reduce(values)
        values /= ctx.world
    return dict(zip(names, values.tolist()))


def optimizer_step(head: torch.nn.Module, optimizer, out: dict, args, ctx: AdapterRun) -> str | None:
    """Average gradients over ranks, check them, clip, step (``head``: every trained parameter, the backbone's
    too with --unfreeze). Returns None on success, else why it was skipped."""
    params = [p for p in head.parameters() if p.requires_grad]
    if ctx.world > 1:
        _all_reduce_grads(params, ctx.world)
    if ctx.scaler is not None:
        ctx.scaler.unscale_(optimizer)
    loss_ok = _all_ranks(bool(torch.isfinite(out["loss"].detach()).all()), ctx)
    grads = [p.grad for p in params if p.grad is not None]
    grads_ok = bool(torch.stack([g.detach().float().abs().sum() for g in grads]).isfinite().all()) if grads else True
    reason = None if loss_ok and grads_ok else ("non-finite loss" if not loss_ok else "non-finite gradients")
    if reason is None:
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        if ctx.scaler is not None:
            ctx.scaler.step(optimizer)
        else:
            optimizer.step()
    if ctx.scaler is not None:
        ctx.scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return reason


def share_plateau(plateau: Plateau, ctx: AdapterRun) -> None:
    """Rank 0's decisions (it alone evaluates) to every rank: the learning rate and the last epoch follow them."""
    if ctx.world <= 1:
        return
    import torch.distributed as dist

    box = [plateau.state() if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    plateau.load(box[0])
