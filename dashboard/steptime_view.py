"""Predicted step time on the pages: New experiment (the form's spec on a chosen hardware profile), Run detail and
Plan's Verify (a finished run's measured step against the prediction on its own hardware, 'cpu' for CPU ranks).
Each says why when there is no number (most often: no 'cpu' profile yet, backend/bench/cpu_profile.py)."""

from __future__ import annotations

from typing import Any

from backend.analytic.steptime.hardware import CPU, get_hardware, load_profiles
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.untimed import NotTimed
from backend.bench.cpu_profile import MISSING

BREAKDOWN = (("compute_s", "compute"), ("exposed_comm_s", "exposed communication"), ("bubble_s", "pipeline bubble"),
             ("optimizer_s", "optimizer step"), ("other_s", "other"))


def profile_options() -> list[str]:
    """'cpu' (this host, whether or not it is measured yet) first, then the published GPU profiles."""
    return [CPU] + [k for k in load_profiles() if k != CPU]


def _calibrated(hardware: str, engine: Any) -> tuple[Any, tuple[float, float] | None, dict | None]:
    from backend.calibration.records import latest_for

    hw = get_hardware(hardware)
    cal = latest_for(engine, hardware) if engine is not None else None
    if cal:
        hw = hw.with_tunables(**cal["params"])
    return hw, (tuple(cal["band"]) if cal else None), cal


def predict(spec: Any, hardware: str, engine: Any = None,
            gpus_per_node: int | None = None) -> tuple[dict | None, str | None]:
    """(step-time summary + "hardware", "calibration", "caveats", None) or (None, why not) for a spec on a profile,
    with the newest calibration for that profile; "caveats": what the number assumes in place of what the spec asks
    for (StepTime.caveats)."""
    if hardware not in load_profiles():
        return None, MISSING if hardware == CPU else f"no hardware profile {hardware!r}"
    hw, band, cal = _calibrated(hardware, engine)
    try:
        timed = step_time(spec, hw, gpus_per_node=gpus_per_node, band=band)
    except NotTimed as e:  # said instead of a misleading number
        return None, str(e)
    return {**timed.summary, "hardware": hardware, "calibration": cal["id"] if cal else None,
            "caveats": timed.caveats}, None


def device_class(hardware: str) -> str:
    """The device class a stack's defaults resolve on (spec/stacks.DEVICE_CLASSES): the profile's, cpu without one."""
    profiles = load_profiles()
    return profiles[hardware].device_class if hardware in profiles else "cpu"


def breakdown_text(summary: dict) -> str:
    parts = " + ".join(f"{label} {summary[key]:.3g} s" for key, label in BREAKDOWN if summary.get(key))
    return f"= {parts}" if parts else ""


def band_text(summary: dict) -> str:
    cal = summary.get("calibration")
    where = f"calibration #{cal}" if cal else "no calibration yet (`python -m backend calibrate`): a ±20% band"
    return f"'{summary['hardware']}' profile, {where}"


def run_comparison(res: Any, engine: Any) -> tuple[dict | None, str | None]:
    """A finished run's measured step vs the prediction on its hardware: (comparison, None) or (None, why not)."""
    from backend.calibration.fit import extrapolation
    from backend.calibration.records import measured_step_s

    if res is None or not res.per_rank or not any(r.step_s for r in res.per_rank):
        return None, "the run recorded no timed steps"
    device = str((res.env or {}).get("device", "cpu")).lower()
    if not ("cpu" in device or str(res.spec.runtime.device) == "cpu"):
        return None, f"its ranks ran on {device}: step times are compared for CPU runs (the 'cpu' profile)"
    pred, why = predict(res.spec, CPU, engine)
    if pred is None:
        return None, why
    measured = measured_step_s(res)
    cal_id = pred["calibration"]
    cal = _calibrated(CPU, engine)[2] if cal_id else None
    return {"hardware": CPU, "calibration": cal_id, "predicted_s": pred["step_s"], "low_s": pred["low_s"],
            "high_s": pred["high_s"], "measured_s": measured, "error_pct": (pred["step_s"] - measured) / measured * 100,
            "inside": pred["low_s"] <= measured <= pred["high_s"],
            "extrapolation": (extrapolation(res.spec, cal["ranges"], get_hardware(CPU).gpus_per_node) if cal
                              else [])}, None
