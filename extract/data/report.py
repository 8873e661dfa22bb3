"""The report of what a data source refused (images, captions, shards) and which images it converted.

Sources record every refusal here instead of raising, so a run never crashes on bad data and ends with
counts by reason, a one-line summary and a JSON file listing each item with its location.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from extract.data.images import BadCaption, BadImage


@dataclass(frozen=True)
class Skip:
    """One refused item: ``kind`` is "image", "caption" or "shard"; ``reason`` is a stable category."""

    kind: str
    id: str
    location: str
    reason: str
    detail: str = ""

    @classmethod
    def from_error(cls, kind: str, id: str, location: str, error: BadImage | BadCaption) -> Skip:
        return cls(kind, id, location, error.reason, error.detail)


@dataclass(frozen=True)
class Note:
    """An image that was kept but whose pixels had to be converted (``note`` says how)."""

    image_id: str
    location: str
    note: str


class SkipReport:
    """What a run refused (and converted), kept in first-seen order.

    An entry is kept once per (kind, id, location, reason) -- the first ``detail`` wins -- so
    iterating a source twice, or merging DataLoader batches into the source's own index-time
    report, never double-counts.
    """

    KINDS = ("shard", "image", "caption")

    def __init__(self) -> None:
        self._skips: dict[tuple[str, str, str, str], Skip] = {}
        self._notes: dict[Note, None] = {}

    @property
    def skips(self) -> list[Skip]:
        return list(self._skips.values())

    @property
    def notes(self) -> list[Note]:
        return list(self._notes)

    def add(self, skip: Skip) -> None:
        self._skips.setdefault((skip.kind, skip.id, skip.location, skip.reason), skip)

    def note(self, image_id: str, location: str, note: str) -> None:
        self._notes.setdefault(Note(image_id, location, note))

    def add_batch(self, good: dict[str, Any], skips: Sequence[Skip]) -> None:
        """Record one ``collate_skipping`` batch: its skip markers and its converted images."""
        for skip in skips:
            self.add(skip)
        for image_id, location, note in zip(good["image_ids"], good["locations"], good["notes"]):
            if note is not None:
                self.note(image_id, location, note)

    def merge(self, other: SkipReport) -> SkipReport:
        """Add ``other``'s entries to this report (in place) and return it."""
        for skip in other.skips:
            self.add(skip)
        for note in other._notes:
            self._notes.setdefault(note)
        return self

    def counts(self) -> dict[str, dict[str, int]]:
        """``{"shard"|"image"|"caption"|"converted": {reason: count}}``; every key is present."""
        result = {kind: _ranked(Counter(s.reason for s in self.skips if s.kind == kind)) for kind in self.KINDS}
        result["converted"] = _ranked(Counter(n.note for n in self._notes))
        return result

    def summary(self) -> str:
        """One line, e.g. "skipped 3 images (2 truncated image data, 1 empty file), 0 captions;
        converted 1 image (CMYK converted to RGB)". Shards are mentioned only when one failed."""
        counts = self.counts()
        skipped = [_phrase(kind, counts[kind]) for kind in self.KINDS if kind != "shard" or counts[kind]]
        return f"skipped {', '.join(skipped)}; converted {_phrase('image', counts['converted'])}"

    def to_json(self, path: str | Path) -> None:
        """Write the summary, the counts and every entry as JSON (parent folders are created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "summary": self.summary(),
            "counts": self.counts(),
            "skipped": [asdict(s) for s in self.skips],
            "converted": [asdict(n) for n in self._notes],
        }
        path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def _ranked(counter: Counter) -> dict[str, int]:
    return dict(sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


def _phrase(noun: str, reasons: dict[str, int]) -> str:
    total = sum(reasons.values())
    text = f"{total} {noun}{'' if total == 1 else 's'}"
    if reasons:
        text += " (" + ", ".join(f"{n} {reason}" for reason, n in reasons.items()) + ")"
    return text
