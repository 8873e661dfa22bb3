"""The safetensors files plugvlm writes: atomic, permissions as the umask says, and a digest of their tensors.

Every safetensors file plugvlm saves (adapter checkpoints and training states, the ``--unfreeze`` backbone,
pre-training ``model.safetensors`` / ``state.safetensors``, per-rank RNG files) is written by
:func:`save_tensors`, which stores :func:`tensors_digest` in the header metadata under ``tensors_sha256``.
Every plugvlm reader of such files goes through :func:`load_tensors`, or :func:`verify_file` where another
library (open_clip) loads the file itself, and both recompute it. A file damaged after it was written (a bad
copy, a failing disk, bytes changed in transit) is then refused with its name instead of silently giving
other numbers, and so is a file we wrote with NaN or infinite floating weights. Files without the key (other
people's checkpoints, files from older plugvlm versions) load as before, unverified.

The digest covers the tensors only, not the JSON description beside them in the header (a damaged
description fails to parse, or says something the loaders check anyway).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Mapping

import torch

from extract.common.files import apply_umask, fsync_path

log = logging.getLogger(__name__)

DIGEST_KEY = "tensors_sha256"
_noted_unverified: set[str] = set()


class TensorFileError(ValueError):
    """A safetensors file that cannot be used: unreadable, damaged, or holding non-finite weights. The
    message names the file."""


class DamagedFileError(TensorFileError):
    """The tensor data no longer match the digest written when the file was saved."""


class NonFiniteError(TensorFileError):
    """Floating tensors hold NaN or infinite values."""


# --------------------------------------------------------------------------------------------- digest
class _Digest:
    """SHA-256 over tensors fed in sorted name order; each contributes a JSON line ``[name, dtype, shape]``
    (dtype as torch names it without ``torch.``) and then its raw bytes (little-endian, as in the file)."""

    def __init__(self):
        self._h = hashlib.sha256()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()  # the values, as saved
        head = [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
        self._h.update(json.dumps(head, separators=(",", ":")).encode() + b"\n")
        self._h.update(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's memory, no copy

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The digest plugvlm stores under ``tensors_sha256`` (see :class:`_Digest` for what it covers): equal
    names, dtypes, shapes and bytes give an equal digest, whatever the order of ``tensors``."""
    d = _Digest()
    for name in sorted(tensors):
        d.add(name, tensors[name])
    return d.hexdigest()


# --------------------------------------------------------------------------------------------- finiteness
def _nonfinite_counts(t: torch.Tensor) -> tuple[int, int] | None:
    """(NaN count, infinite count) of a floating / complex tensor with any of them; None otherwise."""
    if not (t.is_floating_point() or t.is_complex()):
        return None
    if t.element_size() == 1:  # float8 kinds: not every op is implemented for them
        t = t.float()
    if bool(torch.isfinite(t).all()):
        return None
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Name of the first (in sorted name order) floating tensor holding NaN or inf; None when all are finite.
    Integer and bool tensors (RNG states, step counters) are never non-finite."""
    for name in sorted(tensors):
        if _nonfinite_counts(tensors[name]) is not None:
            return name
    return None


def _nonfinite_message(name: str, t: torch.Tensor) -> str:
    nan, inf = _nonfinite_counts(t)
    return f"tensor {name!r} holds {nan} NaN and {inf} infinite values (of {t.numel()})"


def assert_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise :class:`NonFiniteError` ("<what>: tensor 'x' holds 3 NaN and 0 infinite values (of 64)") when a
    floating tensor of ``tensors`` is not finite. For writers that must not save diverged weights."""
    name = first_nonfinite(tensors)
    if name is not None:
        raise NonFiniteError(f"{what}: {_nonfinite_message(name, tensors[name])}")


# --------------------------------------------------------------------------------------------- writing
def _private_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors safetensors accepts: a tensor sharing storage with another one, or viewing part
    of a larger storage, is copied (safetensors refuses shared storage); the others are not (a model's
    weights are not duplicated in memory just to be saved)."""
    out, seen = {}, set()
    for k, v in tensors.items():
        t = v.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out


def save_tensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                 metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` as a safetensors file at ``path`` with ``metadata`` and the digest of the tensors
    (``tensors_sha256``) in its header. Written under a temporary name, given the permissions the umask says
    (safetensors creates files 0600), fsynced and renamed into place: a reader, or a run killed mid-write,
    never sees half a file. Does not refuse non-finite weights (see :func:`assert_finite`); loading them does.
    Returns the path."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = _private_cpu(tensors)
    header = {**(metadata or {}), DIGEST_KEY: tensors_digest(plain)}
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        save_file(plain, str(tmp), metadata=header)
        apply_umask(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


# --------------------------------------------------------------------------------------------- reading
def _open(path: Path):
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise TensorFileError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); it may have "
                              "been cut short while copied: re-copy it") from None


def _check(path: Path, metadata: Mapping[str, str], items: Iterable[tuple[str, torch.Tensor]]) -> bool:
    """Verify ``items`` (all the file's tensors, in sorted name order) against the file's digest and refuse
    non-finite ones; False (nothing checked) when the file carries no digest."""
    expected = metadata.get(DIGEST_KEY)
    if expected is None:
        if "plugvlm" in metadata and str(path) not in _noted_unverified:  # one of ours, from before digests
            _noted_unverified.add(str(path))
            log.warning("%s carries no tensor digest (written by an older plugvlm): loaded without an integrity "
                        "check", path)
        return False
    digest, bad = _Digest(), None
    for name, t in items:
        digest.add(name, t)
        if bad is None and _nonfinite_counts(t) is not None:
            bad = _nonfinite_message(name, t)
    if digest.hexdigest() != expected:
        raise DamagedFileError(f"{path} is damaged: its tensor data do not match the digest written when it was "
                               "saved; re-copy it or use an earlier checkpoint")
    if bad is not None:
        raise NonFiniteError(f"{path} holds non-finite weights: {bad}; the run that saved it had most likely "
                             "diverged: use an earlier checkpoint")
    return True


def load_tensors(path: str | os.PathLike, device: str | torch.device = "cpu"
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, header metadata) of a safetensors file, verified when it carries plugvlm's digest: raises
    :class:`DamagedFileError` when the data do not match it and :class:`NonFiniteError` when a floating tensor
    holds NaN or inf (both name the file). FileNotFoundError for a missing file, :class:`TensorFileError` for
    one that is not safetensors."""
    path = Path(path)
    with _open(path) as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    _check(path, metadata, ((k, tensors[k]) for k in sorted(tensors)))
    if torch.device(device).type != "cpu":
        tensors = {k: v.to(device) for k, v in tensors.items()}
    return tensors, metadata


def verify_file(path: str | os.PathLike) -> bool:
    """Check a safetensors file another library will load (open_clip loads backbone files itself) as
    :func:`load_tensors` would, reading one tensor at a time. True when verified, False when the file carries
    no digest (not written by plugvlm); raises as :func:`load_tensors` does."""
    path = Path(path)
    with _open(path) as f:
        metadata = dict(f.metadata() or {})
        if DIGEST_KEY not in metadata:
            return _check(path, metadata, ())
        return _check(path, metadata, ((k, f.get_tensor(k)) for k in sorted(f.keys())))
