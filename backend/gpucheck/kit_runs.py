"""Phase 3 of the GPU check: real runs through the product's own launcher and engine, each an ordinary
RunResult, plus what the check compares it with:

- `step_time`: the step-time model's prediction (steptime.model.step_time, slowest rank's summary) on the
  device's datasheet profile (hardware.json) and on the profile the probe just measured, next to the measured
  median step and the error of each;
- `memory_fit`: the "fits" verdict the New-experiment page would give (the fullest moment incl. the CUDA
  runtime allowance analytic/device.RuntimeOverhead, as dashboard/predict_view.fit_check counts it) against the
  measured peak allocated and peak reserved; `fits_claim_ok` is False where "fits" was claimed but the
  measured reserved peak exceeds the device.

On CUDA the single-process CPU loss reference is skipped (SHARDLAB_REFERENCE_MAX_BYTES=0: a 1B-parameter fp32
forward/backward on one CPU thread takes minutes); the engine's own note in the result says why; and the
initial weights are drawn in os.cpu_count() threads (SHARDLAB_INIT_THREADS: identical values, ~16 s of one-thread
set-up per run in run 1), which changes nothing the engine measures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from backend.gpucheck.specs import KitRun, spec_for
from backend.result import RunResult, Status

REFERENCE_ENV = "SHARDLAB_REFERENCE_MAX_BYTES"
INIT_THREADS_ENV = "SHARDLAB_INIT_THREADS"
"""backend.models.gpt.INIT_THREADS_ENV (not imported: the kit's own process stays free of the model code)."""


@contextmanager
def hardware_file(path: Path | None) -> Iterator[None]:
    """SHARDLAB_HARDWARE pointing at the measured profile while the block runs (how the product loads one)."""
    old = os.environ.get("SHARDLAB_HARDWARE")
    if path is not None:
        os.environ["SHARDLAB_HARDWARE"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SHARDLAB_HARDWARE", None)
        else:
            os.environ["SHARDLAB_HARDWARE"] = old


def predicted_step(spec: Any, key: str | None, profile_path: Path | None = None) -> dict[str, Any]:
    """{"hardware": key, **summary} of steptime.model.step_time on profile `key`, or {"hardware", "error"}."""
    if not key:
        return {"hardware": None, "error": "no profile for this device"}
    try:
        from backend.analytic.steptime.hardware import get_hardware
        from backend.analytic.steptime.model import step_time

        with hardware_file(profile_path):
            hw = get_hardware(key)
        st = step_time(spec, hw)
        return {"hardware": key, **st.summary, "notes": list(st.notes)}
    except Exception as e:  # noqa: BLE001 - a prediction that cannot be made is recorded, the run stays
        return {"hardware": key, "error": f"{type(e).__name__}: {e}"}


def step_time_block(spec: Any, measured_s: float | None, datasheet_key: str | None, measured_key: str | None,
                    profile_path: Path | None) -> dict[str, Any]:
    out = {"measured_step_s": measured_s, "datasheet": predicted_step(spec, datasheet_key),
           "measured_profile": predicted_step(spec, measured_key, profile_path) if measured_key
           else {"hardware": None, "error": "no measured profile of this device in this check (report.profile)"}}
    for side in ("datasheet", "measured_profile"):
        pred = out[side].get("step_s")
        out[side]["error_pct"] = (measured_s - pred) / pred * 100.0 if measured_s and pred else None
    return out


def memory_fit(spec: Any, result: RunResult, device_bytes: float | None) -> dict[str, Any]:
    """The "fits" verdict for the fullest rank vs the measured CUDA peaks of that run (None off CUDA)."""
    from backend.analytic.device import fits_device, runtime_overhead_bytes
    from backend.analytic.estimate import estimate

    rows = estimate(spec, device=str(spec.runtime.device)).per_rank
    worst: dict[str, Any] = {}
    for r in rows:  # the estimate's own fullest moment of each rank (RankEstimate.fullest_bytes / fullest_moment)
        fullest, moment = r.fullest_bytes(), r.fullest_moment()
        overhead = runtime_overhead_bytes(spec, fullest)
        need = fullest + overhead["total"]
        if need > worst.get("need_bytes", -1):
            worst = {"rank": r.rank, "need_bytes": need, "reserve_bytes": overhead, "moment": moment,
                     "at_optimizer_step": moment == "optimizer_step", "predicted_peak_bytes": r.total_bytes,
                     "predicted_fullest_bytes": fullest}
    alloc = max((r.cuda_max_allocated_bytes or 0 for r in result.per_rank), default=0) or None
    reserved = max((r.cuda_max_reserved_bytes or 0 for r in result.per_rank), default=0) or None
    fits = bool(device_bytes and worst and fits_device(worst["predicted_fullest_bytes"], spec.parallel,
                                                       str(spec.runtime.device), device_bytes))
    return {**worst, "device_bytes": device_bytes, "fits": fits if device_bytes else None,
            "measured_peak_allocated_bytes": alloc, "measured_peak_reserved_bytes": reserved,
            "fits_claim_ok": None if not (device_bytes and reserved) else not (fits and reserved > device_bytes),
            "need_vs_reserved_pct": (worst["need_bytes"] - reserved) / reserved * 100.0
            if reserved and worst.get("need_bytes") else None}


def run_one(run: KitRun, ctx: Any, timeout_s: float) -> dict[str, Any]:
    """Run `run` through backend.launch.launcher.run_experiment; the result dict with the check's blocks."""
    from backend.launch.launcher import run_experiment

    t0 = time.monotonic()
    try:
        spec = spec_for(run, device=ctx.device, nproc=ctx.nproc, timeout_s=timeout_s, device_name=ctx.device_name)
    except ValueError as e:
        return {"status": str(Status.FAILED), "error": str(e), "gpu_check": {"run": run.name}}
    extra_env = {REFERENCE_ENV: "0", INIT_THREADS_ENV: str(os.cpu_count() or 1)} if ctx.device == "cuda" else {}
    result = run_experiment(spec, workdir=ctx.work / run.name, extra_env=extra_env,
                            on_progress=lambda ev: ctx.progress(f"  {run.name}: {ev.get('phase')} "
                                                                f"{ev.get('step')}/{ev.get('of')}", quiet=True))
    if ctx.device == "cuda":
        result.notes.append(f"GPU check: {REFERENCE_ENV}=0 skips the single-process CPU loss reference (a "
                            "1B-parameter fp32 step on one CPU thread takes minutes); no loss-parity check.")
    out = result.model_dump(mode="json", by_alias=True)
    out["step_time"] = step_time_block(spec, result.step_s_median, ctx.datasheet_key, ctx.profile_key,
                                       ctx.profile_path)
    try:
        out["memory_fit"] = memory_fit(spec, result, ctx.device_bytes)
    except Exception as e:  # noqa: BLE001
        out["memory_fit"] = {"error": f"{type(e).__name__}: {e}"}
    out["gpu_check"] = {"check_id": ctx.check_id, "run": run.name, "device_name": ctx.device_name,
                        "seconds": time.monotonic() - t0, "log_tail": _log_tail(ctx.work / run.name)}
    return out


def _log_tail(workdir: Path, chars: int = 3000) -> str | None:
    try:
        return (workdir / "log.txt").read_text(errors="replace")[-chars:]
    except OSError:
        return None
