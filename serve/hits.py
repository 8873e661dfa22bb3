"""What a search returns and refuses: :class:`Hit` (one item, its scores and ranks before and after re-ranking) and
:class:`Hits` (the list, with the query, its direction, k and the notes);
:class:`QueryError`, a query that cannot be searched for."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence


class QueryError(ValueError):
    """A query that cannot be searched for (empty text, a bad image, k <= 0 ...); a ValueError, so entry points
    report it as one line (exit status 2), like serve.layout's IndexDirError / ModelMismatchError."""


@dataclass
class Hit:
    """One result. ``row``: row of ``image.arrow`` (image hits) or ``text.arrow`` (caption hits), = the FAISS
    id; ``id``: its ``image_id`` / ``caption_id``; ``path``: the image file (a caption hit: its image's);
    ``text``: the caption (None for image hits); ``score``: first-stage inner product; ``rerank_score``: the
    model's own score (None without re-ranking); ``rank_before`` / ``rank_after``: 1-based positions in the
    filtered first-stage order and in the final order (equal without re-ranking; both count the ``offset``d
    hits); ``metadata``: the row of the metadata table, as a dict."""

    row: int
    kind: str
    id: str
    path: str | None
    text: str | None
    score: float
    rerank_score: float | None
    rank_before: int
    rank_after: int
    metadata: dict = field(default_factory=dict)

    @property
    def final_score(self) -> float:
        """The score the hit was ordered by: re-ranked if it was, else first-stage."""
        return self.score if self.rerank_score is None else self.rerank_score

    def to_dict(self) -> dict:
        return asdict(self)


class Hits(list):
    """The hits of one search, best first (a list of :class:`Hit`), with ``notes`` (one line each: a clamped
    k, an ignored rerank, a truncated query, a filter that left fewer hits, an approximate first stage searched
    without re-ranking -- FILIP's) and what was asked: ``query`` (the
    text, or the image's name), ``direction`` ("t2i": images for a text, "i2t": captions for an image), ``k``,
    ``rerank``, ``offset`` (as used, after clamping), ``considered`` (candidates that passed the filter);
    ``timings``: milliseconds per stage (``encode`` the query, ``first_stage`` with its filter, ``rerank``,
    ``metadata``: the hits' rows), for the app's and /knn-service's per-stage figures. ``box_note``: set (also
    among the notes) when the model reads ground-truth boxes and has none for the query image, which was then
    searched by the first stage only (serve.service.box_note)."""

    def __init__(self, hits: Sequence[Hit] = (), *, query: str = "", direction: str = "t2i", k: int = 0,
                 rerank: int | None = None, offset: int = 0, considered: int = 0, notes: Sequence[str] = (),
                 timings: Mapping[str, float] | None = None):
        super().__init__(hits)
        self.query, self.direction, self.k, self.rerank, self.offset = query, direction, k, rerank, offset
        self.considered = considered
        self.notes = list(notes)
        self.timings = dict(timings or {})
        self.box_note: str | None = None

    def to_dict(self) -> dict:
        return {"query": self.query, "direction": self.direction, "k": self.k, "rerank": self.rerank,
                "offset": self.offset, "considered": self.considered, "notes": self.notes,
                "box_note": self.box_note, "timings": self.timings, "hits": [h.to_dict() for h in self]}
