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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Callable

from backend.atomic_io import write_atomic, write_json_atomic
from backend.gpucheck import phases
from backend.gpucheck.context import PHASES, PROFILE_FILE, REPORT_FILE, SUMMARY_FILE, KitContext
from backend.gpucheck.summary import render

FAULT_ENV = "SHARDLAB_GPU_CHECK_FAULT"
WEIGHTS = {"env": 0.03, "probe": 0.20, "runs": 0.52, "trace": 0.10, "tests": 0.15}
"""With --budget-s 330 on one GPU: env ~10 s, probe ~67 s, runs ~170 s, trace ~35 s, tests ~50 s (plus what earlier
phases leave unused)."""
MIN_S = {"cuda": {"env": 15, "probe": 25, "runs": 45, "trace": 10, "tests": 10},
         "cpu": {"env": 15, "probe": 5, "runs": 10, "trace": 5, "tests": 5}}
"""Seconds a phase needs to be worth starting; env's is its child's start-up (interpreter, torch, CUDA)."""
REPORT_KEYS = ("env", "profile", "runs", "trace", "tests")
"""report.json's contract keys (issue 22), one per phase (probe -> profile)."""
SECTION = {"env": "env", "probe": "profile", "runs": "runs", "trace": "trace", "tests": "tests"}
RUNNERS: dict[str, Callable[[KitContext, float], Any]] = {
    "env": phases.env_phase, "probe": phases.probe_phase, "runs": phases.runs_phase,
    "trace": phases.trace_phase, "tests": phases.tests_phase}


def parse_phases(text: str | None) -> list[str]:
    wanted = [p.strip() for p in (text or ",".join(PHASES)).split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phase(s) {unknown}; phases are {', '.join(PHASES)}")
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


def run_kit(device: str, out: Path, *, budget_s: float, nproc: int = 1, phase_names: str | None = None,
            run_names: list[str] | None = None, profile: Path | None = None) -> dict[str, Any]:
    """Run the check; returns the report (also in out/report.json and out/summary.md)."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    wanted = parse_phases(phase_names)
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
    finally:
        ctx.report["kit"]["seconds"] = time.monotonic() - ctx.started
        save(ctx)
        shutil.rmtree(work, ignore_errors=True)
    ctx.progress(f"done in {ctx.report['kit']['seconds']:.0f} s: {out / REPORT_FILE}, {out / SUMMARY_FILE}")
    return ctx.report
