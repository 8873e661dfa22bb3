"""``python -m extract`` end to end: cache content against direct computation, reuse / rebuild (whatever the
spelling of --data), damaged shards rebuilt, one run at a time, kill -9 and resume, two processes under
accelerate, bad input, and failing fast on missing weights.

All on the tiny backbone and a 30-scene toy world (ViT-B-32 with random weights once, on two images).
"""
from __future__ import annotations

import csv
import io
import json
import os
import signal
import socket
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from extract.worlds import toyworld
from extract.models.backbone import load_backbone
from extract.cache import CacheDir, CacheError, FeatureCache
from extract.data.sources import ToyWorldSource, open_source
from extract.options import ExtractOptions
from extract.pipeline import _image_seed, build_cache, data_fingerprint, main
from extract.components.regions import crop_regions, gt_boxes, random_grid_boxes
from fixtures import warm
from fixtures.toy import hard_world_cache

ROOT = Path(__file__).resolve().parents[2]
BASE_ARGS = ["--workers", "0", "--batch-size", "8", "--shard-size", "8"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world")
    toyworld.generate(out, n=30, seed=0, workers=1)
    return out


def _argv(data, out, *extra) -> list[str]:
    return ["--data", str(data), "--out", str(out), *BASE_ARGS, *extra]


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory) -> Path:
    """The uninterrupted one-process cache every other run is compared with (default components)."""
    out = tmp_path_factory.mktemp("reference")
    assert main(_argv(world, out)) == 0
    return FeatureCache.open(out).path


def _content(path: Path) -> dict:
    """Every shard array and shard meta of a cache folder, keyed by relative path."""
    out = {}
    for f in sorted(path.glob("shard-*/*")):
        key = str(f.relative_to(path))
        out[key] = np.load(f, allow_pickle=False) if f.suffix == ".npy" else json.loads(f.read_text())
    return out


def _assert_same_content(a: Path, b: Path) -> None:
    ca, cb = _content(a), _content(b)
    assert sorted(ca) == sorted(cb)
    for key in ca:
        if key.endswith(".npy"):
            assert ca[key].dtype == cb[key].dtype, key
            np.testing.assert_array_equal(ca[key], cb[key], err_msg=key)
        else:
            assert ca[key] == cb[key], key
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    assert ma == mb


# --------------------------------------------------------------------------------------------- content
def test_toyworld_cache_matches_direct_computation(world, reference):
    cache = FeatureCache(reference)
    source = ToyWorldSource(world)
    records = source.records()
    assert cache.num_images == len(records) and cache.manifest["images"] == len(records)
    assert cache.num_captions == sum(len(r.captions) for r in records)
    assert not any(cache.manifest["skipped"].values())  # {kind: {reason: count}}, all empty

    # pairing: every caption row points at the image it was written for
    caption_of = {c.id: r.image_id for r in records for c in r.captions}
    image_ids, caption_ids = cache.image_ids(), cache.caption_ids()
    rows = cache.caption_image_index()
    assert [image_ids[i] for i in rows] == [caption_of[c] for c in caption_ids]

    bb = load_backbone("tiny", None)
    by_id = {r.image_id: r for r in records}
    first = [0, 5, len(image_ids) - 1]
    images = [Image.open(by_id[image_ids[i]].source).convert("RGB") for i in first]
    feats = bb.encode_images(torch.stack([bb.preprocess(im) for im in images]))
    img = {k: cache.gather(k, first) for k in cache.keys if k.startswith(("image_", "patch_", "region_", "ventity_",
                                                                          "vrelation_"))}
    np.testing.assert_allclose(img["image_embed"], feats.embedding.half().numpy(), atol=2e-3)
    np.testing.assert_allclose(img["patch_tokens"], feats.patches.half().numpy(), atol=2e-3)

    for row, i in enumerate(first):
        image_id = image_ids[i]
        # ground-truth entity boxes in annotation order, one relation box per pair (top 10)
        boxes, _ = gt_boxes(source.annotations[image_id])
        n = min(len(boxes), 10)
        assert img["ventity_valid"][row].sum() == n
        np.testing.assert_allclose(img["ventity_boxes"][row, :n], boxes[:n])
        assert img["vrelation_valid"][row].sum() == min(n * (n - 1) // 2, 10)
        # the crop scale is the backbone's when not given (the tiny configs: 3, an object fills a third of its crop)
        assert cache.settings["boxes"]["crop_scale"] == bb.spec.crop_scale == 3.0
        crops = crop_regions(images[row], boxes[:n], bb.preprocess, scale=bb.spec.crop_scale)
        np.testing.assert_allclose(img["ventity_embed"][row, :n], bb.encode_images(crops).embedding.half().numpy(),
                                   atol=2e-3)
        # PowerCLIP-R masks: the per-image seeded stream, whatever the shard or batch
        _, masks = random_grid_boxes(bb.grid, 10, _image_seed(0, image_id))
        np.testing.assert_array_equal(img["region_masks"][row], masks)

    cap_rows = np.arange(0, cache.num_captions, 7)
    got = cache.batch(cap_rows)
    texts = {c.id: c.text for r in records for c in r.captions}
    chosen = [texts[caption_ids[i]] for i in cap_rows]
    np.testing.assert_allclose(got["text_embed"], bb.encode_texts(chosen).embedding.half().numpy(), atol=2e-3)
    tok = bb.tokenize(chosen)
    np.testing.assert_array_equal(got["token_mask"].sum(1), tok.attention_mask.sum(1).numpy())

    from extract.components.text import TextComponentExtractor

    comps = TextComponentExtractor().extract(chosen, tok)
    for b, c in enumerate(comps):
        n_ent, n_rel = min(len(c.entities), 10), min(len(c.relations), 10)
        assert got["entity_valid"][b].sum() == n_ent and got["relation_valid"][b].sum() == n_rel
        if n_ent:
            want = bb.encode_texts([e.text for e in c.entities[:n_ent]]).embedding.half().numpy()
            np.testing.assert_allclose(got["entity_embed"][b, :n_ent], want, atol=2e-3)
        leaves = got["leaf_tokens"][b]
        cap = ExtractOptions().max_leaves  # extraction's default cap on phrase-tree leaves
        assert 1 <= got["n_leaves"][b] <= cap and not leaves[got["n_leaves"][b]:].any()
        assert not (leaves & ~got["token_mask"][b].astype(bool)[None]).any()  # leaves cover real tokens only
    assert (cache.path / "config.json").is_file() and (cache.path / "report.json").is_file()


def test_a_phrase_prompt_writes_the_noun_phrases_and_nothing_else(world, reference, tmp_path):
    """--phrase-prompt 'a {}': entity, subject and object phrases are embedded as 'a brown cube' (what a tower
    trained on captions reads), the predicate and the relation as parsed; the prompt is in the fingerprint. The
    default ('{}' for the tiny base) embeds each phrase as parsed and leaves the settings as they were."""
    from extract.components.text import TextComponentExtractor

    out = tmp_path / "prompted"
    assert main(_argv(world, out, "--components", "entities,relations,roles", "--phrase-prompt", "a {}")) == 0
    cache, plain = FeatureCache.open(out), FeatureCache(reference)
    assert cache.settings["text"]["phrase_prompt"] == "a {}" and "phrase_prompt" not in plain.settings["text"]
    bb = load_backbone("tiny", None)
    texts = {c.id: c.text for r in ToyWorldSource(world).records() for c in r.captions}
    assert plain.caption_ids() == cache.caption_ids()
    every = [texts[c] for c in cache.caption_ids()]
    parsed = TextComponentExtractor().extract(every, bb.tokenize(every))
    rows = [i for i, c in enumerate(parsed) if c.relations][:2] + [0]  # two captions naming relations, the first
    comps = [parsed[i] for i in rows]
    got, was = cache.batch(np.array(rows)), plain.batch(np.array(rows))
    checked = 0
    for b, c in enumerate(comps):
        for j, e in enumerate(c.entities[:10]):
            for arrays, text in ((got, f"a {e.text}"), (was, e.text)):
                np.testing.assert_allclose(arrays["entity_embed"][b, j], bb.encode_each([text])[0].half().numpy(),
                                           atol=2e-3)
        for j, r in enumerate(c.relations[:10]):
            for role, text in (("subject", f"a {r.subject.text}"), ("object", f"a {r.object.text}"),
                               ("predicate", r.predicate.text)):
                np.testing.assert_allclose(got[f"role_{role}_embed"][b, j], bb.encode_each([text])[0].half().numpy(),
                                           atol=2e-3, err_msg=role)
            np.testing.assert_array_equal(got["relation_embed"][b, j], was["relation_embed"][b, j])
            checked += 1
    assert checked  # the chosen captions name relations
    with pytest.raises(ValueError, match="once"):
        ExtractOptions(phrase_prompt="a photo")


def test_a_hard_worlds_cache_holds_the_overlap_code_and_thumbnails_of_its_pixels(tmp_path_factory):
    """``ventity_overlap`` and ``ventity_pixels`` as the pipeline writes them, read back from a small hard world's
    cache: each image's arrays are the overlap and thumbnail components' (extract/components/) on its own pixels and
    cached boxes; the overlap code non-zero for every pair the world draws one in front of the other, zero where two
    boxes are apart (the world has such pairs); a thumbnail in every box slot, zeros in the empty ones."""
    from extract.components.overlap import FEATURES, ownership
    from extract.components.thumbnails import thumbnails

    cache, world = hard_world_cache(tmp_path_factory)
    scenes = {str(s["image_id"]): s for s in toyworld.load(world)["scenes"]}
    records = {r.image_id: r for r in ToyWorldSource(world).records()}
    rows = np.arange(cache.num_images)
    got, boxes, valid, pixels = (cache.gather(k, rows) for k in ("ventity_overlap", "ventity_boxes", "ventity_valid",
                                                                  "ventity_pixels"))
    assert pixels.dtype == np.uint8 and pixels[valid].any() and not pixels[~valid].any()
    assert got.shape == (len(rows), 10, 10, FEATURES) and got.dtype == np.float16
    in_front = apart = 0
    for row, image_id in enumerate(cache.image_ids()):
        n = int(valid[row].sum())
        raw = np.asarray(Image.open(records[image_id].source).convert("RGB"))
        want = ownership(raw, boxes[row, :n], 10)
        np.testing.assert_array_equal(got[row], want.astype(np.float16), err_msg=image_id)
        np.testing.assert_array_equal(pixels[row], thumbnails(raw, boxes[row, :n], 10), err_msg=image_id)
        for front, predicate, back in scenes[image_id]["relations"]:
            if predicate == "in front of":  # the front object owns pixels of the other's box: the pair overlaps
                in_front += 1
                assert got[row, front, back, 0] == got[row, back, front, 0] == 1.0, (image_id, front, back)
                assert np.abs(got[row, front, back, 1:]).sum() > 0, (image_id, front, back)
        for a in range(n):
            for b in range(n):
                (x0, y0, x1, y1), (u0, v0, u1, v1) = boxes[row, a], boxes[row, b]
                if min(x1, u1) - max(x0, u0) < -1 or min(y1, v1) - max(y0, v0) < -1:  # a pixel or more apart
                    apart += 1
                    assert not got[row, a, b].any(), (image_id, a, b)
        assert not got[row, n:].any() and not got[row, :, n:].any()  # empty slots
    assert in_front >= 3 and apart > in_front, (in_front, apart)


# --------------------------------------------------------------------------------------------- reuse / rebuild
def test_rerun_reuses_and_a_changed_setting_rebuilds(world, reference, tmp_path, capsys):
    out = reference.parent
    stamps = {p: p.stat().st_mtime_ns for p in reference.glob("shard-*/*")}
    assert main(_argv(world, out)) == 0
    assert "cache up to date" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in reference.glob("shard-*/*")} == stamps

    assert main(_argv(world, out, "--num-regions", "4")) == 0
    said = capsys.readouterr().out
    assert "regions.m: 10 -> 4" in said
    new = FeatureCache.open(out, settings=None, fingerprint=json.loads(
        next(p for p in out.glob("*/manifest.json") if p.parent != reference).read_text())["fingerprint"])
    assert new.path != reference
    assert new.gather("region_masks", [0]).shape[1] == 4
    assert {p: p.stat().st_mtime_ns for p in reference.glob("shard-*/*")} == stamps  # the old one untouched
    with pytest.raises(FileNotFoundError, match="several"):
        FeatureCache.open(out)  # two caches, no choice: an error that lists them, never a silent pick


def test_the_other_settings_note_is_only_for_these_data_by_this_backbone(world, tmp_path, capsys):
    """Caches of other splits or other data in the same --out are simply other caches: no note. A cache of these
    very data by this backbone, extracted with other settings, is one the user may have meant to reuse: the note
    names it and the differences."""
    out = tmp_path / "cache"
    flags = ["--components", "regions"]  # random boxes: no spaCy, no detector
    assert main(_argv(world, out, *flags)) == 0
    first = capsys.readouterr().out
    assert "extracting" in first and "note:" not in first
    images = sorted((world / "images").glob("*.png"))[:3]
    table = tmp_path / "pairs.csv"
    table.write_text("filepath,title\n" + "".join(f"{p},a shape\n" for p in images))
    for other in (_argv(world, out, *flags, "--split", "test"), _argv(table, out, *flags)):
        assert main(other) == 0
        said = capsys.readouterr().out
        assert "extracting" in said and "note:" not in said and "Differences" not in said, other
    assert len(list(out.glob("*/manifest.json"))) == 3
    assert main(_argv(world, out, *flags, "--num-regions", "4")) == 0
    said = capsys.readouterr().out
    train_cache = first.split(" into ")[1].split()[0]  # "extracting 3 of 3 shards into PATH on 1 process(es)"
    assert said.count("note:") == 1 and f"note: {train_cache} holds these data by this backbone" in said
    assert "regions.m: 10 -> 4" in said


def test_progress_in_a_log_is_plain_lines_and_quiet_keeps_only_the_result(world, tmp_path, capsys, monkeypatch):
    """stderr is no terminal here (as under `> log 2>&1`): the progress bar is plain lines, never carriage-return
    frames; --quiet drops progress and status lines and keeps the result."""
    from extract.common import cli

    monkeypatch.setattr(cli, "_log_interval", lambda: 0.0)  # a line per batch instead of one per 30 s
    n = len(ToyWorldSource(world).records())
    flags = ["--components", ""]
    try:
        assert main(_argv(world, tmp_path / "cache", *flags)) == 0
        said = capsys.readouterr()
        lines = said.err.splitlines()
        assert "\r" not in said.err and len(lines) > 1 and all(len(line) < 300 for line in lines)
        assert all(line.startswith("extracting: ") and " img (" in line for line in lines), lines
        assert lines[-1].endswith(" done") and f"{n}/{n} img (100%)" in lines[-1]
        assert "shards into" in said.out and f"cached {n} images" in said.out  # status line and result
        assert main(["--quiet", *_argv(world, tmp_path / "quiet", *flags)]) == 0
        said = capsys.readouterr()
        assert said.err == "" and "extracting" not in said.out and said.out.startswith(f"cached {n} images")
    finally:
        cli.set_verbosity(cli.NORMAL)


def test_data_path_spelling_reuses_the_cache_and_changed_content_does_not(world, tmp_path, monkeypatch, capsys):
    toy = tmp_path / "toy"
    shutil.copytree(world, toy)  # a private copy: edited below
    os.symlink(toy, tmp_path / "link")
    out = tmp_path / "cache"
    flags = ["--components", ""]  # global embeddings only: the fingerprint is what is tested
    monkeypatch.chdir(tmp_path)
    assert main(_argv("toy", out, *flags)) == 0
    assert "extracting" in capsys.readouterr().out
    for spelling in (f"../{tmp_path.name}/toy", str(toy), "./toy/", "link"):
        assert main(_argv(spelling, out, *flags)) == 0
        assert "cache up to date" in capsys.readouterr().out, spelling
    assert len(list(out.iterdir())) == 1
    # same spelling, other content (one caption edited): never the old cache
    coco = toy / "train_coco.json"
    data = json.loads(coco.read_text())
    data["annotations"][0]["caption"] = "a purple hexagon far from everything"
    coco.write_text(json.dumps(data))
    assert main(_argv("toy", out, *flags)) == 0
    said = capsys.readouterr().out
    assert "extracting" in said and "cache up to date" not in said
    assert len(list(out.glob("*/manifest.json"))) == 2


def test_a_toy_worlds_edited_boxes_never_reuse_the_old_cache(world, tmp_path, capsys):
    """The records' hash reads images and captions; the world's box file enters the settings on its own."""
    toy = tmp_path / "toy"
    shutil.copytree(world, toy)
    out = tmp_path / "cache"
    flags = ["--components", "entities", "--boxes", "gt"]
    assert main(_argv(toy, out, *flags)) == 0
    assert main(_argv(toy, out, *flags)) == 0
    assert "cache up to date" in capsys.readouterr().out
    annotations = toy / "annotations.json"
    data = json.loads(annotations.read_text())
    x0, y0, x1, y1 = data["scenes"][0]["objects"][0]["box"]
    data["scenes"][0]["objects"][0]["box"] = [x0 + 1, y0, x1 + 1, y1]
    annotations.write_text(json.dumps(data))
    assert main(_argv(toy, out, *flags)) == 0
    said = capsys.readouterr().out
    assert "extracting" in said and "cache up to date" not in said
    cache = FeatureCache.open(out, settings=None, fingerprint=json.loads(max(
        out.glob("*/manifest.json"), key=lambda p: p.stat().st_mtime_ns).read_text())["fingerprint"])
    assert cache.settings["annotations"]["file"] == str(annotations.resolve())


def test_data_fingerprint_resolves_csv_image_root_and_shard_paths(world, tmp_path, monkeypatch):
    src = sorted((world / "images").glob("*.png"))[:2]
    (tmp_path / "pairs.csv").write_text("filepath,title\n" + "".join(f"{p.name},a shape\n" for p in src))
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "000.tar", "w") as tar:
        for p in src:
            tar.add(p, arcname=p.name)
    monkeypatch.chdir(tmp_path)
    csv_here = data_fingerprint(open_source("pairs.csv", image_root=str(world / "images")))
    tar_here = data_fingerprint(open_source("shards"))
    monkeypatch.chdir(world)
    assert data_fingerprint(open_source(str(tmp_path / "pairs.csv"), image_root="images")) == csv_here
    assert data_fingerprint(open_source(f"../{tmp_path.name}/shards")) == tar_here
    assert data_fingerprint(open_source(str(tmp_path / "shards"))) == tar_here


# --------------------------------------------------------------------------------------------- damaged cache
def test_a_damaged_shard_is_named_and_a_rerun_rebuilds_only_it(world, reference, tmp_path, capsys):
    out = tmp_path / "copy"
    path = out / reference.name
    shutil.copytree(reference, path)
    victim = path / "shard-00001" / "token_embed.npy"
    full = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[:1024])  # a copy cut short
    with pytest.raises(CacheError) as err:
        FeatureCache.open(out)
    msg = str(err.value)
    assert f"{victim} is 1,024 bytes" in msg and f"{full:,}" in msg and "python -m extract" in msg
    stamps = {p: p.stat().st_mtime_ns for p in path.glob("shard-*/*") if p.parent.name != "shard-00001"}
    assert main(_argv(world, out)) == 0
    said = capsys.readouterr().out
    assert str(victim) in said and "extracting 1 of" in said and "already done" in said
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # the intact shards were not rewritten
    _assert_same_content(path, reference)
    assert FeatureCache.open(out).num_images == FeatureCache(reference).num_images


# --------------------------------------------------------------------------------------------- one run at a time
def test_a_second_run_waits_for_the_first_and_reuses_its_cache(world, reference, tmp_path, capsys, monkeypatch):
    out = tmp_path / "shared"
    first = CacheDir(out, json.loads((reference / "settings.json").read_text())["settings"])
    assert first.path.name == reference.name  # the cache the second run wants
    monkeypatch.setenv("PLUGVLM_CACHE_LOCK_TIMEOUT", "300")
    result, said = [], ""
    with first.build_lock("the first run"):
        second = threading.Thread(target=lambda: result.append(main(_argv(world, out))), daemon=True)
        second.start()
        deadline = time.monotonic() + 300
        while "waiting for" not in said and second.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
            said += capsys.readouterr().out
        assert "waiting for" in said and f"pid {os.getpid()} on host {socket.gethostname()}" in said
        # the first run finishes its cache (here: the reference's files) and releases the lock
        shutil.copytree(reference, first.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
    second.join(300)
    said += capsys.readouterr().out
    assert result == [0]
    assert "cache up to date" in said and "extracting" not in said  # no shard computed twice
    _assert_same_content(first.path, reference)


# --------------------------------------------------------------------------------------------- kill -9
@pytest.mark.slow
def test_kill9_mid_run_then_rerun_equals_uninterrupted(world, reference, tmp_path):
    out = tmp_path / "killed"
    proc = warm.start(["-m", "extract", *_argv(world, out)], cwd=ROOT)  # its own process, forked warm
    first = out / reference.name / "shard-00000" / "meta.json"
    deadline = time.monotonic() + 180
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # polling for the first finished shard; the kill lands in the next one
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert first.exists(), "the run ended before its first shard finished"
    path = out / reference.name
    assert not (path / "shard-00002" / "meta.json").exists()  # two more shards take far longer than one poll
    with pytest.raises(FileNotFoundError):
        FeatureCache.open(out)  # an unfinished cache is never readable
    # a shard directory a killed writer left half-written must neither count nor survive the rerun
    tmp = path / "shard-00002.tmp-999999"
    tmp.mkdir(exist_ok=True)
    (tmp / "image_embed.npy").write_bytes(b"\x93NUMPY garbage")
    assert main(_argv(world, out)) == 0
    assert not list(path.glob("*.tmp-*"))
    _assert_same_content(path, reference)


# --------------------------------------------------------------------------------------------- accelerate
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_under_accelerate_equal_one(world, reference, tmp_path):
    out = tmp_path / "ddp"
    # accelerate gives each of N CPU processes cores // N threads by default; BLAS sums in another order with
    # another thread count (1-ulp fp16 differences), so both runs use the reference's count.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_cpu_threads_per_process", str(torch.get_num_threads()),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "-m", "extract", *_argv(world, out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 2 process(es)" in done.stdout
    assert "\r" not in done.stderr and all(len(line) < 300 for line in (done.stdout + done.stderr).splitlines())
    _assert_same_content(out / reference.name, reference)


# --------------------------------------------------------------------------------------------- bad input
def test_bad_input_gets_a_clear_outcome(world, tmp_path):
    src = sorted((world / "images").glob("*.png"))
    (tmp_path / "broken.png").write_bytes(src[0].read_bytes()[:60])  # truncated PNG
    long_caption = " ".join(["a red circle above a blue square"] * 20)
    rows = [(src[0].name, "a small red circle left of a blue square"),
            (src[0].name, "quickly and silently"),  # no noun: zero entities, still a sample
            (src[1].name, long_caption),  # truncated to the context and counted
            (src[1].name, "   "),  # empty: skipped and listed
            ("broken.png", "a green star")]  # unreadable image: skipped and listed
    for p in src[:2]:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    table = tmp_path / "pairs.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filepath", "title"])
        w.writerows(rows)
    out = tmp_path / "cache"
    # a random-init YOLO at conf 0.25 finds nothing: every image keeps only its global component
    assert main(_argv(table, out, "--components", "entities,relations", "--detector", "yolov8n.yaml")) == 0
    cache = FeatureCache.open(out)
    assert cache.num_images == 2 and cache.num_captions == 3
    texts = dict(zip(cache.caption_ids(), [r[1] for r in rows[:3]]))
    got = cache.batch(np.arange(3))
    by_text = {texts[c]: b for b, c in enumerate(cache.caption_ids())}
    assert got["entity_valid"][by_text["quickly and silently"]].sum() == 0
    assert got["entity_valid"][by_text[rows[0][1]]].sum() >= 2
    assert not got["ventity_valid"].any() and not got["vrelation_valid"].any()
    assert (np.linalg.norm(got["image_embed"].astype(np.float32), axis=1) > 0.99).all()
    assert got["truncated"][by_text[long_caption]] and got["truncated"].sum() == 1
    assert cache.manifest["truncated"] == 1
    report = json.loads((cache.path / "report.json").read_text())
    listed = json.dumps(report)
    assert "broken.png" in listed and "empty" in listed.lower()
    skipped = cache.manifest["skipped"]
    assert sum(skipped["image"].values()) == 1 and sum(skipped["caption"].values()) == 1


def test_ground_truth_boxes_from_a_visual_genome_file(world, tmp_path, capsys):
    """Two images, one with an entry. The image without one used to be extracted with no boxes in silence; now the
    run counts it and stops (50 % > --max-missing-boxes 0, the default), and goes on, boxless and said in the log,
    only where the user allows that share."""
    src = sorted((world / "images").glob("*.png"))[:2]
    table = tmp_path / "pairs.csv"
    table.write_text("filepath,title\n" + "".join(f"{p},a shape\n" for p in src))
    objects = [{"image_id": 1, "url": f"http://vg/{src[0].name}",
                "objects": [{"x": 2, "y": 3, "w": 20, "h": 10, "names": ["shape"]},
                            {"x": 30, "y": 30, "w": 8, "h": 8, "names": ["thing"]}]}]
    (tmp_path / "objects.json").write_text(json.dumps(objects))
    options = dict(components=["entities", "relations", "regions"], annotations=tmp_path / "objects.json",
                   regions="gt", workers=0)
    with pytest.raises(ValueError, match=r"pairs.csv: 1 of 2 images \(50.00%\) have no entry in .*objects.json "
                                         r"\(Visual Genome objects.json\).*--max-missing-boxes 0 allows"):
        build_cache(table, tmp_path / "cache", **options)
    cache = build_cache(table, tmp_path / "cache", max_missing_boxes=0.5, **options)
    assert "boxes: pairs.csv: 1 of 2 images (50.00%) have no entry" in capsys.readouterr().out
    rows = {image_id: k for k, image_id in enumerate(cache.image_ids())}
    a, b = rows[str(src[0])], rows[str(src[1])]
    boxes = cache.gather("ventity_boxes", [a, b])
    np.testing.assert_array_equal(boxes[0, :2], [[2, 3, 22, 13], [30, 30, 38, 38]])
    assert cache.gather("ventity_valid", [a, b]).sum(1).tolist() == [2, 0]  # no entry, allowed: global only
    assert cache.gather("vrelation_valid", [a, b]).sum(1).tolist() == [1, 0]
    assert cache.gather("region_valid", [a, b]).sum(1).tolist() == [2, 0]
    assert "annotations" in cache.settings


def test_a_box_file_of_other_images_is_refused_before_the_backbone_loads(world, tmp_path):
    """A COCO captions file given as boxes, or boxes of other images: refused with what file is expected."""
    table = tmp_path / "pairs.csv"
    images = sorted((world / "images").glob("*.png"))[:2]
    table.write_text("filepath,title\n" + "".join(f"{p},a shape\n" for p in images))
    options = dict(components=["entities"], regions="random", workers=0, base="no-such-backbone")
    with pytest.raises(ValueError, match="is a COCO captions file .* boxes come from a box file: COCO instances"):
        build_cache(table, tmp_path / "cache", annotations=world / "train_coco.json", **options)
    (tmp_path / "objects.json").write_text(json.dumps([{"image_id": 99, "objects": []}]))
    with pytest.raises(ValueError, match="pairs.csv: none of the 2 images has an entry in .*expected the box file "
                                         "of this collection"):
        build_cache(table, tmp_path / "cache", annotations=tmp_path / "objects.json", max_missing_boxes=0.9, **options)


def _two_tars(folder: Path, src: list[Path]) -> None:
    """``src[:3]`` and ``src[3:]`` as webdataset shards 000.tar and 001.tar (image + caption per sample)."""
    for t, part in enumerate((src[:3], src[3:])):
        with tarfile.open(folder / f"{t:03d}.tar", "w") as tar:
            for p in part:
                for name, data in ((f"{p.stem}.png", p.read_bytes()), (f"{p.stem}.txt", b"a coloured shape")):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def test_webdataset_source_gives_one_shard_per_tar(world, tmp_path):
    src = sorted((world / "images").glob("*.png"))[:5]
    _two_tars(tmp_path, src)
    cache = build_cache(tmp_path, tmp_path / "cache", components=["patches", "tokens"], workers=0)
    assert [s["images"] for s in cache.manifest["shards"]] == [3, 2]
    assert cache.gather("patch_tokens", [0]).shape[1:] == (64, 64)


def test_a_streams_images_without_boxes_are_counted_as_they_come(world, tmp_path, capsys):
    """Webdataset shards list their images only as they are read: each shard counts those without an entry, and the
    run is judged once all are in (before the manifest: a rerun with another share reuses the shards)."""
    src = sorted((world / "images").glob("*.png"))[:5]
    _two_tars(tmp_path, src)
    objects = [{"image_id": p.stem, "objects": [{"x": 1, "y": 1, "w": 9, "h": 9, "names": ["shape"]}]} for p in src[1:]]
    (tmp_path / "objects.json").write_text(json.dumps(objects))
    options = dict(components=["entities"], annotations=tmp_path / "objects.json", workers=0)
    with pytest.raises(ValueError, match=r": 1 of 5 images \(20.00%\) have no entry in .*'000000'.*--max-missing"):
        build_cache(tmp_path, tmp_path / "cache", **options)
    capsys.readouterr()
    cache = build_cache(tmp_path, tmp_path / "cache", max_missing_boxes=0.25, **options)
    assert "1 of 5 images (20.00%) have no entry" in capsys.readouterr().out
    assert cache.gather("ventity_valid", np.arange(5)).sum(1).tolist() == [0, 1, 1, 1, 1]
    (tmp_path / "objects.json").write_text(json.dumps([{"image_id": "elsewhere", "objects": []}]))
    with pytest.raises(ValueError, match="none of the 3 images has an entry"):  # said after the first shard
        build_cache(tmp_path, tmp_path / "other", **options)


def test_build_cache_rejects_unknown_options(world, tmp_path):
    with pytest.raises(TypeError, match="num_region"):
        build_cache(world, tmp_path, num_region=3)


# --------------------------------------------------------------------------------------------- fail fast
@pytest.fixture
def no_backbone(monkeypatch):
    """Loading the backbone would be work: these failures must come before it."""
    def refuse(*a, **k):
        raise AssertionError("the backbone was loaded before the failing check")
    monkeypatch.setattr("extract.pipeline.load_backbone", refuse)


@pytest.mark.parametrize("flags, named", [
    (["--boxes", "yolo", "--detector", "missing/yolov9c.pt"], "yolov9c.pt"),
    (["--regions", "sam2", "--segmenter", "configs/sam2.1/sam2.1_hiera_t.yaml", "--segmenter-weights",
      "missing/sam2.1_hiera_tiny.pt"], "sam2.1_hiera_tiny.pt"),
    (["--regions", "sam2", "--segmenter", "configs/sam2.1/sam2.1_hiera_t.yaml"], "--segmenter-weights"),
])
def test_missing_detector_or_segmenter_weights_fail_before_any_work(world, tmp_path, capsys, no_backbone, flags,
                                                                    named):
    assert main(_argv(world, tmp_path / "cache", *flags)) == 2  # no_backbone: loading the backbone would fail
    assert named in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------------------------- ViT-B-32
@pytest.mark.slow
def test_vit_b32_with_random_yolo_and_sam2(world, tmp_path):
    src = sorted((world / "images").glob("*.png"))[:2]
    table = tmp_path / "pairs.csv"
    table.write_text("filepath,title\n" + "".join(f"{p},a red circle on a blue square\n" for p in src))
    cache = build_cache(
        table, tmp_path / "cache", base="ViT-B-32", pretrained="none", boxes="yolo", detector="yolov8n.yaml",
        conf=0.0, max_entities=2, max_relations=1, regions="sam2", segmenter="configs/sam2.1/sam2.1_hiera_t.yaml",
        segmenter_weights="none", segmenter_image_size=128, sam_points=4, sam_iou_thresh=0.0,
        sam_stability_thresh=0.0, num_regions=3, workers=0)
    got = cache.batch(np.arange(2))
    assert got["ventity_valid"].sum(1).tolist() == [2, 2] and got["vrelation_valid"].sum(1).tolist() == [1, 1]
    emb = got["ventity_embed"].astype(np.float32)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, atol=2e-3)
    assert got["patch_tokens"].shape == (2, 49, 512) and got["region_masks"].shape == (2, 3, 7, 7)
    assert (got["region_valid"].sum(1) >= 1).all()
    assert (got["region_masks"].reshape(2, 3, -1).any(-1) == got["region_valid"]).all()
    det = cache.settings["boxes"]["detector"]
    assert det["weights"]["config"] == "yolov8n.yaml" and cache.settings["regions"]["segmenter"]["image_size"] == 128
