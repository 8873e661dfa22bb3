"""Held-out evaluation from cached features equals train.evaluate's live evaluation of the saved checkpoint, and the
cached frozen base follows the retrieval protocol (checked against a brute-force ranking)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adapters.checkpoint import load_adapter, read_meta
from extract.cache import FeatureCache
from train import evaluate as ev
from train.adapter_eval import CachedBase, evaluate_heldout, heldout_split

from test_adapter import toy_root, trained_comalign
from test_retrieval import brute_force


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = toy_root(tmp_path_factory)
    return root, trained_comalign(root)


def test_cached_evaluation_equals_the_live_final_table(run):
    """The run's final table (train.evaluate: checkpoint rebuilt from the file, components extracted live from the
    test images and texts) equals the cached evaluation of the same head on a cache of the test split."""
    from adapters.adapter_scorer import LiveExtractor
    from extract.backbone import load_backbone
    from extract.pipeline import build_cache
    from train.adapter_eval import attach_toyworld_negatives

    root, out = run
    head, meta = load_adapter(out / "adapter.safetensors")
    test_cache = build_cache(root / "world", root / "cache", base="tiny", split="test", workers=0, batch_size=64,
                             components=["entities", "relations"])
    held = heldout_split(test_cache, name="test")
    extractor = LiveExtractor(load_backbone("tiny"), meta["extraction"]["args"], box_source="gt",
                              annotations=root / "world")
    assert attach_toyworld_negatives(held, root / "world", "test", extractor) > 0
    cached = ev.headline(evaluate_heldout(head, held, "cpu"))
    table = json.loads((out / "eval" / "results.json").read_text())["results"]["tiny + comalign"]
    live = ev.headline(table)
    assert set(live) == set(cached)
    for k in cached:
        assert live[k] == pytest.approx(cached[k], abs=1e-9), k


def test_cached_base_follows_the_retrieval_protocol(run):
    _, out = run
    head, meta = load_adapter(out / "adapter.safetensors")
    cache_dir = FeatureCache.open(meta["extraction"]["path"]).path.parent
    val = [FeatureCache(p.parent) for p in cache_dir.glob("*/manifest.json")
           if json.loads((p.parent / "settings.json").read_text())["settings"]["data"]["name"].endswith(":val")]
    held = heldout_split(val[0])
    got = evaluate_heldout(CachedBase(), held, "cpu")["retrieval"]
    img = torch.from_numpy(held.cache.gather("image_embed", held.image_rows)).float()
    txt = torch.from_numpy(held.cache.gather("text_embed", held.caption_rows)).float()
    img, txt = torch.nn.functional.normalize(img, dim=-1), torch.nn.functional.normalize(txt, dim=-1)
    t2i, i2t = brute_force((img @ txt.T).numpy(), held.caption_image.numpy())
    for k in (1, 5, 10):
        assert got["text_to_image"][f"R@{k}"] == pytest.approx(100 * (t2i <= k).mean())
        assert got["image_to_text"][f"R@{k}"] == pytest.approx(100 * (i2t[i2t > 0] <= k).mean())


def test_a_held_out_subset_keeps_every_caption_of_its_images(run):
    _, out = run
    cache = FeatureCache.open(read_meta(out / "adapter.safetensors")["extraction"]["path"])
    held = heldout_split(cache, np.array([5, 1, 3]))
    assert held.image_rows.tolist() == [1, 3, 5]
    owners = cache.caption_image_index()[held.caption_rows]
    assert set(owners.tolist()) == {1, 3, 5}
    assert (cache.caption_image_index() == 3).sum() == (owners == 3).sum()
    assert held.caption_image.tolist() == [{1: 0, 3: 1, 5: 2}[int(o)] for o in owners]
