"""Model FLOPs utilisation: the FLOPs a step's model math needs, counted by ``torch.utils.flop_counter``, per
second of step time, against the device's dense peak for the precision.

FLOPs are counted on an eager forward + backward (``FlopCounterMode``: matmuls, convolutions and attention,
2 FLOPs per multiply-add, the backward's own matmuls included), before anything is compiled, and without
activation recomputation: the *model* FLOPs of PaLM's MFU (Chowdhery et al. 2022, App. B), which a faster
implementation of the same math does not change. Element-wise work (norms, softmax, the optimizer) is not
counted, as in that definition.

Peaks are the vendors' dense (no sparsity) figures for the SXM / flagship part of each name: tensor-core bf16 /
fp16 for ``amp`` / ``amp_bf16``, plain fp32 for ``fp32`` (torch's default matmul precision does not use TF32).
A device not in the table (every CPU) has no MFU unless ``--peak-tflops`` says its peak.
"""
from __future__ import annotations

from typing import Callable

import torch

# device-name substring -> (dense 16-bit tensor-core TFLOP/s, fp32 TFLOP/s); the first match wins, so more
# specific names come first.
PEAK_TFLOPS = (
    ("H100 PCIe", (756.0, 51.2)),
    ("H100 NVL", (835.0, 60.0)),
    ("H100", (989.4, 66.9)),
    ("H200", (989.4, 66.9)),
    ("H20", (148.0, 44.0)),
    ("B200", (2250.0, 80.0)),
    ("A100", (312.0, 19.5)),
    ("A800", (312.0, 19.5)),
    ("L40S", (362.1, 91.6)),
    ("L40", (181.0, 90.5)),
    ("L4", (121.0, 30.3)),
    ("RTX 4090", (165.2, 82.6)),
    ("V100", (125.0, 15.7)),
)


def peak_tflops(device: torch.device | str, precision: str, override: float | None = None) -> float | None:
    """The dense peak TFLOP/s of ``device`` at ``precision`` (``fp32``, ``amp``, ``amp_bf16``, ...), ``override``
    when given; None when unknown (every CPU)."""
    if override is not None:
        return override
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, single) in PEAK_TFLOPS:
        if key in name:
            return single if precision == "fp32" else half
    return None


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs ``fn()`` performs (forward and backward if it runs both), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def mfu(flops_per_step: int, seconds_per_step: float, peak: float | None) -> float | None:
    """Achieved model FLOP/s as a fraction of ``peak`` TFLOP/s; None without a peak."""
    if peak is None or seconds_per_step <= 0:
        return None
    return flops_per_step / seconds_per_step / (peak * 1e12)
