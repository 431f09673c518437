"""The planner's second pass (planner/search.py `plan`): each capacity factor's pool of fastest layouts by the
step-time screen re-timed with the step-time model (analytic/steptime/model.py), and the top ones' memory confirmed
on each layout alone with the estimator's own core (estimate.worst_rank_bytes) into the rows `plan` reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backend.analytic.device import RuntimeOverhead, allowance_bytes, fits_device, fullest_budget_bytes
from backend.analytic.estimate import worst_rank_bytes
from backend.analytic.layout import ZERO_STAGE_NAMES, Layout
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.model import InconsistentStepTime, step_time
from backend.analytic.steptime.untimed import NotTimed
from backend.planner.capacity import dropped_share, factor_label
from backend.planner.held import HeldTraining
from backend.planner.space import light_spec
from backend.spec import ExperimentSpec, ModelSpec


@dataclass
class Screened:
    """One capacity factor's search (planner/capacity.py): its model, every layout with its worst-rank bytes, the
    fitting ones fastest first by the screen (runnable only unless include_predicted) and the pool to re-time."""
    model: ModelSpec
    layouts: Layout
    memory: np.ndarray
    order: np.ndarray
    fitting: int
    left_out: int
    by_rule: dict[str, int]
    pool: np.ndarray


@dataclass
class Timed:
    """One pooled layout re-timed with steptime.model: its summary, index in its screen, spec dict and light spec,
    and what its time assumes in place of what it asks for (StepTime.caveats)."""
    summary: dict[str, Any]
    index: int
    data: dict[str, Any]
    spec: ExperimentSpec
    screen: Screened
    caveats: list[str]


@dataclass
class Retimed:
    """The pools re-timed (fastest first), the layouts whose step-time check failed, and why none was timed (held
    training this model cannot time: one reason for every layout)."""
    timed: list[Timed]
    failed: list[dict[str, str]]
    untimed: str | None


def layout_label(data: dict[str, Any]) -> str:
    """A planned layout in full, in words: degrees and flavour, micro-batch, recompute, schedule, SP."""
    t, p = data["train"], data["parallel"]
    schedule = f", {p['pp_schedule']} v={p['virtual_stages']}" if p["pp"] > 1 else ""
    return (f"{data['name'].removeprefix('plan ')}, b={t['micro_batch']}, recompute {t['recompute']}{schedule}"
            + (", SP" if p.get("sequence_parallel") else ""))


def retime_pools(screens: list[Screened], held: HeldTraining, *, named_by_factor: bool, hw: Hardware,
                 gpus_per_node: int, band: tuple[float, float] | None) -> Retimed:
    timed, failed = [], []
    for screen in screens:
        for i in screen.pool:
            data = screen.layouts.take(int(i)).spec_dict(screen.model)
            data["train"].update(held.spec_train(data["train"]["recompute"]))
            if named_by_factor:
                data["name"] += f" {factor_label(screen.model.capacity_factor)}"
            spec = light_spec(data)
            try:
                st = step_time(spec, hw, gpus_per_node=gpus_per_node, band=band)
            except InconsistentStepTime as e:
                failed.append({"layout": layout_label(data), "why": f"{layout_label(data)}: {e}"})
                continue
            except NotTimed as e:  # held training: the same reason for every layout
                return Retimed(sorted(timed, key=lambda t: t.summary["step_s"]), failed, str(e))
            timed.append(Timed(st.summary, int(i), data, spec, screen, st.caveats))
    return Retimed(sorted(timed, key=lambda t: t.summary["step_s"]), failed, None)


def config_row(t: Timed, device_bytes: float, overhead: RuntimeOverhead) -> tuple[dict[str, Any], list[str]]:
    """A reported layout's row, its memory confirmed on the layout alone (the same core), and the mismatch with the
    array path if any (> 0.5%)."""
    spec, data, i = t.spec, t.data, t.index
    worst, rank = worst_rank_bytes(spec)
    mismatch = [f"{data['name']}: array path {t.screen.memory[i]:.0f} B vs one layout {worst} B"] \
        if abs(worst - t.screen.memory[i]) > 0.005 * worst else []
    device = str(spec.runtime.device)
    allowance = allowance_bytes(worst, spec.parallel, device, overhead)
    return {"spec": data, "mem_bytes_max": int(worst), "fullest_moment": rank.fullest_moment(),
            "step_time": t.summary, "strategy": ZERO_STAGE_NAMES[int(t.screen.layouts.zero_stage[i])],
            "worst_rank": rank.rank,
            "fits_exact": bool(fits_device(worst, spec.parallel, device, device_bytes, overhead)),
            "need_bytes": worst + allowance["total"], "allowance_bytes": allowance,
            "fullest_budget_bytes": fullest_budget_bytes(spec.parallel, device, device_bytes, overhead),
            "breakdown_bytes": {k: getattr(rank, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                              "activations_bytes", "other_bytes")},
            "capacity_factor": data["model"].get("capacity_factor"),
            "predicted_dropped_share": dropped_share(data)}, mismatch
