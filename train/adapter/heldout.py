"""Held-out evaluation of an adapter head (and of the frozen base) from cached features, for the training loop.

Each epoch the loop scores the validation split through the head without touching the backbone: image and
caption arrays come from the cache, the retrieval protocol is ``adapters.eval.retrieval.retrieval_metrics`` (via
``adapters.eval.retrieval.retrieval_from_reps``, which ranks each direction with its own matrix for directional heads),
and the toy world's hard negatives (``train.eval.datasets.read_toyworld``) are scored as in ``train.eval``
(image -> text choice, a tie is wrong). The negatives' texts are not captions, so they are not in the cache:
their arrays are computed once, before training, by the live pipeline with the cache's own settings
(:class:`adapters.adapter_scorer.LiveExtractor`), exactly as evaluation and serving will compute them.

Results have ``train.eval``'s layout (``{"retrieval": ..., "compositional": {"toyworld": ...}}``, and the
retrieval's ``multi_positive`` section when the toy world's truth is attached), so ``train.eval.report.headline``
flattens them the same way for logs and tables.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from adapters.heads.base import to_tensors
from adapters.scoring import cat_reps, take_reps
from extract.cache import FeatureCache
from extract.common.cli import warn_once


@dataclass
class HeldOut:
    """A held-out split inside a cache: its images (global rows), its captions (rows) and, optionally, hard
    negatives ``(image position, positive text, negative text, type, tags)`` over ``texts`` whose arrays are in
    ``text_arrays`` (tags: further rows the item counts in, ``train.eval.datasets.Item.tags``)."""

    cache: FeatureCache
    image_rows: np.ndarray
    caption_rows: np.ndarray
    name: str = "val"
    negatives: list[tuple[int, int, int, str, tuple]] = field(default_factory=list)
    text_arrays: dict[str, np.ndarray] | None = None
    truth: object = None  # adapters.eval.multipositive.ToyTruth of these images and captions (multi-positive retrieval)

    @property
    def caption_image(self) -> torch.Tensor:
        """[T] position (in ``image_rows``) of each caption's image."""
        where = {int(r): k for k, r in enumerate(self.image_rows)}
        glob = self.cache.caption_image_index()[self.caption_rows]
        return torch.tensor([where[int(g)] for g in glob], dtype=torch.long)


def heldout_split(cache: FeatureCache, image_rows: np.ndarray | None = None, name: str = "val") -> HeldOut:
    """The whole cache (``image_rows=None``) or the images ``image_rows`` with all of their captions."""
    caption_image = cache.caption_image_index()
    if image_rows is None:
        image_rows = np.arange(cache.num_images)
        caption_rows = np.arange(cache.num_captions)
    else:
        image_rows = np.sort(np.asarray(image_rows, dtype=np.int64))
        caption_rows = np.nonzero(np.isin(caption_image, image_rows))[0]
    return HeldOut(cache, image_rows, caption_rows, name)


def attach_toyworld_negatives(heldout: HeldOut, world, split: str, extractor, batch_size: int = 256) -> int:
    """Add the toy world's hard negatives of ``split`` whose images are in ``heldout`` (matched by image id);
    the texts' arrays are computed with ``extractor`` (a LiveExtractor). Returns the number of items.

    Also attaches the toy world's truth (which caption is true of which image: ``heldout.truth``), so the
    held-out figures include multi-positive retrieval as ``train.eval``'s do; a held-out set whose ids are not
    the toy world's (or that keeps no caption ids) goes without."""
    from train.eval.datasets import read_toyworld

    bench = read_toyworld(world, split=split)
    ids = heldout.cache.image_ids()
    position = {ids[int(r)]: k for k, r in enumerate(heldout.image_rows)}
    texts: dict[str, int] = {}
    items = []
    for item in bench.items:
        image_id = extractor.image_id(os.path.basename(item.images[0]))
        if image_id not in position:
            continue
        pos, neg = (texts.setdefault(t, len(texts)) for t in item.texts)
        items.append((position[image_id], pos, neg, item.subtype, item.tags))
    ordered = list(texts)
    parts = [extractor.batch_text_arrays(ordered[a:a + batch_size]) for a in range(0, len(ordered), batch_size)]
    heldout.negatives = items
    heldout.text_arrays = concat_padded(parts) if parts else None
    heldout.truth = _toyworld_truth(heldout, world, split)
    return len(items)


def _toyworld_truth(heldout: HeldOut, world, split: str):
    from adapters.eval.multipositive import toyworld_truth
    from extract.common.json_memo import read_json

    caption_ids = getattr(heldout.cache, "caption_ids", None)
    if caption_ids is None:
        return None
    scenes = {str(s["image_id"]): s for s in read_json(Path(world) / "annotations.json")["scenes"]
              if s.get("split") == split}
    image_ids, all_captions = heldout.cache.image_ids(), caption_ids()
    try:
        return toyworld_truth(scenes, [str(image_ids[int(r)]) for r in heldout.image_rows],
                              [str(all_captions[int(r)]) for r in heldout.caption_rows])
    except ValueError:
        return None


def concat_padded(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate per-batch arrays whose trailing dims may differ (token lengths), zero-padding as the cache."""
    from extract.pipeline import concat_rows

    return concat_rows(parts)


# --------------------------------------------------------------------------------------------- encoding
class CachedBase:
    """The frozen backbone as a 'head' over cached arrays: cosine of the global embeddings (CLIP)."""

    name = "frozen base"
    image_keys = ("image_embed",)
    text_keys = ("text_embed",)
    directional = False

    def encode_image(self, batch):
        return {"embed": F.normalize(batch["image_embed"].float(), dim=-1)}

    def encode_text(self, batch):
        return {"embed": F.normalize(batch["text_embed"].float(), dim=-1)}

    def score(self, image_reps, text_reps):
        return image_reps["embed"] @ text_reps["embed"].T


@torch.no_grad()
def encode_rows(head, cache: FeatureCache, rows: np.ndarray, image: bool, device, batch_size: int = 1024):
    """Head representations of cache rows (image rows if ``image`` else caption rows), in batches."""
    keys = head.image_keys if image else head.text_keys
    encode = head.encode_image if image else head.encode_text
    parts = []
    for a in range(0, len(rows), batch_size):
        sl = rows[a:a + batch_size]
        parts.append(encode(to_tensors({k: cache.gather(k, sl) for k in keys}, device)))
    return cat_reps(parts)


@torch.no_grad()
def encode_heldout(head, heldout: HeldOut, device, batch_size: int = 1024):
    """(image reps, caption reps) of a held-out split through ``head``."""
    return (encode_rows(head, heldout.cache, heldout.image_rows, True, device, batch_size),
            encode_rows(head, heldout.cache, heldout.caption_rows, False, device, batch_size))


@torch.no_grad()
def evaluate_heldout(head, heldout: HeldOut, device, batch_size: int = 1024, reps=None) -> dict:
    """Retrieval (+ hard negatives when attached) of ``head`` on ``heldout``, in train.eval's layout.
    ``reps``: already computed (image reps, caption reps).

    Prints train.eval's warning lines (non-finite scores naming the head, a split too small for its
    metrics) once per process (``extract.common.cli.warn_once``): the training loop evaluates the same split every
    epoch, a comparison in every run, and each warning is one line."""
    from adapters.eval.ranking import rank_safe
    from adapters.eval.retrieval import retrieval_from_reps
    from train.eval.evaluate import item_correct, result_warnings

    was_training = getattr(head, "training", False)
    if hasattr(head, "eval"):
        head.eval()
    try:
        image_reps, text_reps = reps if reps is not None else encode_heldout(head, heldout, device, batch_size)
        out = {"retrieval": retrieval_from_reps(head, image_reps, text_reps, heldout.caption_image, truth=heldout.truth)}
        out["retrieval"].update(images=len(heldout.image_rows), captions=len(heldout.caption_rows))
        if heldout.negatives and heldout.text_arrays is not None:
            neg_reps = head.encode_text(to_tensors({k: heldout.text_arrays[k] for k in head.text_keys}, device))
            by_image = defaultdict(list)
            for item in heldout.negatives:
                by_image[item[0]].append(item)
            per_type: dict[str, list[bool]] = defaultdict(list)
            n_bad = n_scores = 0
            for image_pos, items in by_image.items():
                cols = sorted({c for it in items for c in it[1:3]})
                col = {c: k for k, c in enumerate(cols)}
                img, txt = take_reps(image_reps, [image_pos]), take_reps(neg_reps, cols)
                s = head.score_directed(img, txt, "i2t") if head.directional else head.score(img, txt)
                n_bad, n_scores = n_bad + rank_safe(s)[1], n_scores + s.numel()
                for _, pos, neg, subtype, tags in items:
                    ok = item_correct("text", s[:, [col[pos], col[neg]]])["acc"]
                    for group in (subtype, *tags, "all"):
                        per_type[group].append(ok)
            table = {sub: {"acc": 100 * float(np.mean(v)), "n": len(v)}
                     for sub, v in sorted(per_type.items(), key=lambda kv: (kv[0] != "all", kv[0]))}
            out["compositional"] = {"toyworld": {"kind": "text", "per_type": table, "excluded": 0,
                                                 "nonfinite_scores": n_bad, "n_scores": n_scores}}
        for line in result_warnings(getattr(head, "name", type(head).__name__), out):
            warn_once(f"{line} (held-out {heldout.name})")
        return out
    finally:
        if was_training:
            head.train()
