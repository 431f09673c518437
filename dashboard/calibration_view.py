"""Calibrated profiles on the Plan page (issue 25): every named profile with its leave-one-out error, and per profile
its runs (measured, the fit's prediction and residual, the left-out prediction and error)."""

from __future__ import annotations

from typing import Any

import pandas as pd


def profiles_frame(engine: Any) -> pd.DataFrame:
    from backend.calibration.records import named_profiles

    rows = []
    for c in named_profiles(engine):
        kinds = c["details"].get("kinds") or {}
        rows.append({"profile": c["name"], "of": c["hardware"], "calibration": c["id"], "runs": len(c["fit_runs"]),
                     "imported runs": kinds.get("imported", 0),
                     "own runs": len(c["fit_runs"]) - kinds.get("imported", 0),
                     "leave-one-out error %": c["loo_mape"], "interval low %": 100 * c["band"][0],
                     "interval high %": 100 * c["band"][1], "fitted": ", ".join(c["params"])})
    return pd.DataFrame(rows, columns=["profile", "of", "calibration", "runs", "imported runs", "own runs",
                                       "leave-one-out error %", "interval low %", "interval high %", "fitted"])


def runs_frame(cal: dict[str, Any]) -> pd.DataFrame:
    details = cal.get("details") or {}
    loo = {r["run_id"]: r for r in details.get("loo", [])}
    rows = [{"run": r["run_id"], "measured s": r["measured_s"], "fit s": r["predicted_s"],
             "residual %": r["residual_pct"], "left out s": loo.get(r["run_id"], {}).get("predicted_s"),
             "leave-one-out error %": loo.get(r["run_id"], {}).get("error_pct")} for r in details.get("residuals", [])]
    return pd.DataFrame(rows, columns=["run", "measured s", "fit s", "residual %", "left out s",
                                       "leave-one-out error %"])
