"""The feature cache: sharded, memory-mappable, fingerprinted, safe to kill at any moment.

Layout of ``CACHE_DIR`` (one sub-folder per fingerprint, so caches built with different settings live side
by side and are never confused)::

    CACHE_DIR/<fingerprint[:16]>/settings.json       everything that changes the numbers (+ full fingerprint)
    CACHE_DIR/<fingerprint[:16]>/shard-00000/         one finished shard: <array>.npy files + meta.json
    CACHE_DIR/<fingerprint[:16]>/manifest.json        written last, when every shard is done
    CACHE_DIR/<fingerprint[:16]>/report.json          skipped inputs and counts
    CACHE_DIR/<fingerprint[:16]>/lock                 flock'ed by the run building the cache (holder as JSON)

A shard is written into ``shard-XXXXX.tmp-<pid>`` and renamed into place only when complete (a directory
rename is atomic on POSIX), so a kill -9 leaves at worst a temporary folder that no reader looks at and the
next run deletes. Readers open ``.npy`` files with ``mmap_mode="r"``: nothing is loaded until indexed.

Damage after the fact (a copy cut short, a full disk, a file truncated by hand) is caught when a cache is
opened, not at the first gather: each shard's meta.json records the byte size of every ``.npy`` it holds, and
:func:`shard_problem` compares them with ``stat`` (caches written before sizes were recorded: the size the
``.npy`` header implies). Readers raise :class:`CacheError` naming the file; the writer (``python -m
extract``) treats a damaged shard as not done, so rerunning the command that built the cache rebuilds exactly
the damaged shards.

One run builds a given cache at a time: :meth:`CacheDir.build_lock` holds an exclusive ``flock`` on the
``lock`` file (the kernel drops it when the process dies, kill -9 included). A second run into the same folder
waits for it, saying who holds it, and then finds the cache complete and reuses it; after
:data:`LOCK_TIMEOUT_S` it gives up with :class:`CacheBusyError`. Reading a finished cache takes no lock.

Arrays are keyed by name; those starting with ``image_`` / ``region_`` / ``ventity_`` / ``vrelation_`` / ``patch_``
have one row per image of the shard, all others one row per caption (``caption_image`` maps a caption
to its image row inside the shard).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from extract.common.files import (atomic_write_text, fsync_path, holder_text, read_holder, release_flock,
                                 take_flock)

FORMAT_VERSION = 1
IMAGE_PREFIXES = ("image_", "patch_", "region_", "ventity_", "vrelation_")


# How long a run waits for another run building the same cache before giving up (seconds). Waiting is the
# useful default: the other run's cache is what this one would compute, so it is reused when that finishes.
# The environment variable PLUGVLM_CACHE_LOCK_TIMEOUT overrides it.
LOCK_TIMEOUT_S = 24 * 3600.0


class CacheError(ValueError):
    """A cache folder that cannot be used as it is (damaged files, busy); the message names the file and what to
    do. A ValueError, so command-line entry points report it as a one-line error."""


class CacheBusyError(CacheError):
    """Another run holds the cache's build lock and did not release it within the timeout."""


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


def shard_problem(shard: Path, meta: dict | None = None) -> str | None:
    """None when the finished shard folder ``shard`` is intact, else what is wrong with it, naming the file.

    Cheap: one ``stat`` per array, compared with the byte sizes meta.json recorded at write time (``meta``:
    that file's content, if already read). Shards written before sizes were recorded fall back to the size the
    ``.npy`` header implies (a read of its first bytes), so a truncated file is caught there too.
    """
    meta_path = shard / "meta.json"
    if meta is None:
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            return f"{meta_path} is missing"
        except (OSError, ValueError) as e:
            return f"{meta_path} is unreadable ({e})"
    if not isinstance(meta, dict) or not isinstance(meta.get("arrays"), dict):
        return f"{meta_path} lists no arrays"
    recorded = meta.get("bytes") or {}
    for key, info in sorted(meta["arrays"].items()):
        path = shard / f"{key}.npy"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{path} is missing"
        except OSError as e:
            return f"{path} cannot be read ({e.strerror or e})"
        if key in recorded:
            if size != recorded[key]:
                return f"{path} is {size:,} bytes, the shard's meta.json says {recorded[key]:,}"
            continue
        problem = _npy_problem(path, size, info)
        if problem:
            return problem
    return None


def _npy_problem(path: Path, size: int, info: dict) -> str | None:
    """Check a .npy against its own header (and the shape / dtype meta.json lists): for caches without sizes."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
            header = f.tell()
    except (OSError, ValueError, EOFError) as e:
        return f"{path} is not a readable .npy file ({e})"
    if list(shape) != list(info.get("shape", shape)) or str(dtype) != info.get("dtype", str(dtype)):
        return (f"{path} holds {dtype} {list(shape)}, the shard's meta.json says {info.get('dtype')} "
                f"{info.get('shape')}")
    want = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != want:
        return f"{path} is {size:,} bytes, its header ({dtype} {list(shape)}) needs {want:,}"
    return None


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
        """The shard is finished and intact (see :func:`shard_problem`); a damaged one counts as not done."""
        return self.shard_problem(index) is None

    def shard_problem(self, index: int) -> str | None:
        """None when shard ``index`` is finished and intact, else what is wrong ("... is missing" when absent)."""
        return shard_problem(self.path / shard_name(index))

    def damaged_shards(self, indices: Iterable[int]) -> dict[int, str]:
        """Shards among ``indices`` whose folder exists but fails the check, with what is wrong."""
        out = {}
        for i in indices:
            if (self.path / shard_name(i)).exists():
                problem = self.shard_problem(i)
                if problem is not None:
                    out[i] = problem
        return out

    def problems(self) -> dict[str, str]:
        """For a finished cache: the shards of its manifest that are missing or damaged, with what is wrong."""
        try:
            manifest = json.loads((self.path / "manifest.json").read_text())
            names = [s["name"] for s in manifest["shards"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return {"manifest.json": f"{self.path / 'manifest.json'} is unreadable ({e})"}
        found = {name: shard_problem(self.path / name) for name in names}
        return {name: p for name, p in found.items() if p is not None}

    def discard_shard(self, index: int) -> None:
        """Remove a (damaged) finished shard: renamed to a temporary name first, which no reader looks at and
        :meth:`clean_partial` deletes if this process dies before the removal ends."""
        final = self.path / shard_name(index)
        aside = self.path / f"{shard_name(index)}.tmp-damaged-{os.getpid()}"
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
            shutil.rmtree(aside, ignore_errors=True)

    def retract_manifest(self) -> None:
        """Mark a finished cache unfinished again (before rebuilding a damaged shard), so no reader opens it."""
        try:
            os.unlink(self.path / "manifest.json")
        except FileNotFoundError:
            return
        fsync_path(self.path)

    @contextmanager
    def build_lock(self, run: str, leader: bool = True, timeout: float | None = None,
                   say: Callable[[str], None] = print, poll: float = 0.5) -> Iterator[None]:
        """Hold this cache's build lock for one run (an exclusive ``flock`` on ``<path>/lock``).

        run: what identifies the run (the same string in every process of a multi-process run).
        leader: the process that takes the lock (rank 0). The other processes of the run (``leader=False``)
            take nothing: they wait until the lock file names their run as holder, so a run of N processes
            holds the lock once, and no process starts before its run owns the cache.
        timeout: seconds to wait (default: $PLUGVLM_CACHE_LOCK_TIMEOUT, else :data:`LOCK_TIMEOUT_S`); then
            :class:`CacheBusyError`. While waiting, ``say`` tells who holds the lock (pid, host, since when),
            again every LOCK_REMINDER_S.

        The kernel releases an flock when its process dies (kill -9 included), so a crashed run never leaves
        the cache locked. The holder description is cleared before a normal release.
        """
        if timeout is None:
            raw = os.environ.get("PLUGVLM_CACHE_LOCK_TIMEOUT", LOCK_TIMEOUT_S)
            try:
                timeout = float(raw)
            except ValueError:
                raise CacheError(f"PLUGVLM_CACHE_LOCK_TIMEOUT={raw!r} is not a number of seconds") from None
        self.path.mkdir(parents=True, exist_ok=True)
        lock_path = self.path / "lock"
        with open(lock_path, "a+") as f:
            if leader:
                self._take_lock(f, lock_path, run, timeout, say, poll)
                try:
                    yield
                finally:
                    release_flock(f)
            else:
                self._wait_for_leader(f, lock_path, run, timeout, poll)
                yield

    def _take_lock(self, f, lock_path: Path, run: str, timeout: float, say, poll: float) -> None:
        take_flock(f, lock_path, run, timeout=timeout, say=say, poll=poll,
                   busy=lambda holder: CacheBusyError(
                       f"{lock_path} is held by {holder}: another run is building this cache. Gave up waiting after "
                       f"{timeout:.0f} s (PLUGVLM_CACHE_LOCK_TIMEOUT); rerun the same command once it has finished "
                       "and its cache is reused."),
                   waiting=lambda holder: (
                       f"waiting for {lock_path}: held by {holder}, another run building this cache; it is reused "
                       f"when that run finishes (giving up after {timeout:.0f} s)"))

    def _wait_for_leader(self, f, lock_path: Path, run: str, timeout: float, poll: float) -> None:
        # The leader may itself wait up to `timeout` for another run; allow it that, plus time to get there.
        deadline = time.monotonic() + timeout + min(timeout, 120.0)
        while True:
            if (read_holder(lock_path) or {}).get("run") == run:
                try:  # the description could outlive a killed leader: the lock must also be held right now
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    fcntl.flock(f, fcntl.LOCK_UN)
                except BlockingIOError:
                    return
            if time.monotonic() >= deadline:
                raise CacheBusyError(f"{lock_path}: the first process of this run never took the lock "
                                     f"(holder: {holder_text(read_holder(lock_path))})")
            time.sleep(poll)

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
        sizes = {}
        for key, value in arrays.items():
            with open(tmp / f"{key}.npy", "wb") as f:
                np.save(f, np.ascontiguousarray(value), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
                sizes[key] = f.tell()
        # byte sizes let readers find a cut file with one stat (shard_problem) instead of at the first gather
        meta = dict(meta, arrays={k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in arrays.items()},
                    bytes=sizes)
        with open(tmp / "meta.json", "w") as f:
            f.write(json.dumps(meta, sort_keys=True, default=str))
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if final.exists():
            if shard_problem(final) is None:  # an earlier run finished it meanwhile: theirs is identical
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            self.discard_shard(index)  # damaged: ours replaces it
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
        self.manifest = self._json(manifest_path)
        self.settings = self._json(self.path / "settings.json")["settings"]
        self.fingerprint = self.manifest["fingerprint"]
        self._shards: list[_Shard] = []
        img = cap = 0
        damaged = []
        # Every array file is checked here (one stat each), so a cut file fails at open, naming itself, instead
        # of as numpy's "mmap length is greater than file size" at the first gather, hours into a run.
        for s in self.manifest["shards"]:
            shard = self.path / s["name"]
            meta = None
            try:
                meta = json.loads((shard / "meta.json").read_text())
            except (OSError, ValueError):
                pass  # shard_problem below says what is wrong with it
            problem = shard_problem(shard, meta)
            if problem is not None:
                damaged.append(problem)
                continue
            self._shards.append(_Shard(shard, meta, img, cap))
            img += meta["images"]
            cap += meta["captions"]
        if damaged:
            advice = (f"rerun the same `python -m extract` command (or python -m train.adapter) that built this cache to rebuild "
                      f"{'that shard' if len(damaged) == 1 else 'those shards'} (nothing else is recomputed), or "
                      f"delete {self.path}")
            raise CacheError(f"{damaged[0]}: the shard is damaged; {advice}" if len(damaged) == 1 else
                             f"{len(damaged)} shards of {self.path} are damaged:\n  " + "\n  ".join(damaged)
                             + f"\n{advice}")
        self.num_images, self.num_captions = img, cap
        self._cap_starts = np.array([s.caption_offset for s in self._shards] + [cap])
        self._img_starts = np.array([s.image_offset for s in self._shards] + [img])
        self._mmaps: dict[tuple[int, str], np.ndarray] = {}

    @staticmethod
    def _json(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise CacheError(f"{path} is missing: the cache {path.parent} is damaged; delete it and rerun the "
                             "command that built it") from None
        except (OSError, ValueError) as e:
            raise CacheError(f"{path} is unreadable ({e}): the cache {path.parent} is damaged; delete it and rerun "
                             "the command that built it") from None

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
