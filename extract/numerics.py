"""The process-wide numeric settings that make a value a function of its input, decided in one place.

Imported by each package's ``__init__`` (``extract``, ``adapters``, ``serve``, ``train``), so every entry point of
ours (``python -m serve``, ``python -m extract``, ``from adapters.load import load_scorer``) has them before its
first matrix product:

- **MKL's conditional numerical reproducibility** (``MKL_CBWR=AUTO,STRICT``). torch's CPU BLAS is MKL; in its
  default mode MKL may take another code path for a differently aligned buffer or another thread split, so the same
  product could round differently in a resumed run or another process. STRICT fixes the path for the CPU it runs
  on. MKL reads the variable once, at its first call, so it is set here, before any; a process that multiplied
  matrices before importing us keeps the mode it started with (:func:`mkl_mode` tells; the default (unset) MKL
  already gives equal results for equal, 64-byte aligned inputs, which is what torch's allocator hands out). A
  user's own ``MKL_CBWR`` is kept. It costs nothing measurable here (a 3200x768x3072 product 90 ms either way).

What this cannot decide: the kernels' summation order for a given *shape*, which is why live extraction computes
each item alone (:class:`adapters.adapter_scorer.LiveExtractor`), and a thread count, which the caller chooses
(two processes compare bit for bit at the same count; 1 against 2 threads agree to about 1e-6).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

#: MKL_CBWR's value: the CPU's own code path, strict (bitwise reproducible for a given CPU and thread count)
MKL_CBWR = "AUTO,STRICT"
os.environ.setdefault("MKL_CBWR", MKL_CBWR)

#: mkl_cbwr_get's bits (MKL's mkl_service.h): MKL_CBWR_OFF 0, MKL_CBWR_AUTO 2, MKL_CBWR_STRICT 0x10000
_MODES = {0: "off", 1: "off", 2: "auto"}
_STRICT = 0x10000


def mkl_mode() -> str | None:
    """The mode MKL runs in ("auto,strict", "auto", "off", or a CPU branch's number), None where torch carries no MKL
    (an ARM build, or one linked against another BLAS). Reading it fixes the mode, as MKL's first call would."""
    import torch

    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get  # MKL is linked into torch statically: its service symbols come with it
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    bits = get(-1)  # MKL_CBWR_ALL
    branch = _MODES.get(bits & 0xFFFF, str(bits & 0xFFFF))
    return branch + (",strict" if bits & _STRICT else "")
