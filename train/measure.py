"""Measuring on this machine, shared by the benchmarks (``train.bench``) and the reports that time things
(``train.eval.nla_report``): the median time of a call, the peak memory a piece of work adds, and whether other
processes compete for the cores while it runs.

How memory is measured (CPU): PyTorch's CPU allocator keeps no statistics and ``tracemalloc`` does not see
it, so the process's resident set is read from ``/proc/self/status``: free heap pages are handed back to the
kernel (``malloc_trim``), the kernel's high-water mark is reset (``echo 5 > /proc/self/clear_refs``), the
work runs, and the peak growth is ``VmHWM - VmRSS`` at the reset. That counts every page the work touched,
PyTorch's temporaries included, and nothing allocated before. Where the reset is not allowed (non-Linux,
some sandboxes) the growth of ``ru_maxrss`` in a fresh process is used instead and the output says so. On
CUDA the allocator's own peak (``torch.cuda.max_memory_allocated``) is used.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable

import torch

from extract.common.memory import reset_peak, status_kib, trim_heap

GIB = 1 << 30
MIB = 1 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: str | torch.device = "cpu", *, repeats: int = 5,
              warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def batch_sizes(value) -> list[int]:
    """The benchmarks' ``--batch-size``: a comma list (``"128,256"``), a list or one number -> [int >= 1, ...]."""
    items = str(value).replace(" ", "").split(",") if isinstance(value, str) else \
        (value if isinstance(value, (list, tuple)) else [value])
    try:
        sizes = [int(v) for v in items if v != ""]
    except (TypeError, ValueError):
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-size: expected integers >= 1, comma separated (128,256); got {value!r}")
    return sizes


def rss_method() -> str:
    """How :func:`peak_growth` measures CPU memory in this process ('hwm-reset' or 'unavailable')."""
    return "hwm-reset" if reset_peak() else "unavailable"


@contextmanager
def peak_growth(device: str | torch.device = "cpu"):
    """``with peak_growth(dev) as peak: work()`` then ``peak["bytes"]``: the peak memory the work added on
    top of what was allocated before it (CUDA: allocator peak; CPU: resident-set high-water mark, see the
    module docstring). ``peak["bytes"]`` is None where it cannot be measured honestly in-process."""
    device = torch.device(device)
    out: dict[str, object] = {"bytes": None, "method": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield out
        torch.cuda.synchronize(device)
        out.update(bytes=torch.cuda.max_memory_allocated(device) - base, method="cuda-allocator")
        return
    trim_heap()
    ok = reset_peak()
    base = status_kib("VmRSS") if ok else None
    yield out
    if ok and base is not None:
        out.update(bytes=max(0, (status_kib("VmHWM") or base) - base) * 1024, method="hwm-reset")
    else:
        out["method"] = "unavailable"


#: the loop that says how fast this machine is today (it varies ~2x by the hour): its time goes beside every time taken
DAY_SPEED_ADDITIONS = 10**7


def day_speed() -> float:
    """Seconds of a pure-Python loop of :data:`DAY_SPEED_ADDITIONS` additions at a script's top level (as ``python -c``
    runs it: names looked up by dictionary, which a function's locals are not, 2x slower): the day's speed said
    beside a time (about 0.7 s on a quiet day on this project's 2-core machines, 1.4 s and more on a slow one)."""
    scope = {"perf_counter": time.perf_counter, "n": DAY_SPEED_ADDITIONS}
    exec(compile("start = perf_counter()\ntotal = 0\nfor i in range(n):\n    total += i\n"
                 "seconds = perf_counter() - start\n", "<day speed>", "exec"), scope)
    return scope["seconds"]


def machine_load() -> dict:
    """1-minute load average against the CPU count; timings taken while other processes compete for the
    cores (OpenMP threads then wait on each other) can be off by an order of magnitude."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return {"load_1min": None, "cpus": os.cpu_count(), "busy": None}
    cpus = os.cpu_count() or 1
    return {"load_1min": load, "cpus": cpus, "busy": load > 0.75 * cpus}


def load_warning(load: dict, threads: int) -> str | None:
    if not load["busy"]:
        return None
    return (f"warning: the machine is busy (load {load['load_1min']:.1f} on {load['cpus']} CPUs): timings are "
            f"unreliable{'; --threads 1 suffers least from the contention' if threads > 1 else ''}")
