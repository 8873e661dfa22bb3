"""A ``python -m train.adapter`` run's pieces, as its steps (``train.adapter.engine``) pass them along: where it
happens (:class:`Env`), what it trains on (:class:`TrainData`), what trains (:class:`Model`), where it is
(:class:`State`, all of it in the training state) and the whole (:class:`Run`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from adapters.heads.base import AdapterHead
from extract.common.cli import say
from train.bad_steps import BadSteps
from train.adapter.heldout import HeldOut
from train.adapter.logs import RunLogs
from train.adapter.options import AdapterOptions
from train.adapter.step import AdapterRun
from train.adapter.stopping import Plateau


@dataclass
class Env:
    """Where the run happens (:func:`setup`): processes and device, the frozen backbone, the run folder."""

    accelerator: object
    ctx: AdapterRun
    is_main: bool
    backbone: object
    base_info: dict           # the original weights, before any fine-tuning
    out: Path | None = None   # set by place_run

    @property
    def state_path(self) -> Path:
        return self.out / "checkpoints" / "last.safetensors"

    def say(self, *parts) -> None:
        """A status line, from rank 0 only (silenced by --quiet)."""
        if self.is_main:
            say(*parts)

    def warn(self, text: str) -> None:
        """A warning line, from rank 0 only (kept by --quiet)."""
        if self.is_main:
            print(text)


@dataclass
class TrainData:
    """What the loop trains and evaluates on (:func:`load_data`)."""

    train_rows: np.ndarray       # caption rows trained on
    caption_image: np.ndarray    # [num_captions] image row of every caption of the training data
    extraction: dict             # how the arrays were made (the checkpoint's description)
    key: str                     # identifies the training data across --resume (the cache's fingerprint)
    test: dict                   # train.eval.evaluate data options of the final table ({}: none)
    global_batch: int = 0
    steps_per_epoch: int = 0
    cache: object = None         # the training FeatureCache (cached path)
    live: object = None          # train.adapter.live.LiveData (--unfreeze)
    val: HeldOut | None = None   # held-out arrays; with --unfreeze re-encoded every epoch (None until needed)
    negatives: object = None     # train.adapter.negatives.TrainNegatives (--hard-negatives)


@dataclass
class Model:
    """What trains (:func:`build_model`)."""

    head: AdapterHead
    trained: torch.nn.Module     # the head, or (--unfreeze) backbone + head behind the head's interface
    modules: dict                # extra modules of the training state ({"backbone": ...} with --unfreeze)
    optimizer: torch.optim.Optimizer
    scheduler: object
    resume_key: dict             # what a --resume must agree on
    plateau: Plateau | None = None  # without --epochs: when the run stops (train.adapter.stopping)


@dataclass
class State:
    """Where the run is: the position of the next batch and the counters, all in the training state, so
    ``--resume`` continues exactly."""

    epoch: int = 0
    batch: int = 0               # next batch of ``epoch``
    step: int = 0
    history: list = field(default_factory=list)
    bad: BadSteps = field(default_factory=BadSteps)  # skipped steps (train.bad_steps: the policy of both engines)
    stopped: bool = False        # by --stop-after-steps


@dataclass
class Run:
    """One run's pieces, as the steps after :func:`start_or_resume` share them."""

    opts: AdapterOptions
    env: Env
    data: TrainData
    model: Model
    state: State
    logs: RunLogs
