"""Calibrations in the experiment store: collect measured runs, save a fit, and resolve --hardware/--calibration."""

from __future__ import annotations

import json
import statistics
from typing import Any

from sqlalchemy import Engine, insert, select

from backend.analytic.steptime.hardware import Hardware, get_hardware
from backend.calibration.fit import Fit, Sample
from db import queries as q
from db.models import Calibration


def samples(engine: Engine, *, tag: str | None = None, ids: list[int] | None = None) -> tuple[list[Sample], list[str]]:
    """Finished ok runs (by tag or ids) as fit samples; problems for ids that cannot be used."""
    problems: list[str] = []
    if ids:
        chosen = ids
    else:
        chosen = [r["id"] for r in q.list_experiments(engine, status=["ok"], tag=[tag] if tag else None)]
    out = []
    for i in sorted(chosen):
        d = q.get_experiment(engine, i)
        if d is None:
            problems.append(f"run {i} does not exist")
            continue
        res = d["result"]
        if d["status"] != "ok" or res is None or not res.step_s_median:
            problems.append(f"run {i} has no measured step time (status {d['status']})")
            continue
        by_kind = {k: c.seconds for k, c in res.per_rank[0].comm.items() if c.seconds} if res.per_rank else {}
        out.append(Sample(run_id=i, spec=d["spec"], step_s=measured_step_s(res), comm_s=sum(by_kind.values()) or None,
                          comm_by_collective=by_kind, phases=measured_phases(res)))
    return out, problems


def measured_step_s(res) -> float:
    """Min over timed steps of the slowest rank's step time. On a CPU shared with other work, steps only ever get
    slower than the machine allows; the minimum is the least disturbed (Python's timeit docs: "the lowest value
    gives a lower bound for how fast your machine can run the given code snippet")."""
    steps = [r.step_s for r in res.per_rank if r.step_s]
    if not steps:
        return float(res.step_s_median)
    return min(max(s[k] for s in steps if k < len(s)) for k in range(min(len(s) for s in steps)))


def measured_phases(res) -> dict[int, tuple[float, float]]:
    """Pipeline stage -> (median forward, median backward) seconds of one microbatch from the run's timeline."""
    by: dict[tuple[int, str], list[float]] = {}
    for ev in res.timeline:
        if ev.pass_ in ("F", "B") and ev.stage >= 0:
            by.setdefault((ev.stage, ev.pass_), []).append(ev.end_s - ev.start_s)
    return {s: (statistics.median(by[(s, "F")]), statistics.median(by[(s, "B")]))
            for s in sorted({s for s, _ in by}) if (s, "F") in by and (s, "B") in by}


def save(engine: Engine, hardware: str, fit: Fit, run_ids: list[int]) -> int:
    with engine.begin() as c:
        res = c.execute(insert(Calibration).values(
            hardware=hardware, params_json=json.dumps(fit.params), fit_run_ids_json=json.dumps(run_ids),
            loo_mape=fit.loo_mape, band_low=fit.band[0], band_high=fit.band[1], ranges_json=json.dumps(fit.ranges),
            notes_json=json.dumps(fit.notes)))
        return int(res.inserted_primary_key[0])


def load(engine: Engine, calibration_id: int) -> dict[str, Any] | None:
    with engine.connect() as c:
        row = c.execute(select(Calibration.__table__).where(Calibration.id == calibration_id)).first()
    return _as_dict(row) if row else None


def latest_for(engine: Engine, hardware: str) -> dict[str, Any] | None:
    with engine.connect() as c:
        row = c.execute(select(Calibration.__table__).where(Calibration.hardware == hardware)
                        .order_by(Calibration.id.desc()).limit(1)).first()
    return _as_dict(row) if row else None


def _as_dict(row) -> dict[str, Any]:
    m = dict(row._mapping)
    return {"id": m["id"], "hardware": m["hardware"], "params": json.loads(m["params_json"]),
            "fit_runs": json.loads(m["fit_run_ids_json"]), "loo_mape": m["loo_mape"],
            "band": (m["band_low"], m["band_high"]), "ranges": json.loads(m["ranges_json"] or "{}"),
            "notes": json.loads(m["notes_json"] or "[]"), "created_at": m["created_at"]}


def resolve(hardware: str | None, calibration_id: int | None, db_url: str | None = None
            ) -> tuple[Hardware, tuple[float, float] | None, dict[str, Any] | None]:
    """(profile with the calibration's parameters, its interval, the calibration) for --hardware/--calibration."""
    cal = None
    if calibration_id is not None:
        from db.session import open_db
        cal = load(open_db(db_url), calibration_id)
        if cal is None:
            raise ValueError(f"calibration {calibration_id} not found")
        if hardware and hardware != cal["hardware"]:
            raise ValueError(f"calibration {calibration_id} was fitted for {cal['hardware']!r}, not {hardware!r}")
    hw = get_hardware(hardware or cal["hardware"])  # type: ignore[index]
    if cal is None:
        return hw, None, None
    return hw.with_tunables(**cal["params"]), tuple(cal["band"]), cal
