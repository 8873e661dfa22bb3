"""train.bad_steps: the one bad-step policy of both engines: counted in a row and in total, the limit stops the run
with exit status 3, a good step resets the count, the counters survive a resume (old pre-training states too)."""
from __future__ import annotations

from train.bad_steps import DIVERGED, MAX_BAD_STEPS, BadSteps, TrainingDiverged


def test_the_limit_in_a_row_stops_and_a_good_step_resets_the_count():
    bad = BadSteps(limit=3)
    assert bad.clean and not bad.bad(1) and not bad.bad(2) and not bad.clean
    bad.good()
    assert bad.clean and not bad.bad(5) and not bad.bad(6) and bad.bad(7)  # 3 in a row: 5, 6, 7
    assert (bad.in_a_row, bad.total, bad.steps) == (3, 5, [1, 2, 5, 6, 7])
    assert "step 7: skipped (nan); 3 in a row (--max-bad-steps 3)" in bad.warning(7, "nan")


def test_the_stop_names_the_steps_what_was_kept_and_how_to_go_on():
    bad = BadSteps(limit=2)
    bad.bad(4), bad.bad(5)
    kept = bad.stopped("/run/last.safetensors", resume="--resume", advice="lower --lr.")
    assert isinstance(kept, TrainingDiverged) and kept.exit_code == DIVERGED == 3
    assert str(kept) == ("training diverged: 2 non-finite steps in a row (steps 4, 5); the last good checkpoint is "
                         "kept: /run/last.safetensors. Continue with --resume after lower --lr.")
    none = str(bad.stopped(None, resume="--resume", advice="lower --lr."))
    assert "no good checkpoint was saved yet" in none and "--resume" not in none and "Start again after" in none


def test_the_counters_survive_a_resume_and_read_the_old_pretraining_key():
    bad = BadSteps(limit=MAX_BAD_STEPS)
    bad.bad(2), bad.good(), bad.bad(9)
    again = BadSteps(limit=MAX_BAD_STEPS)
    again.load(bad.state())
    assert (again.in_a_row, again.total, again.steps) == (1, 2, [2, 9])
    old = BadSteps()
    old.load({"bad_in_row": 2})  # a pre-training checkpoint written before the engines shared this policy
    assert (old.in_a_row, old.total) == (2, 2) and MAX_BAD_STEPS == 5
