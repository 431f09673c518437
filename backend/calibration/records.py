"""Calibrations in the experiment store: collect measured runs, save a fit, and resolve --hardware/--calibration."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from typing import Any

from sqlalchemy import Engine, insert, select

from backend.analytic.steptime.hardware import CPU, Hardware, get_hardware, load_profiles
from backend.analytic.steptime.untimed import untimed_reason
from backend.calibration.fit import Fit, Sample
from db import queries as q
from db.models import Calibration

DEVICE_PROFILES = {  # torch.cuda.get_device_name() (lower case) -> the hardware.json profile of that part
    "nvidia h100 80gb hbm3": "h100-sxm", "nvidia h100 sxm5 80gb": "h100-sxm", "nvidia h100 pcie": "h100-pcie",
    "nvidia h200": "h200", "nvidia a100-sxm4-80gb": "a100-80gb-sxm", "nvidia a100-sxm4-40gb": "a100-40gb-sxm",
    "nvidia b200": "b200", "amd instinct mi300x": "mi300x",
}


def profile_for_device(device_name: str | None) -> str | None:
    return DEVICE_PROFILES.get(str(device_name or "").strip().lower())


def run_profile(res) -> str | None:
    """The profile a stored run ran on: an imported run's (its import resolved it), "cpu" for CPU ranks, the profile of
    the GPU the env names; None when the run does not say."""
    if res.imported is not None:
        return res.imported.hardware
    env = res.env or {}
    if env.get("device_type") == "cpu" or str(env.get("device", "")).lower() == "cpu":
        return "cpu"
    return profile_for_device(env.get("device_name"))


def samples(engine: Engine, *, tag: str | None = None, ids: list[int] | None = None,
            hardware: str | None = None) -> tuple[list[Sample], list[str]]:
    """Finished ok runs (by tag or ids) as fit samples, ShardLab's own and imported ones; problems for runs that
    cannot be used (no step time, or measured on another device than `hardware`'s)."""
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
        ran_on = run_profile(res)
        if hardware is not None and ran_on is not None and ran_on != hardware:
            problems.append(f"run {i} ran on {ran_on!r}, not {hardware!r}: left out")
            continue
        if ran_on == "cpu" and (why := untimed_reason(d["spec"], "cpu")) is not None:
            problems.append(f"run {i} left out: {why}")
            continue
        waits = [k for k, v in (res.imported.unmapped if res.imported else {}).items() if isinstance(v, dict)
                 and v.get("pending")]
        if waits:
            problems.append(f"run {i} left out: its prediction ignores {', '.join(waits)} (the spec has no such field "
                            "yet)")
            continue
        if res.imported is not None:  # a log's step time is a median of interval means; no per-collective seconds
            out.append(Sample(run_id=i, spec=d["spec"], step_s=float(res.step_s_median), comm_s=None))
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


def save(engine: Engine, hardware: str, fit: Fit, run_ids: list[int], *, name: str | None = None,
         kinds: dict[str, int] | None = None) -> int:
    """Store a fit; `name` makes it a named profile ("h100-ourcluster") that --hardware accepts."""
    details = {"residuals": fit.residuals, "loo": fit.loo, "kinds": kinds or {}}
    with engine.begin() as c:
        res = c.execute(insert(Calibration).values(
            hardware=hardware, params_json=json.dumps(fit.params), fit_run_ids_json=json.dumps(run_ids),
            loo_mape=fit.loo_mape, band_low=fit.band[0], band_high=fit.band[1], ranges_json=json.dumps(fit.ranges),
            notes_json=json.dumps(fit.notes), name=name, details_json=json.dumps(details)))
        return int(res.inserted_primary_key[0])


def latest_named(engine: Engine, name: str) -> dict[str, Any] | None:
    """The newest calibration stored under a profile name."""
    with engine.connect() as c:
        row = c.execute(select(Calibration.__table__).where(Calibration.name == name)
                        .order_by(Calibration.id.desc()).limit(1)).first()
    return _as_dict(row) if row else None


def named_profiles(engine: Engine) -> list[dict[str, Any]]:
    """The newest calibration of every profile name, newest first."""
    with engine.connect() as c:
        rows = c.execute(select(Calibration.__table__).where(Calibration.name.is_not(None))
                         .order_by(Calibration.id.desc())).all()
    seen, out = set(), []
    for row in rows:
        d = _as_dict(row)
        if d["name"] not in seen:
            seen.add(d["name"])
            out.append(d)
    return out


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
            "notes": json.loads(m["notes_json"] or "[]"), "created_at": m["created_at"], "name": m.get("name"),
            "details": json.loads(m.get("details_json") or "{}")}


def resolve(hardware: str | None, calibration_id: int | None, db_url: str | None = None
            ) -> tuple[Hardware, tuple[float, float] | None, dict[str, Any] | None]:
    """(profile with the calibration's parameters, its interval, the calibration) for --hardware/--calibration."""
    cal = None
    if hardware and calibration_id is None and hardware not in load_profiles():
        cal = _named(hardware, db_url)
    if calibration_id is not None:
        from db.session import open_db
        cal = load(open_db(db_url), calibration_id)
        if cal is None:
            raise ValueError(f"calibration {calibration_id} not found")
        if hardware and hardware not in (cal["hardware"], cal.get("name")):
            raise ValueError(f"calibration {calibration_id} was fitted for {cal['hardware']!r}, not {hardware!r}")
    hw = get_hardware(cal["hardware"] if cal is not None else hardware)  # type: ignore[arg-type]
    if cal is None:
        return hw, None, None
    named = replace(hw, key=cal["name"] or hw.key, calibration_id=cal["id"])
    return named.with_tunables(**cal["params"]), tuple(cal["band"]), cal


def existing_store(db_url: str | None):
    """The store's engine, or None where it is a SQLite file that does not exist yet: looking a profile name up must
    not create data/shardlab.db in the checkout (a typo in --hardware would)."""
    from db.session import open_db, resolve_url, sqlite_path

    url = resolve_url(db_url)
    path = sqlite_path(url)
    return None if path is not None and not path.exists() else open_db(url)


def _named(name: str, db_url: str | None) -> dict[str, Any]:
    """A calibrated profile by name; ValueError listing the profiles (shipped and calibrated) when there is none."""
    engine = existing_store(db_url)
    cal = latest_named(engine, name) if engine is not None else None
    if cal is None:
        if name == CPU:  # the one profile this host measures itself
            from backend.bench.cpu_profile import MISSING

            raise ValueError(MISSING)
        known = sorted(load_profiles()) + ([c["name"] for c in named_profiles(engine)] if engine is not None else [])
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(known)} (calibrated profiles come from "
                         "`python -m backend calibrate --name`)")
    return cal
