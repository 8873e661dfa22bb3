"""Adapter training data: the batch order (no image twice in a batch, every caption at most once, a pure function
of seed and epoch), held-out image splits, and the checks on a given cache."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from extract.models.backbone import load_backbone
from adapters.registry import ADAPTERS
from adapters.checkpoint import read_meta
from train.adapter.engine import AdapterOptions, resolve
from train.adapter.data import (caption_rows_of, check_cache, epoch_batches, extraction_options, final_table_data,
                                obtain_cache, split_images)

from fixtures.toy import toy_root, trained_comalign


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(1, 6), min_size=1, max_size=60), batch=st.integers(1, 12), seed=st.integers(0, 5),
       epoch=st.integers(0, 3))
def test_batches_never_repeat_an_image_or_a_caption(counts, batch, seed, epoch):
    caption_image = np.repeat(np.arange(len(counts)), counts)
    rows = np.arange(len(caption_image))
    batches = epoch_batches(rows, caption_image, batch, seed, epoch)
    assert all(len(b) == batch for b in batches)
    assert all(len(set(caption_image[b].tolist())) == batch for b in batches)
    used = np.concatenate(batches) if batches else np.zeros(0, int)
    assert len(set(used.tolist())) == len(used) and set(used.tolist()) <= set(rows.tolist())
    assert len(batches) <= len(rows) // batch
    again = epoch_batches(rows, caption_image, batch, seed, epoch)
    assert len(again) == len(batches) and all((a == b).all() for a, b in zip(again, batches))


def test_batches_use_every_caption_when_images_allow_and_change_per_epoch():
    rng = np.random.default_rng(0)
    caption_image = np.repeat(np.arange(200), rng.integers(1, 6, 200))
    rows = np.arange(len(caption_image))
    e0 = epoch_batches(rows, caption_image, 32, seed=0, epoch=0)
    e1 = epoch_batches(rows, caption_image, 32, seed=0, epoch=1)
    assert len(e0) == len(rows) // 32  # waiting captions fill later batches: nothing is lost but the remainder
    assert not all((a == b).all() for a, b in zip(e0, e1))
    assert len(epoch_batches(rows, caption_image, 32, 0, 0, max_batches=3)) == 3
    assert epoch_batches(np.arange(10), np.zeros(10, int), 2, 0, 0) == []  # one image: no batch of two


def test_held_out_images_take_all_their_captions():
    caption_image = np.repeat(np.arange(50), 3)
    train, val = split_images(50, 0.2, seed=1)
    assert len(val) == 10 and not set(train) & set(val) and len(train) + len(val) == 50
    assert (split_images(50, 0.2, seed=1)[1] == val).all() and not (split_images(50, 0.2, seed=2)[1] == val).all()
    rows = caption_rows_of(caption_image, val)
    assert len(rows) == 30 and set(caption_image[rows]) == set(val)
    with pytest.raises(ValueError, match="val-fraction"):
        split_images(10, 1.0, 0)


def test_caches_are_reused_by_fingerprint_and_checked_against_backbone_and_method(tmp_path_factory):
    root = toy_root(tmp_path_factory)
    out = trained_comalign(root)
    meta = read_meta(out / "adapter.safetensors")
    tiny = load_backbone("tiny")
    opts = resolve(AdapterOptions(method="comalign", data=str(root / "world"), cache_dir=str(root / "cache"),
                                  extract_batch_size=64))
    options = extraction_options(opts, root / "world", "train", device="cpu", workers=0)
    assert (options.components, options.split, options.out, options.batch_size) == (
        ["entities", "relations"], "train", str(root / "cache"), 64)
    cache = obtain_cache(options, tiny)  # the training run's cache: found, not rebuilt
    assert cache.fingerprint == meta["extraction"]["fingerprint"]
    check_cache(cache, ADAPTERS.get("comalign"), tiny, {})
    other = load_backbone("tiny", init_seed=1)  # same architecture, other weights
    with pytest.raises(ValueError, match="weights_sha256"):
        check_cache(cache, ADAPTERS.get("comalign"), other, {})
    with pytest.raises(ValueError, match="regions: cache has 'random', comalign needs 'gt'"):
        check_cache(cache, ADAPTERS.get("comalign"), tiny, {"regions": "gt"})


def test_extraction_and_table_options_carry_the_runs_own_settings(tmp_path):
    """What an adapter run hands to python -m extract's and train.eval's jobs: its pass-through extraction
    options, --image-root and the --csv-* options (so the cache and the table read the data as the run does)."""
    opts = resolve(AdapterOptions(method="comalign", data="pairs.csv", val_data="val.csv", image_root="imgs",
                                  csv_img_key="image", csv_separator=";", extract_options={"detector": "y.pt"},
                                  benchmark=["sugarcrepe=sc"]))
    ex = extraction_options(opts, "val.csv")
    assert (ex.data, ex.split, ex.detector, ex.image_root, ex.csv_img_key, ex.csv_separator, ex.csv_caption_key) == (
        "val.csv", None, "y.pt", "imgs", "image", ";", "title")
    assert final_table_data(opts) == {"retrieval_data": "val.csv", "benchmark": ["sugarcrepe=sc"], "image_root": "imgs",
                                      "csv_img_key": "image", "csv_separator": ";"}
    world = tmp_path / "world"
    world.mkdir()
    (world / "meta.json").write_text("{}")
    (world / "annotations.json").write_text("{}")
    assert final_table_data(resolve(AdapterOptions(method="comalign", data=str(world)))) == {
        "data": str(world), "split": "test"}
    assert final_table_data(resolve(AdapterOptions(method="comalign", data="pairs.csv"))) == {}
