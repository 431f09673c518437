"""What the step-time model refuses to time, and why (pure Python): no number rather than a wrong one.

- fp8 on CPU ranks: no probe measures torchao's float8 casts on the host (issue 30).
- fp8 on a GPU without fp8 tensor cores (Ampere, sm80): such a run cannot start. torchao's Float8Linear multiplies
  with torch._scaled_mm, which refuses the device (pytorch 960a684 aten/src/ATen/native/cuda/Blas.cpp
  `_scaled_mm_out_cuda`: "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9,
  or ROCm MI300+"), and Transformer Engine refuses fp8 below 8.9 (TransformerEngine 62a84b3
  transformer_engine/pytorch/fp8.py `check_fp8_support`: "Device compute capability 8.9 or higher required for FP8
  execution."). Timing its float8 GEMMs at bf16's rate, as a profile without fp8 figures otherwise is, would show a
  step for a run that fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.analytic.steptime.hardware import Hardware
    from backend.spec import ExperimentSpec


class NotTimed(ValueError):
    """The model has no terms for what dominates this spec's step on this kind of hardware: it gives no number rather
    than a wrong one (`untimed_reason` says why)."""


FP8_ON_CPU = ("fp8 on CPU ranks is not timed: the 'cpu' profile times every GEMM at the rate of an fp32 matmul, while "
              "torchao's float8 Linears on the CPU add casts and scaling (amax) of their inputs, weights and gradients "
              "to each Linear, which no probe measures; fp8 is timed on GPU profiles")
"""Issue 30: a tiny fp8 FSDP run measured 2.98 s per step against 0.016 s predicted. Here, 8 float8 Linears at d=64
took 48 ms forward and backward against 8.6 ms under bf16 autocast alone (about 5 ms more per Linear, one thread)."""

NO_FP8_CORES = ("sm80",)
"""Device classes (spec/stacks.DEVICE_CLASSES) whose GPUs have no fp8 tensor cores: Ampere (A100, A10, A30, A40)."""


def fp8_without_cores(hw: Hardware) -> str:
    """Why fp8 is not timed on `hw`, a profile of a device class in NO_FP8_CORES."""
    return (f"fp8 does not run on {hw.key}: Ampere (compute capability 8.0) has no fp8 tensor cores, and both "
            "torchao's float8 training (torch._scaled_mm) and Transformer Engine refuse fp8 below compute capability "
            "8.9 (Ada, Hopper, Blackwell; AMD MI300): use bf16-mixed on this GPU, or pick an fp8 GPU")


def untimed_reason(spec: ExperimentSpec, kind: str, hw: Hardware | None = None) -> str | None:
    """Why a spec's step is not timed on a profile of this kind ("cpu" or "gpu"), or None; `hw`, the profile where the
    caller has it, for what depends on the GPU's generation."""
    if str(spec.train.precision) != "fp8":
        return None
    if kind == "cpu":
        return FP8_ON_CPU
    if hw is not None and hw.device_class in NO_FP8_CORES:
        return fp8_without_cores(hw)
    return None
