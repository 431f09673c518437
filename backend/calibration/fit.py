"""Fit the step-time model's tunables to measured runs; leave-one-out error and prediction interval.

Loss = Σ_runs [ log²(predicted step / measured step)
                + w_c · Σ_collectives log²(predicted / measured seconds of that collective)
                + w_p · mean_stages (log²(pred / meas forward) + log²(pred / meas backward)) ]
per collective: rank 0's seconds before overlap (model.RankTime.comm_by_collective_s) vs its measured
`comm.<collective>.seconds`; per phase: the pipeline stages' forward / backward seconds of one microbatch
(model.StepTime.stage_fwd_s / stage_bwd_s) vs the run's timeline (median F / B event per stage), where recorded.
Parameters (`fitted_params(profile)`: the GEMM
scale, kernel floor, link efficiency and latency, overlap, fixed overhead, DTensor dispatch, all-gather /
reduce-scatter bandwidth, and a scale on each operation table the profile has: attention, element-wise,
optimizer) are fitted in log space as multipliers of the base profile's values (Nelder & Mead 1965, "A simplex method
for function minimization", Computer Journal 7: the simplex moves below, with the standard coefficients 1, 2, 0.5, 0.5).
Interval: the 5th/95th percentiles of the leave-one-out relative errors (a residual-based prediction
interval; with n runs its nominal coverage is about 1 - 2/(n+1)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.model import step_time

FITTED = ("gemm_scale", "kernel_launch_s", "intra_efficiency", "intra_latency_s", "overlap_efficiency",
          "step_overhead_s", "dtensor_op_s", "all_gather_efficiency", "reduce_scatter_efficiency")
"""Fitted on every profile; gemm_scale multiplies its GEMM table or size curve."""
TABLE_SCALES = (("attention", "attention_scale"), ("elementwise", "elementwise_scale"),
                ("optimizer", "optimizer_scale"))
"""Fitted too where the profile has that operation table."""
COMM_WEIGHT = 0.1
PHASE_WEIGHT = 0.5
BOUNDS = {"gemm_scale": (1e-3, 10.0), "gemm_efficiency_max": (1e-3, 1.0), "intra_efficiency": (1e-4, 1.0),
          "overlap_efficiency": (0.0, 1.0), "all_gather_efficiency": (1e-3, 10.0),
          "reduce_scatter_efficiency": (1e-3, 10.0), "inter_efficiency": (1e-4, 1.0),
          "attention_flash_efficiency": (1e-3, 1.0), "memory_efficiency": (1e-3, 1.0)}


@dataclass
class Sample:
    run_id: int
    spec: Any
    step_s: float
    comm_s: float | None
    """Measured collective seconds per step of rank 0 (sum over collectives), None if not recorded."""
    comm_by_collective: dict[str, float] = field(default_factory=dict)
    """Rank 0's measured seconds per step by collective (where measured)."""
    phases: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Pipeline stage -> (forward, backward) seconds of one microbatch, medians over the timeline's events."""


@dataclass
class Fit:
    params: dict[str, float]
    loo_mape: float | None
    band: tuple[float, float]
    loo: list[dict[str, float]] = field(default_factory=list)
    ranges: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    residuals: list[dict[str, float]] = field(default_factory=list)
    """Each run's measured step vs the all-runs fit's prediction (the fit residual, in %)."""
    profile: Hardware | None = None
    """The base profile with the fitted tunables (its operation tables scaled by them)."""


CPU_ONLY = ("dtensor_op_s", "all_gather_efficiency", "reduce_scatter_efficiency")
"""Host DTensor dispatch (0 on GPUs: the host runs ahead of the kernels) and gloo's all-gather / reduce-scatter
bandwidth (NCCL runs every ring collective at one bus bandwidth): not fitted on GPU profiles."""


def fitted_params(hw: Hardware) -> tuple[str, ...]:
    """The tunables a calibration of `hw` fits: FITTED (without CPU_ONLY on GPUs) plus the scale of each operation
    table the profile has."""
    base = FITTED if hw.kind == "cpu" else tuple(k for k in FITTED if k not in CPU_ONLY)
    return base + tuple(scale for part, scale in TABLE_SCALES if getattr(hw.tables, part))


def apply(hw: Hardware, params: dict[str, float]) -> Hardware:
    return hw.with_tunables(**params)


def _params(hw: Hardware, x: np.ndarray, names: tuple[str, ...] = FITTED) -> dict[str, float]:
    out = {}
    for k, v in zip(names, x, strict=False):
        val = getattr(hw.tune, k) * math.exp(float(v))
        lo, hi = BOUNDS.get(k, (0.0, math.inf))
        out[k] = min(max(val, lo), hi)
    return out


def predict(hw: Hardware, s: Sample) -> float:
    """Predicted step seconds of one run's spec on hw."""
    return step_time(s.spec, hw).summary["step_s"]


def sample_loss(hw: Hardware, s: Sample) -> float:
    """One run's share of the loss (module docstring)."""
    st = step_time(s.spec, hw)
    total = math.log(st.summary["step_s"] / s.step_s) ** 2
    pred = st.per_rank[0].comm_by_collective_s
    for kind, meas in s.comm_by_collective.items():
        if meas > 0 and pred.get(kind, 0.0) > 0:
            total += COMM_WEIGHT * math.log(pred[kind] / meas) ** 2
    terms = [math.log(p / m) ** 2 for stage, (f, b) in s.phases.items() if stage < len(st.stage_fwd_s)
             for p, m in ((st.stage_fwd_s[stage], f), (st.stage_bwd_s[stage], b)) if p > 0 and m > 0]
    if terms:
        total += PHASE_WEIGHT * sum(terms) / len(terms)
    return total


def _loss(hw: Hardware, samples: list[Sample], x: np.ndarray, names: tuple[str, ...] = FITTED) -> float:
    h = apply(hw, _params(hw, x, names))
    return sum(sample_loss(h, s) for s in samples)


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, *, step: float = 0.7, iters: int = 200,
                tol: float = 1e-6) -> np.ndarray:
    """Minimise f from x0 (Nelder & Mead 1965: reflect 1, expand 2, contract 0.5, shrink 0.5)."""
    n = len(x0)
    simplex = [x0.copy()] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def _percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else 0.0


def measured_ranges(samples: list[Sample], gpus_per_node: int) -> dict[str, Any]:
    from backend.analytic.params import count_params
    worlds = [s.spec.parallel.world_size for s in samples]
    params = [count_params(s.spec.model) for s in samples]
    return {"world_size": [min(worlds), max(worlds)], "params": [min(params), max(params)],
            "tiers": sorted({"inter" if s.spec.parallel.world_size > gpus_per_node else "intra" for s in samples}),
            "strategies": sorted({str(s.spec.parallel.strategy) for s in samples})}


def extrapolation(spec: Any, ranges: dict[str, Any], gpus_per_node: int) -> list[str]:
    """Why a prediction for `spec` lies outside what the calibration measured (empty: inside)."""
    from backend.analytic.params import count_params
    out = []
    w, (wlo, whi) = spec.parallel.world_size, ranges.get("world_size", [0, math.inf])
    if not wlo <= w <= whi:
        out.append(f"world_size {w} outside measured {wlo}..{whi}")
    n, (plo, phi) = count_params(spec.model), ranges.get("params", [0, math.inf])
    if not plo <= n <= phi:
        out.append(f"{n:,} params outside measured {plo:,}..{phi:,}")
    tier = "inter" if w > gpus_per_node else "intra"
    if tier not in ranges.get("tiers", [tier]):
        out.append(f"link tier {tier} not measured")
    if str(spec.parallel.strategy) not in ranges.get("strategies", [str(spec.parallel.strategy)]):
        out.append(f"strategy {spec.parallel.strategy} not among the measured {', '.join(ranges['strategies'])}")
    return out


def fit(hw: Hardware, samples: list[Sample], *, loo: bool = True, iters: int = 150, cold_loo: bool = False,
        names: tuple[str, ...] | None = None) -> Fit:
    """Fit `names` (default fitted_params(hw)) on all samples, then leave each out for the LOO MAPE and interval:
    each refit starts from the profile (cold_loo) or, cheaper, from the all-runs fit (warm)."""
    names = names or fitted_params(hw)
    if len(samples) < len(names) + 1:
        raise ValueError(f"need at least {len(names) + 1} measured runs to fit {len(names)} parameters of {hw.key!r} "
                         f"({', '.join(names)}), got {len(samples)}")
    x0 = np.zeros(len(names))
    best = nelder_mead(lambda x: _loss(hw, samples, x, names), x0, iters=iters)
    params = _params(hw, best, names)
    fitted = apply(hw, params)
    residuals = [{"run_id": s.run_id, "measured_s": s.step_s, "predicted_s": (p := predict(fitted, s)),
                  "residual_pct": (p - s.step_s) / s.step_s * 100} for s in samples]
    rows, rel = [], []
    if loo:
        for i, s in enumerate(samples):
            rest = samples[:i] + samples[i + 1:]
            if cold_loo:  # the left-out run never shapes its own prediction
                xi = nelder_mead(lambda x: _loss(hw, rest, x, names), x0, iters=iters)  # noqa: B023 - run here
            else:  # warm start from the all-runs fit: ~10x cheaper, slightly optimistic
                xi = nelder_mead(lambda x: _loss(hw, rest, x, names), best, step=0.2,  # noqa: B023 - run here
                                 iters=max(20, iters // 4))
            pred = predict(apply(hw, _params(hw, xi, names)), s)
            rel.append((s.step_s - pred) / pred)
            rows.append({"run_id": s.run_id, "measured_s": s.step_s, "predicted_s": pred,
                         "error_pct": (pred - s.step_s) / s.step_s * 100})
    mape = float(np.mean([abs(r["error_pct"]) for r in rows])) if rows else None
    band = (_percentile(rel, 5), _percentile(rel, 95)) if rel else (-0.2, 0.2)
    return Fit(params=params, loo_mape=mape, band=band, loo=rows, ranges=measured_ranges(samples, hw.gpus_per_node),
               residuals=residuals, profile=fitted,
               notes=[f"fitted {', '.join(names)} as multipliers of profile {hw.key!r}",
                      "interval: 5th..95th percentile of leave-one-out relative errors",
                      "leave-one-out refits start from "
                      f"{'the profile (cold)' if cold_loo else 'the all-runs fit (warm)'}"])
