"""tests/fixtures/slow_rule.py: which started commands make a test slow by rule, and the recording itself."""
from __future__ import annotations

import subprocess
import sys

from fixtures import slow_rule


def test_the_rules_commands():
    slow = ["torchrun --nproc_per_node 2 -m train.pretrain", f"{sys.executable} -m torch.distributed.run --nproc-per-node 2 x.py",
            "accelerate launch --multi_gpu --num_processes 2 -m train.adapter", f"{sys.executable} -m train.demo --n 80",
            "/venv/bin/torchrun -m train.adapter",
            f"{sys.executable} -m accelerate.commands.launch --multi_gpu --num_processes 2 -m extract"]
    fast = [f"{sys.executable} -m train.adapter --method comalign", f"{sys.executable} -m train.demo_helper",
            "bash -c 'python -m serve.query runs/index x'", f"{sys.executable} -c 'import train.demo as d'",
            f"{sys.executable} -m accelerate.commands.launch --num_processes 1 -m train.adapter"]
    assert [bool(slow_rule.COMMANDS.search(c)) for c in slow] == [True] * len(slow)
    assert [bool(slow_rule.COMMANDS.search(c)) for c in fast] == [False] * len(fast)


def test_what_a_test_starts_is_recorded():
    slow_rule.install()
    slow_rule.start()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert slow_rule.started() == [f"{sys.executable} -c pass"] and slow_rule.reasons() == []  # not a slow one
    slow_rule.launched("torch.compile (inductor)")
    slow_rule.launched("torchrun --nproc_per_node 2 -m x")
    assert slow_rule.reasons() == ["torch.compile (inductor)", "torchrun --nproc_per_node 2 -m x"]
    slow_rule.start()  # the next test starts with nothing recorded
    assert slow_rule.reasons() == []
    assert slow_rule.command_line(["a", 1]) == "a 1" and slow_rule.command_line(b"x y") == "x y"


def test_the_measured_bar():
    tests = {"a.py::slow_one": slow_rule.BAR_SECONDS, "a.py::quick": slow_rule.BAR_SECONDS - 0.01}
    assert slow_rule.over_bar("a.py::slow_one", tests) == slow_rule.BAR_SECONDS
    assert slow_rule.over_bar("a.py::quick", tests) is None and slow_rule.over_bar("a.py::new", tests) is None


def test_every_collected_test_over_the_bar_is_marked_slow(request):
    """The fast subset is the inner loop: a test that took BAR_SECONDS or more in the last run that measured it
    (tests/durations.json) carries the slow marker, whatever it starts. Every collected test is held to it (each
    xdist worker collects them all; under -m "not slow" the slow ones are deselected and the rest are checked; a run of
    some files checks theirs)."""
    from fixtures.balance import measured_tests

    seconds = measured_tests()
    assert len(seconds) > 1000, "tests/durations.json holds no per-test seconds: python -m pytest --write-durations"
    over = [f"{item.nodeid} ({took:.1f} s)" for item in request.session.items if item.get_closest_marker("slow") is None
            and (took := slow_rule.over_bar(item.nodeid, seconds)) is not None]
    assert not over, (f"{len(over)} test(s) took {slow_rule.BAR_SECONDS:g} s or more where last measured: mark them "
                      "@pytest.mark.slow or make them cheaper, then measure again (python -m pytest "
                      "--write-durations, then python -m pytest -m 'not slow' --write-durations):\n" + "\n".join(over))
