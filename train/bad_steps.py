"""The one policy for bad training steps, shared by both engines (``python -m train.adapter``, ``python -m
train.pretrain``): a step whose loss or gradients are not finite is skipped (no update) and counted;
``--max-bad-steps`` of them in a row stop the run with exit status 3 and a message naming what was kept and what to
try. A checkpoint is never written while the count in a row is above zero (its caller checks :attr:`BadSteps.clean`),
so ``--resume`` always finds a good state. The counters are part of the training state, so a resumed run continues
the count."""
from __future__ import annotations

from dataclasses import dataclass, field

from extract.common.cli import JobFailed

#: ``--max-bad-steps``' default in both engines: a handful in a row is a fluke (one bad batch, an fp16 overflow the
#: scaler recovers from); more is divergence, and training on would only burn time
MAX_BAD_STEPS = 5
#: exit status of a run stopped by bad steps
DIVERGED = 3


class TrainingDiverged(JobFailed):
    """Too many non-finite steps in a row (or non-finite final weights); the message says what was kept and what
    to try. Exit status 3 on the command line."""

    exit_code = DIVERGED


@dataclass
class BadSteps:
    """Skipped steps: in a row (reset by a good step), in total, and their step numbers."""

    limit: int = MAX_BAD_STEPS
    in_a_row: int = 0
    total: int = 0
    steps: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """True after a good step: the state may be saved."""
        return self.in_a_row == 0

    def good(self) -> None:
        self.in_a_row = 0

    def bad(self, step: int) -> bool:
        """Count a skipped step; True when the run must stop (``limit`` in a row)."""
        self.in_a_row += 1
        self.total += 1
        self.steps.append(step)
        return self.in_a_row >= self.limit

    def warning(self, step: int, reason: str) -> str:
        """The line each skipped step prints."""
        return f"warning: step {step}: skipped ({reason}); {self.in_a_row} in a row (--max-bad-steps {self.limit})"

    def stopped(self, kept: str | None, *, resume: str, advice: str) -> TrainingDiverged:
        """The error that stops the run: which steps, what was kept (the last good checkpoint's path, or None), how
        to continue from it (``resume``: the engine's flag) and ``advice`` (the engine's remedies)."""
        where = (f"the last good checkpoint is kept: {kept}. Continue with {resume} after" if kept else
                 "no good checkpoint was saved yet (one is saved only after a good step with finite weights). "
                 "Start again after")
        return TrainingDiverged(
            f"training diverged: {self.in_a_row} non-finite steps in a row (steps {', '.join(map(str, self.steps[-self.in_a_row:]))}); "
            f"{where} {advice}")

    def state(self) -> dict:
        return {"bad_in_a_row": self.in_a_row, "skipped_total": self.total, "skipped_step_numbers": list(self.steps)}

    def load(self, state: dict) -> None:
        """From :meth:`state`, or from a training state written before both engines shared this policy (the
        pre-training engine stored ``bad_in_row`` only)."""
        self.in_a_row = int(state.get("bad_in_a_row", state.get("bad_in_row", 0)))
        self.steps = [int(x) for x in state.get("skipped_step_numbers", [])]
        self.total = int(state.get("skipped_total", max(len(self.steps), self.in_a_row)))
