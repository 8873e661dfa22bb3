"""FLIP (Li et al. 2023, "Scaling Language-Image Pre-training via Masking"): CLIP with a random subset of the
image patches dropped before the image transformer (50% by default), which roughly halves the image tower's
cost; the loss is CLIP's. At evaluation every patch is used (the paper's unmasked inference).

The drop is open_clip's ``PatchDropout`` rule (keep ``max(1, int(N (1 - ratio)))`` patches, chosen by the
smallest of U[0,1) noise, after the position embeddings are added), with the noise drawn per sample from the
step's seed (:func:`adapters.objectives.base.batch_random`) so a run is reproducible across resumes and ranks.
"""
from __future__ import annotations

import argparse
from typing import ClassVar

from torch import Tensor, nn

from adapters.objectives.base import StepContext, batch_random
from adapters.objectives.towers import encode_image, keep_count, random_keep
from adapters.objectives.clip import CLIPObjective
from adapters.registry import PRETRAIN


@PRETRAIN.register("flip")
class FLIPObjective(CLIPObjective):
    """CLIP on a random ``mask_ratio`` of the patches dropped (FLIP §3)."""

    chooses_patches: ClassVar[bool] = True

    def __init__(self, mask_ratio: float = 0.5):
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"--mask-ratio must lie in [0, 1), got {mask_ratio}")
        self.mask_ratio = mask_ratio

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("flip")
        g.add_argument("--mask-ratio", type=float, default=0.5,
                       help="flip: fraction of image patches dropped at random before the image transformer")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FLIPObjective":
        return cls(mask_ratio=args.mask_ratio)

    def config(self) -> dict:
        return {"mask_ratio": self.mask_ratio}

    def image_out(self, model: nn.Module, batch: dict[str, Tensor], ctx: StepContext):
        images = batch["image"]
        rows, cols = model.visual.grid_size
        n = rows * cols
        noise = batch_random(ctx, "flip-drop", len(images), n, device=images.device)
        return encode_image(model, images, keep=random_keep(noise, keep_count(n, self.mask_ratio)))
