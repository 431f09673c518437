"""The phases of the GPU check (diag: backend/gpucheck/diag.py). Each takes the shared context and its time
allotment and returns its report
section; each child process runs in a session of its own with a hard timeout (the whole group is killed), so
nothing can hang the kit. The kit's own process never touches CUDA."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from backend.gpucheck.kit_context import PROFILE_FILE, KitContext
from backend.gpucheck.specs import runs_for, spec_for

ROOT = Path(__file__).resolve().parents[2]
GPU_TEST_FILES = ("tests/e2e/test_gpu.py",)
COMPAT_TEST_FILES = ("tests/unit/test_torch_compat.py", "tests/unit/test_trace_compat.py",
                     "tests/multiprocess/test_trace_compat.py")
"""The private torch symbols ShardLab uses, checked against the device's torch (2.11 there, 2.13 here)."""
RUN_MIN_S = {"cuda": 30.0, "cpu": 8.0}
"""A run is not started with less time left than this (run 1: 28-42 s per run, ~24 s of it set-up)."""
LATE_RUN_MIN_S = {"cuda": 45.0, "cpu": 8.0}
"""The offload run: set-up plus four steps of FSDP2's CPU AdamW over 1.24B parameters."""
RUN_MAX_S = {"cuda": 120.0, "cpu": 60.0}
CPU_RUNS = ("ddp", "zero3-offload")


def default_runs(device: str) -> list[str] | None:
    """Every run on a GPU; on the CPU (the test suite, `make gpu-check` here) the two that cover the classic
    DDP wrapper and FSDP2 with host offload, so the CPU kit stays under a minute (--runs picks others)."""
    return None if device == "cuda" else list(CPU_RUNS)


def run_child(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> tuple[int | None, str, str]:
    """(returncode or None on timeout, stdout, stderr) of cmd in its own session; on timeout the whole process
    group is killed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout_s))
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err


def child_row(rc: int | None, out: str, err: str) -> dict[str, Any]:
    """The JSON object a probe child printed last, or a failed row saying why there is none (timed out, exited
    non-zero, or printed something else)."""
    if rc != 0:
        return {"status": "failed", "error": f"{'timed out' if rc is None else f'exited {rc}'}: {err[-2000:]}"}
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as e:
        return {"status": "failed", "error": f"unreadable output ({e}): {out[-500:]}"}


def child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""), PYTHONUNBUFFERED="1")


def env_phase(ctx: KitContext, budget_s: float) -> dict[str, Any]:
    rc, out, err = run_child([ctx.python, "-m", "backend.gpucheck.env_probe", "--device", ctx.device], budget_s)
    if rc != 0:
        raise RuntimeError(f"env probe {'timed out' if rc is None else f'exited {rc}'}: {err[-2000:]}")
    env = json.loads(out)
    facts = env.get("torch", {})
    ctx.device_name = str(facts.get("device_name") or "")
    ctx.device_bytes = facts.get("memory_bytes")
    from backend.bench.op_profile import datasheet_key

    ctx.datasheet_key = datasheet_key(ctx.device_name)
    env["datasheet_profile"] = ctx.datasheet_key
    ctx.progress(f"env: {ctx.device_name or '?'}, torch {facts.get('torch')}, CUDA {facts.get('cuda_build')}, "
                 f"NCCL {facts.get('nccl')}, datasheet profile {ctx.datasheet_key}; missing APIs: "
                 f"{[k for k, v in env.get('apis', {}).items() if v != 'ok'] or 'none'}")
    return env


def probe_phase(ctx: KitContext, budget_s: float) -> dict[str, Any]:
    """hw_probe's operation tables in a child process; the profile file lands in OUT/profile.json."""
    path = ctx.out / PROFILE_FILE
    startup_s = 15.0 if ctx.device == "cuda" else 4.0  # interpreter + torch import + CUDA context
    tables_s = max(5.0, budget_s - startup_s - 5.0)
    cmd = [ctx.python, "-m", "backend.bench.hw_probe", "--device", ctx.device, "--tables", "-o", str(path),
           "--budget-s", f"{tables_s:.0f}", "--sizes", "full" if ctx.device == "cuda" else "tiny"]
    rc, out, err = run_child(cmd, budget_s)
    if rc != 0 or not path.exists():
        raise RuntimeError(f"hw_probe {'timed out' if rc is None else f'exited {rc}'}: {err[-3000:]}")
    ((key, entry),) = json.loads(path.read_text())["profiles"].items()
    use_profile(ctx, path, key)
    ctx.progress(f"probe: profile {key}: tunables {json.dumps(entry.get('tune'))}; tables "
                 f"{ {k: round(v, 1) for k, v in entry['measured'].get('seconds', {}).items()} }")
    return {"key": key, "file": PROFILE_FILE, **entry}


def use_profile(ctx: KitContext, path: Path, key: str) -> None:
    ctx.profile_path, ctx.profile_key = path, key


def runs_phase(ctx: KitContext, budget_s: float) -> list[dict[str, Any]]:
    """Each early run in priority order while time is left; results go into the report as they come."""
    return _runs(ctx, budget_s, late=False)


def late_runs_phase(ctx: KitContext, budget_s: float) -> list[dict[str, Any]]:
    """The late runs (zero3-offload), after everything else, appended to the report's runs."""
    return _runs(ctx, budget_s, late=True)


def _runs(ctx: KitContext, budget_s: float, late: bool) -> list[dict[str, Any]]:
    from backend.gpucheck.kit_runs import run_one

    end = time.monotonic() + budget_s
    results: list[dict[str, Any]] = ctx.report["runs"] if late and isinstance(ctx.report.get("runs"), list) else []
    ctx.report["runs"] = results  # the same list grows as runs finish: each save() writes what came so far
    for run in runs_for(ctx.nproc, ctx.run_names or default_runs(ctx.device), late=late):
        left = end - time.monotonic()
        need = (LATE_RUN_MIN_S if late else RUN_MIN_S)[ctx.device]
        if left < need:
            results.append({"status": "skipped", "error": f"not started: {left:.0f} s left in the "
                            f"{'late_runs' if late else 'runs'} phase < {need:.0f} s", "gpu_check": {"run": run.name}})
            ctx.progress(f"run {run.name}: skipped ({left:.0f} s left)")
            continue
        ctx.progress(f"run {run.name}: start (timeout {min(left, RUN_MAX_S[ctx.device]):.0f} s)")
        try:
            res = run_one(run, ctx, min(left, RUN_MAX_S[ctx.device]))
        except Exception as e:  # noqa: BLE001 - run_experiment never raises for a failed run; anything else is this run's
            res = {"status": "failed", "error": f"{type(e).__name__}: {e}", "gpu_check": {"run": run.name}}
        results.append(res)
        ctx.save()
        ctx.progress(f"run {run.name}: {run_line(res)}")
    return results


def run_line(res: dict[str, Any]) -> str:
    st = res.get("step_time", {})
    pred = "/".join(f"{(st.get(k) or {}).get('step_s') or float('nan'):.3f}" for k in ("datasheet", "measured_profile"))
    fit = res.get("memory_fit", {})
    gib = lambda b: f"{b / 2**30:.2f}" if b else "-"  # noqa: E731
    if res.get("status") != "ok":
        return f"{res.get('status')}: {str(res.get('error'))[:300]}"
    return (f"ok step {res.get('step_s_median') or float('nan'):.3f} s (predicted datasheet/measured {pred}), "
            f"MFU {res.get('mfu') or float('nan'):.3f}, peak alloc/reserved "
            f"{gib(fit.get('measured_peak_allocated_bytes'))}/{gib(fit.get('measured_peak_reserved_bytes'))} GiB, fits "
            f"{fit.get('fits')}, {res.get('gpu_check', {}).get('seconds', 0):.0f} s")


def trace_phase(ctx: KitContext, budget_s: float) -> list[dict[str, Any]]:
    """The runs' specs traced at full size on fake tensors of the run's device, in parallel, beside the runs'
    measured per-category bytes; a spec not started before the phase's end is a skipped row."""
    from backend.trace.trace_spec import trace_spec

    end = time.monotonic() + budget_s
    measured = {r.get("gpu_check", {}).get("run"): r for r in ctx.report.get("runs") or []}
    runs = runs_for(ctx.nproc, ctx.run_names or default_runs(ctx.device))
    specs = [(run.name, spec_for(run, device=ctx.device, nproc=ctx.nproc, timeout_s=60.0)) for run in runs]
    workers = max(2, min(len(specs), (os.cpu_count() or 2) // 2))

    def one(item: tuple[str, Any]) -> dict[str, Any]:
        name, spec = item
        left = end - time.monotonic()
        if left < 5:
            return {"run": name, "status": "skipped", "error": f"not started: {left:.0f} s left", "per_rank": []}
        try:
            tr = trace_spec(spec, device=ctx.device, rank_timeout_s=left)
        except Exception as e:  # noqa: BLE001 - one spec failing is its row
            tr = {"status": "failed", "error": f"{type(e).__name__}: {e}", "per_rank": []}
        tr.pop("spec", None)
        for row in tr.get("per_rank", []):
            row.pop("memory", None)
            row["measured"] = _measured_rank(measured.get(name), row["rank"])
        return {"run": name, **tr}

    with ThreadPoolExecutor(max_workers=workers) as pool:
        rows = list(pool.map(one, specs))
    for row in rows:
        ctx.progress(f"trace {row['run']}: {row.get('status')} {str(row.get('error') or '')[:200]}")
    return rows


def _measured_rank(run: dict[str, Any] | None, rank: int) -> dict[str, Any] | None:
    for r in (run or {}).get("per_rank", []):
        if r.get("rank") == rank and (run or {}).get("status") == "ok":
            return r.get("measured")
    return None


def tests_phase(ctx: KitContext, budget_s: float) -> dict[str, Any]:
    """The private-torch-API checks (they failed on the device's torch in run 1), then `pytest -m gpu` on the gpu
    test file, with junit XML per test."""
    out: dict[str, Any] = {}
    end = time.monotonic() + budget_s
    for label, files, marker in (("torch_compat", COMPAT_TEST_FILES, None), ("gpu", GPU_TEST_FILES, "gpu")):
        left = end - time.monotonic()
        if left < 5:
            out[label] = {"status": "skipped", "reason": f"{left:.0f} s left"}
            continue
        out[label] = run_pytest(ctx, list(files), marker, left, ctx.work / f"junit-{label}.xml")
        ctx.progress(f"tests {label}: {out[label]['counts']} (exit {out[label]['returncode']})")
    return out


def run_pytest(ctx: KitContext, files: list[str], marker: str | None, timeout_s: float, xml: Path) -> dict[str, Any]:
    # addopts cleared: pytest.ini's --timeout needs pytest-timeout, which the device image may lack
    cmd = [ctx.python, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
    if marker:
        cmd += ["-m", marker]
    t0 = time.monotonic()
    rc, out, err = run_child(cmd, timeout_s)
    tests = parse_junit(xml) if xml.exists() else []
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"returncode": rc, "timed_out": rc is None, "seconds": time.monotonic() - t0, "counts": counts,
            "tests": tests, "output_tail": (out + err)[-3000:]}


def parse_junit(path: Path) -> list[dict[str, Any]]:
    rows = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or el.text or "")[:1500]
                break
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time") or 0), "message": message})
    return rows
