"""The boxes serving reads for an adapter trained on detected boxes (``--boxes yolo``): by default the detector its run
folder carries, for the indexed items and the image queries alike; ``--annotations`` given to ``python -m
serve.index`` replace it (said in the log, recorded in the manifest, and read again by ``Searcher.open`` for image
queries), as does ``annotations=`` given to ``Searcher.open`` (``python -m serve --annotations``); the toy world's
own boxes, which serving finds by itself, do not. Both box sources at once are refused in one line.

The run is fixtures.detector.detector_run's (a 40-scene toy world, ComAlign trained 1 epoch on a random detector's
boxes), shared with tests/train/test_adapter_detector.py; its 4 test images are indexed twice."""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

pytest.importorskip("faiss")
pytest.importorskip("pyarrow")
pytest.importorskip("ultralytics")

from extract.cache import FeatureCache  # noqa: E402
from extract.data.sources import ToyWorldSource  # noqa: E402
from serve.index import main  # noqa: E402
from serve.search import Searcher  # noqa: E402
from fixtures.detector import detector_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
QUERY = "a red circle to the left of a blue square"


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """(world, run, work folder, the index built with --annotations WORLD, the one built without, each build's
    log)."""
    world, run, _ = detector_run(tmp_path_factory)
    work = tmp_path_factory.mktemp("serve-index-boxes")
    argv = ["--model", str(run), "--data", str(world), "--kind", "flat", "--cache-dir", str(work / "cache"),
            "--workers", "0"]
    logs = {}
    for name, extra in (("given", ["--annotations", str(world)]), ("own", [])):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main([*argv, "--out", str(work / name), *extra]) == 0
        logs[name] = out.getvalue()
    return world, run, work, work / "given", work / "own", logs


def _manifest(index):
    return json.loads((index / "manifest.json").read_text())


def _cached_boxes(index) -> np.ndarray:
    cache = FeatureCache(_manifest(index)["cache"]["path"])
    return cache.gather("ventity_boxes", np.arange(cache.num_images))


@pytest.mark.slow
def test_annotations_given_to_serve_index_replace_the_trained_detector(indexed):
    world, run, work, given, own, logs = indexed
    g, o = _manifest(given)["model"], _manifest(own)["model"]
    assert g["annotations"] == str(world) and g["boxes"] == {"source": "gt", "trained": "yolo", "from": str(world)}
    assert o["annotations"] is None and o["boxes"] == {"source": "yolo", "trained": "yolo",
                                                       "from": str(run / "detector.pt")}
    said = "tiny + comalign: scoring with gt boxes from {}, as given (it was trained on yolo boxes)".format(world)
    assert said in logs["given"] and "scoring with" not in logs["own"]
    caches = [FeatureCache(_manifest(i)["cache"]["path"]) for i in (given, own)]
    assert [c.settings["boxes"]["source"] for c in caches] == ["gt", "yolo"]
    boxed, detected = _cached_boxes(given), _cached_boxes(own)
    assert boxed.shape != detected.shape or not np.array_equal(boxed, detected)
    # the cache holds the world's annotated boxes: every object of every test scene, in order
    records = ToyWorldSource(world, "test").records()
    scenes = {str(s["image_id"]): s for s in json.loads((world / "annotations.json").read_text())["scenes"]}
    for row, record in zip(boxed, records):
        objects = [o["box"] for o in scenes[str(record.image_id)]["objects"]]
        np.testing.assert_allclose(row[:len(objects)], objects, atol=1e-3)


@pytest.mark.slow
def test_the_searcher_reads_the_boxes_the_index_was_built_with_or_those_it_is_given(indexed):
    """Image queries are extracted with the boxes of the indexed items: the manifest's annotations (given at index
    time) or, by default, the detector; annotations given when opening replace the detector; the toy world's own
    boxes, found by serving itself, do not."""
    from PIL import Image

    world, run, work, given, own, logs = indexed
    searchers = {"given": Searcher.open(given), "own": Searcher.open(own),
                 "own + annotations": Searcher.open(own, annotations=str(world))}
    assert {k: s.scorer.boxes_used["source"] for k, s in searchers.items()} == {
        "given": "gt", "own": "yolo", "own + annotations": "gt"}
    records = ToyWorldSource(world, "test").records()
    images = [Image.open(r.source).convert("RGB") for r in records]
    for name, index in (("given", given), ("own", own)):  # the query side reads the indexed boxes
        live = searchers[name].scorer.extractor.image_arrays(images, [r.source for r in records])["ventity_boxes"]
        cached = _cached_boxes(index)
        np.testing.assert_array_equal(live, cached[:, :live.shape[1]])
    # and the re-ranked scores are those of the indexed boxes: the same query reads otherwise on the two indexes
    reranked = [{h.id: h.rerank_score for h in searchers[k].search_text(QUERY, k=4, rerank=4)}
                for k in ("given", "own")]
    assert reranked[0].keys() == reranked[1].keys() and reranked[0] != reranked[1]


@pytest.mark.slow
def test_both_box_sources_at_once_are_refused_in_one_line(indexed, capsys):
    world, run, work, given, own, logs = indexed
    capsys.readouterr()
    assert main(["--model", str(run), "--data", str(world), "--out", str(work / "both"), "--cache-dir",
                 str(work / "cache"), "--workers", "0", "--annotations", str(world), "--detector",
                 str(run / "detector.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "two box sources" in err[0] and not (work / "both").exists()
