"""python -m serve.index end to end on the tiny backbone and toy worlds: the toy world's test split searched exactly
(flat index = brute force over the model's own scores), an adapter's vectors from the cache equal to the live
model's, a plain folder of images (image index only), --add, on-disk IVF through the build, kill -9 at several
points of a build, two builds at once, and bad input (one line, exit 2, nothing built lost)."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("faiss")
pytest.importorskip("pyarrow")

from extract.cache import FeatureCache  # noqa: E402
from extract.data.sources import ToyWorldSource  # noqa: E402
from serve import layout  # noqa: E402
from serve.index import IndexOptions, build_index, main  # noqa: E402
from serve.layout import IndexBusyError, IndexDirError, ModelMismatchError  # noqa: E402
from fixtures.toy import toy_root, trained_comalign  # noqa: E402
from fixtures import warm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The session's 120-scene toy world (96 train / 12 val / 12 test images), shared with tests/train/test_adapter.py."""
    return toy_root(tmp_path_factory) / "world"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-index")


def options(world: Path, work: Path, out: str, **kw) -> IndexOptions:
    return IndexOptions(**{"model": "tiny", "data": str(world), "out": str(work / out),
                           "cache_dir": str(work / "cache"), "workers": 0, **kw})


@pytest.fixture(scope="module")
def tiny_index(world, work) -> Path:
    """tiny on the toy world's test split (the default split)."""
    build_index(options(world, work, "tiny"))
    return work / "tiny"


def reconstruct(index_dir: Path, side: str) -> np.ndarray:
    index = layout.open_index(index_dir, side, mmap=False)
    return index.reconstruct_n(0, index.ntotal)


def test_defaults_and_relative_paths(world, work, monkeypatch, capsys):
    """Relative --data / --cache-dir / --out (as the README types them) give an index that opens from any folder,
    with its cache found; no --out: runs/index-<model>."""
    from serve.search import Searcher

    folder = work / "relative"
    folder.mkdir()
    monkeypatch.chdir(folder)
    os.symlink(world, folder / "world")
    assert main(["--model", "tiny", "--data", "world", "--cache-dir", "cache", "--workers", "0", "-q"]) == 0
    assert "-> runs/index-tiny" in capsys.readouterr().out
    monkeypatch.chdir(work)
    searcher = Searcher.open(folder / "runs" / "index-tiny")
    assert Path(searcher.manifest["cache"]["path"]).is_absolute() and searcher.num_images == 12
    assert len(searcher.search_text("a red circle", k=3)) == 3


def test_a_pretrained_checkpoint_is_indexed_and_searched(world, work):
    """--model OUT/model.safetensors of python -m train.pretrain: indexed as kind "pretrain", opened by the
    Searcher from the manifest alone (its weights file is not an adapter checkpoint), ranked as the model ranks."""
    from adapters.load import load_scorer
    from serve.search import Searcher
    from train.pretrain.engine import main as pretrain

    run = work / "pretrained"
    assert pretrain(["--data", str(world), "--out", str(run), "--batch-size", "16", "--workers", "0", "--epochs", "1",
                     "--no-tensorboard", "--eval-every-n-epochs", "0", "-q"]) == 0
    weights = run / "model.safetensors"
    manifest = build_index(options(world, work, "pretrained-index", model=str(weights)))
    assert manifest["model"]["kind"] == "pretrain"
    searcher = Searcher.open(work / "pretrained-index")
    assert not searcher.has_second_stage
    hits = searcher.search_text("a red circle", k=12)
    scorer = load_scorer(str(weights))
    cache = FeatureCache(manifest["cache"]["path"])
    image = torch.from_numpy(cache.gather("image_embed", np.arange(cache.num_images)).astype(np.float32))
    text = scorer.encode_texts(["a red circle"])["embed"]
    expected = torch.argsort(image @ text[0], descending=True, stable=True).tolist()
    assert [h.row for h in hits] == expected


# --------------------------------------------------------------------------------------------- exactness
def test_toy_test_split_flat_search_equals_brute_force_over_the_model_scores(tiny_index, world):
    manifest = layout.read_manifest(tiny_index)
    assert manifest["data"]["split"] == "test" and manifest["model"]["kind"] == "backbone"
    captions = sum(len(r.captions) for r in ToyWorldSource(world, "test").records())
    assert manifest["collection"] == {"images": 12, "captions": captions}
    for side in ("image", "text"):
        entry = manifest["indexes"][side]
        assert entry["key"] == "Flat" and entry["recall_at_10"] is None and entry["ntotal"] > 0
    # the stored vectors are the cache's global embeddings, fp16 -> float32, untouched
    cache = FeatureCache(manifest["cache"]["path"])
    image = cache.gather("image_embed", np.arange(cache.num_images)).astype(np.float32)
    text = cache.gather("text_embed", np.arange(cache.num_captions)).astype(np.float32)
    np.testing.assert_array_equal(reconstruct(tiny_index, "image"), image)
    np.testing.assert_array_equal(reconstruct(tiny_index, "text"), text)
    # text -> image through the index = torch's top-k over the bare backbone's own score matrix
    from adapters.load import load_scorer

    scorer = load_scorer("tiny")
    scores = scorer.score({"embed": torch.from_numpy(image)}, {"embed": torch.from_numpy(text)}).T  # [T, I]
    ref_scores, ref_ids = torch.topk(scores, 12, dim=1)
    found_scores, found_ids = layout.open_index(tiny_index, "image").search(text, 12)
    np.testing.assert_allclose(found_scores, ref_scores.numpy(), rtol=1e-5, atol=1e-6)
    assert (found_ids == ref_ids.numpy()).mean() > 0.99  # float ties aside
    _, back = layout.open_index(tiny_index, "text").search(image, 1)  # image -> text over the same scores
    np.testing.assert_array_equal(back[:, 0], scores.argmax(0).numpy())


def test_metadata_round_trip_matches_the_source(tiny_index, world):
    records = ToyWorldSource(world, "test").records()
    images = layout.read_metadata(tiny_index, "image").to_pylist()
    texts = layout.read_metadata(tiny_index, "text").to_pylist()
    assert [r["image_id"] for r in images] == [r.image_id for r in records]
    assert [r["path"] for r in images] == [os.path.abspath(r.source) for r in records]
    assert [r["captions"] for r in images] == [[c.text for c in r.captions] for r in records]
    assert [t["text"] for t in texts] == [c.text for r in records for c in r.captions]
    assert [t["caption_id"] for t in texts] == [c.id for r in records for c in r.captions]
    for t in texts:
        assert images[t["image_row"]]["image_id"] == t["image_id"] and t["text"] in images[t["image_row"]]["captions"]
    assert {r["part"] for r in images + texts} == {0} and [r["cache_row"] for r in images] == list(range(12))


def test_a_rebuild_reuses_the_cache_and_replaces_the_index(tiny_index, world, work, capsys):
    before = layout.read_manifest(tiny_index)
    again = build_index(options(world, work, "tiny"))
    assert "cache up to date" in capsys.readouterr().out  # never recomputed
    assert again["cache"] == before["cache"] and again["model"]["fingerprint"] == before["model"]["fingerprint"]
    assert layout.read_manifest(tiny_index)["created"] == again["created"]
    assert sorted(p.name for p in work.iterdir() if p.name.startswith("tiny")) == ["tiny"]  # no leftovers, no lock


# --------------------------------------------------------------------------------------------- an adapter
@pytest.mark.slow
def test_adapter_index_holds_the_live_models_first_stage_vectors(world, work, tmp_path_factory):
    """ComAlign (trained on ground-truth boxes) indexed from a cache built with its own extraction settings:
    every stored vector equals what the live model computes from the image / caption itself."""
    from adapters.load import load_scorer

    run = trained_comalign(toy_root(tmp_path_factory))
    manifest = build_index(options(world, work, "comalign", model=str(run)))
    assert manifest["model"]["kind"] == "adapter" and manifest["model"]["name"] == "tiny + comalign"
    cache = FeatureCache(manifest["cache"]["path"])
    assert {"entities", "relations"} <= set(cache.settings["components"])
    scorer = load_scorer(str(run), annotations=str(world))
    assert layout.model_fingerprint(scorer) == manifest["model"]["fingerprint"]
    from PIL import Image

    records = ToyWorldSource(world, "test").records()
    images = [Image.open(r.source).convert("RGB") for r in records]
    live_image = scorer.first_stage_image(scorer.encode_pil(images, [r.image_id for r in records]), "t2i")
    live_text = scorer.first_stage_text(scorer.encode_texts([c.text for r in records for c in r.captions]), "i2t")
    assert manifest["model"]["first_stage_dim"] == live_image.shape[1]
    np.testing.assert_allclose(reconstruct(work / "comalign", "image"), live_image.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(reconstruct(work / "comalign", "text"), live_text.numpy(), rtol=1e-4, atol=1e-5)
    assert manifest["indexes"]["image"]["queries"] == "captions of the collection (t2i)"


# --------------------------------------------------------------------------------------------- other sources, --add
def photo_folder(world: Path, target: Path, split: str = "train", n: int = 20) -> Path:
    """A plain folder of images (no captions) made of toy-world images of one split, some in a sub-folder."""
    if not target.exists():
        for k, r in enumerate(ToyWorldSource(world, split).records()[:n]):
            folder = target / ("more" if k % 3 == 0 else "")
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(r.source, folder / Path(r.source).name)
    return target


def test_a_folder_of_images_gives_an_image_index_only(world, work):
    folder = photo_folder(world, work / "photos")
    manifest = build_index(options(folder, work, "photos-index"))
    assert set(manifest["indexes"]) == {"image"} and manifest["collection"] == {"images": 20, "captions": 0}
    assert sorted(os.listdir(work / "photos-index")) == ["image.arrow", "image.index", "manifest.json"]
    assert manifest["indexes"]["image"]["queries"] == "images of the collection"
    rows = layout.read_metadata(work / "photos-index", "image").to_pylist()
    assert all(r["captions"] == [] and Path(r["path"]).is_file() for r in rows)
    assert any(r["image_id"].startswith("more/") for r in rows)
    with pytest.raises(IndexDirError, match="has no text index"):
        layout.open_index(work / "photos-index", "text")


def test_add_appends_another_source_and_ids_continue(world, work):
    base = options(world, work, "grown")
    first = build_index(base)
    old_image = reconstruct(work / "grown", "image")
    old_text = reconstruct(work / "grown", "text")
    folder = photo_folder(world, work / "photos")
    grown = build_index(options(folder, work, "grown", add=True))
    assert [p["images"] for p in grown["parts"]] == [12, 20] and grown["parts"][1]["image_rows"] == [12, 32]
    assert grown["collection"] == {"images": 32, "captions": first["collection"]["captions"]}
    assert grown["indexes"]["image"]["ntotal"] == 32 and grown["indexes"]["text"]["ntotal"] == len(old_text)
    assert grown["model"]["fingerprint"] == first["model"]["fingerprint"] and grown["data"] == first["data"]
    image = reconstruct(work / "grown", "image")
    np.testing.assert_array_equal(image[:12], old_image)  # the old rows untouched
    meta = layout.read_metadata(work / "grown", "image").to_pylist()
    assert [r["row"] for r in meta] == list(range(32)) and [r["part"] for r in meta] == [0] * 12 + [1] * 20
    assert [r["cache_row"] for r in meta[12:]] == list(range(20))
    _, found = layout.open_index(work / "grown", "image").search(image[12:], 1)
    np.testing.assert_array_equal(found[:, 0], np.arange(12, 32))  # each new image finds itself at its row
    with pytest.raises(IndexDirError, match="is already in"):
        build_index(options(folder, work, "grown", add=True))
    layout.check_alignment(work / "grown")


def test_add_with_another_model_is_refused_naming_both(world, work, capsys):
    build_index(options(world, work, "mismatch"))
    before = (work / "mismatch" / "manifest.json").read_bytes()
    with pytest.raises(ModelMismatchError, match=r"built with tiny \(tiny, fingerprint \w+\), not tiny-coca"):
        build_index(options(world, work, "mismatch", model="tiny-coca", split="val", add=True))
    capsys.readouterr()
    argv = ["--model", "tiny-coca", "--data", str(world), "--split", "val", "--out", str(work / "mismatch"),
            "--cache-dir", str(work / "cache"), "--workers", "0", "--add"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "tiny-coca" in err[0]
    assert (work / "mismatch" / "manifest.json").read_bytes() == before


@pytest.mark.slow
def test_ondisk_ivf_through_the_build_and_add(world, work):
    """IVF with its lists on disk, filled in 3 blocks, opened from the swapped-in folder (IO_FLAG_ONDISK_SAME_DIR),
    searched exactly at full nprobe, then extended by --add."""
    opts = options(world, work, "ondisk", split="train", kind="ivf-flat", ondisk="on", ondisk_shard_rows=40)
    manifest = build_index(opts)
    entry = manifest["indexes"]["image"]
    assert entry["ondisk"] and entry["kind"] == "ivf-flat" and entry["ntotal"] == 96
    assert {"image.ivfdata", "image.trained.index", "text.ivfdata"} <= set(os.listdir(work / "ondisk"))
    assert not list(work.glob("ondisk.tmp-*"))
    index = layout.open_index(work / "ondisk", "image")
    nlist = int(entry["key"][3:].split(",")[0])
    index.nprobe = nlist  # every list: exact
    cache = FeatureCache(manifest["cache"]["path"])
    vectors = cache.gather("image_embed", np.arange(96)).astype(np.float32)
    queries = cache.gather("text_embed", np.arange(20)).astype(np.float32)
    exact = np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :5]
    assert (index.search(queries, 5)[1] == exact).mean() > 0.99
    grown = build_index(options(world, work, "ondisk", split="val", add=True, ondisk_shard_rows=40))
    assert grown["indexes"]["image"]["ntotal"] == 108 and grown["indexes"]["image"]["ondisk"]
    index = layout.open_index(work / "ondisk", "image")
    assert index.ntotal == 108 and layout.check_alignment(work / "ondisk")


# --------------------------------------------------------------------------------------------- kill -9, two builds
_CHILD = """
import sys
from serve import layout
from serve.index import IndexOptions, build_index
if sys.argv[1] == "two-renames":
    layout._exchange = lambda a, b: False
build_index(IndexOptions(model="tiny", data=sys.argv[2], split=sys.argv[3], out=sys.argv[4], cache_dir=sys.argv[5],
                         workers=0))
"""


def child(world: Path, work: Path, out: Path, split: str, hook: str | None, swap: str = "exchange"):
    env = {**os.environ, layout.HOOK_ENV: hook or ""}
    return warm.start(["-c", _CHILD, swap, str(world), split, str(out), str(work / "cache")], cwd=ROOT, env=env)


@pytest.mark.parametrize("point,swap,outcome", [
    ("image.index", "exchange", "old"),        # mid-build
    ("manifest.json", "exchange", "old"),      # complete, not yet swapped in
    ("aside", "two-renames", "old"),           # the old folder moved aside, the new one not in yet
    ("swapped", "exchange", "new"),            # swapped, the old one not yet deleted
])
@pytest.mark.slow
def test_kill_9_during_a_build_leaves_a_whole_index(world, work, point, swap, outcome):
    out = work / f"killed-{point}"
    build_index(options(world, work, out.name))  # the old index: test split
    proc = child(world, work, out, "val", f"{point}:kill", swap)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    manifest = layout.read_manifest(out)  # a swap cut between its renames is put back here
    assert manifest["data"]["split"] == ("test" if outcome == "old" else "val")
    layout.check_alignment(out)
    for side in manifest["indexes"]:
        assert layout.open_index(out, side).ntotal == manifest["indexes"][side]["ntotal"]
    build_index(options(world, work, out.name, split="val"))  # the next build cleans up after the killed one
    assert sorted(p.name for p in work.iterdir() if p.name.startswith(out.name)) == [out.name]


@pytest.mark.slow
def test_kill_9_during_a_first_build_leaves_no_index(world, work):
    out = work / "killed-first"
    proc = child(world, work, out, "test", "image.arrow:kill")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    with pytest.raises(IndexDirError, match=r"does not exist \(killed-first\.tmp-\d+ beside it: a build that did not"):
        layout.read_manifest(out)


@pytest.mark.slow
def test_two_builds_at_once_one_wins_the_other_refuses(world, work, capsys):
    out = work / "raced"
    proc = child(world, work, out, "test", "locked:sleep=3")
    try:
        lock = layout.lock_path(out)
        deadline = time.monotonic() + 120
        while not (lock.is_file() and lock.read_text().strip()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        with pytest.raises(IndexBusyError, match=rf"raced is being built by another run .*pid {proc.pid} "):
            build_index(options(world, work, "raced"))
        assert main(["--model", "tiny", "--data", str(world), "--out", str(out), "--cache-dir", str(work / "cache"),
                     "--workers", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is being built by another run" in err[0]
    finally:
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-2000:]
    assert layout.check_alignment(out)["data"]["split"] == "test"


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv,message", [
    (["--data", "{world}", "--out", "{work}/x"], "--model is required"),
    (["--model", "tiny", "--data", "{work}/absent", "--out", "{work}/x"], "does not exist"),
    (["--model", "tiny", "--data", "{world}", "--out", "{work}/not-an-index"], "is not a plugvlm index"),
    (["--model", "tiny", "--data", "{world}", "--out", "{work}/absent-index", "--add"], "absent-index does not exist"),
    (["--model", "tiny", "--data", "{work}/photos", "--split", "val", "--out", "{work}/x"],
     "--split applies to toy worlds only"),
    (["--model", "tiny", "--data", "{world}", "--out", "{work}/x", "--max-memory", "lots"], "not a memory size"),
    (["--model", "tiny", "--data", "{world}", "--out", "{work}/x", "--kind", "ivf-pq"], "ivf-pq needs at least"),
])
def test_bad_input_is_one_line_and_exit_2(world, work, capsys, argv, message):
    photo_folder(world, work / "photos")
    (work / "not-an-index").mkdir(exist_ok=True)
    (work / "not-an-index" / "notes.txt").write_text("keep me")
    argv = [a.format(world=world, work=work) for a in argv] + ["--cache-dir", str(work / "cache"), "--workers", "0"]
    try:
        code = main(argv)
    except SystemExit as e:  # refused by the parser itself
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[0] and len([line for line in err if "error:" in line]) == 1, err
    assert (work / "not-an-index" / "notes.txt").read_text() == "keep me"
    assert not (work / "x").exists()
