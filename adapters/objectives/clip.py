"""CLIP (Radford et al. 2021): symmetric InfoNCE between the global image and text embeddings of a batch.

The forward is open_clip's own (every patch, class-token pooling); the loss is
:func:`adapters.losses.contrastive.clip_loss` on the features gathered over ranks (with ``local_loss`` and
``gather_with_grad`` -- the engine's defaults -- two ranks give exactly one process's loss and gradients).
The other objectives build on this one: they change the forward (FLIP, CLIP-PGS) or add a term (PowerCLIP).
"""
from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from adapters.losses.contrastive import clip_loss
from adapters.objectives.base import Features, PretrainObjective, StepContext
from adapters.objectives.towers import check_model, encode_image, encode_text, normalize
from adapters.registry import PRETRAIN


@PRETRAIN.register("clip")
class CLIPObjective(PretrainObjective):
    """Batch: ``image`` [b, 3, H, W], ``text`` [b, L]. Features: normalised ``image_features`` / ``text_features``
    [b, D] and ``logit_scale`` (the multiplier, exp of the learnt log-scale).

    CLIP needs only the global embedding, so it trains a ResNet image tower too, and so do the objectives that
    embed patches (FILIP, PowerCLIP: a ResNet's patches are its final feature map's positions); those that choose
    which patches enter the tower (``chooses_patches``: FLIP, CLIP-PGS) need a ViT."""

    chooses_patches: ClassVar[bool] = False

    def setup(self, model: nn.Module, data_info) -> None:
        check_model(model, chooses_patches=self.chooses_patches)

    def image_out(self, model: nn.Module, batch: dict[str, Tensor], ctx: StepContext):
        """The image forward; subclasses that change which patches are seen override this alone."""
        return encode_image(model, batch["image"])

    def features(self, model: nn.Module, batch: dict[str, Tensor], ctx: StepContext) -> Features:
        image = self.image_out(model, batch, ctx)
        text = encode_text(model, batch["text"])
        return {"image_features": normalize(image.pooled), "text_features": normalize(text.pooled),
                "logit_scale": model.logit_scale.exp()}

    def loss(self, features: Features, ctx: StepContext) -> dict[str, Tensor]:
        loss = clip_loss(features["image_features"], features["text_features"], features["logit_scale"],
                         rank=ctx.rank, world_size=ctx.world_size, local_loss=ctx.local_loss,
                         gather_with_grad=ctx.gather_with_grad)
        return {"loss": loss, "clip": loss.detach()}
