"""Run by tests/train/test_pretrain.py, under ``torchrun --nproc_per_node 2`` or as one plain process: one step of the
real engine (data loader, DDP wrapper, objective, gathered loss, backward) on the first global batch of a toy
world, then rank 0 writes the loss (mean over ranks, as DDP's gradient is the mean) and every gradient, for each
configuration in turn (one launch for all: each costs three interpreters and a process group).

usage: python tests/train/_pretrain_ddp_worker.py TOYWORLD OUT_DIR GLOBAL_BATCH CONFIGS
(CONFIGS: a JSON list of [tag, method, [more train.pretrain flags, e.g. --compile]]; writes TAG-world<N>.safetensors)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from train.pretrain.trainer import create_model, resolve_architecture, Trainer  # noqa: E402
from train.pretrain.options import build_objective, parse_args  # noqa: E402
from train.pretrain.dist import init_distributed  # noqa: E402
from train.pretrain.data import SeededTransform, build_train_data, to_device  # noqa: E402


def run(world: str, out: Path, global_batch: int, configs) -> None:
    """One step per configuration ``(tag, method, flags)``; with torchrun's variables set this is one rank of a
    distributed run."""
    dist = init_distributed("cpu")
    b = global_batch // dist.world_size
    for tag, method, extra in configs:
        args = parse_args(["--data", world, "--method", method, "--batch-size", str(b), "--workers", "0",
                           "--augment", "none", "--out", str(out / "unused"), "--seed", "3", *extra])
        arch = resolve_architecture(args.model)
        model, _, eval_tf, tokenizer = create_model(arch, False, args.seed)
        objective = build_objective(args.method, args.method_options)
        objective.setup(model, {"image_ids": None})
        trainer = Trainer(args, dist, model, objective)
        data = build_train_data(world, batch_size=b, rank=dist.rank, world_size=dist.world_size, accum_freq=1,
                                seed=args.seed, tokenizer=tokenizer, objective=objective,
                                transform=SeededTransform(eval_tf, False), workers=0)
        micro = [to_device(m, dist.device) for m in next(iter(data.epoch_batches(0, 0)))]
        trainer.optimizer.zero_grad(set_to_none=True)
        losses = trainer.forward_backward(micro, trainer.context(0, 0, 1))
        loss = losses["loss"].clone()
        if dist.world_size > 1:
            torch.distributed.all_reduce(loss)
            loss /= dist.world_size
        if dist.rank == 0:
            tensors = {f"grad/{n}": p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                       if p.grad is not None}
            tensors["loss"] = loss.reshape(1)
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / f"{tag}-world{dist.world_size}.safetensors"))
    if dist.world_size > 1:
        # every rank leaves together: a rank that tore its gloo group down while the other still wrote its file
        # aborted once in CI under load ("terminate called without an active exception", exit -6)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
