"""Hard negatives for any pre-training objective (``python -m train.pretrain --hard-negatives all``): NegCLIP's recipe.

NegCLIP (Yuksekgonul et al., ICLR 2023, §4 "Composition-aware hard negative mining") adds, for each caption of the
batch, texts that name the same things in another structure and puts them into the image->text softmax as extra
columns: an image must now prefer its caption over the batch's other captions *and* over every hard negative of the
batch. :class:`WithHardNegatives` wraps a registered objective and adds exactly that term:

    loss = objective's own loss + weight * CE_i2t(image_i; [texts of the global batch, negatives of the global batch])

The objective's loss is untouched (``--hard-negatives none`` is the objective itself), and the extra term scores
texts with the objective's own image->text logits (:meth:`PretrainObjective.image_text_logits`: global embeddings,
or FILIP's token-wise s^I), so every objective takes negatives the same way. Negatives come from each caption's
parse (:mod:`extract.components.hard_negatives`, at most one per type), drawn in the data-loader workers with a seed fixed by
the run seed and the batch's image ids and captions: the same on every rank, after a resume, and fresh each epoch
as the batches change. A slot a caption has no negative for is masked out of the softmax.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from adapters.losses.contrastive import extra_columns_loss, gather_any
from adapters.objectives.base import Features, PretrainObjective, StepContext
from extract.components.hard_negatives import fill_slots, format_types

PREFIX = "hn:"  # feature names of the negatives' text side


def _seed(seed: int, image_ids, captions) -> int:
    h = hashlib.sha256(f"{seed}\0".encode())
    for i, c in zip(image_ids, captions):
        h.update(f"{i}\0{c}\0".encode())
    return int.from_bytes(h.digest()[:8], "little")


class WithHardNegatives(PretrainObjective):
    """``objective`` plus NegCLIP's hard-negative columns (module docstring). ``generator``: an
    :class:`extract.components.hard_negatives.HardNegatives` whose vocabulary comes from the training captions; ``weight``:
    the extra term's weight; ``seed``: the run's."""

    def __init__(self, objective: PretrainObjective, generator, weight: float = 1.0, seed: int = 0):
        if not weight >= 0:
            raise ValueError(f"--hard-negative-weight must be >= 0, got {weight}")
        self.inner, self.generator, self.weight, self.seed = objective, generator, float(weight), seed
        self.name = objective.name  # checkpoints name the objective; the config says negatives were used
        self.needs_fixed_geometry = objective.needs_fixed_geometry

    @property
    def slots(self) -> int:
        return len(self.generator.types)

    def config(self) -> dict[str, Any]:
        v = self.generator.vocab
        return {**self.inner.config(), "hard_negatives": list(self.generator.types),
                "hard_negative_weight": self.weight,
                "hard_negative_vocabulary": {"nouns": len(v.nouns), "predicates": len(v.predicates),
                                             **{k: len(w) for k, w in v.attributes.items()}}}

    def describe(self) -> str:
        types = format_types(self.generator.types).replace(",", ", ")  # replace-rel*3, not replace-rel three times
        return f"{self.inner.describe()} + hard negatives ({types}; weight {self.weight:g})"

    def setup(self, model: nn.Module, data_info) -> None:
        self.inner.setup(model, data_info)

    def compile(self, backend: str, mode: str) -> None:
        self.inner.compile(backend, mode)

    # -- data (workers)
    def prepare(self, captions: list[str], image_ids: list[str], tokenizer) -> dict[str, Tensor]:
        out = self.inner.prepare(captions, image_ids, tokenizer)
        rng = np.random.default_rng(_seed(self.seed, image_ids, captions))
        drawn = self.generator.draw(captions, rng)
        types = self.generator.types
        texts, valid = [], torch.zeros(len(captions), self.slots, dtype=torch.bool)
        for b, negs in enumerate(drawn):
            by_slot = fill_slots(types, negs)
            for k in range(len(types)):
                valid[b, k] = k in by_slot
                texts.append(by_slot.get(k, ""))
        tokens = tokenizer(texts)
        out["hn_text"] = tokens.view(len(captions), self.slots, -1)
        out["hn_valid"] = valid
        return out

    # -- model
    def features(self, model: nn.Module, batch: dict[str, Tensor], ctx: StepContext) -> Features:
        f = self.inner.features(model, batch, ctx)
        hn = batch["hn_text"]
        b, k = hn.shape[:2]
        side = self.inner.text_side(model, hn.flatten(0, 1))
        f.update({PREFIX + name: v.reshape(b, k, *v.shape[1:]) for name, v in side.items()})
        f["hn_valid"] = batch["hn_valid"]
        return f

    def loss(self, features: Features, ctx: StepContext) -> dict[str, Tensor]:
        own = {k: v for k, v in features.items() if not k.startswith(PREFIX) and k != "hn_valid"}
        out = self.inner.loss(own, ctx)
        term = self.negative_loss(features, ctx)
        out["hard_negatives"] = term.detach()
        out["loss"] = out["loss"] + self.weight * term
        return out

    def negative_loss(self, features: Features, ctx: StepContext) -> Tensor:
        """Image->text cross-entropy over the global batch's texts and hard negatives (NegCLIP's columns)."""
        names = [k[len(PREFIX):] for k in features if k.startswith(PREFIX)]
        g = lambda x: gather_any(x, ctx.rank, ctx.world_size, with_grad=ctx.gather_with_grad)  # noqa: E731
        texts = {k: g(features[k]) for k in names}
        negatives = {k: g(features[PREFIX + k].flatten(0, 1)) for k in names}
        valid = g(features["hn_valid"].flatten())
        return extra_columns_loss(self.inner.image_text_logits(features, texts),
                                  self.inner.image_text_logits(features, negatives), valid, ctx.rank, ctx.world_size)
