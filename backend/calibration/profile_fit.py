"""`fit_profile`: THE one function that fits a hardware profile to measured runs (ShardLab's own and imported ones).

It fits multipliers of the step-time model's tunables and of the profile's operation tables (calibration/fit.py
fitted_params) on the runs' step times (plus, for ShardLab's own CPU runs, their per-collective seconds and
pipeline phases). Imported GPU runs carry only a step time each, so on a GPU profile the parameters are taken in
order of how much of a training step they govern, as many as the runs can support (at most n - 1 for n runs,
leaving the leave-one-out refits something to test): the GEMM table's scale first, then the fixed per-step
overhead, compute/communication overlap, intra- and inter-node link efficiency, the scales of the attention,
element-wise and optimizer tables the profile has, kernel launch. `calibrate` and the dashboard call only this.
"""

from __future__ import annotations

from backend.analytic.steptime.hardware import Hardware
from backend.calibration.fit import TABLE_SCALES, Fit, Sample, fit, fitted_params

MIN_RUNS = 2


def gpu_order(hw: Hardware) -> tuple[str, ...]:
    """A GPU profile's parameters, most of a training step first (the table scales only where it has the table)."""
    tables = tuple(scale for part, scale in TABLE_SCALES if getattr(hw.tables, part))
    return ("gemm_scale", "step_overhead_s", "overlap_efficiency", "intra_efficiency", "inter_efficiency",
            *tables, "kernel_launch_s")


def fitted_parameters(hw: Hardware, n_runs: int) -> tuple[str, ...]:
    order = fitted_params(hw) if hw.kind == "cpu" else gpu_order(hw)
    return order[:max(1, min(len(order), n_runs - 1))]


def fit_profile(hw: Hardware, samples: list[Sample], *, loo: bool = True, iters: int = 150) -> Fit:
    """The fitted profile (parameters, residuals, leave-one-out errors, measured ranges) of `hw` on `samples`.
    ValueError (with the counts) when the runs cannot support a fit."""
    if len(samples) < MIN_RUNS:
        raise ValueError(f"need at least {MIN_RUNS} runs with a measured step time to calibrate {hw.key!r} "
                         f"(a fit and a leave-one-out check), got {len(samples)}")
    names = fitted_parameters(hw, len(samples))
    result = fit(hw, samples, loo=loo, iters=iters, names=names)
    if len(names) < len(fitted_parameters(hw, len(names) + 10**6)):
        result.notes.append(f"{len(samples)} runs support {len(names)} fitted parameter(s) (at most n - 1); the others "
                            f"keep the profile's values")
    return result
