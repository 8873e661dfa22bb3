"""The model and one optimizer step of ``python -m train.pretrain``, as open_clip's trainer does them: the
architecture created for a seed, AdamW's two groups (no decay on gains, biases and the logit scale), the cosine
schedule, and :class:`Trainer`: forward, the objective's loss, backward (gradient accumulation with cached features,
the engine's docstring says why), the checks and the update."""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import torch

from adapters.objectives.base import StepContext, split_features
from adapters.objectives.phases import phase
from adapters.objectives.towers import uses_cuda_graphs
from extract.models.tokens import tokenizer_for
from train.pretrain.dist import Dist
from train.pretrain.options import PRECISIONS, PretrainOptions

def resolve_architecture(model: str) -> str:
    """open_clip model name for ``--model`` (plugvlm aliases such as ``tiny`` map to their config)."""
    from extract.models.backbone import resolve_spec

    return resolve_spec(model, "none").model


def create_model(arch: str, quick_gelu: bool, seed: int, pretrained: str | None = None):
    """(model in fp32 on CPU, train transform, eval transform, tokenizer); identical on every rank for a seed."""
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from extract.models.backbone import register_configs, quiet_open_clip

    quiet_open_clip()  # open_clip's "No pretrained weights loaded" is wrong here: weights are loaded below or trained
    register_configs()  # plugvlm-tiny and friends
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.create_model(arch, pretrained=None, force_quick_gelu=quick_gelu)
    if pretrained:
        from extract.models.weights import resolve_weights

        weights = resolve_weights(arch, pretrained)
        if weights.path is not None:  # verified if plugvlm wrote it; a foreign pickle is explained, not unpickled
            from extract.models.weights_file import load_weights_file

            load_weights_file(model, weights.path, arch)
    pp = PreprocessCfg(**model.visual.preprocess_cfg)
    return (model, image_transform_v2(pp, is_train=True), image_transform_v2(pp, is_train=False),
            tokenizer_for(arch))


def param_groups(model: torch.nn.Module, wd: float) -> tuple[list[dict], list[str]]:
    """open_clip_train.main's grouping: no weight decay on gains, biases, 1-d tensors and the logit scale.
    Returns (groups, parameter names in optimizer order)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n  # noqa: E731
    decay = [(n, p) for n, p in named if not exclude(n, p)]
    no_decay = [(n, p) for n, p in named if exclude(n, p)]
    groups = [{"params": [p for _, p in no_decay], "weight_decay": 0.0},
              {"params": [p for _, p in decay], "weight_decay": wd}]
    return groups, [n for n, _ in no_decay] + [n for n, _ in decay]


def cosine_lr(base_lr: float, warmup: int, steps: int, step: int) -> float:
    """open_clip_train.scheduler.cosine_lr at ``step``: linear warm-up, then cosine decay to 0."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    e, es = step - warmup, max(1, steps - warmup)
    return 0.5 * (1 + math.cos(math.pi * e / es)) * base_lr


class DDPForward(torch.nn.Module):
    """What DDP wraps: the model plus the objective's forward, so gradient all-reduce follows its backward."""

    def __init__(self, model: torch.nn.Module, objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: dict, ctx: StepContext) -> dict:
        return self.objective.features(self.model, batch, ctx)


@dataclass(frozen=True)
class Readout:
    """One step's metrics, still on the device: ``values`` holds the ``names``' values, then ok (1 or 0)."""

    names: tuple[str, ...]
    values: torch.Tensor


def read_steps(readouts: Sequence[Readout]) -> list[tuple[dict[str, float], bool]]:
    """(metrics, ok) of each step, read with one copy to the host: the one synchronisation for all of them."""
    if not readouts:
        return []
    flat = torch.cat([r.values for r in readouts]).tolist()
    out, i = [], 0
    for r in readouts:
        n = len(r.names)
        out.append((dict(zip(r.names, flat[i:i + n])), bool(flat[i + n])))
        i += n + 1
    return out


class Trainer:
    """Model, objective, optimizer and one optimizer step (forward, loss, backward, checks, update)."""

    def __init__(self, args: PretrainOptions, dist: Dist, model: torch.nn.Module, objective):
        self.args, self.dist, self.objective = args, dist, objective
        self.model = model.to(dist.device)
        if args.grad_checkpointing:
            self.model.set_grad_checkpointing(True)
        if args.compile:
            from adapters.objectives.towers import compile_towers

            compile_towers(self.model, backend=args.compile_backend, mode=args.compile_mode)
            objective.compile(args.compile_backend, args.compile_mode)
        self.graphs = bool(args.compile) and uses_cuda_graphs(args.compile_mode, dist.device)
        groups, self.param_names = param_groups(self.model, args.wd)
        self.params = [p for g in groups for p in g["params"]]
        fused = {"on": True, "off": False, "auto": dist.device.type == "cuda"}[args.fused_adamw]
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                                           fused=fused or None)
        amp = PRECISIONS[args.precision]
        self.autocast = (lambda: torch.autocast(device_type=dist.device.type, dtype=amp)) if amp else nullcontext
        self.scaler = torch.amp.GradScaler(dist.device.type) if amp == torch.float16 else None
        wrapped = DDPForward(self.model, objective)
        if dist.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [dist.device.index] if dist.device.type == "cuda" else None
            wrapped = DistributedDataParallel(wrapped, device_ids=ids, broadcast_buffers=False)
        self.forward = wrapped
        self.nan_steps = set(args.debug_nan_steps)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def context(self, step: int, epoch: int, epochs: int) -> StepContext:
        a = self.args
        return StepContext(step=step, epoch=epoch, progress=epoch / max(1, epochs), rank=self.dist.rank,
                           world_size=self.dist.world_size, seed=a.seed, local_loss=a.local_loss,
                           gather_with_grad=a.gather_with_grad)

    def forward_backward(self, micro: list[dict], ctx: StepContext) -> dict[str, torch.Tensor]:
        """Gradients of the loss on the step's whole batch (all micro-batches, all ranks) into ``.grad``.
        ``micro``: this rank's micro-batches, already on the device. Returns the loss parts (detached)."""
        w, r, a = self.dist.world_size, self.dist.rank, len(micro)
        b = len(micro[0]["image"])
        ctxs = [ctx.with_batch((j * w + r) * b, a * w * b) for j in range(a)]
        poison = ctx.step + 1 in self.nan_steps  # step numbers are 1-based, as in the log
        if a == 1:
            with self.autocast():
                with phase("features"):
                    features = self.forward(micro[0], ctxs[0])
                with phase("loss"):
                    losses = self.objective.loss(features, ctxs[0])
            loss = losses["loss"] * float("nan") if poison else losses["loss"]
            with phase("backward"):
                self._backward(loss)
            return {k: v.detach() for k, v in {**losses, "loss": loss}.items()}
        # open_clip's accum_freq: cache every micro-batch's features, then differentiate one at a time
        cached = []
        with torch.no_grad(), self.autocast():
            for j in range(a):
                cached.append(split_features(self.forward(micro[j], ctxs[j]))[0])
        sync_free = getattr(self.forward, "no_sync", None)
        for j in range(a):
            with (sync_free() if sync_free is not None and j < a - 1 else nullcontext()):
                with self.autocast():
                    per, shared = split_features(self.forward(micro[j], ctxs[j]))
                    full = {k: torch.cat([per[k] if i == j else cached[i][k] for i in range(a)]) for k in per}
                    # A shared tensor (the logit scale) enters each of the a losses whole: give it 1/a of the
                    # gradient each time, so the sum is the big batch's (open_clip lets it accumulate a times).
                    shared = {k: v / a + (v - v / a).detach() for k, v in shared.items()}
                    losses = self.objective.loss({**full, **shared}, ctxs[j])
                loss = losses["loss"] * float("nan") if poison else losses["loss"]
                self._backward(loss)
        return {k: v.detach() for k, v in {**losses, "loss": loss}.items()}

    @property
    def defers(self) -> bool:
        """True when a step needs nothing from the host: fused AdamW skips a bad step on the device (no loss
        scaler), so its metrics may be read later, several steps at once (the engine's read window). Asked of the
        optimizer itself, since a resumed one keeps its checkpoint's kernel."""
        return self.scaler is None and bool(self.optimizer.param_groups[0].get("fused"))

    def step(self, micro: list[dict], ctx: StepContext, lr: float) -> tuple[dict[str, float], bool]:
        """One optimizer step, its metrics read at once. Returns (metrics, ok); not ok = non-finite loss or
        gradient, step skipped."""
        return read_steps([self.step_async(micro, ctx, lr)])[0]

    def step_async(self, micro: list[dict], ctx: StepContext, lr: float) -> Readout:
        """One optimizer step; its metrics stay on the device until :func:`read_steps` (with :attr:`defers`, the
        step never waits for the device)."""
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        losses = self.forward_backward(micro, ctx)
        with phase("optimizer"):
            return self._update(losses)

    def _update(self, losses: dict[str, torch.Tensor]) -> Readout:
        """Check, clip and apply the gradients. With fused AdamW the check, the skip and the update all stay on the
        device; the foreach kernel and the fp16 scaler ask the host whether to step."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.scaler is not None:
            # fp16: inf gradients are the loss scaler's business (it skips those steps and lowers the scale)
            bad = self.dist.any(not bool(torch.isfinite(losses["loss"])))
            norm = None
            if self.args.grad_clip_norm is not None:
                self.scaler.unscale_(self.optimizer)
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.args.grad_clip_norm)
            if not bad:
                self.scaler.step(self.optimizer)
            self.scaler.update()
            ok = torch.tensor(not bad, device=self.dist.device)  # beside the metrics: one copy to the host
        else:
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.dist.device)
            ok = self.dist.all_true(torch.isfinite(losses["loss"]) & torch.isfinite(norm))
            if self.args.grad_clip_norm is not None:  # a non-finite norm makes NaN gradients: skipped below
                torch.nn.utils.clip_grads_with_norm_(self.params, self.args.grad_clip_norm, norm)
            if self.optimizer.param_groups[0].get("fused"):  # a resumed optimizer keeps its checkpoint's kernel
                # the fused kernel skips the update of every tensor, and undoes its step count, where found_inf
                # is set (GradScaler's protocol), so a bad step is skipped without the host asking
                self.optimizer.found_inf = (~ok).float()
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.found_inf
            elif bool(ok):
                self.optimizer.step()
        with torch.no_grad():  # CLIP's clamp of the temperature, ln(100) (open_clip_train.train)
            self.model.logit_scale.clamp_(0, math.log(100))
        named = {**losses, "logit_scale": self.model.logit_scale.detach().exp()}
        if norm is not None:
            named["grad_norm"] = norm
        values = torch.stack([v.detach().float().reshape(()).to(ok.device) for v in named.values()]
                             + [ok.float().reshape(())])
        return Readout(tuple(named), values)
