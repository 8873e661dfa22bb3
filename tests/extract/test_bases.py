"""extract/models/bases/: the toy-world bases plugvlm ships (``--base toy-clip``, ``--base toy-negclip``) load by alias,
verified, and see shapes: zero-shot "colour shape" on single-object scenes of a toy world they never saw."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from extract.worlds import toyworld
from extract.models.backbone import load_backbone, resolve_spec, trained_holdout

HOLDOUT = "yellow circle,purple square,orange triangle,white star"  # the bases' training world held these out


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    world = tmp_path_factory.mktemp("bases") / "world"
    toyworld.generate(world, 300, seed=7, holdout=HOLDOUT, workers=1)
    ones = [s for s in json.loads((world / "annotations.json").read_text())["scenes"] if len(s["objects"]) == 1]
    return world, ones


@pytest.mark.parametrize("base", ["toy-clip", "toy-negclip"])
def test_a_shipped_base_sees_colour_and_shape(base, scenes):
    world, ones = scenes
    spec = resolve_spec(base)
    assert spec.model == "plugvlm-tiny-rn" and spec.pretrained.endswith("model.safetensors")
    meta = json.loads(Path(spec.pretrained).with_suffix(".json").read_text())
    assert meta["dtype"] == "float16" and "python -m train.pretrain" in meta["command"]
    # what it never saw is recorded with it (the demo's world holds the same combinations out): the command's
    assert trained_holdout(base) == sorted(HOLDOUT.split(",")) and f'--holdout "{HOLDOUT}"' in meta["command"]
    bb = load_backbone(base)
    classes = [(c, s) for c in toyworld.COLOURS for s in toyworld.SHAPES]
    texts = bb.encode_texts([f"a {c} {s}" for c, s in classes]).embedding
    images = torch.stack([bb.preprocess(Image.open(world / s["file_name"]).convert("RGB")) for s in ones])
    truth = torch.tensor([classes.index((s["objects"][0]["colour"], s["objects"][0]["shape"])) for s in ones])
    top1 = (bb.encode_images(images).embedding @ texts.T).argmax(1)
    assert len(ones) >= 50 and (top1 == truth).float().mean() >= 0.9
    # random weights of the same architecture are near chance (1/48): the figure is the shipped weights'
    rand = load_backbone("tiny-rn")
    chance = (rand.encode_images(images).embedding @ rand.encode_texts([f"a {c} {s}" for c, s in classes]).embedding.T)
    assert (chance.argmax(1) == truth).float().mean() < 0.2
