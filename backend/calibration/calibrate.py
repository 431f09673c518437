"""One calibration end to end: pick the stored runs (by tag or ids, ShardLab's own and imported ones, on one device),
fit them (profile_fit.fit_profile), store the result (optionally as a named profile). `python -m backend calibrate`
and the Plan page's "Calibrate" box both call `calibrate`."""

from __future__ import annotations

import re
from typing import Any

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def name_problem(name: str | None) -> str | None:
    from backend.analytic.steptime.hardware import load_profiles

    if name is None:
        return None
    if not NAME.fullmatch(name):
        return f"name {name!r}: letters, digits, '.', '_' and '-' only, at most 64 characters"
    if name in load_profiles():
        return f"name {name!r} is a shipped hardware profile: choose another name for the calibrated one"
    return None


def calibrate(engine, *, hardware: str, tag: str | None = None, ids: list[int] | None = None,
              name: str | None = None, loo: bool = True) -> dict[str, Any]:
    """{"id", "name", "hardware", "params", "fit_runs", "kinds", "residuals", "loo", "loo_mape", "uncalibrated",
    "uncalibrated_mape", "interval", "ranges", "notes"}; ValueError with the reason (nothing stored)."""
    from backend.analytic.steptime.hardware import get_hardware, load_profiles
    from backend.calibration import records
    from backend.calibration.profile_fit import fit_profile
    from db import queries as q

    if problem := name_problem(name):
        raise ValueError(problem)
    base = hardware
    if base not in load_profiles():
        named = records.latest_named(engine, base)
        if named is None:
            get_hardware(base)  # raises the list of known profiles
        base, name = named["hardware"], name or named["name"]
    hw = get_hardware(base)
    samples, problems = records.samples(engine, tag=tag, ids=ids, hardware=hw.key)
    if problems and ids:
        raise ValueError("; ".join(problems))
    try:
        result = fit_profile(hw, samples, loo=loo)
    except ValueError as e:
        raise ValueError(str(e) + (f" ({'; '.join(problems)})" if problems else "")) from None
    run_ids = [s.run_id for s in samples]
    kinds: dict[str, int] = {}
    for i in run_ids:
        kind = (q.get_experiment(engine, i) or {}).get("kind", "measured")
        kinds[kind] = kinds.get(kind, 0) + 1
    cal_id = records.save(engine, hw.key, result, run_ids, name=name, kinds=kinds)
    before, before_mape = uncalibrated(hw, samples)
    notes = result.notes + problems + worse_note(hw.key, result.loo_mape, before_mape)
    return {"id": cal_id, "name": name, "hardware": hw.key, "params": result.params, "fit_runs": run_ids,
            "kinds": kinds, "residuals": result.residuals, "loo": result.loo, "loo_mape": result.loo_mape,
            "uncalibrated": before, "uncalibrated_mape": before_mape, "interval": list(result.band),
            "ranges": result.ranges, "notes": notes}


def uncalibrated(hw, samples: list) -> tuple[list[dict[str, float]], float]:
    """Each run's step on the profile itself, before any fit, and their MAPE: what the calibration must beat."""
    from backend.calibration.fit import predict

    rows = [{"run_id": s.run_id, "measured_s": s.step_s, "predicted_s": (p := predict(hw, s)),
             "error_pct": (p - s.step_s) / s.step_s * 100} for s in samples]
    return rows, sum(abs(r["error_pct"]) for r in rows) / len(rows)


def worse_note(hardware: str, loo_mape: float | None, before_mape: float) -> list[str]:
    """Say so when the leave-one-out error, the calibration's honest error on a new run, is worse than the profile's."""
    if loo_mape is None or loo_mape <= before_mape:
        return []
    return [f"leave-one-out MAPE {loo_mape:.1f}% is worse than profile {hardware!r} uncalibrated on the same runs "
            f"({before_mape:.1f}%): this calibration would likely predict a new run worse than the profile itself "
            "(too few runs, or runs too unlike each other, for its parameters)"]
