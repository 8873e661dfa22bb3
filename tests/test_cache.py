"""Cache storage: atomic shards, fingerprinted folders, memory-mapped gathers equal to a plain reference."""
import json

import numpy as np
import pytest

from extract.cache import CacheDir, FeatureCache, fingerprint, settings_diff


def _shard(rng, n_img, caps_per_img, tok_len, d=4):
    cap_img = np.repeat(np.arange(n_img), caps_per_img).astype(np.int32)
    c = len(cap_img)
    return {
        "image_embed": rng.standard_normal((n_img, d)).astype(np.float16),
        "region_masks": rng.random((n_img, 3, 2, 2)) > 0.5,
        "text_embed": rng.standard_normal((c, d)).astype(np.float16),
        "token_embed": rng.standard_normal((c, tok_len, d)).astype(np.float16),
        "token_mask": np.ones((c, tok_len), bool),
        "caption_image": cap_img,
    }


def _build(root, settings, shards):
    cache = CacheDir(root, settings)
    cache.prepare()
    for k, arrays in enumerate(shards):
        n_img, n_cap = len(arrays["image_embed"]), len(arrays["text_embed"])
        cache.write_shard(k, arrays, {"images": n_img, "captions": n_cap,
                                      "image_ids": [f"{k}-{i}" for i in range(n_img)],
                                      "caption_ids": [f"{k}-c{j}" for j in range(n_cap)]})
    cache.write_manifest(len(shards), {})
    return cache


def test_gather_and_batch_match_concatenated_reference(tmp_path):
    rng = np.random.default_rng(0)
    shards = [_shard(rng, 5, 2, 3), _shard(rng, 3, 1, 6), _shard(rng, 4, 3, 2)]
    _build(tmp_path, {"a": 1}, shards)
    fc = FeatureCache.open(tmp_path)
    assert (fc.num_images, fc.num_captions) == (12, 25)
    # plain reference: concatenate everything with padding to the longest token length
    text = np.concatenate([s["text_embed"] for s in shards])
    tok = np.zeros((25, 6, 4), np.float16)
    row = 0
    for s in shards:
        tok[row:row + len(s["token_embed"]), : s["token_embed"].shape[1]] = s["token_embed"]
        row += len(s["token_embed"])
    img_off = np.cumsum([0] + [len(s["image_embed"]) for s in shards])
    cap_img = np.concatenate([s["caption_image"] + o for s, o in zip(shards, img_off)])
    images = np.concatenate([s["image_embed"] for s in shards])
    rows = rng.permutation(25)[:17]
    b = fc.batch(rows, ["text_embed", "token_embed", "image_embed", "region_masks"])
    np.testing.assert_array_equal(b["text_embed"], text[rows])
    np.testing.assert_array_equal(b["token_embed"], tok[rows])
    np.testing.assert_array_equal(b["image_embed"], images[cap_img[rows]])
    np.testing.assert_array_equal(fc.caption_image_index(), cap_img)
    assert fc.caption_ids()[5] == "0-c5" and fc.image_ids()[5] == "1-0"


def test_fingerprint_folders_and_open_selection(tmp_path):
    rng = np.random.default_rng(1)
    a = _build(tmp_path, {"backbone": "tiny", "m": 10}, [_shard(rng, 2, 1, 2)])
    b = _build(tmp_path, {"backbone": "tiny", "m": 12}, [_shard(rng, 2, 1, 2)])
    assert a.path != b.path and fingerprint({"m": 1, "x": 2}) == fingerprint({"x": 2, "m": 1})
    with pytest.raises(FileNotFoundError, match="several"):
        FeatureCache.open(tmp_path)
    assert FeatureCache.open(tmp_path, settings={"backbone": "tiny", "m": 12}).path == b.path
    assert FeatureCache.open(tmp_path, fingerprint=a.fingerprint).path == a.path
    with pytest.raises(FileNotFoundError, match="no finished"):
        FeatureCache.open(tmp_path, settings={"backbone": "ViT-B-32", "m": 10})
    with pytest.raises(ValueError, match="m: 10 -> 11"):
        FeatureCache.open(a.path, settings={"backbone": "tiny", "m": 11})
    assert settings_diff({"a": {"b": 1}}, {"a": {"b": 2}}) == ["a.b: 1 -> 2"]


def test_partial_shards_are_invisible_and_cleaned(tmp_path):
    rng = np.random.default_rng(2)
    cache = CacheDir(tmp_path, {"s": 1})
    cache.prepare()
    tmp = cache.path / "shard-00000.tmp-99999"  # what a kill -9 mid-write leaves behind
    tmp.mkdir()
    (tmp / "image_embed.npy").write_bytes(b"partial")
    assert not cache.shard_done(0)
    with pytest.raises(RuntimeError, match="missing"):
        cache.write_manifest(1, {})
    with pytest.raises(FileNotFoundError, match="resumes"):
        FeatureCache(cache.path)
    assert cache.clean_partial([0]) == 1 and not tmp.exists()
    arrays = _shard(rng, 2, 1, 2)
    cache.write_shard(0, arrays, {"images": 2, "captions": 2, "image_ids": ["a", "b"], "caption_ids": ["x", "y"]})
    assert cache.shard_done(0)
    meta = json.loads((cache.path / "shard-00000" / "meta.json").read_text())
    assert meta["arrays"]["token_embed"] == {"shape": [2, 2, 4], "dtype": "float16"}
    np.save(cache.path / "shard-00000" / "probe.npy", np.zeros(1))  # files stay memory-mapped, not loaded
    cache.write_manifest(1, {})
    fc = FeatureCache(cache.path)
    assert isinstance(fc._array(0, "text_embed"), np.memmap)
