"""Files that survive a kill: atomic writes (a reader sees the old file or the whole new one), fsync of files and
their folders, permissions as the umask says, and build locks that describe their holder. Shared by the feature
cache, checkpoints and the search index."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

LOCK_REMINDER_S = 600.0  # while waiting, repeat who holds the lock this often


def take_flock(f, lock_path: Path, run: str, *, timeout: float, busy: Callable[[str], Exception],
               waiting: Callable[[str], str] | None = None, say: Callable[[str], None] = print,
               poll: float = 0.5) -> None:
    """Take an exclusive ``flock`` on ``f`` (the open file ``lock_path``, mode ``a+``), then describe the holder in
    it (pid, host, ``run``, since when) for whoever finds it held.

    timeout: seconds to wait (0: one try). Still held then: raise ``busy(holder)``, ``holder`` being who holds it
        ("pid 12 on host h since ... (3 min ago)"). While waiting, ``say(waiting(holder))`` once and again every
        :data:`LOCK_REMINDER_S`.

    The kernel drops an flock when its process dies (kill -9 included): a crashed holder never leaves it taken.
    Release with :func:`release_flock`. Shared by the feature cache's build lock and the search index's.
    """
    start = last_said = time.monotonic()
    said = False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now - start >= timeout:
            raise busy(lock_holder(lock_path))
        if waiting is not None and (not said or now - last_said >= LOCK_REMINDER_S):
            say(waiting(lock_holder(lock_path)))
            said, last_said = True, now
        time.sleep(poll)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "run": run,
              "since": time.strftime("%Y-%m-%d %H:%M:%S %z"), "since_unix": time.time()}
    f.seek(0)
    f.truncate()
    f.write(json.dumps(holder))
    f.flush()


def release_flock(f) -> None:
    """Clear the holder description :func:`take_flock` wrote and release the lock."""
    f.seek(0)
    f.truncate()
    f.flush()
    fcntl.flock(f, fcntl.LOCK_UN)


def lock_holder(lock_path: Path) -> str:
    """Who holds ``lock_path``, as its holder described itself: "pid 12 on host h since ... (3 min ago)"."""
    return holder_text(read_holder(lock_path))


def read_holder(lock_path: Path) -> dict | None:
    """The holder a lock file describes (written by its holder after taking it), or None."""
    try:
        holder = json.loads(lock_path.read_text() or "null")
    except (OSError, ValueError):
        return None  # being rewritten at this instant, or unreadable: described as unknown
    return holder if isinstance(holder, dict) else None


def holder_text(holder: dict | None) -> str:
    if not holder:
        return "a process that has not described itself yet"
    ago = time.time() - float(holder.get("since_unix", time.time()))
    return (f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')} "
            f"({ago / 60:.0f} min ago)")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one, never a part, even
    after kill -9 or a power cut: temporary file, flushed and fsynced, renamed over, folder entry fsynced."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    apply_umask(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def current_umask() -> int:
    """The process's umask. Read from /proc where Linux shows it: os.umask can only read it by setting it,
    and a thread creating a file in between would get the wrong permissions."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give a file we wrote the permissions a plain ``open(path, "w")`` would have: 0o666 less the umask.
    Every atomic writer calls it on its temporary file before the rename, because some writers create files
    0600 whatever the umask (safetensors' save_file, tempfile.mkstemp), which hides checkpoints from the rest
    of a group sharing a run folder."""
    os.chmod(path, 0o666 & ~current_umask())


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
