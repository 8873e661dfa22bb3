"""The contract every pre-training objective fulfils (CLIP, FLIP, FILIP, CLIP-PGS, PowerCLIP, and any new one).

An objective is one file in ``adapters/objectives/`` with a class registered as ``@PRETRAIN.register(name)``.
The engine (``train.pretrain``) knows nothing about a method beyond this class:

1. ``add_args(parser)`` / ``from_args(args)``: the method's own flags (an argument group each) and the object
   built from them; ``config()`` is what the checkpoint's JSON records.
2. ``setup(model, data_info)``: checks before the first step (e.g. a SAM2 mask cache fits the model's grid).
3. ``prepare(captions, image_ids, tokenizer)``: runs in the data-loader workers on one local batch and returns
   extra tensors for it (first dim = the batch), e.g. PowerCLIP's phrase trees; ``"text"`` in the result
   replaces the engine's own tokenisation.
4. ``features(model, batch, ctx)``: the forward pass, *with* the method's modification of the model's forward
   (patch dropping, PGS masking, patch / token outputs). Returns a dict of tensors: 0-dim tensors are shared
   (``logit_scale``), every other tensor has the local batch as its first dimension. It runs inside the
   engine's DDP wrapper, so gradients are all-reduced.
5. ``loss(features, ctx)``: the objective on the local features, on one rank or many (features are gathered
   inside, with gradients). Returns ``{"loss": scalar, <part>: detached scalar, ...}``.
6. ``text_side(model, text)`` / ``image_text_logits(features, texts)``: the text features of extra texts and the
   image->text logits against them (defaults: the global embeddings; FILIP overrides both). Hard negatives
   (``--hard-negatives``) use these, so they work with every objective.

Splitting 4 and 5 is what makes gradient accumulation exact for contrastive losses (open_clip's
``accum_freq``): the engine caches every micro-batch's features without gradients, then recomputes one
micro-batch at a time with gradients and evaluates the loss on the concatenation, so the negatives are the
whole accumulated batch.

Randomness (masks, patch drops, seeds) never comes from a global RNG: :func:`batch_random` draws it for the
whole global batch of the step from ``(seed, step, purpose)`` and each rank keeps its rows. Hence a sample
gets the same mask on one process or many, in the no-grad and the grad pass of accumulation, and after a
resume, which is what the reliability tests check.
"""
from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

Features = dict[str, Tensor]


@dataclass(frozen=True)
class StepContext:
    """Where a local (micro-)batch sits in training.

    step: optimizer steps done before this one (0-based); epoch: 0-based; progress: fraction of training
    done in epochs (``epoch / epochs``, constant within an epoch), for schedules such as CLIP-PGS's alpha.
    rank / world_size: this process among the data-parallel ranks. offset: index of the local batch's first
    sample in the step's global batch (micro-batch j of rank r holds rows ``(j * world_size + r) * b ...``);
    global_batch: samples in the step's global batch (all ranks and micro-batches). seed: run seed.
    local_loss / gather_with_grad: how contrastive losses use the gathered features
    (:mod:`adapters.losses.contrastive`).
    """

    step: int = 0
    epoch: int = 0
    progress: float = 0.0
    rank: int = 0
    world_size: int = 1
    offset: int = 0
    global_batch: int = 0
    seed: int = 0
    local_loss: bool = True
    gather_with_grad: bool = True

    def with_batch(self, offset: int, global_batch: int) -> "StepContext":
        return StepContext(**{**self.__dict__, "offset": offset, "global_batch": global_batch})


def _seed_of(seed: int, step: int, purpose: str) -> int:
    digest = hashlib.sha256(f"{seed}:{step}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def step_generator(ctx: StepContext, purpose: str) -> torch.Generator:
    """A CPU generator seeded by (seed, step, purpose): the same on every rank and after a resume."""
    return torch.Generator().manual_seed(_seed_of(ctx.seed, ctx.step, purpose))


def step_numpy_rng(ctx: StepContext, purpose: str) -> np.random.Generator:
    """numpy counterpart of :func:`step_generator`."""
    return np.random.default_rng(_seed_of(ctx.seed, ctx.step, purpose))


def runs_ahead(device: torch.device) -> bool:
    """Whether the host queues work ahead of ``device`` (CUDA), so that reading a tensor's value there (``int``,
    ``bool``, ``.item()``) stalls the step until the device catches up; an objective avoids such reads where this
    holds (tests/train/test_pretrain_host_reads.py)."""
    return device.type == "cuda"


def batch_random(ctx: StepContext, purpose: str, b: int, *shape: int, device=None) -> Tensor:
    """U[0, 1) noise [b, *shape] for this local batch: rows ``offset .. offset + b`` of the noise of the whole
    global batch, so each sample's draw does not depend on how the batch is split over ranks."""
    total = max(ctx.global_batch, ctx.offset + b)
    noise = torch.rand((total, *shape), generator=step_generator(ctx, purpose))
    # non_blocking: a blocking copy to a GPU waits for everything queued before it (a cudaStreamSynchronize)
    return noise[ctx.offset:ctx.offset + b].to(device, non_blocking=True)


class PretrainObjective:
    """Base class of registered pre-training objectives (see the module docstring for the contract)."""

    name: ClassVar[str] = "base"
    #: True when per-sample data is tied to the evaluation preprocessing geometry (e.g. SAM2 masks cached on the
    #: patch grid of the centre crop): the engine then trains without random-resized-crop augmentation.
    needs_fixed_geometry: ClassVar[bool] = False

    # -- configuration -------------------------------------------------------------------------------
    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add this method's flags (called for every registered method; names must not clash)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PretrainObjective":
        return cls()

    def config(self) -> dict[str, Any]:
        """The settings that define this objective (written to the checkpoint's JSON)."""
        return {}

    def describe(self) -> str:
        """One line for the log."""
        cfg = self.config()
        return self.name + (" (" + ", ".join(f"{k}={v}" for k, v in cfg.items()) + ")" if cfg else "")

    # -- lifecycle -----------------------------------------------------------------------------------
    def setup(self, model: nn.Module, data_info: dict[str, Any]) -> None:
        """Checks before training (``data_info``: ``source`` (the data source), ``image_ids`` (a set or
        None for streams), ``grid`` (rows, cols)). Raise ValueError / FileNotFoundError with advice."""

    def compile(self, backend: str, mode: str) -> None:
        """``--compile``: compile the objective's own tensor work, if it has some worth it (the towers are compiled
        apart, ``towers.compile_towers``). Keep only picklable state: the objective goes to the data workers."""

    def prepare(self, captions: list[str], image_ids: list[str], tokenizer) -> dict[str, Tensor]:
        """Worker-side extras for one local batch (must be picklable; build heavy state lazily)."""
        return {}

    def features(self, model: nn.Module, batch: dict[str, Tensor], ctx: StepContext) -> Features:
        raise NotImplementedError

    def loss(self, features: Features, ctx: StepContext) -> dict[str, Tensor]:
        raise NotImplementedError

    # -- extra texts (hard negatives, :mod:`adapters.objectives.hard_negatives`) ---------------------------
    def text_side(self, model: nn.Module, text: Tensor) -> Features:
        """The text features of token ids ``text`` [T, L] under the names :meth:`features` gives them, each with
        T first. Default: the normalised global embedding, ``text_features``."""
        from adapters.objectives.towers import encode_text, normalize

        return {"text_features": normalize(encode_text(model, text, trim=True).pooled)}

    def image_text_logits(self, features: Features, texts: Features) -> Tensor:
        """Logits [b, T] of this local batch's images against ``texts`` (:meth:`text_side`'s layout, T first):
        the image->text scores the objective's own loss uses. Default: scaled cosine of global embeddings."""
        return features["logit_scale"] * features["image_features"] @ texts["text_features"].T


def split_features(features: Features) -> tuple[Features, Features]:
    """(per-sample features, shared 0-dim features) -- the first are cached and concatenated under gradient
    accumulation, the second (e.g. ``logit_scale``) always come from the micro-batch being differentiated."""
    per_sample = {k: v for k, v in features.items() if v.dim() > 0}
    shared = {k: v for k, v in features.items() if v.dim() == 0}
    return per_sample, shared
