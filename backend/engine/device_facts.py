"""Device facts the result needs: peak FLOP/s by exact device name, MFU vs HFU, and where `auto` runs.

Peaks are dense (no 2:4 sparsity) per GPU, from the vendors' datasheets; fp32 is plain FP32 (torch's
default matmul precision is "highest": no TF32). A name that is not in the table gives no peak (mfu/hfu
None), never a guess from a substring: an "H100" is 756 (PCIe), 835 (NVL) or 989 (SXM) TFLOP/s in bf16.
Keys are `torch.cuda.get_device_name()` strings, compared case-insensitively after trimming.

MFU counts model FLOPs only (6N + attention per token, no recompute: Chowdhery et al. 2022, PaLM,
Appendix B); HFU counts the FLOPs the hardware ran, recompute included (Korthikanti et al. 2022 Sec 6.3).
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

# (fp32 FLOP/s, 16-bit tensor-core FLOP/s), dense
_H100_SXM = (67e12, 989e12)  # NVIDIA H100 datasheet, H100 SXM column: FP32 67 TF, BF16 1,979 TF with sparsity
_H100_NVL = (60e12, 835e12)  # same datasheet, H100 NVL column: FP32 60 TF, BF16 1,671 TF with sparsity
_H100_PCIE = (51e12, 756e12)  # H100 PCIe (2022 datasheet): FP32 51 TF, BF16 1,513 TF with sparsity
_H200_SXM = (67e12, 989e12)  # NVIDIA H200 datasheet, H200 SXM: FP32 67 TF, BF16 1,979 TF with sparsity
_H200_NVL = (60e12, 835e12)  # H200 NVL: FP32 60 TF, BF16 1,671 TF with sparsity
_A100 = (19.5e12, 312e12)  # NVIDIA A100 datasheet: FP32 19.5 TF, BF16 312 TF (SXM and PCIe, 40 and 80 GB alike)
_B200 = (80e12, 2250e12)  # NVIDIA HGX B200 (1,000 W): FP32 80 TF, BF16 4.5 PF with sparsity
_MI300X = (163.4e12, 1307.4e12)  # AMD Instinct MI300X datasheet: FP32 matrix 163.4 TF, BF16 1,307.4 TF dense

PEAKS: dict[str, tuple[float, float]] = {
    "nvidia h100 80gb hbm3": _H100_SXM,
    "nvidia h100 sxm5 80gb": _H100_SXM,
    "nvidia gh200 480gb": _H100_SXM,  # the Hopper GPU of GH200 is an H100 SXM part
    "nvidia h100 nvl": _H100_NVL,
    "nvidia h100 pcie": _H100_PCIE,
    "nvidia h200": _H200_SXM,
    "nvidia h200 nvl": _H200_NVL,
    "nvidia a100-sxm4-80gb": _A100,
    "nvidia a100-sxm4-40gb": _A100,
    "nvidia a100-pcie-40gb": _A100,
    "nvidia a100 80gb pcie": _A100,
    "nvidia b200": _B200,
    "amd instinct mi300x": _MI300X,
}


def peak_flops(device_name: str | None, precision: str) -> float | None:
    """Dense peak FLOP/s of one device of exactly this name at this precision; None when unknown."""
    row = PEAKS.get(str(device_name or "").strip().lower())
    if row is None:
        return None
    return row[0] if str(precision) == "fp32" else row[1]


def utilization(model_flops: float, hardware_flops: float, step_s: float | None, env: dict[str, Any],
                precision: str, world_size: int) -> tuple[float | None, float | None]:
    """(MFU, HFU) of a step that took step_s on `world_size` devices; (None, None) off CUDA, for mixed or unknown
    devices, or without a step time."""
    if not step_s or env.get("device_type") != "cuda":
        return None, None
    names = env.get("device_names") or [env.get("device_name")]
    peaks = {peak_flops(n, precision) for n in names}
    if len(peaks) != 1 or None in peaks:
        return None, None
    total = peaks.pop() * world_size * step_s
    return model_flops / total, hardware_flops / total


def host_device(requested: str) -> str:
    """spec.runtime.device resolved on this host as the engine would (backend.engine.mesh.pick_backend_device).
    With a CPU-only build of torch `auto` is the CPU, known without importing torch (~3 s and ~275 MB for a queue
    insert: `submit`, `estimate`)."""
    from backend.analytic.device import resolve_device

    if str(requested) != "auto":
        return resolve_device(str(requested), cuda_available=False)
    return resolve_device("auto", cuda_available=cuda_available())


def cuda_available() -> bool:
    """torch.cuda.is_available(); a CPU-only build of torch answers False without being imported."""
    if "torch" not in sys.modules and not torch_build_has_gpu():
        return False
    import torch

    return torch.cuda.is_available()


@functools.cache
def torch_build_has_gpu() -> bool:
    """Whether the installed torch was built for a GPU (CUDA or ROCm), read from its torch/version.py without importing
    it (once a process: the installed build does not change under it); True when that file cannot be read (then torch
    itself is asked)."""
    found = importlib.util.find_spec("torch")
    if found is None or not found.submodule_search_locations:
        return False
    try:
        text = (Path(next(iter(found.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return True
    builds = re.findall(r"^(cuda|hip)\s*(?::[^=\n]*)?=\s*(.+?)\s*$", text, re.M)
    return len(builds) < 2 or any(value != "None" for _, value in builds)
