"""When ``python -m train.adapter`` stops without ``--epochs``: when the held-out figures stop improving.

A fixed number of epochs is a bet on the data's size: 5 epochs of the 2,000-scene toy world train the grounded
relation head to 100 on its controlled four-way test, 10 epochs of a 1,000-scene world stop it at 61 (left / right
learnt, above / below not; issue 52). So without ``--epochs`` the run watches its held-out split instead:

- **Schedule: warm-up, stable, cool-down** (warmup-stable-decay; Hägele et al. 2024, "Scaling Laws and
  Compute-Optimal Training Beyond Fixed Training Durations": a constant learning rate, then a linear cool-down of
  a fifth or so of the run, matches a cosine schedule of the same length, which needs the length in advance).
  Warm-up: ``--warmup`` steps, at most one epoch; then the head's learning rate, constant.
- **Held-out score** (:func:`held_out_score`): the mean of the retrieval part (R@1, R@5, R@10 in both directions)
  and, on a toy world, the binding part (the accuracy on each type of hard negative, every type weighing the same:
  replace-rel is a tenth of the negatives and the hardest). One number for every head, read the same way.
- **Patience**: evaluations at least :data:`EVAL_STEPS` steps apart (every epoch on real data; several epochs
  of a small world), and the cool-down starts after ``--patience`` evaluations without an improvement of
  ``--min-delta`` points over the best so far (3 and 0.5: I2T R@1 on the toy world's 100 held-out images moves by
  2-3 points between evaluations of a converged head, a quarter point of the score).
- **Cool-down**: the learning rate falls linearly to 0 over ``--cooldown`` (a fifth) of the steps so far, in whole
  epochs, then the run ends. ``--max-epochs`` caps the run; the cool-down starts early enough to end within it.

The log says each decision (the best score and where, why the cool-down started, why the run ended); the training
state holds the rule's state, so ``--resume`` continues the same decisions.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

#: held-out evaluations at least this many optimizer steps apart (an epoch of a 500-scene toy world is 6 steps)
EVAL_STEPS = 20

RETRIEVAL = tuple(f"retrieval {d} R@{k}" for d in ("T2I", "I2T") for k in (1, 5, 10))


def held_out_score(metrics: dict[str, float]) -> float | None:
    """The one figure the rule watches (module docstring): the mean of the retrieval part and the binding part,
    whichever the held-out figures have; None with neither."""
    from extract.worlds.toyworld import NEGATIVE_TYPES

    parts = []
    for keys in (RETRIEVAL, tuple(f"toyworld {t}" for t in NEGATIVE_TYPES)):
        found = [metrics[k] for k in keys if metrics.get(k) is not None]
        if found:
            parts.append(sum(found) / len(found))
    return sum(parts) / len(parts) if parts else None


@dataclass
class Plateau:
    """The rule's state and its decisions (module docstring); one per run, the same on every rank."""

    patience: int
    min_delta: float
    cooldown: float
    max_epochs: int
    steps_per_epoch: int
    warmup: int
    phase: str = "stable"            # stable -> cooldown -> done
    best: float | None = None
    best_step: int = 0
    best_epoch: int = 0
    since_best: int = 0              # evaluations without an improvement
    cooldown_start: int = 0          # step
    cooldown_steps: int = 0
    end_epoch: int = 0               # the run ends after this many epochs
    reason: str = ""
    scores: list = field(default_factory=list)  # [epoch, step, score] of every evaluation

    @classmethod
    def from_options(cls, opts, steps_per_epoch: int) -> "Plateau":
        warmup = min(opts.warmup, steps_per_epoch)
        return cls(opts.patience, opts.min_delta, opts.cooldown, opts.max_epochs, steps_per_epoch, warmup,
                   end_epoch=opts.max_epochs)

    @property
    def eval_every(self) -> int:
        """Epochs between held-out evaluations: at least :data:`EVAL_STEPS` steps apart."""
        return max(1, math.ceil(EVAL_STEPS / self.steps_per_epoch))

    def due(self, epochs_done: int) -> bool:
        """Whether the held-out split is evaluated after ``epochs_done`` epochs (always after the last one)."""
        return epochs_done % self.eval_every == 0 or epochs_done >= self.end_epoch

    @property
    def done(self) -> bool:
        return self.phase == "done"

    def lr_factor(self, step: int) -> float:
        """The learning rate's factor at ``step``: linear warm-up, 1 while stable, linear to 0 in the cool-down."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.phase == "stable":
            return 1.0
        return max(0.0, 1.0 - (step - self.cooldown_start) / max(1, self.cooldown_steps))

    def _cooldown_epochs(self, epochs_done: int) -> int:
        return max(1, math.ceil(self.cooldown * epochs_done))

    def update(self, epochs_done: int, step: int, score: float | None, steps_of=None) -> list[str]:
        """After ``epochs_done`` epochs (``step`` steps), with the held-out ``score`` when it was evaluated (None
        otherwise): the next phase. ``steps_of(epoch)``: the steps epoch ``epoch`` (0-based) will take (a batch holds
        each image once, so an epoch may take fewer than its captions fill), which the cool-down spans exactly;
        without it, :attr:`steps_per_epoch` each. Returns the lines to log."""
        lines = []
        if score is not None:
            self.scores.append([epochs_done, step, round(score, 4)])
            if self.best is None or score > self.best + self.min_delta:
                self.best, self.best_step, self.best_epoch, self.since_best = score, step, epochs_done, 0
            else:
                self.since_best += 1
            lines.append(f"held-out score {score:.2f} (best {self.best:.2f} at step {self.best_step}"
                         + (f", {self.since_best} evaluation{'s' * (self.since_best != 1)} without a gain of "
                            f"{self.min_delta:g}" if self.since_best else "") + ")")
        if self.phase == "stable":
            why = None
            if self.since_best >= self.patience:
                why = (f"the held-out score has not improved by {self.min_delta:g} in {self.since_best} evaluations "
                       f"({step - self.best_step} steps; best {self.best:.2f} at step {self.best_step}, epoch "
                       f"{self.best_epoch})")
            elif epochs_done + self._cooldown_epochs(epochs_done) >= self.max_epochs:
                why = f"--max-epochs {self.max_epochs} is near (the held-out score was still improving)"
            if why:
                n = min(self._cooldown_epochs(epochs_done), max(1, self.max_epochs - epochs_done))
                self.phase, self.cooldown_start = "cooldown", step
                self.end_epoch = epochs_done + n
                self.cooldown_steps = sum(steps_of(e) if steps_of else self.steps_per_epoch
                                          for e in range(epochs_done, self.end_epoch))
                self.reason = why
                lines.append(f"cooling down: {why}; the learning rate falls to 0 over the next {n} epoch"
                             f"{'s' * (n != 1)} ({self.cooldown_steps} steps, {self.cooldown:.0%} of the "
                             f"{step} so far), then the run ends")
        elif self.phase == "cooldown" and epochs_done >= self.end_epoch:
            self.phase = "done"
            lines.append(f"stopped after epoch {epochs_done} (step {step}): the cool-down has ended; it started "
                         f"because {self.reason}")
        return lines

    def state(self) -> dict:
        return asdict(self)

    def load(self, state: dict) -> None:
        """The state a training state file saved (``--resume``)."""
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)

    def summary(self) -> dict:
        """What summary.json and the checkpoint say about the stop."""
        return {"rule": "held-out plateau, then cool-down", "reason": self.reason, "best": self.best,
                "best_step": self.best_step, "best_epoch": self.best_epoch, "end_epoch": self.end_epoch,
                "patience": self.patience, "min_delta": self.min_delta, "cooldown": self.cooldown,
                "max_epochs": self.max_epochs, "scores": self.scores}
