"""Cache storage: atomic shards, fingerprinted folders, memory-mapped gathers equal to a plain reference, damaged
files named at open, one build at a time."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from extract.cache import CacheBusyError, CacheDir, CacheError, FeatureCache, fingerprint, settings_diff


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


# --------------------------------------------------------------------------------------------- damaged files
def _cut(path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def test_a_cut_array_file_is_named_when_the_cache_is_opened(tmp_path):
    rng = np.random.default_rng(3)
    cache = _build(tmp_path, {"s": 1}, [_shard(rng, 2, 2, 3), _shard(rng, 3, 1, 2), _shard(rng, 2, 1, 4)])
    victim = cache.path / "shard-00001" / "text_embed.npy"
    size = victim.stat().st_size
    meta = json.loads((cache.path / "shard-00001" / "meta.json").read_text())
    assert meta["bytes"]["text_embed"] == size  # recorded at write time, for a stat-only check
    _cut(victim, size - 8)
    with pytest.raises(CacheError) as err:
        FeatureCache.open(tmp_path)  # at open, not as numpy's "mmap length ..." at the first gather
    msg = str(err.value)
    assert f"{victim} is {size - 8:,} bytes" in msg and f"{size:,}" in msg
    assert "damaged" in msg and "python -m extract" in msg and str(cache.path) in msg
    # the writer's view: that shard, and only it, is not done (a rerun rebuilds exactly it)
    assert [cache.shard_done(k) for k in range(3)] == [True, False, True]
    assert list(cache.damaged_shards(range(3))) == [1] and list(cache.problems()) == ["shard-00001"]
    (cache.path / "shard-00002" / "token_mask.npy").unlink()
    with pytest.raises(CacheError, match="2 shards") as err:
        FeatureCache.open(tmp_path)
    assert str(cache.path / "shard-00002" / "token_mask.npy") + " is missing" in str(err.value)


def test_rewriting_a_damaged_shard_replaces_it_and_the_cache_opens_again(tmp_path):
    rng = np.random.default_rng(4)
    shards = [_shard(rng, 2, 2, 3), _shard(rng, 3, 1, 2)]
    cache = _build(tmp_path, {"s": 1}, shards)
    _cut(cache.path / "shard-00000" / "image_embed.npy", 20)
    cache.write_shard(0, shards[0], {"images": 2, "captions": 4, "image_ids": ["0-0", "0-1"],
                                     "caption_ids": [f"0-c{j}" for j in range(4)]})
    assert not list(cache.path.glob("*.tmp-*"))
    fc = FeatureCache.open(tmp_path)
    np.testing.assert_array_equal(fc.gather("image_embed", [0, 1]), shards[0]["image_embed"])


def test_caches_without_recorded_sizes_are_checked_against_the_npy_header(tmp_path):
    rng = np.random.default_rng(5)
    shards = [_shard(rng, 2, 2, 3), _shard(rng, 3, 1, 2)]
    cache = _build(tmp_path, {"s": 1}, shards)
    for k in range(2):  # as written before sizes were recorded
        meta_path = cache.path / f"shard-0000{k}" / "meta.json"
        meta = json.loads(meta_path.read_text())
        del meta["bytes"]
        meta_path.write_text(json.dumps(meta))
    fc = FeatureCache.open(tmp_path)  # intact: no false alarm from the header check
    np.testing.assert_array_equal(fc.gather("text_embed", [4, 5]), shards[1]["text_embed"][:2])
    victim = cache.path / "shard-00001" / "token_embed.npy"
    _cut(victim, victim.stat().st_size - 1)
    with pytest.raises(CacheError, match="header") as err:
        FeatureCache.open(tmp_path)
    assert str(victim) in str(err.value)
    _cut(victim, 5)  # not even a header
    with pytest.raises(CacheError, match="not a readable .npy") as err:
        FeatureCache.open(tmp_path)
    assert str(victim) in str(err.value)
    assert not cache.shard_done(1) and cache.shard_done(0)


# --------------------------------------------------------------------------------------------- build lock
def test_a_second_run_waits_for_the_lock_naming_its_holder_then_gives_up(tmp_path):
    cache = CacheDir(tmp_path, {"s": 1})
    said = []
    with cache.build_lock("run-a"):
        holder = json.loads((cache.path / "lock").read_text())
        assert holder["pid"] == os.getpid() and holder["run"] == "run-a"
        started = time.monotonic()
        with pytest.raises(CacheBusyError) as err:
            with CacheDir(tmp_path, {"s": 1}).build_lock("run-b", timeout=0.6, say=said.append, poll=0.05):
                pytest.fail("two runs held the lock at once")
        assert time.monotonic() - started >= 0.6  # it waited out its timeout before giving up
        msg = str(err.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()} since {holder['since']}" in msg
        assert str(cache.path / "lock") in msg and "rerun" in msg
        assert len(said) == 1 and f"pid {os.getpid()}" in said[0] and "waiting" in said[0]
        # another process of run-a (a non-zero rank) proceeds; one of another run keeps waiting
        with cache.build_lock("run-a", leader=False, timeout=0.5):
            pass
        with pytest.raises(CacheBusyError):
            with cache.build_lock("run-b", leader=False, timeout=0.2, poll=0.05):
                pass
    assert (cache.path / "lock").read_text() == ""  # released: no holder described
    with cache.build_lock("run-b", timeout=0.5):
        pass


def test_the_lock_of_a_killed_run_is_released(tmp_path):
    script = ("import sys, time; from extract.cache import CacheDir\n"
              f"with CacheDir({str(tmp_path)!r}, {{'s': 1}}).build_lock('victim'):\n"
              "    print('held', flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout.readline().strip() == "held"
        cache = CacheDir(tmp_path, {"s": 1})
        with pytest.raises(CacheBusyError, match=f"pid {proc.pid}"):
            with cache.build_lock("mine", timeout=0.3, say=lambda _: None):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with cache.build_lock("mine", timeout=10, say=lambda _: None):
        assert json.loads((cache.path / "lock").read_text())["pid"] == os.getpid()


# --------------------------------------------------------------------------------------------- permissions
@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask022", "umask027"])
def test_written_files_get_the_permissions_the_umask_says(tmp_path, umask, mode):
    import stat

    from extract.common.files import apply_umask, atomic_write_text, current_umask

    private = tmp_path / "private.bin"  # as safetensors' save_file and tempfile.mkstemp create files
    private.touch(mode=0o600)
    os.chmod(private, 0o600)
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        apply_umask(private)
        atomic_write_text(tmp_path / "latest", "step_00000001\n")
        cache = CacheDir(tmp_path / "cache", {"s": 1})
        cache.prepare()
    finally:
        os.umask(old)
    files = [private, tmp_path / "latest", cache.path / "settings.json"]
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: oct(mode) for p in files}
