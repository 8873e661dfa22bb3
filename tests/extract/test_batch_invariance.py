"""Batch invariance of the feature cache, by construction (extract/README, "Batch invariance").

A cached phrase embedding must be a function of its phrase alone: the same bits whether it was embedded on its own
or among a long caption's phrases, in the shard an uninterrupted run built or in the same shard rebuilt by a rerun
(which meets every phrase of the shard as new). Equal kernels on one CPU can hide a dependence on the batch, so the
tests give the backbone a text tower whose rounding follows its batch's shape, as real kernels may choose their
summation order by shape (seen: one fp16 step in 3 of 21,120 predicate values on an AMD EPYC): code that embeds a
phrase in a shape that depends on its batch mates fails here on any CPU. The same checks also run on the real kernels.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from extract.cache import FeatureCache
from extract.worlds import toyworld
from extract.data.sources import ToyWorldSource
from extract.models.backbone import load_backbone
from extract.options import ExtractOptions
from extract.pipeline import ExtractionComponents, ShardBuilder, run

PHRASE_KEYS = ("entity_embed", "relation_embed", "role_subject_embed", "role_predicate_embed", "role_object_embed")
LONG = ("a small red circle to the left of a large blue square above a green triangle below a yellow star "
        "to the right of a purple diamond")


def shape_dependent(backbone):
    """``backbone`` whose text tower adds a term that depends on the batch's shape (rows x the columns it runs),
    a stand-in for kernels whose summation order follows the shape. A text encoded alone gets its own shape's
    term, so its value is still a function of the text."""
    real = backbone.encode_token_ids

    def encode_token_ids(ids, attention_mask):
        embedding, tokens = real(ids, attention_mask)
        rows, columns = ids.shape[0], int(attention_mask.sum(1).max()) if len(ids) else 0
        return embedding + 1e-3 * (rows + columns / 100), tokens

    backbone.encode_token_ids = encode_token_ids
    return backbone


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world")
    toyworld.generate(out, n=24, seed=3, workers=1)
    return out


def _builder(world: Path, backbone) -> ShardBuilder:
    """A fresh builder (an empty phrase table: a new process, rank or rerun) for the phrase components."""
    args = ExtractOptions(data=str(world), out="unused", components=["entities", "relations", "roles"], workers=0)
    return ShardBuilder(backbone, ExtractionComponents(args, ToyWorldSource(world), torch.device("cpu")), args)


@pytest.mark.parametrize("kernels", ["shape-dependent", "real"])
def test_a_phrase_alone_equals_the_phrase_among_a_long_captions_phrases(world, kernels):
    backbone = load_backbone("tiny", None)
    if kernels == "shape-dependent":
        shape_dependent(backbone)
    caption = "a red circle to the left of a blue square"
    alone, _ = _builder(world, backbone).caption_batch([caption])
    among, _ = _builder(world, backbone).caption_batch([LONG, caption, LONG.replace("red", "white")])
    for key in PHRASE_KEYS:
        valid = alone["role_valid" if key.startswith("role_") else key.replace("_embed", "_valid")][0]
        assert valid.any(), key  # the caption has entities and a relation: something to compare
        np.testing.assert_array_equal(among[key][1][valid], alone[key][0][valid], err_msg=key)
    # and each phrase is its own text tower output, alone
    np.testing.assert_array_equal(alone["entity_embed"][0, 0],
                                  backbone.encode_each(["red circle"])[0].half().numpy())


def _shards(path: Path) -> dict[str, np.ndarray]:
    return {str(f.relative_to(path)): np.load(f, allow_pickle=False) for f in sorted(path.glob("shard-*/*.npy"))}


def test_a_rebuilt_shard_equals_the_uninterrupted_one_with_shape_dependent_kernels(world, tmp_path):
    """The rerun meets every phrase of shard 1 as new, the uninterrupted run only those shard 0 did not have: with
    phrases embedded in their batch's shape, shard 1 would differ."""
    def build(out: Path):
        args = ExtractOptions(data=str(world), out=str(out), components=["entities", "relations", "roles"],
                              workers=0, batch_size=8, shard_size=8)
        return run(args, backbone=shape_dependent(load_backbone("tiny", None)))

    build(tmp_path / "a")
    reference = FeatureCache.open(tmp_path / "a").path
    copy = tmp_path / "b" / reference.name
    shutil.copytree(reference, copy)
    shutil.rmtree(copy / "shard-00001")
    build(tmp_path / "b")
    got, want = _shards(copy), _shards(reference)
    assert sorted(got) == sorted(want) and any(k.startswith("shard-00001/role_") for k in got)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# --------------------------------------------------------------------------------------------- live extraction
def image_shape_dependent(backbone):
    """``backbone`` whose image tower also adds a term that depends on its batch's size (the crops' forward too)."""
    real = backbone.encode_images

    def encode_images(images):
        feats = real(images)
        feats.embedding = feats.embedding + 1e-3 * images.shape[0]
        return feats

    backbone.encode_images = encode_images
    return backbone


def _live(world, backbone, components=("entities", "relations")):
    """A live extractor as an adapter scorer builds one (a weights digest: the process's memory is used), for the
    components a ComAlign head reads on ground-truth boxes (a grounded head's: ``roles``)."""
    from adapters.adapter_scorer import LiveExtractor

    args = {"components": list(components), "boxes": "gt", "data": str(world)}
    return LiveExtractor(backbone, args, box_source="gt", annotations=world, weights_sha256=backbone.test_digest)


@pytest.mark.parametrize("kernels", ["shape-dependent", "real"])
def test_a_served_item_is_its_own_whatever_it_came_with_and_whatever_the_process_did_before(world, kernels,
                                                                                           monkeypatch):
    """What live extraction serves (a query's arrays, a scored image's) is the item's own: asked among others or
    alone, remembered from an earlier request of this process or computed fresh, the same bits (issue 81: a caption
    the final evaluation had extracted among its batch mates was served from the memory with their rounding)."""
    from PIL import Image

    import adapters.adapter_scorer as scorer_module
    from adapters.live_memo import ArrayMemo

    backbone = load_backbone("tiny", None)
    backbone.test_digest = kernels.ljust(64, "0")  # what the process's memory tells the two backbones apart by
    if kernels == "shape-dependent":
        image_shape_dependent(shape_dependent(backbone))
    tables = {}
    monkeypatch.setattr(scorer_module, "phrase_table", lambda scope: tables.setdefault(scope, {}))
    caption = "a red circle to the left of a blue square"
    files = sorted((world / "images").glob("*.png"))[:3]
    images = [Image.open(f).convert("RGB") for f in files]

    monkeypatch.setattr(scorer_module, "MEMO", ArrayMemo())  # this process has computed nothing yet
    alone_t = _live(world, backbone).text_arrays([caption])
    alone_i = _live(world, backbone).image_arrays(images[1:2], files[1:2])
    monkeypatch.setattr(scorer_module, "MEMO", ArrayMemo())
    live = _live(world, backbone)
    among_t = live.text_arrays([LONG, caption, LONG.replace("red", "white")])
    among_i = live.image_arrays(images, files)
    batch = [LONG, caption]  # a run's bulk inputs are computed as one batch and remembered as that batch only
    bulk, again = live.batch_text_arrays(batch), _live(world, backbone).batch_text_arrays(batch)
    for key, want in live.builder.caption_batch(batch)[0].items():
        np.testing.assert_array_equal(bulk[key], want, err_msg=key)
        np.testing.assert_array_equal(again[key], want, err_msg=key)
    # an evaluation's images likewise (AdapterScorer.encode_pil_bulk): the cache's batch, remembered as that batch
    pixels = torch.stack([backbone.preprocess(im) for im in images])
    want_i = live.builder.image_batch(pixels, [np.asarray(im) for im in images], [live.image_id(f) for f in files])
    bulk_i, again_i = live.batch_image_arrays(images, files), _live(world, backbone).batch_image_arrays(images, files)
    for key, want in want_i.items():
        np.testing.assert_array_equal(bulk_i[key], want, err_msg=key)
        np.testing.assert_array_equal(again_i[key], want, err_msg=key)
    if kernels == "shape-dependent":  # what the batch computed is not what an item alone gets: kept apart
        assert not np.array_equal(bulk_i["image_embed"][1], alone_i["image_embed"][0])
    later_t = _live(world, backbone).text_arrays([caption])  # from the memory of the calls above
    later_i = _live(world, backbone).image_arrays(images[1:2], files[1:2])
    assert scorer_module.MEMO.hits == 4  # the two batches, the caption and the image
    # another adapter's extractor on this backbone reads the towers' outputs and phrases the first one computed
    other_t = _live(world, backbone, ("entities", "roles")).text_arrays([caption])
    other_i = _live(world, backbone, ("entities", "roles")).image_arrays(images[1:2], files[1:2])
    assert scorer_module.MEMO.hits == 6
    for key in ("text_embed", "entity_embed"):
        np.testing.assert_array_equal(other_t[key], alone_t[key], err_msg=key)
    np.testing.assert_array_equal(other_i["image_embed"], alone_i["image_embed"])
    for got, row in ((among_t, 1), (later_t, 0)):
        for key, want in alone_t.items():
            np.testing.assert_array_equal(got[key][row, ..., :want.shape[-1]] if key.startswith("token_") else
                                          got[key][row], want[0], err_msg=key)
    for got, row in ((among_i, 1), (later_i, 0)):
        for key, want in alone_i.items():
            np.testing.assert_array_equal(got[key][row], want[0], err_msg=key)
