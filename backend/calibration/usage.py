"""Which hardware profile and calibration a prediction used, and where it extrapolates (plan CLI, Plan page)."""

from __future__ import annotations

from typing import Any


def calibration_used(hw, cal: dict | None, configs: list[dict[str, Any]], gpus_per_node: int) -> dict[str, Any]:
    """Which profile and calibration the plan used ("profile": {hardware, base, calibration, loo_mape, interval,
    fit_runs}), a line saying so, and per config the reasons it lies outside what the calibration measured."""
    from backend.calibration.fit import extrapolation
    from backend.spec import ExperimentSpec

    profile = {"hardware": hw.key, "base": cal["hardware"] if cal else hw.key,
               "calibration": cal["id"] if cal else None, "loo_mape": cal["loo_mape"] if cal else None,
               "interval": list(cal["band"]) if cal else None, "fit_runs": len(cal["fit_runs"]) if cal else 0}
    flags = [extrapolation(ExperimentSpec.for_prediction(c["spec"]), cal["ranges"], gpus_per_node) if cal else []
             for c in configs]
    if cal:
        mape = "-" if cal["loo_mape"] is None else f"{cal['loo_mape']:.1f}%"
        line = (f"profile {hw.key!r}: calibration {cal['id']} of {profile['base']} on {profile['fit_runs']} runs, "
                f"leave-one-out error {mape}; {sum(bool(f) for f in flags)} of {len(flags)} layouts extrapolate beyond "
                "the calibrated runs")
    else:
        line = f"profile {hw.key!r}: uncalibrated (published figures; `python -m backend calibrate` fits one)"
    return {"profile": profile, "extrapolation": flags, "line": line}
