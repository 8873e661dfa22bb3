"""The machine, memory and timing: what every section's figures are measured with."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from extract.common.memory import reset_peak, rss_bytes, rss_source, status_kib, trim_heap


def machine() -> dict:
    import importlib.metadata
    import platform

    try:
        load = list(os.getloadavg())
    except (OSError, AttributeError):
        load = None
    versions = {}
    for name, dist in (("faiss", "faiss-cpu"), ("torch", "torch"), ("numpy", "numpy"),
                       ("open_clip", "open_clip_torch")):
        try:
            versions[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    from serve.faiss_index import import_faiss

    faiss = import_faiss()
    versions["faiss"] = versions["faiss"] or getattr(faiss, "__version__", None)
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "load_average": load, "versions": versions,
            "faiss_build_threads": faiss.omp_get_max_threads(), "memory": memory_method()}


def memory_method() -> str:
    peak = "/proc/self/status VmHWM reset before each build" if reset_peak() else "unavailable"
    return f"RSS via {rss_source()}; peak via {peak}"


class MemoryProbe:
    """``with MemoryProbe() as m: work()`` -> ``m.added`` (RSS after - before: what the work keeps resident) and
    ``m.peak`` (VmHWM - RSS before: the most it held at once; None where the high-water mark cannot be reset)."""

    def __enter__(self):
        trim_heap()
        self.can_peak = reset_peak()
        self.before = rss_bytes()
        self.added = self.peak = None
        return self

    def __exit__(self, *exc):
        after = rss_bytes()
        if self.before is not None and after is not None:
            self.added = after - self.before
        if self.can_peak and self.before is not None:
            self.peak = max(0, (status_kib("VmHWM") or 0) * 1024 - self.before)


def percentiles(seconds) -> dict:
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()),
            "count": int(len(ms))}


def query_latency(index, queries: np.ndarray, k: int) -> dict:
    """p50 / p99 / mean of ``index.search`` one query at a time, FAISS on one thread (after one warm-up search)."""
    from serve.faiss_index import single_thread

    q = np.ascontiguousarray(queries, dtype=np.float32)
    k = max(1, min(k, index.ntotal))
    times = np.empty(len(q))
    with single_thread():
        index.search(q[:1], k)
        for i in range(len(q)):
            t = time.perf_counter()
            index.search(q[i:i + 1], k)
            times[i] = time.perf_counter() - t
    return percentiles(times)


def interleaved(paths: list[tuple[str, Callable[[int], object]]], count: int, rounds: int = 3,
                warm: bool = True) -> dict[str, np.ndarray]:
    """Seconds of every path on queries 0..count-1, measured alike: for each query every path runs once untimed
    (``warm``: its data warm, a memory-mapped index's lists, the caches), then ``rounds`` timed rounds, each in an
    order rotated by query and round (no path always follows another, whose leftovers it would pay for), and each
    path's time is its fastest round (what the work costs, without the interruptions a round happened to meet). A
    path that wraps another (the search path around the bare FAISS call) can then never time faster than it,
    unless the measurement itself is at fault, which :func:`wrap_ratio` reports. Paths of hundreds of ms (query
    encoding) are timed once each (``rounds=1, warm=False``): their noise is small against their cost."""
    times = {name: np.full(count, np.inf) for name, _ in paths}
    for i in range(count):
        for _, fn in (paths if warm else ()):
            fn(i)
        for r in range(rounds):
            for j in range(len(paths)):
                name, fn = paths[(i + r + j) % len(paths)]
                t = time.perf_counter()
                fn(i)
                times[name][i] = min(times[name][i], time.perf_counter() - t)
    return times


def wrap_ratio(path: np.ndarray, bare: np.ndarray) -> tuple[float, bool]:
    """(median over queries of path / bare, whether that is believable): a path that wraps the bare call cannot be
    faster than it; a median ratio below 0.97 means the two were not measured alike."""
    ratio = float(np.median(np.asarray(path) / np.asarray(bare)))
    return ratio, ratio >= 0.97


def throughput(fn: Callable[[int], object], count: int, callers: int, seconds: float) -> dict:
    """Queries per second of ``callers`` threads calling ``fn(query)`` on a shared object for ``seconds``."""
    import itertools

    from serve.faiss_index import import_faiss

    faiss = import_faiss()
    counter = itertools.count()
    done = [0] * callers
    errors: list[BaseException] = []
    stop = time.perf_counter() + seconds

    def worker(w: int) -> None:
        faiss.omp_set_num_threads(1)  # one request, one thread (Searcher sets it per search too)
        try:
            # at least one query each: on a busy machine a thread can start after the window has closed, and a
            # caller that never ran would read as 0 queries per second (the suite's 0.1 s window met exactly that)
            while True:
                fn(next(counter) % count)
                done[w] += 1
                if time.perf_counter() >= stop:
                    break
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(callers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return {"callers": callers, "queries": sum(done), "seconds": elapsed, "qps": sum(done) / elapsed}


_T0 = time.perf_counter()


def startclock() -> None:
    """The run's clock starts now (:func:`clock` prints the time since)."""
    global _T0
    _T0 = time.perf_counter()


def clock_seconds() -> float:
    return time.perf_counter() - _T0


def clock() -> str:
    """H:MM:SS since :func:`start_clock`, for progress lines."""
    s = int(clock_seconds())
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def params_text(p: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in p.items()) or "-"
