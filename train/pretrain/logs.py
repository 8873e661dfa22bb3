"""What ``python -m train.pretrain`` logs: ``OUT/log.csv`` (one row per logged step, appended on resume) and
TensorBoard scalars (``OUT/tb``)."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

class RunLog:
    """CSV (``OUT/log.csv``, one row per logged step, appended on resume) and TensorBoard (``OUT/tb``)."""

    def __init__(self, out: Path, tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.path = out / "log.csv"
        self.columns: list[str] | None = None
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tb"))
            except ImportError:
                print("note: tensorboard is not installed (pip install 'plugvlm[train]'); logging to CSV only")
        if enabled and self.path.is_file():
            with open(self.path, newline="") as f:
                self.columns = next(csv.reader(f), None)

    def write(self, step: int, row: dict[str, Any], prefix: str = "train") -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step",):
                    self.tb.add_scalar(f"{prefix}/{k}", v, step)
        if prefix != "train":
            return
        if self.columns is None:
            self.columns = list(row)
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(self.columns)
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in self.columns])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
