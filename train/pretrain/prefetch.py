"""The batch's copy to the device, overlapped with the step before it (``python -m train.pretrain``).

On the lent H200 the copy of a ViT-B/16 batch of 256 took 19-24 ms of a 107 ms step when the step waited for it
(train/pretrain/README.md, Speed). Here the next step's micro-batches are taken from the loader and copied while
the current step computes: on CUDA on a stream of their own, from pinned memory (the loader pins them when the
device is CUDA), the compute stream told to wait for the copy and the allocator told that the compute stream uses
the copied tensors (``record_stream``), so their memory is not reused before the step is done with it. On other
devices the copy is the plain ``to_device`` one step ahead. The batches and their order are the loader's: only
the moment they are taken changes. The data report counts a batch when it is taken, so a log row's or a
checkpoint's ``data_skipped`` may include the next step's batch; the engine never asks for a batch past the steps
it will run, so the run's ``data_report.json`` counts exactly the batches it trained on.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from adapters.objectives.phases import phase
from train.pretrain.data import to_device

Micro = list[dict[str, Any]]


def one_ahead(batches: Iterable[Micro], copy: Callable[[Micro], Micro],
              ready: Callable[[Micro], None] = lambda micro: None) -> Iterator[Micro]:
    """``copy(b)`` for each of ``batches``, the next one copied before the current one is given out; ``ready(c)``
    just before ``c`` is given out (CUDA: the compute stream waits for its copy)."""
    it = iter(batches)
    raw = next(it, None)
    nxt = copy(raw) if raw is not None else None
    while nxt is not None:
        current = nxt
        ready(current)
        raw = next(it, None)
        nxt = copy(raw) if raw is not None else None  # queued before the current step's kernels
        yield current


def to_device_ahead(batches: Iterable[Micro], device: torch.device) -> Iterator[Micro]:
    """``batches`` on ``device``, each copied while the step before it runs (see the module docstring)."""
    if device.type != "cuda":
        def copy(micro: Micro) -> Micro:
            with phase("data"):
                return [to_device(m, device) for m in micro]

        return one_ahead(batches, copy)
    side = torch.cuda.Stream(device)

    def copy_on_side(micro: Micro) -> Micro:
        with phase("data"), torch.cuda.stream(side):
            return [to_device(m, device) for m in micro]

    def ready(micro: Micro) -> None:
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(side)
        for m in micro:
            for v in m.values():
                if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                    v.record_stream(compute)

    return one_ahead(batches, copy_on_side, ready)
