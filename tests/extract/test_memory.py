"""extract.common.memory: this process's resident set, its high-water mark and its reset, the heap trimmed (and
frozen) before a measurement, and freed blocks kept for reuse."""
import gc
import os
import sys
import weakref
from pathlib import Path

import pytest

from extract.common import memory

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


@linux
def test_the_resident_set_of_this_process_and_of_another():
    mine = memory.rss_bytes()
    assert mine == memory.status_kib("VmRSS") * 1024 or abs(mine - memory.status_kib("VmRSS") * 1024) < 64 << 20
    assert mine > 10 << 20 and memory.rss_source() == "/proc/self/status VmRSS"
    assert memory.rss_bytes(os.getppid()) > 0
    assert memory.rss_bytes(2 ** 22 + 12345) is None and memory.status_kib("VmRSS", 2 ** 22 + 12345) is None


@linux
def test_reset_peak_brings_the_high_water_mark_down_to_the_resident_set():
    block = bytearray(96 << 20)  # touched: resident
    block[::4096] = b"x" * len(block[::4096])
    del block
    memory.trim_heap()
    if not memory.reset_peak():
        pytest.skip("this kernel does not let a process reset its VmHWM")
    assert memory.status_kib("VmHWM") - memory.status_kib("VmRSS") < 32 << 10  # kB: the 96 MB peak is gone


def test_inside_frozen_heap_new_garbage_is_collected_and_old_objects_are_left_alone():
    old = Node()
    old_ref = weakref.ref(old)
    with memory.frozen_heap():
        assert gc.get_freeze_count() > 0
        new = Node()
        new_ref = weakref.ref(new)
        del new, old
        memory.trim_heap()
        assert new_ref() is None  # made inside: collected as before
        assert old_ref() is not None  # alive on entry: frozen, not walked
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None  # released on exit


def test_frozen_heap_is_released_when_the_work_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with memory.frozen_heap():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


@linux
def test_freed_blocks_are_reused_without_new_page_faults_once_kept():
    """keep_freed_memory: a large block freed and allocated again comes back from the heap, no page faulted in anew
    (glibc had unmapped it); measured in a process of its own, before and after (the setting is process-wide)."""
    import subprocess

    code = ("import resource\n"
            "import numpy as np\n"
            "from extract.common.memory import keep_freed_memory\n"
            "def faults():\n"
            "    a = np.ones(96 << 17); del a  # 96 MiB, touched\n"
            "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "    b = np.ones(96 << 17); del b\n"
            "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
            "print(faults(), keep_freed_memory(), faults())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    before, kept, after = done.stdout.split()
    assert kept == "True" and int(before) >= 20 and int(after) <= int(before) // 10, done.stdout
