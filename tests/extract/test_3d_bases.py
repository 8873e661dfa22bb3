"""extract/models/bases/: the 3D world's bases (``--base toy-clip-3d``, ``toy-negclip-3d``, ``toy-clip-3d-mixed``) load
by alias, verified, and see the 3D world's objects: zero-shot "colour shape" on the crops of 3D scenes they never saw
(path-traced here: 48 scenes, every object cropped), partly hidden and metal ones included, where the hard base they
were fine-tuned from reads them near chance. The first two read their held-out combinations far worse, the mixed one
much less so (extract/models/bases/README.md): held to what they do, so a regression shows, and printed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("mitsuba", reason="the 3D world renders with Mitsuba 3 (the render3d extra)")

from extract.worlds import hardworld, world3d, world3d_layout  # noqa: E402
from extract.models.backbone import resolve_spec, trained_holdout  # noqa: E402

HOLDOUT = "yellow cylinder,purple cube,cyan sphere,brown cube"  # the bases' training world held these out
CLASSES = [(c, s) for c in world3d.COLOURS for s in world3d.SHAPES]


@pytest.fixture(scope="module")
def crops(tmp_path_factory):
    """Every object of 48 scenes of a seed no base saw, each scene in the val / test splits (so all its objects
    are cropped), at the bases' 96 px and 32 samples a pixel."""
    out = tmp_path_factory.mktemp("3d-bases")
    (out / "images").mkdir()
    (out / "objects").mkdir()
    settings = world3d_layout.Settings3D(48, seed=9, splits=(0.0, 0.5, 0.5))
    scenes = [world3d_layout.build_scene(i, settings, str(out))[0] for i in range(settings.n)]
    return out, [{**o, "scene": i} for i, s in enumerate(scenes) for o in s["objects"]]


@pytest.mark.parametrize("base, negatives", [("toy-clip-3d", False), ("toy-negclip-3d", True),
                                             ("toy-clip-3d-mixed", False)])
@pytest.mark.slow
def test_the_3d_base_sees_the_3d_worlds_objects_hidden_and_metal_ones_too(crops, crop_top1, base, negatives):
    world, objects = crops
    spec = resolve_spec(base)
    assert spec.model == "plugvlm-tiny-rn" and spec.crop_scale == hardworld.CROP_SCALE
    meta = json.loads(Path(spec.pretrained).with_suffix(".json").read_text())
    assert meta["dtype"] == "float16" and "--world 3d" in meta["command"] and "--split pretrain" in meta["command"]
    assert ("--hard-negatives all" in meta["command"]) == negatives
    assert trained_holdout(base) == sorted(HOLDOUT.split(","))
    right = crop_top1(base, world, objects, CLASSES)
    hidden = torch.tensor([o["visible"] < 0.999 for o in objects])
    metal = torch.tensor([o["material"] == "metal" for o in objects])
    held = torch.tensor([f"{o['colour']} {o['shape']}" in HOLDOUT.split(",") for o in objects])
    assert len(objects) >= 150 and hidden.sum() >= 30 and metal.sum() >= 60 and held.sum() >= 10
    print(f"{base}: {right.float().mean():.3f} of {len(objects)} crops; seen {right[~held].float().mean():.3f}, held "
          f"out {right[held].float().mean():.3f}, hidden {right[hidden].float().mean():.3f}, metal "
          f"{right[metal].float().mean():.3f}")
    # measured (toy-clip-3d; toy-negclip-3d; toy-clip-3d-mixed): overall 0.868; 0.879; 0.948, seen combinations
    # 0.973; 0.966; 0.973, partly hidden 0.848; 0.826; 0.978, metal 0.915; 0.915; 0.976 (held out 0.240; 0.360;
    # 0.800: the mixed base, fine-tuned in 24 colours, names the held-out combinations too)
    if base == "toy-clip-3d-mixed":
        assert right.float().mean() >= 0.9 and right[held].float().mean() >= 0.6, right[held].float().mean()
    assert right.float().mean() >= 0.8, right.float().mean()
    assert right[~held].float().mean() >= 0.9, right[~held].float().mean()
    assert right[hidden].float().mean() >= 0.75, right[hidden].float().mean()
    assert right[metal].float().mean() >= 0.8, right[metal].float().mean()


@pytest.mark.slow
def test_the_mixed_base_finds_a_phrase_written_as_its_captions_write_it(crops):
    """The parse gives "brown cube"; the base's captions write "a brown cube". Bare, a phrase finds its objects'
    crops among all others far less often (R-precision: of the k crops nearest the phrase, k the crops of its colour
    and shape, the share that are; a held-out colour drifts to a seen one's), so toy-clip-3d-mixed embeds noun
    phrases as "a {}" (backbones.json phrase_prompt, extraction's --phrase-prompt default): how the grounded head
    finds a held-out cube in a stack (train/adapter/README, the 3D world)."""
    from PIL import Image

    from extract.models.backbone import load_backbone

    world, objects = crops
    assert resolve_spec("toy-clip-3d-mixed").phrase_prompt == "a {}" and resolve_spec("toy-clip-3d").phrase_prompt == "{}"
    bb = load_backbone("toy-clip-3d-mixed")
    names = [f"{o['colour']} {o['shape']}" for o in objects]
    found = {}
    with torch.no_grad():
        images = bb.encode_images(torch.stack([bb.preprocess(Image.open(world / o["crop"]).convert("RGB"))
                                               for o in objects])).embedding
        for prompt in ("{}", "a {}"):
            for group, which in ((HOLDOUT.split(","), "held out"), (sorted(set(names) - set(HOLDOUT.split(","))),
                                                                    "seen")):
                share = []
                for name in (n for n in group if n in names):
                    text = bb.encode_texts([prompt.replace("{}", name)]).embedding[0]
                    nearest = (images @ text).topk(names.count(name)).indices.tolist()
                    share.append(sum(names[j] == name for j in nearest) / names.count(name))
                found[prompt, which] = sum(share) / len(share)
    print("toy-clip-3d-mixed, R-precision of its objects' crops:", {k: round(v, 3) for k, v in found.items()})
    # measured: held out 0.656 as parsed, 0.875 as written; seen 0.758, 0.935 (toy-clip-3d: 0.700, 0.887; 0.905, 0.935)
    for which in ("held out", "seen"):
        assert found["a {}", which] >= found["{}", which] + 0.1, found


@pytest.mark.slow
def test_the_hard_bases_see_it_far_less(crops, crop_top1):
    world, objects = crops
    assert crop_top1("toy-clip-hard", world, objects, CLASSES).float().mean() < 0.3  # measured 0.161
