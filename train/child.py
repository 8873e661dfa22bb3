"""A job in a process of its own: its output to a log file, its result (JSON) back, its share of the CPU threads.

What ``python -m train.pretrain.compare --jobs N`` trains its runs in, and where ``python -m train.demo`` trains the hard
world's head while the version-2 world's adapters train beside it. The child starts from a fork server that imported
torch, open_clip and the job's module once (a spawned interpreter would import them again: ~5 s on two cores, per
job), so it holds none of the parent's state and has never touched CUDA (it can still pick its GPU); spawn where there
is no fork server (Windows). A job is ``"module:function"`` called with keyword arguments that pickle; what it returns
must be JSON. A job that raises leaves its traceback in its log and its one-line error for the parent
(:class:`ChildFailed`).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from extract.common.cli import JobFailed


class ChildFailed(JobFailed):
    """A job's process failed: ``error`` is its one-line error (None when it died without saying, e.g. killed), ``log``
    the file holding its output and traceback. A command line ends with its message as one ``error:`` line."""

    def __init__(self, name: str, error: str | None, code: int | None, log: Path):
        self.error, self.code, self.log = error, code, log
        super().__init__(f"{name} failed ({error or f'its process exited with code {code}'}); the traceback is in "
                         f"{log}")


def job_plan(jobs: int, cores: int, gpus: int) -> tuple[int, list[int | None]]:
    """CPU threads of each of ``jobs`` concurrent processes, and the GPU each job slot uses (None: the job's own
    default). The cores are shared out evenly (at least one each); with several GPUs, slot k takes GPU k mod
    ``gpus``."""
    threads = max(1, cores // jobs)
    return threads, [k % gpus if gpus > 1 else None for k in range(jobs)]


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def context(preload: list[str]):
    """The multiprocessing context jobs start from (module docstring); ``preload``: modules the fork server imports
    once, besides torch and open_clip."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "open_clip", *preload])  # effective when the server starts (once)
    return ctx


def spawn():
    """The context of a job whose parent must not wait for it to start: a fresh interpreter that imports what the
    job needs beside the parent (a fork server's first job waits until the server has imported torch)."""
    import multiprocessing

    return multiprocessing.get_context("spawn")


def to_file(path: str | os.PathLike) -> None:
    """From here on, this process's standard output and error go to ``path`` (truncated), line by line."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)


def _run(target: str, kwargs: dict, log: str, result: str, threads: int, gpu: int | None) -> None:
    """In the child: the GPU, the log, the threads, then ``target(**kwargs)``; its return value or its error to
    ``result``."""
    if gpu is not None:  # before anything initialises CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    to_file(log)
    # the job's own processes (data loaders, a world's drawing workers) start as a command's would: a spawned child
    # inherits "spawn" as its default, and each such worker then imported this job's parent module again before its
    # work (train.demo: torch, open_clip, every head; 6 workers x ~6 s of CPU in the demo's hard-world steps)
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
    from extract.common.memory import keep_freed_memory

    keep_freed_memory()  # as a command's job does (extract.common.cli.run_job)
    import torch

    torch.set_num_threads(threads)
    module, _, name = target.partition(":")
    try:
        value = getattr(importlib.import_module(module), name)(**kwargs)
    except BaseException as e:  # the traceback to the log, the one line for the parent's message
        import traceback

        traceback.print_exc()
        Path(result).write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise SystemExit(1) from None
    Path(result).write_text(json.dumps({"value": value}, default=str))


class Child:
    """``target(**kwargs)`` (``"module:function"``) running in a process of its own with ``threads`` CPU threads (and
    ``gpu``), its output in ``log``; :meth:`join` waits for its return value."""

    def __init__(self, name: str, target: str, kwargs: dict[str, Any], log: str | os.PathLike, *, threads: int,
                 gpu: int | None = None, ctx=None):
        # not daemonic: a job may start processes of its own (data loaders, a world's drawing workers); the parent
        # ends it (:meth:`stop`) when it fails or is interrupted first
        self.name, self.log = name, Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._result = self.log.with_name(self.log.name + ".result.json")
        self._result.unlink(missing_ok=True)
        ctx = ctx or context([target.partition(":")[0]])
        self.process = ctx.Process(target=_run, args=(target, kwargs, str(self.log), str(self._result), threads, gpu),
                                   name=name)
        self.started = time.perf_counter()
        self.process.start()

    @property
    def sentinel(self):
        return self.process.sentinel

    def done(self) -> bool:
        return self.process.exitcode is not None

    def join(self, timeout: float | None = None) -> Any:
        """The job's return value, once it ended; :class:`ChildFailed` when it failed."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise TimeoutError(f"{self.name} still running after {timeout} s")
        answer = json.loads(self._result.read_text()) if self._result.is_file() else {}
        self._result.unlink(missing_ok=True)
        if self.process.exitcode != 0 or "value" not in answer:
            raise ChildFailed(self.name, answer.get("error"), self.process.exitcode, self.log)
        return answer["value"]

    def stop(self) -> None:
        """End the job now (the parent was interrupted or failed: no job outlives it)."""
        if self.process.exitcode is None:
            self.process.terminate()
        self.process.join()
