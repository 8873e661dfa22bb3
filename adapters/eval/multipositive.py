"""Multi-positive retrieval: captions that are true of several images, and images that several captions describe.

Strict R@k (``adapters/eval/retrieval.py``) credits a caption only with its own image. On data whose captions can be true of
other images too, that undercounts: a toy-world one-object caption ("a small red circle") is true of every test
image holding a small red circle, about 6 of 200, so a perfect model's strict T2I R@1 on those captions is about
1/6, and a gain on partial captions is invisible. The toy world knows the truth
(``extract.worlds.toyworld.satisfies``); :func:`toyworld_truth` turns it into a matrix and these metrics read it.

Definitions. ``truth[i, t]``: caption t is true of image i (a caption is always true of its own image). Scores go
through ``adapters.eval.ranking``'s rules: a non-finite score is the worst score (-inf, counted by the caller) and ties
count against the model (a false candidate scoring *equal* to a true one ranks ahead of it). For a query with true
candidates whose scores, sorted, are v_1 >= v_2 >= ... >= v_n::

    rank_k = k + #{false candidates c : S[c] >= v_k}      (the position of the k-th true candidate)
    any-true rank = rank_1      any-true R@k = [rank_1 <= k]: the top k hold a candidate the query is true of
    AP = (1/n) sum_k k / rank_k                             mAP = mean AP over queries

text -> image: a caption ranks all images (true ones: the images it is true of). image -> text: an image ranks all
captions of the split (true ones: every caption true of it, its own and other images' captions). With one true
candidate, rank_1 is the strict rank and AP = 1 / rank. A query without any true candidate (an image no caption
is true of) has ``n_true = 0``, rank 0 and AP NaN, and is left out of the means.

Computation (:class:`MultiPositivePasses`), inside the two chunked passes of ``adapters.eval.retrieval``: text -> image
per chunk of captions (whole columns) by one sort per column (:func:`ranked_truth`); image -> text needs whole
rows, so pass 1 collects each image's true-caption scores and pass 2 counts, chunk by chunk, the captions scoring
at least each of them (``torch.searchsorted`` on the sorted chunk), never holding more than one chunk of scores.
Both are tested against a per-query reference (``tests/fixtures/references.py``) and a hand-computed example
(``tests/adapters/test_multipositive.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from adapters.eval.ranking import KS, rank_safe

#: caption kinds in the order tables show them; kinds a data set adds come after these, sorted
KIND_ORDER = ("one-object", "relation", "long")


# --------------------------------------------------------------------------------------------- ranking
def ranked_truth(scores: Tensor, truth: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(any-true rank [Q] long, AP [Q] float64, number of true candidates [Q] long) of queries ``scores`` [Q, C]
    (candidates along dim 1) with ``truth`` [Q, C] bool; definitions in the module docstring. Non-finite scores
    rank last (``rank_safe``); a query without a true candidate gets rank 0 and AP NaN.

    One stable sort by truth (false first) then a stable descending sort by score puts every false candidate
    ahead of the true ones it ties with, which is the ties-against-the-model rule."""
    safe, _ = rank_safe(scores.float())
    truth = truth.to(safe.device, torch.bool)
    by_truth = torch.argsort(truth.to(torch.uint8), dim=1, stable=True)
    s1, t1 = safe.gather(1, by_truth), truth.gather(1, by_truth)
    order = torch.argsort(s1, dim=1, descending=True, stable=True)
    ranked = t1.gather(1, order)  # truth of the candidates in ranked order
    n_true = ranked.sum(1)
    position = torch.arange(1, ranked.shape[1] + 1, device=ranked.device, dtype=torch.float64)
    hits = ranked.cumsum(1, dtype=torch.float64)
    ap = torch.where(ranked, hits / position, torch.zeros((), dtype=torch.float64, device=ranked.device)).sum(1)
    ap = torch.where(n_true > 0, ap / n_true.clamp(min=1), torch.full_like(ap, float("nan")))
    first = torch.where(n_true > 0, ranked.to(torch.uint8).argmax(1) + 1, torch.zeros_like(n_true))
    return first.long(), ap, n_true.long()


class _RowPositives:
    """image -> text over caption chunks: pass 1 :meth:`collect` keeps every true (image, caption) score, pass 2
    :meth:`count` adds how many captions of each chunk score at least each of them; :meth:`result` gives the
    per-image any-true rank, AP and number of true captions (module docstring)."""

    def __init__(self, n_images: int):
        self.n_images = n_images
        self.rows: list[Tensor] = []
        self.scores: list[Tensor] = []
        self.thresholds: Tensor | None = None

    def collect(self, s: Tensor, truth: Tensor) -> None:
        """``s`` [I, c] rank-safe scores of a chunk, ``truth`` [I, c] bool."""
        rows, cols = truth.nonzero(as_tuple=True)
        self.rows.append(rows)
        self.scores.append(s[rows, cols])

    def close(self) -> None:
        """After pass 1: each image's true-caption scores, descending, padded to [I, P] (+inf: never reached by a
        rank-safe score, so padding counts no caption in pass 2)."""
        rows = torch.cat(self.rows) if self.rows else torch.zeros(0, dtype=torch.long)
        scores = torch.cat(self.scores) if self.scores else torch.zeros(0)
        order = torch.argsort(scores, descending=True, stable=True)
        rows, scores = rows[order], scores[order]
        order = torch.argsort(rows, stable=True)
        rows, scores = rows[order], scores[order]  # by image, then by score descending
        self.n_true = torch.bincount(rows, minlength=self.n_images)
        starts = torch.cumsum(self.n_true, 0) - self.n_true
        k = torch.arange(len(rows)) - starts[rows]  # 0-based position within the image
        width = max(1, int(self.n_true.max()) if len(rows) else 1)
        self.thresholds = torch.full((self.n_images, width), float("inf"))
        self.thresholds[rows, k] = scores
        # how many of the image's own positives score >= each positive: the end of its run of equal scores
        change = torch.ones(len(rows), dtype=torch.bool)
        if len(rows) > 1:
            change[1:] = (rows[1:] != rows[:-1]) | (scores[1:] != scores[:-1])
        run = torch.cumsum(change.long(), 0) - 1
        run_end = torch.zeros(int(run[-1]) + 1 if len(rows) else 0, dtype=torch.long).scatter_reduce(
            0, run, torch.arange(len(rows)), reduce="amax", include_self=False)
        self.true_ge = torch.zeros(self.n_images, width, dtype=torch.long)
        self.true_ge[rows, k] = run_end[run] - starts[rows] + 1
        self.valid = torch.zeros(self.n_images, width, dtype=torch.bool)
        self.valid[rows, k] = True
        self.all_ge = torch.zeros(self.n_images, width, dtype=torch.long)

    def count(self, s: Tensor) -> None:
        """Pass 2: ``s`` [I, c] rank-safe scores of a chunk."""
        ascending = torch.sort(s.float(), dim=1).values.contiguous()
        below = torch.searchsorted(ascending, self.thresholds.contiguous(), side="left")
        self.all_ge += s.shape[1] - below

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        k = torch.arange(1, self.thresholds.shape[1] + 1, dtype=torch.float64)
        rank = k + (self.all_ge - self.true_ge).double()
        ap = torch.where(self.valid, k / rank, torch.zeros((), dtype=torch.float64)).sum(1)
        has = self.n_true > 0
        ap = torch.where(has, ap / self.n_true.clamp(min=1), torch.full_like(ap, float("nan")))
        first = torch.where(has, rank[:, 0].long(), torch.zeros_like(self.n_true))
        return first, ap, self.n_true.clone()


@dataclass
class MultiPositive:
    """Per-query multi-positive figures of one score matrix [I, T] (module docstring): text -> image per caption
    (``t2i_*`` [T]) and image -> text per image (``i2t_*`` [I]); a direction not computed holds None."""

    t2i_first: Tensor | None = None  # any-true rank, 1 = best
    t2i_ap: Tensor | None = None     # float64
    t2i_true: Tensor | None = None   # number of images the caption is true of
    i2t_first: Tensor | None = None  # 0: no caption is true of the image
    i2t_ap: Tensor | None = None
    i2t_true: Tensor | None = None


class MultiPositivePasses:
    """The multi-positive side of ``adapters.eval.retrieval``'s two passes over caption chunks. ``truth``: a bool tensor
    [I, T] or a function ``rows -> bool [I, len(rows)]`` (caption t true of image i); own pairs are set true."""

    def __init__(self, truth, n_images: int, caption_image: Tensor, directions: Sequence[str] = ("t2i", "i2t")):
        self.truth, self.caption_image, self.directions = truth, caption_image, tuple(directions)
        n_texts = len(caption_image)
        self.out = MultiPositive()
        if "t2i" in self.directions:
            self.out.t2i_first = torch.zeros(n_texts, dtype=torch.long)
            self.out.t2i_ap = torch.zeros(n_texts, dtype=torch.float64)
            self.out.t2i_true = torch.zeros(n_texts, dtype=torch.long)
        self.rows = _RowPositives(n_images) if "i2t" in self.directions else None

    def truth_chunk(self, sl: slice, n_images: int) -> Tensor:
        t = self.truth(sl) if callable(self.truth) else self.truth[:, sl]
        t = torch.as_tensor(t).to(torch.bool).cpu().clone()
        if t.shape != (n_images, len(range(*sl.indices(len(self.caption_image))))):
            raise ValueError(f"truth chunk has shape {tuple(t.shape)}; expected [images, captions of the chunk]")
        t[self.caption_image[sl], torch.arange(t.shape[1])] = True  # a caption is true of its own image
        return t

    def first_pass(self, s: Tensor, sl: slice) -> None:
        """``s`` [I, c]: rank-safe scores of caption chunk ``sl``."""
        truth = self.truth_chunk(sl, s.shape[0])
        if self.out.t2i_first is not None:
            self.out.t2i_first[sl], self.out.t2i_ap[sl], self.out.t2i_true[sl] = ranked_truth(s.T, truth.T)
        if self.rows is not None:
            self.rows.collect(s, truth)

    def second_pass(self, s: Tensor) -> None:
        if self.rows is not None:
            if self.rows.thresholds is None:
                self.rows.close()
            self.rows.count(s)

    def needs_second_pass(self) -> bool:
        return self.rows is not None

    def result(self) -> MultiPositive:
        if self.rows is not None:
            if self.rows.thresholds is None:
                self.rows.close()
            self.out.i2t_first, self.out.i2t_ap, self.out.i2t_true = self.rows.result()
        return self.out


# --------------------------------------------------------------------------------------------- summaries
def summary(first: Tensor, ap: Tensor, n_true: Tensor, keep: Tensor | None = None, ks: Sequence[int] = KS,
            strict: Tensor | None = None) -> dict:
    """{"R@k": any-true R@k (percent), "mAP" (percent), "n" queries, "true_per_query": mean number of true
    candidates, and "strict R@1" when ``strict`` ranks are given} over the queries in ``keep`` that have a true
    candidate; an empty selection gives {"n": 0}."""
    keep = (n_true > 0) if keep is None else (torch.as_tensor(keep, dtype=torch.bool) & (n_true > 0))
    n = int(keep.sum())
    if n == 0:
        return {"n": 0}
    f = first[keep].double()
    out = {f"R@{k}": float((f <= k).double().mean() * 100) for k in ks}
    out["mAP"] = float(ap[keep].mean() * 100)
    if strict is not None:
        out["strict R@1"] = float((strict[keep] == 1).double().mean() * 100)
    out.update(n=n, true_per_query=float(n_true[keep].double().mean()))
    return out


@dataclass
class ToyTruth:
    """Which captions are true of which images in a toy-world split, and how to split the queries.

    ``matrix`` [I, T] bool (caption t true of image i), ``kinds`` [T] (the caption kinds: one-object, relation,
    long, ...), ``caption_objects`` [T] (object count of each caption's own image) and ``image_objects`` [I]."""

    matrix: Tensor
    kinds: list[str]
    caption_objects: np.ndarray
    image_objects: np.ndarray
    kind_order: list[str] = field(default_factory=list)

    def caption_groups(self) -> dict[str, np.ndarray]:
        """Caption subsets for the text -> image splits: by kind ("one-object"), by the object count of the
        caption's own image ("3-object images"), and one-object captions by that count ("one-object in 3-object
        images")."""
        kinds = np.asarray(self.kinds)
        groups = {kind: kinds == kind for kind in self.kind_order}
        counts = sorted(set(self.caption_objects.tolist()))
        groups.update({f"{n}-object images": self.caption_objects == n for n in counts})
        if "one-object" in self.kind_order:
            groups.update({f"one-object in {n}-object images": (kinds == "one-object") & (self.caption_objects == n)
                           for n in counts})
        return groups

    def image_groups(self) -> dict[str, np.ndarray]:
        """Image subsets for the image -> text split: by object count ("3-object images")."""
        return {f"{n}-object images": self.image_objects == n for n in sorted(set(self.image_objects.tolist()))}


def _combo_bits(objects: Sequence[Mapping]) -> int:
    """A bitmask of the (colour, shape) pairs a list of objects names; objects lacking either are left out (the
    mask is then only a necessary condition, which is all :func:`toyworld_truth` uses it for)."""
    from extract.worlds.toyworld import COLOURS, SHAPES

    bits = 0
    for obj in objects:
        if obj.get("colour") in COLOURS and obj.get("shape") in SHAPES:
            bits |= 1 << (list(COLOURS).index(obj["colour"]) * len(SHAPES) + SHAPES.index(obj["shape"]))
    return bits


def toyworld_truth(scenes: Mapping[str, dict], image_ids: Sequence[str], caption_ids: Sequence[str]) -> ToyTruth:
    """The truth of a toy-world split as evaluated: ``scenes`` maps image id (``str``) to its scene (an entry of
    ``annotations.json``), ``image_ids`` [I] and ``caption_ids`` [T] are the evaluated images and captions (ids as
    the data source gives them: the scene's ``image_id`` and the caption's ``id``, as strings).

    ``matrix[i, t] = extract.worlds.toyworld.satisfies(scene_i, struct_t)``. A (colour, shape) bitmask rules out most
    pairs first (a caption naming a combination the scene lacks cannot be true: combinations are unique per
    scene), so ``satisfies`` runs only on the few candidates. Raises ValueError when an id is not in ``scenes``."""
    from extract.worlds.toyworld import satisfies

    caption_of: dict[str, tuple[dict, dict]] = {}
    for scene in scenes.values():
        for caption in scene.get("captions", ()):
            caption_of[str(caption["id"])] = (scene, caption)
    missing_images = [i for i in image_ids if str(i) not in scenes]
    missing_captions = [c for c in caption_ids if str(c) not in caption_of]
    if missing_images or missing_captions:
        raise ValueError(f"{len(missing_images)} image id(s) and {len(missing_captions)} caption id(s) are not in the "
                         f"toy world's annotations (e.g. {(missing_images + missing_captions)[:3]})")
    image_scenes = [scenes[str(i)] for i in image_ids]
    captions = [caption_of[str(c)] for c in caption_ids]
    image_bits = np.array([_combo_bits(s["objects"]) for s in image_scenes], dtype=np.int64)
    caption_bits = np.array([_combo_bits(c["struct"]["objects"]) for _, c in captions], dtype=np.int64)
    candidates = (caption_bits[None, :] & ~image_bits[:, None]) == 0  # [I, T]: the scene has every combination
    matrix = np.zeros(candidates.shape, dtype=bool)
    for i, t in zip(*np.nonzero(candidates)):
        matrix[i, t] = satisfies(image_scenes[i], captions[t][1]["struct"])
    kinds = [c["kind"] for _, c in captions]
    present = set(kinds)
    order = [k for k in KIND_ORDER if k in present] + sorted(present - set(KIND_ORDER))
    return ToyTruth(torch.from_numpy(matrix), kinds, np.array([len(s["objects"]) for s, _ in captions]),
                    np.array([len(s["objects"]) for s in image_scenes]), order)
