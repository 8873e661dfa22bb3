"""Hard negatives for adapter training (``python -m train.adapter --hard-negatives all``): NegCLIP's extra columns.

For every training caption, at most one negative per type (``TYPE*N``: N) is drawn from its parse
(:mod:`extract.components.hard_negatives`, the vocabulary from the training captions only; on a toy world no
negative names a held-out combination) and encoded once, before training, by the live extraction that scores
queries, in batches (``LiveExtractor.batch_text_arrays``: the frozen backbone's global and component embeddings). Each
step then adds to the head's own loss

    weight * CE_i2t(image_i; [the global batch's texts, every negative of the global batch's captions])

with the head's own image->text logits (``head.logits``: its score times its loss's inverse temperature), so every registered head takes negatives the same way
(:class:`NegativeLoss`). Negatives are drawn once per run (seeded by ``--seed``), not per epoch: encoding them
is the cost (one text pass per negative), and a cached run's features are fixed anyway.

``--hard-negatives world`` takes a toy world's own negatives of its training captions instead (``negatives.json``,
split train: :func:`world_negatives`): one of each type the world writes, each checked false of its scene by the
world's rules, where a negative drawn from the text alone can be true of the image ("a matte cube" for "a shiny
cube" where the scene has both) and a parse cannot change a count, the middle of "between" or a chain's objects.
``world,replace-rel*2`` adds drawn slots after the world's: the world's replace-rel says only the converse (fair to a
text-only model at test), so a predicate never meets the pairs of another axis as its negative unless drawn ones add
them (train/adapter/wide3d.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from torch import Tensor

from adapters.losses.contrastive import extra_columns_loss, gather_any

PREFIX = "neg:"
#: ``--hard-negatives`` item: the toy world's own negatives (:func:`world_negatives`), alone or beside drawn types
WORLD_NEGATIVES = "world"


def split_world(spec) -> tuple[bool, str]:
    """``--hard-negatives`` (a comma string, or a list from a config file) as (the world's own negatives asked for,
    the drawn types' spec): "world,replace-rel*2" -> (True, "replace-rel*2"), "all" -> (False, "all"), "world" ->
    (True, "")."""
    given = spec.split(",") if isinstance(spec, str) else [str(t) for t in spec]
    items = [t.strip() for t in given if t.strip()]
    return WORLD_NEGATIVES in items, ",".join(t for t in items if t != WORLD_NEGATIVES)


@dataclass
class TrainNegatives:
    """rows [num_captions, K]: for each caption row of the cache and type slot, the index of its negative in
    ``arrays`` (-1: none); ``arrays``: the negatives' text arrays, as cached; ``types``: the K slots."""

    rows: np.ndarray
    arrays: dict[str, np.ndarray]
    types: tuple[str, ...]

    def batch(self, caption_rows: np.ndarray, keys) -> dict[str, np.ndarray]:
        """The negatives of these captions: ``neg:<key>`` [b, K, ...] (zeros where none) and ``neg_valid`` [b, K]."""
        index = self.rows[np.asarray(caption_rows)]
        out = {PREFIX + k: self.arrays[k][np.maximum(index, 0)] for k in keys}
        out["neg_valid"] = index >= 0
        return out


def caption_texts(cache, source_spec, split: str | None, options: dict) -> list[str]:
    """The text of every caption row of ``cache``, read from the source it was built from (matched by caption id)."""
    from extract.data.sources import open_source

    source = open_source(source_spec, **({"split": split} if split else {}), **options)
    text = {c.id: c.text for r in source.records() for c in r.captions}
    ids = cache.caption_ids()
    missing = [i for i in ids if i not in text]
    if missing:
        raise ValueError(f"--hard-negatives: {len(missing)} cached captions (e.g. {missing[0]!r}) are not in "
                         f"{source_spec}; rebuild the cache or pass the data it was built from")
    return [text[i] for i in ids]


@dataclass
class DrawnNegatives:
    """rows [num_captions, K]: for each caption row and type slot, the index of its negative in ``texts`` (-1:
    none); ``types``: the K slots."""

    rows: np.ndarray
    texts: list[str]
    types: tuple[str, ...]

    def joined(self, other: "DrawnNegatives") -> "DrawnNegatives":
        """These slots, then ``other``'s (the same caption rows), each distinct text once."""
        index = {t: i for i, t in enumerate(self.texts)}
        remap = np.array([index.setdefault(t, len(index)) for t in other.texts] or [0], dtype=np.int64)
        rows = np.where(other.rows >= 0, remap[np.maximum(other.rows, 0)], -1)
        return DrawnNegatives(np.concatenate([self.rows, rows], 1), list(index), self.types + other.types)

    def summary(self, captions: int) -> str:
        counts = {t: sum(int((self.rows[:, k] >= 0).sum()) for k, s in enumerate(self.types) if s == t)
                  for t in dict.fromkeys(self.types)}
        return (f"hard negatives: {len(self.texts)} texts for {captions} training captions ("
                + ", ".join(f"{t} {n}" for t, n in counts.items()) + ")")


def draw_negatives(texts: list[str], train_rows: np.ndarray, types, *, seed: int, forbid=()) -> DrawnNegatives:
    """The training captions' negatives, at most one per slot of ``types`` each (a type's slots: how many of it,
    ``extract.components.hard_negatives.parse_types``), the vocabulary that of ``texts[train_rows]``; each distinct
    text once."""
    from extract.components.hard_negatives import HardNegatives, fill_slots

    train_texts = [texts[int(r)] for r in train_rows]
    gen = HardNegatives.for_captions(train_texts, types, forbid=forbid)
    drawn = gen.draw(train_texts, np.random.default_rng(seed))
    rows = np.full((len(texts), len(gen.types)), -1, dtype=np.int64)
    unique: dict[str, int] = {}
    for r, negs in zip(train_rows, drawn):
        for slot, text in fill_slots(gen.types, negs).items():
            rows[int(r), slot] = unique.setdefault(text, len(unique))
    return DrawnNegatives(rows, list(unique), gen.types)


def world_negatives(world, texts: list[str], caption_ids: list[str], train_rows: np.ndarray) -> DrawnNegatives:
    """The toy world ``world``'s own negatives of the training captions (``negatives.json``, split train, read and
    checked by ``train.eval.datasets.read_toyworld``): slot k of type ``types[k]``, the world's types in the order
    it lists them. ``texts`` / ``caption_ids``: every caption row of the cache; a training caption whose text is not
    the world's is an error (the cache was built from other data)."""
    from train.eval.datasets import read_toyworld

    per_caption: dict[str, dict[str, str]] = {}
    positive: dict[str, str] = {}
    for item in read_toyworld(world, split="train").items:
        caption_id, _, kind = item.item_id.rpartition("/")
        per_caption.setdefault(caption_id, {})[kind] = item.texts[1]
        positive[caption_id] = item.texts[0]
    types = tuple(dict.fromkeys(kind for negs in per_caption.values() for kind in negs))
    rows = np.full((len(texts), len(types)), -1, dtype=np.int64)
    unique: dict[str, int] = {}
    for r in train_rows:
        caption_id = str(caption_ids[int(r)])
        if caption_id in positive and positive[caption_id] != texts[int(r)]:
            raise ValueError(f"--hard-negatives world: caption {caption_id} reads {texts[int(r)]!r} in the cache and "
                             f"{positive[caption_id]!r} in {world}/negatives.json; pass the world the cache was built "
                             "from")
        for kind, text in per_caption.get(caption_id, {}).items():
            rows[int(r), types.index(kind)] = unique.setdefault(text, len(unique))
    return DrawnNegatives(rows, list(unique), types)


def encode_negatives(drawn: DrawnNegatives, train_rows: np.ndarray, text_arrays: Callable, *, batch_size: int = 256,
                     say=print) -> TrainNegatives:
    """``drawn`` encoded with ``text_arrays`` (captions -> cached-layout arrays), in batches."""
    from train.adapter.heldout import concat_padded

    say(drawn.summary(len(train_rows)) + "; encoding them")
    ordered = drawn.texts
    parts = [text_arrays(ordered[a:a + batch_size]) for a in range(0, len(ordered), batch_size)]
    arrays = concat_padded(parts) if parts else {}
    return TrainNegatives(drawn.rows, arrays, drawn.types)


def build_negatives(texts: list[str], train_rows: np.ndarray, types, text_arrays: Callable, *, seed: int,
                    forbid=(), batch_size: int = 256, say=print) -> TrainNegatives:
    """Draw the training captions' negatives (:func:`draw_negatives`) and encode them (:func:`encode_negatives`)."""
    drawn = draw_negatives(texts, train_rows, types, seed=seed, forbid=forbid)
    return encode_negatives(drawn, train_rows, text_arrays, batch_size=batch_size, say=say)


class LiveNegatives:
    """``--unfreeze``'s negatives: tokenized per batch, so the backbone being trained encodes them at every step
    (NegCLIP fine-tunes the whole model this way, §4 of Yuksekgonul et al. 2023)."""

    def __init__(self, drawn: DrawnNegatives, tokenizer, context_length: int, text_arrays=None):
        self.drawn, self.tokenizer, self.context_length = drawn, tokenizer, context_length
        #: texts -> {key: [n, ...] tensor}: the caption arrays that come from the data (phrase trees), for heads
        #: that read them (train.adapter.live.DataArrays.texts)
        self.text_arrays = text_arrays

    @property
    def types(self) -> tuple[str, ...]:
        return self.drawn.types

    def batch(self, caption_rows) -> dict:
        """``neg:ids`` [b, K, L], ``neg:attention_mask`` [b, K, l] (l: the longest negative) and ``neg_valid`` [b, K]
        of these caption rows (an empty text where a caption has no negative of a type)."""
        import torch

        from extract.models.tokens import tokenize_with_spans

        index = self.drawn.rows[np.asarray(caption_rows)]
        b, k = index.shape
        texts = [self.drawn.texts[i] if i >= 0 else "" for i in index.reshape(-1)]
        tok = tokenize_with_spans(self.tokenizer, texts, self.context_length)
        length = int(tok.attention_mask.sum(1).max())
        out = {PREFIX + "ids": tok.ids.reshape(b, k, -1),
               PREFIX + "attention_mask": tok.attention_mask[:, :length].reshape(b, k, length),
               "neg_valid": torch.as_tensor(index >= 0)}
        if self.text_arrays is not None:
            out.update({PREFIX + name: v.reshape(b, k, *v.shape[1:]) for name, v in self.text_arrays(texts).items()})
        return out


class NegativeLoss:
    """A head (or ``--unfreeze``'s live model) with NegCLIP's extra columns: ``encode_text`` also encodes the
    ``neg:*`` arrays (shaped [b, K, ...] so that micro-batches slice them with their captions), ``loss`` adds
    ``weight`` x the extra-column cross-entropy (module docstring) to the head's loss.

    A head that defines ``negatives_loss(image_reps, text_reps, negative_reps, negative_valid, types, rank=,
    world_size=)`` takes its negatives its own way instead: that term, ``weight`` x it, replaces the extra columns.
    It gets each local image with its own caption (``text_reps``, [b, ...]) and that caption's K negatives
    (``negative_reps`` [b, K, ...], ``negative_valid`` [b, K], slot k of type ``types[k]``): for a head whose score
    has a part that only its own negatives can train, or that is too costly to score against every negative of the
    batch (``adapters/heads/grounded.py``)."""

    def __init__(self, head, weight: float, types: tuple[str, ...] = ()):
        self.head, self.weight, self.types = head, float(weight), tuple(types)

    def encode_image(self, batch):
        return self.head.encode_image(batch)

    def encode_text(self, batch):
        own = {k: v for k, v in batch.items() if not k.startswith(PREFIX) and k != "neg_valid"}
        reps = dict(self.head.encode_text(own))
        neg = {k[len(PREFIX):]: v for k, v in batch.items() if k.startswith(PREFIX)}
        if neg:
            b, k = batch["neg_valid"].shape
            encoded = self.head.encode_text({name: v.flatten(0, 1) for name, v in neg.items()})
            reps.update({PREFIX + name: v.reshape(b, k, *v.shape[1:]) for name, v in encoded.items()})
            reps["neg_valid"] = batch["neg_valid"]
        return reps

    def loss(self, image_reps, text_reps, *, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
        own = {k: v for k, v in text_reps.items() if not k.startswith(PREFIX) and k != "neg_valid"}
        out = dict(self.head.loss(image_reps, own, rank=rank, world_size=world_size))
        if "neg_valid" not in text_reps:
            return out
        own_term = getattr(self.head, "negatives_loss", None)
        if own_term is not None:
            local = {k[len(PREFIX):]: v for k, v in text_reps.items() if k.startswith(PREFIX)}
            extra = own_term(image_reps, own, local, text_reps["neg_valid"], self.types, rank=rank,
                             world_size=world_size)
            for name, value in extra.items():
                if name == "loss":
                    out["loss"] = out["loss"] + self.weight * value
                else:
                    out[name] = value.detach()
            return out
        g = lambda x: gather_any(x, rank, world_size)  # noqa: E731
        texts = {k: g(v) for k, v in own.items()}
        negatives = {k[len(PREFIX):]: g(v.flatten(0, 1)) for k, v in text_reps.items() if k.startswith(PREFIX)}
        term = extra_columns_loss(self.head.logits(image_reps, texts), self.head.logits(image_reps, negatives),
                                  g(text_reps["neg_valid"].flatten()), rank, world_size)
        out["hard_negatives"] = term.detach()
        out["loss"] = out["loss"] + self.weight * term
        return out
