"""This process's memory, as the benchmarks and the server's health route read it: resident set, the high-water mark
and its reset (Linux /proc), and a heap trimmed before a measurement so that pages freed earlier count again.

One place for what ``train.bench.nla``, ``train.bench.serve`` and ``serve.http`` each read on their own before.
"""
from __future__ import annotations

import ctypes
import gc
from contextlib import contextmanager


def status_kib(field: str, pid: int | None = None) -> int | None:
    """A ``kB`` field of /proc/PID/status (``VmRSS``, ``VmHWM``) of ``pid`` (default: this process); None off Linux."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident memory of process ``pid`` (default: this one) in bytes: /proc (Linux), else psutil; None when
    neither can say (psutil missing, or the process gone)."""
    kib = status_kib("VmRSS", pid)
    if kib is not None:
        return kib * 1024
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:
        return None


def rss_source() -> str:
    """Where :func:`rss_bytes` reads this process's resident set here."""
    if status_kib("VmRSS") is not None:
        return "/proc/self/status VmRSS"
    try:
        import psutil

        return f"psutil {psutil.__version__}"
    except ImportError:
        return "unavailable"


def reset_peak() -> bool:
    """Set this process's high-water mark (VmHWM) to its current resident set (Linux >= 4.0); False where that
    cannot be done, and then no peak can be measured in-process."""
    if status_kib("VmHWM") is None:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Free what can be freed and hand the heap's free pages back to the kernel, so a resident-set delta counts the
    pages the next piece of work touches, reused ones included."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


#: glibc's mallopt parameters (malloc.h) and the size from which this process gives freed memory back to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_BELOW = 1 << 30


def keep_freed_memory() -> bool:
    """Blocks this process frees stay in its heap for its next allocations, up to :data:`KEEP_BELOW` (1 GiB), instead
    of going back to the kernel; False where that cannot be set (not glibc). A training step frees and allocates the
    same large tensors again every step, and glibc maps each block above its adaptive threshold (at most 32 MiB) on
    its own and unmaps it when freed, so every step paid fresh zeroed pages, a page fault per 4 KiB: the grounded
    head's step on a batch of 256 with its negatives took 1.2-1.5 s that way, 0.7-0.8 s with the blocks kept (same
    session, two CPU threads). Allocation is not arithmetic: results are the same bits. The resident set stays near
    its peak instead of falling back between steps; :func:`trim_heap` still hands the free pages back before a
    measurement. Every command sets it when it starts (``extract.common.cli.run_job``), as does a job in a process of
    its own (``train.child``)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BELOW))
    except (OSError, AttributeError):
        return False


@contextmanager
def frozen_heap():
    """``with frozen_heap(): ...``: what is alive on entry is collected once, then left out of every collection inside
    (``gc.freeze``; released on exit, whatever happens). A benchmark that trims before each of many measurements then
    walks only the objects made since, not the whole process: in one that holds torch, open_clip and spaCy a full
    collection took ~0.5 s, longer than the measurement it prepared. Garbage made inside is collected as before."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
