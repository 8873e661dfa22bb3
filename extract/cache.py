"""The feature cache: sharded, memory-mappable, fingerprinted, safe to kill at any moment.

Layout of ``CACHE_DIR`` (one sub-folder per fingerprint, so caches built with different settings live side
by side and are never confused)::

    CACHE_DIR/<fingerprint[:16]>/settings.json       everything that changes the numbers (+ full fingerprint)
    CACHE_DIR/<fingerprint[:16]>/shard-00000/         one finished shard: <array>.npy files + meta.json
    CACHE_DIR/<fingerprint[:16]>/manifest.json        written last, when every shard is done
    CACHE_DIR/<fingerprint[:16]>/report.json          skipped inputs and counts

A shard is written into ``shard-XXXXX.tmp-<pid>`` and renamed into place only when complete (a directory
rename is atomic on POSIX), so a kill -9 leaves at worst a temporary folder that no reader looks at and the
next run deletes. Readers open ``.npy`` files with ``mmap_mode="r"``: nothing is loaded until indexed.

Arrays are keyed by name; those starting with ``image_`` / ``region_`` / ``ventity_`` / ``vrelation_`` / ``patch_``
have one row per image of the shard, all others one row per caption (``caption_image`` maps a caption
to its image row inside the shard).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

FORMAT_VERSION = 1
IMAGE_PREFIXES = ("image_", "patch_", "region_", "ventity_", "vrelation_")


def is_image_key(key: str) -> bool:
    """True for arrays with one row per image (see module docstring), False for per-caption arrays."""
    return key.startswith(IMAGE_PREFIXES)


def fingerprint(settings: dict) -> str:
    """SHA-256 of the settings as canonical JSON (sorted keys, no whitespace): equal settings, equal hash."""
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def settings_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two settings dicts (``key: old -> new``), for rebuild messages."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += settings_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out


_fingerprint = fingerprint  # FeatureCache.open has a parameter of the same name


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


class CacheDir:
    """One fingerprinted cache folder (``CACHE_DIR/<fingerprint[:16]>``): the writer's side."""

    def __init__(self, root: str | os.PathLike, settings: dict):
        self.settings = settings
        self.fingerprint = fingerprint(settings)
        self.root = Path(root)
        self.path = self.root / self.fingerprint[:16]

    def prepare(self) -> None:
        """Create the folder and its settings.json (same content from every rank, written atomically)."""
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.path / "settings.json"
        if not target.exists():
            atomic_write_text(target, json.dumps({"fingerprint": self.fingerprint, "format": FORMAT_VERSION,
                                                   "settings": self.settings}, indent=2, sort_keys=True, default=str))

    def other_caches(self) -> list[tuple[Path, dict]]:
        """Caches in the same root built with other settings (to explain why this one is being built)."""
        found = []
        for s in sorted(self.root.glob("*/settings.json")):
            if s.parent != self.path:
                try:
                    found.append((s.parent, json.loads(s.read_text())["settings"]))
                except (OSError, ValueError, KeyError):
                    continue
        return found

    def is_complete(self) -> bool:
        return (self.path / "manifest.json").is_file()

    def shard_done(self, index: int) -> bool:
        return (self.path / shard_name(index) / "meta.json").is_file()

    def clean_partial(self, indices: Iterable[int]) -> int:
        """Delete temporary folders left by a killed run for these shard indices; returns how many."""
        removed = 0
        for i in indices:
            for tmp in self.path.glob(shard_name(i) + ".tmp-*"):
                shutil.rmtree(tmp, ignore_errors=True)
                removed += 1
        return removed

    def write_shard(self, index: int, arrays: dict[str, np.ndarray], meta: dict) -> Path:
        """Write one shard atomically: arrays as .npy, ``meta`` (ids, counts, skips) as meta.json last."""
        final = self.path / shard_name(index)
        tmp = self.path / f"{shard_name(index)}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # Files are fsynced before the rename so a power cut cannot leave a renamed (= finished-looking)
        # shard with empty files; kill -9 alone could not, the page cache survives the process.
        for key, value in arrays.items():
            with open(tmp / f"{key}.npy", "wb") as f:
                np.save(f, np.ascontiguousarray(value), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
        meta = dict(meta, arrays={k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in arrays.items()})
        with open(tmp / "meta.json", "w") as f:
            f.write(json.dumps(meta, sort_keys=True, default=str))
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if final.exists():  # another rank or an earlier run finished it meanwhile: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
            return final
        os.rename(tmp, final)
        fsync_path(self.path)
        return final

    def write_manifest(self, n_shards: int, extra: dict) -> dict:
        """Check every shard is present, sum their counts, and write manifest.json (last act of a build)."""
        shards = []
        for i in range(n_shards):
            meta_path = self.path / shard_name(i) / "meta.json"
            if not meta_path.is_file():
                raise RuntimeError(f"cannot finish the cache: {meta_path.parent} is missing")
            meta = json.loads(meta_path.read_text())
            shards.append({"name": shard_name(i), "images": meta["images"], "captions": meta["captions"]})
        manifest = {"fingerprint": self.fingerprint, "format": FORMAT_VERSION, "shards": shards,
                    "images": sum(s["images"] for s in shards), "captions": sum(s["captions"] for s in shards),
                    **extra}
        atomic_write_text(self.path / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True))
        return manifest


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one, never a part, even
    after kill -9 or a power cut: temporary file, flushed and fsynced, renamed over, folder entry fsynced."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (rename durability needs the directory entry flushed too); a no-op where the
    OS refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------- reading
@dataclass
class _Shard:
    path: Path
    meta: dict
    image_offset: int
    caption_offset: int


class FeatureCache:
    """Read side of a finished cache. Memory-mapped; batches are gathered with one fancy index per shard.

    ``FeatureCache.open(CACHE_DIR)`` picks the only complete cache in ``CACHE_DIR`` (or the one with the
    given fingerprint / settings); several candidates without a choice is an error that lists them.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{self.path} is not a finished cache (no manifest.json); rerun the extraction "
                                    "command that built it: it resumes where it stopped")
        self.manifest = json.loads(manifest_path.read_text())
        self.settings = json.loads((self.path / "settings.json").read_text())["settings"]
        self.fingerprint = self.manifest["fingerprint"]
        self._shards: list[_Shard] = []
        img = cap = 0
        for s in self.manifest["shards"]:
            meta = json.loads((self.path / s["name"] / "meta.json").read_text())
            self._shards.append(_Shard(self.path / s["name"], meta, img, cap))
            img += meta["images"]
            cap += meta["captions"]
        self.num_images, self.num_captions = img, cap
        self._cap_starts = np.array([s.caption_offset for s in self._shards] + [cap])
        self._img_starts = np.array([s.image_offset for s in self._shards] + [img])
        self._mmaps: dict[tuple[int, str], np.ndarray] = {}

    @classmethod
    def open(cls, root: str | os.PathLike, fingerprint: str | None = None, settings: dict | None = None) -> FeatureCache:
        root = Path(root)
        if (root / "manifest.json").is_file():
            cache = cls(root)
        else:
            want = fingerprint or (_fingerprint(settings) if settings is not None else None)
            done = [p.parent for p in sorted(root.glob("*/manifest.json"))]
            if want is not None:
                done = [p for p in done if want.startswith(p.name) or p.name.startswith(want[:16])]
            if len(done) != 1:
                listing = "\n".join(f"  {p.name}: {json.loads((p / 'settings.json').read_text())['settings'].get('summary', '')}"
                                    for p in done) or "  (none)"
                raise FileNotFoundError(
                    f"{'no' if not done else 'several'} finished cache(s) in {root} match"
                    f"{' fingerprint ' + want[:16] if want else ''}:\n{listing}\n"
                    "Build it with `python -m extract ... --out " + str(root) + "`, or name one by its fingerprint.")
            cache = cls(done[0])
        if settings is not None and cache.settings != settings:
            diff = "\n  ".join(settings_diff(cache.settings, settings))
            raise ValueError(f"cache {cache.path} was built with other settings:\n  {diff}")
        return cache

    # -- metadata --------------------------------------------------------------------------------------
    @property
    def keys(self) -> list[str]:
        return sorted(self._shards[0].meta["arrays"]) if self._shards else []

    def caption_ids(self) -> list[str]:
        return [c for s in self._shards for c in s.meta["caption_ids"]]

    def image_ids(self) -> list[str]:
        return [i for s in self._shards for i in s.meta["image_ids"]]

    def caption_image_index(self) -> np.ndarray:
        """[num_captions] global image row of every caption."""
        return np.concatenate([self._array(k, "caption_image").astype(np.int64) + s.image_offset
                               for k, s in enumerate(self._shards)]) if self._shards else np.zeros(0, np.int64)

    def _array(self, shard: int, key: str) -> np.ndarray:
        m = self._mmaps.get((shard, key))
        if m is None:
            m = np.load(self._shards[shard].path / f"{key}.npy", mmap_mode="r", allow_pickle=False)
            self._mmaps[(shard, key)] = m
        return m

    # -- gathering -------------------------------------------------------------------------------------
    def gather(self, key: str, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows (global image rows for image keys, caption rows otherwise) of one array, in the given order.

        Per-shard arrays may differ in a trailing padded length (e.g. tokens trimmed to the shard's longest
        caption); the result is zero-padded to the longest, so masks stored alongside stay exact.
        """
        rows = np.asarray(rows, dtype=np.int64)
        starts = self._img_starts if is_image_key(key) else self._cap_starts
        shard_of = np.searchsorted(starts, rows, side="right") - 1
        parts, order = [], []
        for k in np.unique(shard_of):
            sel = np.nonzero(shard_of == k)[0]
            parts.append(self._array(int(k), key)[rows[sel] - starts[k]])
            order.append(sel)
        if not parts:
            return np.zeros((0,), dtype=np.float32)
        shape = np.max([p.shape for p in parts], axis=0)
        out = np.zeros((len(rows), *shape[1:]), dtype=parts[0].dtype)
        for sel, p in zip(order, parts):
            out[(sel, *[slice(0, n) for n in p.shape[1:]])] = p
        return out

    def batch(self, caption_rows: Sequence[int] | np.ndarray, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Everything for a batch of (image, caption) pairs given by caption rows: caption arrays for those
        captions, image arrays for their images (so row b of every output belongs to pair b)."""
        caption_rows = np.asarray(caption_rows, dtype=np.int64)
        keys = list(keys or self.keys)
        image_rows = None
        out = {}
        for key in keys:
            if key == "caption_image":
                continue
            if is_image_key(key):
                if image_rows is None:
                    image_rows = self._global_image_rows(caption_rows)
                out[key] = self.gather(key, image_rows)
            else:
                out[key] = self.gather(key, caption_rows)
        return out

    def _global_image_rows(self, caption_rows: np.ndarray) -> np.ndarray:
        shard_of = np.searchsorted(self._cap_starts, caption_rows, side="right") - 1
        out = np.empty(len(caption_rows), dtype=np.int64)
        for k in np.unique(shard_of):
            sel = np.nonzero(shard_of == k)[0]
            local = self._array(int(k), "caption_image")[caption_rows[sel] - self._cap_starts[k]]
            out[sel] = local + self._img_starts[k]
        return out
