"""What ``python -m train.adapter`` logs while it trains: ``RUN/metrics.csv`` (one row per step, skipped steps
included; a ``--resume`` drops the rows a killed run wrote after its checkpoint) and TensorBoard scalars
(``RUN/tb``), from rank 0 only."""
from __future__ import annotations

import csv
from pathlib import Path


class RunLogs:
    """metrics.csv (one row per step, skipped steps included) and TensorBoard scalars; rank 0 only."""

    def __init__(self, out: Path, enabled: bool, resume_step: int | None):
        self.enabled, self.path = enabled, out / "metrics.csv"
        self.rows: list[dict] = []
        self.fields: list[str] | None = None
        self.tb = None
        if not enabled:
            return
        if self.path.is_file() and resume_step is not None:  # drop rows a killed run wrote after the checkpoint
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.fields = reader.fieldnames
                kept = [r for r in reader if int(r["step"]) <= resume_step]
            self._rewrite(kept)
        elif self.path.exists():
            self.path.unlink()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"), purge_step=resume_step + 1 if resume_step is not None else None)
        except ImportError:
            print("note: tensorboard is not installed (pip install 'plugvlm[train]'); logging to metrics.csv only")

    def _rewrite(self, rows: list[dict]) -> None:
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields)
            w.writeheader()
            w.writerows(rows)

    def step(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.fields is None:
            self.fields = list(row) + [k for k in ("skipped", "reason") if k not in row]
            self._rewrite([])
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore").writerow(row)
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"train/{k}", v, row["step"])

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
