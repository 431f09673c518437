"""The GPU check's diag phase: what the two gaps of run 1 need (report.json key `diag`, a section of summary.md).

- activation gap (measured activations 4.5 % below the prediction on CUDA, 6.6 % for ddp): the saved-tensor
  listing of one block + head + loss (backend/gpucheck/saved_tensors.py) on the run's device at the 1B shape
  ("full") and at a smaller "compare" shape, and the same "compare" listing on the host CPU, where the analytic
  model was validated; next to the runs' measured-minus-predicted activations per layer;
- compile: the same listing with each block compiled (elementwise=compiled), on the run's device, against
  memory/compiled_block.py (measured with Inductor on the CPU);
- step-time gap (zero3 +35 % over the measured-profile prediction): one profiled step of ddp and zero3 at world
  1 with the product's set-up (backend/gpucheck/step_profile.py), device time by kernel category, busy vs wall.
Each part is a child process with a hard timeout; a part that fails or times out is its own entry.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from backend.gpucheck.kit_context import KitContext
from backend.gpucheck.kit_runs import INIT_THREADS_ENV
from backend.gpucheck.phases import child_env, run_child

PROFILE_RUNS = "ddp,zero3"
PART_MAX_S = {"saved_device": 60.0, "profile": 150.0, "saved_host": 60.0, "saved_compiled": 90.0}
"""On an H200: the CUDA listing ~15 s (start-up ~8), the profile ~60 s (two 1B set-ups), the CPU listing ~25 s; the
compiled block's listing (not yet run on a GPU) last, so its compile cannot starve the others."""


def diag_phase(ctx: KitContext, budget_s: float) -> dict[str, Any]:
    end = time.monotonic() + budget_s
    out: dict[str, Any] = {"saved_tensors": [], "step_profile": None, "parts": {}}
    ctx.report["diag"] = out
    cuda = ctx.device == "cuda"
    threads = str(os.cpu_count() or 1)
    parts = [("saved_device", [ctx.device, "full,compare" if cuda else "tiny"])]
    parts.append(("profile", None))
    if cuda:
        parts.append(("saved_host", ["cpu", "compare"]))
    parts.append(("saved_compiled", [ctx.device, "compare" if cuda else "tiny", "compiled"]))
    for name, args in parts:
        left = end - time.monotonic()
        if left < 10:
            out["parts"][name] = {"status": "skipped", "reason": f"{left:.0f} s left"}
            continue
        t0 = time.monotonic()
        try:
            if name == "profile":
                out["step_profile"] = _profile(ctx, min(left, PART_MAX_S[name]))
            else:
                out["saved_tensors"] += _saved(ctx, args, threads, min(left, PART_MAX_S[name]))
            out["parts"][name] = {"status": "ok"}
        except Exception as e:  # noqa: BLE001 - one part failing is recorded, the next still runs
            out["parts"][name] = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:1500]}"}
        out["parts"][name]["seconds"] = time.monotonic() - t0
        ctx.progress(f"diag {name}: {out['parts'][name]['status']} in {out['parts'][name]['seconds']:.1f} s "
                     f"{out['parts'][name].get('error', '')[:200]}")
        ctx.save()
    out["activation_gap"] = activation_gap(out["saved_tensors"], ctx.report.get("runs") or [])
    return out


def _saved(ctx: KitContext, args: list[str], threads: str, timeout_s: float) -> list[dict[str, Any]]:
    """One saved-tensor listing child: args = [device, shapes] or [device, shapes, modes]."""
    device, shapes = args[0], args[1]
    cmd = [ctx.python, "-m", "backend.gpucheck.saved_tensors", "--device", device, "--shape", shapes]
    cmd += ["--modes", args[2]] if len(args) > 2 else []
    if device == "cpu" and ctx.device == "cuda":
        cmd += ["--threads", threads]
    rc, stdout, err = run_child(cmd, timeout_s)
    if rc != 0:
        raise RuntimeError(f"saved_tensors {'timed out' if rc is None else f'exited {rc}'}: {err[-2000:]}")
    return json.loads(stdout)


def _profile(ctx: KitContext, timeout_s: float) -> list[dict[str, Any]]:
    path = ctx.work / "step_profile.json"
    env = dict(child_env(), **({INIT_THREADS_ENV: str(os.cpu_count() or 1)} if ctx.device == "cuda" else {}))
    cmd = [ctx.python, "-m", "backend.gpucheck.step_profile", "--device", ctx.device, "--runs", PROFILE_RUNS,
           "--out", str(path)]
    rc, _, err = run_child(cmd, timeout_s, env=env)
    rows = json.loads(path.read_text()) if path.exists() else []  # what finished before a timeout still counts
    if rc != 0 and not rows:
        raise RuntimeError(f"step_profile {'timed out' if rc is None else f'exited {rc}'}: {err[-2000:]}")
    if rc != 0:
        rows.append({"run": "(rest)", "status": "failed", "error": f"{'timed out' if rc is None else f'exited {rc}'}: "
                     f"{err[-1000:]}"})
    return rows


def activation_gap(listings: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per listing and mode: the block's saved bytes (weight casts apart) vs the analytic block term; per run: the
    measured minus predicted activations per layer (the engine's tracker, rank 0)."""
    blocks = []
    for entry in listings:
        for mode, v in entry.get("modes", {}).items():
            if "unique_bytes" not in v:
                continue
            saved, pred = v["unique_bytes"].get("block", 0), v["analytic"]["block_bytes"]
            blocks.append({"device": entry["device"], "shape": entry["shape"], "mode": mode, "saved_block_bytes": saved,
                           "analytic_block_bytes": pred, "diff_pct": (saved - pred) / pred * 100.0 if pred else None,
                           "weight_cast_bytes": v["unique_bytes"].get("block_weight_casts", 0)})
    per_run = []
    for run in runs:
        rank = (run.get("per_rank") or [{}])[0]
        meas = (rank.get("measured") or {}).get("activations_bytes")
        pred = (rank.get("predicted") or {}).get("activations_bytes")
        layers = ((run.get("spec") or {}).get("model") or {}).get("n_layers")
        if run.get("status") == "ok" and meas and pred and layers:
            per_run.append({"run": (run.get("gpu_check") or {}).get("run"), "measured_bytes": meas,
                            "predicted_bytes": pred, "diff_per_layer_bytes": (meas - pred) / layers})
    return {"blocks": blocks, "runs": per_run}
