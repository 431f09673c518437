"""The GPU check's driver: phases in priority order, each guarded and timed, the report rewritten after each.

Time: `--budget-s` is split over the requested phases by weight; time a phase leaves unused passes to the ones
after it. A phase whose share is below its minimum is skipped with the reason (never started to be killed).
An exception in a phase is recorded in report.json (`phases.<name>`: status, error, traceback tail) and the
kit goes on. `SHARDLAB_GPU_CHECK_FAULT=<phase>` makes that phase raise at its start (the test suite checks
that a failing phase is recorded and the later ones still run).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backend.atomic_io import write_atomic, write_json_atomic
from backend.gpucheck import phases
from backend.gpucheck.allocator import allocator_phase
from backend.gpucheck.diag import diag_phase
from backend.gpucheck.kit_context import PHASES, PROFILE_FILE, REPORT_FILE, SUMMARY_FILE, KitContext
from backend.gpucheck.power import power_phase
from backend.gpucheck.summary import render

FAULT_ENV = "SHARDLAB_GPU_CHECK_FAULT"
WEIGHTS = {"env": 0.05, "probe": 0.20, "runs": 0.40, "diag": 0.20, "trace": 0.08, "tests": 0.15, "late_runs": 0.12,
           "allocator": 0.15, "power": 0.08}
"""Shares of the time left among the phases still to run (time a phase leaves passes on). --budget-s 370 on one H200
with --profile (no probe): env ~19 s, runs ~150 s (5 runs, ~21-30 s each), diag ~75-90 s, trace ~30-40 s,
tests ~60-85 s, late_runs what is left (~60-100 s); allocator (not yet run on a GPU): two children of a 1B set-up and
eight steps each, ~40-60 s apiece; power (not yet run on a GPU): one child, ~40 s."""
MIN_S = {"cuda": {"env": 15, "probe": 25, "runs": 45, "diag": 20, "trace": 10, "tests": 10, "late_runs": 45,
                  "allocator": 40, "power": 35},
         "cpu": {"env": 40, "probe": 5, "runs": 10, "diag": 5, "trace": 5, "tests": 5, "late_runs": 5, "allocator": 1,
                 "power": 1}}
"""Seconds a phase needs to be worth starting; env's is its child's start-up (interpreter, torch, CUDA)."""
REPORT_KEYS = ("env", "profile", "runs", "diag", "trace", "tests", "allocator", "power")
"""report.json's contract keys (issue 22, + diag, + allocator, + power), one per phase (probe -> profile; late_runs
adds to runs)."""
SECTION = {"env": "env", "probe": "profile", "runs": "runs", "diag": "diag", "trace": "trace", "tests": "tests",
           "late_runs": "runs", "allocator": "allocator", "power": "power"}
RUNNERS: dict[str, Callable[[KitContext, float], Any]] = {
    "env": phases.env_phase, "probe": phases.probe_phase, "runs": phases.runs_phase, "diag": diag_phase,
    "trace": phases.trace_phase, "tests": phases.tests_phase, "late_runs": phases.late_runs_phase,
    "allocator": allocator_phase, "power": power_phase}


def parse_phases(text: str | None, reuse_profile: bool = False) -> list[str]:
    """The phases to run, in priority order; without --phases all of them, less the probe when a profile is reused."""
    default = [p for p in PHASES if not (reuse_profile and p == "probe")]
    wanted = [p.strip() for p in (text or ",".join(default)).split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phase(s) {unknown}; phases are {', '.join(PHASES)}")
    if reuse_profile and "probe" in wanted:
        raise ValueError("--profile reuses a measured profile: leave probe out of --phases")
    return [p for p in PHASES if p in wanted]  # always in priority order


def allotment_s(phase: str, todo: list[str], left_s: float) -> float:
    """This phase's share of the time left, by weight among the phases still to run."""
    return left_s * WEIGHTS[phase] / sum(WEIGHTS[p] for p in todo)


def new_report(ctx: KitContext, budget_s: float, wanted: list[str]) -> dict[str, Any]:
    previous = ctx.out / REPORT_FILE
    report: dict[str, Any] = {k: None for k in REPORT_KEYS}
    if previous.exists():  # a retry into the same folder keeps what the phases it does not rerun found
        try:
            report.update({k: v for k, v in json.loads(previous.read_text()).items() if k in REPORT_KEYS})
        except (OSError, json.JSONDecodeError):
            pass
    report["kit"] = {"check_id": ctx.check_id, "device": ctx.device, "nproc": ctx.nproc, "budget_s": budget_s,
                     "phases_requested": wanted, "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                     "runs_requested": ctx.run_names}
    report["phases"] = {}
    return report


def save(ctx: KitContext) -> None:
    write_json_atomic(ctx.out / REPORT_FILE, ctx.report)
    write_atomic(ctx.out / SUMMARY_FILE, render(ctx.report))


def run_phase(ctx: KitContext, phase: str, budget_s: float) -> None:
    t0 = time.monotonic()
    ctx.progress(f"phase {phase}: start (budget {budget_s:.0f} s)")
    record: dict[str, Any] = {"budget_s": budget_s}
    try:
        if os.environ.get(FAULT_ENV) == phase:
            raise RuntimeError(f"injected failure ({FAULT_ENV}={phase})")
        ctx.report[SECTION[phase]] = RUNNERS[phase](ctx, budget_s)
        record["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a phase failing is recorded and the kit goes on
        record.update(status="failed", error=f"{type(e).__name__}: {str(e)[:2000]}",
                      traceback_tail=traceback.format_exc()[-3000:])
        ctx.progress(f"phase {phase}: FAILED {record['error'][:300]}")
    record["seconds"] = time.monotonic() - t0
    ctx.report["phases"][phase] = record
    ctx.progress(f"phase {phase}: {record['status']} in {record['seconds']:.1f} s")
    save(ctx)


def reuse_profile(ctx: KitContext, path: Path) -> None:
    """--profile FILE: a profile measured by an earlier check (a retry that skips the probe)."""
    data = json.loads(path.read_text())
    ((key, entry),) = data["profiles"].items()
    if path.resolve() != (ctx.out / PROFILE_FILE).resolve():
        shutil.copyfile(path, ctx.out / PROFILE_FILE)
    phases.use_profile(ctx, ctx.out / PROFILE_FILE, key)
    ctx.report["profile"] = {"key": key, "file": PROFILE_FILE, "reused_from": str(path), **entry}


def check_reused_profile(ctx: KitContext) -> None:
    """A reused profile measured on another device model is not used for the measured-profile predictions."""
    prof = ctx.report.get("profile") or {}
    measured_on = (prof.get("provenance") or {}).get("device_name")
    if prof.get("reused_from") and ctx.device_name and measured_on and measured_on != ctx.device_name:
        ctx.profile_key = ctx.profile_path = None
        prof["not_used"] = f"measured on {measured_on}, this check runs on {ctx.device_name}"
        ctx.progress(f"profile {prof.get('key')}: NOT used ({prof['not_used']})")


def run_kit(device: str, out: Path, *, budget_s: float, nproc: int = 1, phase_names: str | None = None,
            run_names: list[str] | None = None, profile: Path | None = None) -> dict[str, Any]:
    """Run the check; returns the report (also in out/report.json and out/summary.md)."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    wanted = parse_phases(phase_names, reuse_profile=profile is not None)
    work = Path(tempfile.mkdtemp(prefix="shardlab-gpu-check-"))
    check_id = f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
    ctx = KitContext(device=device, nproc=nproc, out=out, work=work, check_id=check_id, run_names=run_names)
    ctx.report = new_report(ctx, budget_s, wanted)
    ctx.save = lambda: save(ctx)
    end = time.monotonic() + budget_s
    try:
        if profile is not None:
            reuse_profile(ctx, profile)
        if "env" not in wanted:  # the other phases still need the device's name and memory
            run_phase(ctx, "env", 60.0)
            check_reused_profile(ctx)
        for k, phase in enumerate(wanted):
            left = end - time.monotonic()
            need = MIN_S[device][phase]
            share = max(allotment_s(phase, wanted[k:], left), min(need, left))  # a phase gets its minimum if left
            if share < need:
                ctx.report["phases"][phase] = {"status": "skipped", "seconds": 0.0,
                                               "reason": f"{left:.0f} s left, its share {share:.0f} s < {need} s"}
                ctx.progress(f"phase {phase}: skipped ({ctx.report['phases'][phase]['reason']})")
                save(ctx)
                continue
            run_phase(ctx, phase, share)
            if phase == "env":
                check_reused_profile(ctx)
    finally:
        ctx.report["kit"]["seconds"] = time.monotonic() - ctx.started
        save(ctx)
        shutil.rmtree(work, ignore_errors=True)
    ctx.progress(f"done in {ctx.report['kit']['seconds']:.0f} s: {out / REPORT_FILE}, {out / SUMMARY_FILE}")
    return ctx.report
