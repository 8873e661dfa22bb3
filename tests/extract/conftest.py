"""Fixtures shared by tests/extract/."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def crop_top1():
    """``top1(base, world, objects, classes)``: whether each object's crop (its ``crop`` file under ``world``) is
    classified right among the "a colour shape" prompts of ``classes`` [(colour, shape)], by the base's cosine."""
    import torch
    from PIL import Image

    from extract.models.backbone import load_backbone

    def top1(base: str, world: Path, objects: list[dict], classes: list[tuple[str, str]]) -> torch.Tensor:
        bb = load_backbone(base)
        texts = bb.encode_texts([f"a {c} {s}" for c, s in classes]).embedding
        images = torch.stack([bb.preprocess(Image.open(world / o["crop"]).convert("RGB")) for o in objects])
        truth = torch.tensor([classes.index((o["colour"], o["shape"])) for o in objects])
        with torch.no_grad():
            return (bb.encode_images(images).embedding @ texts.T).argmax(1) == truth

    return top1
