"""`fit_profile`: THE one function that fits a hardware profile to measured runs (ShardLab's own and imported ones).

Today it fits multipliers of the step-time model's global tunables (calibration/fit.py) on the runs' step times
(plus, for ShardLab's own CPU runs, their per-collective seconds and pipeline phases). Imported GPU runs carry only
a step time each, so on a GPU profile the parameters are taken in order of how much of a training step they govern,
as many as the runs can support (at most n - 1 for n runs, leaving the leave-one-out refits something to test):
GEMM efficiency first, then the fixed per-step overhead, compute/communication overlap, intra- and inter-node link
efficiency, flash-attention and memory-bandwidth efficiency, kernel launch. Issue 22B's per-device operation tables
replace this body (same signature, same Fit): `calibrate` and the dashboard call only this.
"""

from __future__ import annotations

from backend.analytic.steptime.hardware import Hardware
from backend.calibration.fit import FITTED, Fit, Sample, fit

GPU_ORDER = ("gemm_efficiency_max", "step_overhead_s", "overlap_efficiency", "intra_efficiency", "inter_efficiency",
             "attention_flash_efficiency", "memory_efficiency", "kernel_launch_s")
MIN_RUNS = 2


def fitted_parameters(hw: Hardware, n_runs: int) -> tuple[str, ...]:
    order = FITTED if hw.kind == "cpu" else GPU_ORDER
    return order[:max(1, min(len(order), n_runs - 1))]


def fit_profile(hw: Hardware, samples: list[Sample], *, loo: bool = True) -> Fit:
    """The fitted profile (parameters, residuals, leave-one-out errors, measured ranges) of `hw` on `samples`.
    ValueError (with the counts) when the runs cannot support a fit."""
    if len(samples) < MIN_RUNS:
        raise ValueError(f"need at least {MIN_RUNS} runs with a measured step time to calibrate {hw.key!r} "
                         f"(a fit and a leave-one-out check), got {len(samples)}")
    names = fitted_parameters(hw, len(samples))
    result = fit(hw, samples, loo=loo, names=names)
    if len(names) < (len(FITTED) if hw.kind == "cpu" else len(GPU_ORDER)):
        result.notes.append(f"{len(samples)} runs support {len(names)} fitted parameter(s) (at most n - 1); the others "
                            f"keep the profile's values")
    return result
