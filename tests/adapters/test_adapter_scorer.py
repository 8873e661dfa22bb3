"""The adapter scorer: live extraction reproduces the cached arrays, the checkpoint alone rebuilds the model, and
what it cannot know (boxes, the base weights) is asked for clearly."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from adapters.adapter_scorer import AdapterScorer, LiveExtractor
from adapters.checkpoint import CheckpointError, read, read_meta, write
from adapters.scoring import BackboneScorer
from adapters.load import is_adapter_path, load_scorer
from extract.models.backbone import load_backbone
from extract.cache import FeatureCache
from extract.data.boxes import MissingBoxes, read_boxes

from fixtures.toy import toy_root, trained_comalign


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = toy_root(tmp_path_factory)
    return root, trained_comalign(root)


def test_live_extraction_reproduces_the_cached_arrays(run):
    root, out = run
    meta = read_meta(out / "adapter.safetensors")
    cache = FeatureCache.open(meta["extraction"]["path"])
    extractor = LiveExtractor(load_backbone("tiny"), meta["extraction"]["args"], box_source="gt",
                              annotations=root / "world")
    rows = np.arange(5)
    files = [str(root / "world" / "images" / f"{int(cache.image_ids()[r]):06d}.png") for r in rows]
    images = [Image.open(f).convert("RGB") for f in files]
    caption_rows = np.arange(7)
    text_of = {str(c["id"]): c["text"] for sc in json.loads((root / "world" / "annotations.json").read_text())["scenes"]
               for c in sc["captions"]}
    picked = [text_of[cid] for cid in cache.caption_ids()[:7]]
    # each item alone (what is served) and an evaluation's batch computed together (the bulk path): both the cache's
    for live, live_t in ((extractor.image_arrays(images, files), extractor.text_arrays(picked)),
                         (extractor.batch_image_arrays(images, files), extractor.batch_text_arrays(picked))):
        for key in ("ventity_valid", "vrelation_valid", "ventity_boxes", "vrelation_pairs"):
            np.testing.assert_array_equal(live[key], cache.gather(key, rows), err_msg=key)
        for key in ("image_embed", "ventity_embed", "vrelation_embed"):  # fp16, computed in other batches
            np.testing.assert_allclose(live[key].astype(np.float32), cache.gather(key, rows).astype(np.float32),
                                       atol=2e-3, err_msg=key)
        for key in ("entity_valid", "relation_valid"):
            np.testing.assert_array_equal(live_t[key], cache.gather(key, caption_rows), err_msg=key)
        np.testing.assert_allclose(live_t["entity_embed"].astype(np.float32),
                                   cache.gather("entity_embed", caption_rows).astype(np.float32), atol=2e-3)


def test_live_extraction_writes_the_phrases_as_the_cache_did(run):
    """The noun-phrase prompt comes from the cache's arguments: 'a {}' embeds 'a red circle' where the parse gives
    'red circle'; the arguments of a cache from before the option (no key) embed the phrases as parsed, as it did."""
    from extract.components.text import TextComponentExtractor

    root, out = run
    meta = read_meta(out / "adapter.safetensors")
    cache = FeatureCache.open(meta["extraction"]["path"])
    args = {k: v for k, v in meta["extraction"]["args"].items() if k != "phrase_prompt"}
    bb = load_backbone("tiny")
    text_of = {str(c["id"]): c["text"] for sc in json.loads((root / "world" / "annotations.json").read_text())["scenes"]
               for c in sc["captions"]}
    picked = [text_of[cid] for cid in cache.caption_ids()[:3]]
    old = LiveExtractor(bb, args, box_source="gt", annotations=root / "world").text_arrays(picked)
    np.testing.assert_allclose(old["entity_embed"].astype(np.float32),
                               cache.gather("entity_embed", np.arange(3)).astype(np.float32), atol=2e-3)
    written = LiveExtractor(bb, {**args, "phrase_prompt": "a {}"}, box_source="gt",
                            annotations=root / "world").text_arrays(picked)
    first = TextComponentExtractor().extract(picked[:1], bb.tokenize(picked[:1]))[0].entities[0].text
    np.testing.assert_allclose(written["entity_embed"][0, 0].astype(np.float32),
                               bb.encode_each([f"a {first}"])[0].numpy(), atol=2e-3)
    assert not np.allclose(written["entity_embed"][0, 0], old["entity_embed"][0, 0], atol=2e-3)


def test_load_scorer_rebuilds_adapters_and_still_loads_backbones(run):
    root, out = run
    assert is_adapter_path(str(out)) and is_adapter_path(str(out / "adapter.safetensors"))
    scorer = load_scorer(str(out), annotations=root / "world")
    assert isinstance(scorer, AdapterScorer) and scorer.directional and scorer.name == "tiny + comalign"
    assert isinstance(load_scorer("tiny"), BackboneScorer)
    with pytest.raises(ValueError, match="crop or detect on the original image"):
        scorer.encode_images(torch.zeros(1, 3, 64, 64))
    from train.eval.evaluate import run_linear_probe

    assert "no single global image embedding" in run_linear_probe(scorer, None, None, 8, 0)["skipped"]


def test_ground_truth_boxes_are_asked_for(run):
    root, out = run
    with pytest.raises(ValueError, match="ground-truth boxes.*annotations"):
        AdapterScorer.from_checkpoint(out / "adapter.safetensors")
    boxes = read_boxes(root / "world")
    scene = json.loads((root / "world" / "annotations.json").read_text())["scenes"][3]
    assert boxes.entry(scene["image_id"]) is boxes.entry("000003.png")
    scorer = AdapterScorer.from_checkpoint(out / "adapter.safetensors", annotations=boxes)
    assert scorer.extractor.image_id(str(root / "world" / "images" / "000003.png")) == "3"
    with pytest.raises(ValueError, match="test_coco.json is a COCO captions file"):  # what users pass by mistake
        AdapterScorer.from_checkpoint(out / "adapter.safetensors", annotations=root / "world" / "test_coco.json")


def test_integer_ids_and_an_image_without_boxes(run):
    """COCO's ids are ints: encode_pil takes them as their str(); an image the annotations do not name is an error
    naming the file and the image, not a score without its entity and relation terms."""
    root, out = run
    scenes = json.loads((root / "world" / "annotations.json").read_text())["scenes"][:2]
    scorer = load_scorer(str(out), annotations={s["image_id"]: s for s in scenes})  # int keys
    images = [Image.open(root / "world" / s["file_name"]).convert("RGB") for s in scenes]
    texts = scorer.encode_texts([c["text"] for c in scenes[0]["captions"][:2]])
    by_int = scorer.score(scorer.encode_pil(images, ids=[s["image_id"] for s in scenes]), texts)
    by_str = scorer.score(scorer.encode_pil(images, ids=[str(s["image_id"]) for s in scenes]), texts)
    torch.testing.assert_close(by_int, by_str)
    with pytest.raises(MissingBoxes, match=r"the boxes given as a dict .* holds no boxes for image '1804'"):
        scorer.encode_pil(images[:1], ids=[1804])
    blind = scorer.encode_pil(images[:1], ids=[1804], missing_boxes="empty")  # a caller that says so itself
    assert not blind["entity_valid"].any()


def test_other_base_weights_are_refused_and_foreign_files_explained(run, tmp_path):
    root, out = run
    tensors, meta = read(out / "adapter.safetensors")
    meta["base"]["weights_sha256"] = "0" * 64
    forged = write(tmp_path / "forged.safetensors", tensors, meta)
    with pytest.raises(CheckpointError, match="SHA-256 0000000000000000.*--pretrained"):
        AdapterScorer.from_checkpoint(forged, annotations=root / "world")
    plain = tmp_path / "open_clip_model.safetensors"
    save_file({"w": torch.zeros(1)}, str(plain))
    with pytest.raises(CheckpointError, match="--pretrained, not --model"):
        load_scorer(str(plain))
