"""This process among the data-parallel ranks of ``python -m train.pretrain``: rank, world and device read from
the environment as ``open_clip_train.distributed`` reads them (torchrun, accelerate, SLURM, MPI), the process group
started, and the few collective questions the engine asks (does every rank agree? does any?)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

@dataclass
class Dist:
    """This process among the data-parallel ranks (read from the environment like open_clip_train.distributed)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def all_true(self, flag: torch.Tensor) -> torch.Tensor:
        """A 0-d bool tensor, True on every rank when ``flag`` is True on every rank; it stays on the device (no
        host synchronisation)."""
        if self.world_size == 1:
            return flag
        t = flag.to(device=self.device, dtype=torch.float32).reshape(1)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return t[0] > 0.5

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item() > 0)


def world_info_from_env() -> tuple[int, int, int]:
    """(local_rank, rank, world_size) from torchrun / accelerate / SLURM / MPI variables (open_clip's order)."""
    def first(names, default):
        for n in names:
            if n in os.environ:
                return int(os.environ[n])
        return default
    local = first(("LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)
    rank = first(("RANK", "PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"), 0)
    world = first(("WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"), 1)
    return local, rank, world


def init_distributed(device: str | None, dist_url: str = "env://") -> Dist:
    local, rank, world = world_info_from_env()
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not torch.distributed.is_initialized():
        if dist_url == "env://" and "MASTER_ADDR" not in os.environ:
            raise RuntimeError("distributed run without MASTER_ADDR: launch with torchrun / accelerate, or export "
                               "MASTER_ADDR and MASTER_PORT (SLURM: the first node of $SLURM_JOB_NODELIST), or pass "
                               "--dist-url tcp://HOST:PORT")
        # SLURM gives ranks but not torchrun's variables: pass them on for the env:// rendezvous
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("LOCAL_RANK", str(local))
        backend = "nccl" if dev.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, init_method=dist_url, rank=rank, world_size=world)
    return Dist(rank=rank, local_rank=local, world_size=world, device=dev)
