"""Held-out evaluation from cached features equals train.eval's live evaluation of the saved checkpoint, and the
cached frozen base follows the retrieval protocol (checked against a brute-force ranking)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adapters.checkpoint import load_adapter, read_meta
from extract.cache import FeatureCache
from train.eval.report import headline
from train.adapter.heldout import CachedBase, HeldOut, evaluate_heldout, heldout_split

from fixtures.toy import toy_root, trained_comalign
from fixtures.references import brute_force


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = toy_root(tmp_path_factory)
    return root, trained_comalign(root)


def test_cached_evaluation_equals_the_live_final_table(run):
    """The run's final table (train.eval.evaluate: checkpoint rebuilt from the file, components extracted live from the
    test images and texts) equals the cached evaluation of the same head on a cache of the test split."""
    from adapters.adapter_scorer import LiveExtractor
    from extract.models.backbone import load_backbone
    from extract.pipeline import build_cache
    from train.adapter.heldout import attach_toyworld_negatives

    root, out = run
    head, meta = load_adapter(out / "adapter.safetensors")
    test_cache = build_cache(root / "world", root / "cache", base="tiny", split="test", workers=0, batch_size=64,
                             components=["entities", "relations"])
    held = heldout_split(test_cache, name="test")
    extractor = LiveExtractor(load_backbone("tiny"), meta["extraction"]["args"], box_source="gt",
                              annotations=root / "world")
    assert attach_toyworld_negatives(held, root / "world", "test", extractor) > 0
    cached = headline(evaluate_heldout(head, held, "cpu"))
    table = json.loads((out / "eval" / "results.json").read_text())["results"]["tiny + comalign"]
    # the final table also reads the controlled test, which the held-out evaluation has no cache of
    live = {k: v for k, v in headline(table).items() if not k.startswith("toyworld-controlled ")}
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


class _ArrayCache:
    """The two calls evaluate_heldout makes of a FeatureCache, over arrays in memory."""

    def __init__(self, image_embed, text_embed, caption_image):
        self.arrays = {"image_embed": image_embed, "text_embed": text_embed}
        self._caption_image = np.asarray(caption_image)

    def gather(self, key, rows):
        return self.arrays[key][rows]

    def caption_image_index(self):
        return self._caption_image


def _held(n_images, image_embed=None, name="val"):
    g = np.random.default_rng(0)
    img = g.standard_normal((n_images, 8)).astype(np.float32) if image_embed is None else image_embed
    cap = np.repeat(np.arange(n_images), 2)
    txt = img[cap] + 0.1 * g.standard_normal((len(cap), 8)).astype(np.float32)
    return HeldOut(_ArrayCache(img, txt, cap), np.arange(n_images), np.arange(len(cap)), name)


def test_a_one_image_split_warns_once_per_run_not_every_epoch(capsys):
    held = _held(1)
    first = evaluate_heldout(CachedBase(), held, "cpu")["retrieval"]
    assert first["text_to_image"]["R@1"] == 100.0 and "only 1 image" in first["warning"]
    for _ in range(3):  # the following epochs
        evaluate_heldout(CachedBase(), held, "cpu")
    printed = [line for line in capsys.readouterr().out.splitlines() if "only 1 image" in line]
    assert len(printed) == 1 and printed[0].startswith("warning: retrieval:") and "held-out val" in printed[0]
    # --unfreeze re-encodes the split every epoch, a comparison evaluates it in every run: still one line
    evaluate_heldout(CachedBase(), _held(1), "cpu")
    assert "only 1 image" not in capsys.readouterr().out
    evaluate_heldout(CachedBase(), _held(1, name="test"), "cpu")  # another split warns
    assert "only 1 image" in capsys.readouterr().out


def test_a_normal_split_does_not_warn_and_nan_features_rank_last(capsys):
    held = _held(120)
    got = evaluate_heldout(CachedBase(), held, "cpu")["retrieval"]
    assert "warning" not in got and got["nonfinite_scores"] == 0
    assert capsys.readouterr().out == ""
    nan = _held(120, np.full((120, 8), np.nan, dtype=np.float32))
    got = evaluate_heldout(CachedBase(), nan, "cpu")["retrieval"]
    assert got["text_to_image"]["R@1"] == 0.0 and got["image_to_text"]["R@1"] == 0.0
    assert got["nonfinite_scores"] == 120 * 240
    assert "warning: frozen base gave 28800 non-finite retrieval scores" in capsys.readouterr().out
