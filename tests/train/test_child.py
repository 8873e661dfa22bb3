"""A job in a process of its own (train/child.py): it returns its value, its output lands in its log, it computes with
its share of the threads, and a failure names itself and leaves its traceback in the log."""
from __future__ import annotations

import multiprocessing

import pytest

from train.child import Child, ChildFailed, context, job_plan


def test_jobs_fork_from_a_server_that_imported_torch_once_where_there_is_one():
    """Jobs start from a fork server preloaded with torch, open_clip and the job's module (no ~5 s of imports per
    job), spawned where there is none; never forked from the parent's own process."""
    ctx = context(["train.pretrain.engine"])
    if "forkserver" in multiprocessing.get_all_start_methods():
        assert ctx.get_start_method() == "forkserver"
        from multiprocessing import forkserver

        preload = getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None)  # CPython's record
        assert preload is None or {"torch", "open_clip", "train.pretrain.engine"} <= set(preload)
    else:
        assert ctx.get_start_method() == "spawn"


def test_job_plan_shares_the_cores_and_the_gpus():
    assert job_plan(2, 2, 0) == (1, [None, None])
    assert job_plan(3, 16, 0) == (5, [None, None, None])
    assert job_plan(4, 2, 1) == (1, [None] * 4)  # one GPU: every run keeps the default device
    assert job_plan(4, 32, 2) == (8, [0, 1, 0, 1])


@pytest.mark.slow
def test_a_job_returns_its_value_with_its_threads_and_a_failure_names_itself(tmp_path):
    """... and a job spawned beside the demo (train/demo_hard.py) starts its own data loaders and drawing workers the
    platform's default way, as a command's process does: a spawned child inherits "spawn" as its default, and each such
    worker then imported the parent's module again (torch, open_clip, every head) before its work."""
    from train.child import spawn

    spawned = Child("start method", "multiprocessing:get_start_method", {}, tmp_path / "d.log", threads=1, ctx=spawn())
    threads = Child("threads", "torch:get_num_threads", {}, tmp_path / "a.log", threads=3)
    said = Child("said", "builtins:print", {"end": "on its own line\n"}, tmp_path / "b.log", threads=1)
    bad = Child("bad", "json:loads", {"s": "not json"}, tmp_path / "c.log", threads=1)
    assert threads.join(120) == 3 and said.join(120) is None
    assert (tmp_path / "b.log").read_text() == "on its own line\n"
    with pytest.raises(ChildFailed, match=r"^bad failed \(JSONDecodeError: Expecting value.*the traceback is in "
                                          r".*c\.log$") as failure:
        bad.join(120)
    assert failure.value.code == 1 and "Traceback" in (tmp_path / "c.log").read_text()
    assert spawned.join(120) == multiprocessing.get_all_start_methods()[0]  # the first is the platform's default
    assert not list(tmp_path.glob("*.result.json"))  # the answers are read and removed
