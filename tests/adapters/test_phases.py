"""adapters/objectives/phases.py: a phase is a profiler range, and timed only while a PhaseTimer is active; a phase
re-entered inside itself counts once."""
from __future__ import annotations

import time

import torch

from adapters.objectives.phases import PhaseTimer, phase


def test_phases_are_timed_once_each_and_only_under_a_timer():
    with phase("image_tower"):  # no timer: nothing recorded anywhere
        pass
    with PhaseTimer("cpu") as timer:
        with phase("features"):
            with phase("image_tower"):
                with phase("image_tower"):  # encode_image calling patch_embed
                    time.sleep(0.02)
            time.sleep(0.01)
    assert set(timer.seconds) == {"features", "image_tower"}
    assert 0.02 <= timer.seconds["image_tower"] < 0.03 + 0.02  # counted once, not twice
    assert timer.seconds["features"] >= timer.seconds["image_tower"] + 0.01  # inclusive of what it holds
    with phase("loss"):
        pass
    assert "loss" not in timer.seconds  # the timer is no longer active


def test_a_phase_is_a_named_profiler_range():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phase("text_tower"):
            torch.ones(4) * 2
    assert "plugvlm::text_tower" in {e.key for e in prof.key_averages()}
