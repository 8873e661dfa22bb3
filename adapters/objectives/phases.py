"""Named phases of a pre-training step (image tower, text tower, loss, backward, optimizer, data), for the
profile breakdown of ``python -m train.bench.pretrain``.

``with phase("image_tower"): ...`` is a ``torch.profiler.record_function`` range (``plugvlm::image_tower``:
visible in any torch.profiler / Perfetto trace, ~microseconds of overhead) unless a :class:`PhaseTimer` is
active, which then times the phase with wall-clock and a device synchronisation at both ends. The
synchronisation removes the overlap of host and device work, so a timed step is slower than an untimed one;
the timer's figures say where a step's time goes, the benchmark's untimed rounds say how long it takes.

A phase entered inside itself (``encode_image`` calling ``patch_embed``) counts once, at the outermost level;
different phases nest (``image_tower`` inside ``features``) and each keeps its inclusive time.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

_active: "PhaseTimer | None" = None


class PhaseTimer:
    """Inclusive seconds per phase while active (``with PhaseTimer(device) as t: ...``; ``t.seconds``)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: dict[str, int] = defaultdict(int)
        self._previous: PhaseTimer | None = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> "PhaseTimer":
        global _active
        self._previous, _active = _active, self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._previous

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        outer = self._open[name] == 0
        self._open[name] += 1
        if outer:
            self.sync()
            t0 = time.perf_counter()
        try:
            yield
        finally:
            self._open[name] -= 1
            if outer:
                self.sync()
                self.seconds[name] += time.perf_counter() - t0


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase of the step (module docstring)."""
    timer = _active
    with torch.profiler.record_function(f"plugvlm::{name}"):
        if timer is None:
            yield
        else:
            with timer.time(name):
                yield
