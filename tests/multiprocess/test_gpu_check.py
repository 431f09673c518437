"""The GPU check kit in child processes: the device path imports none of the dashboard's packages, and the whole kit end to end on the CPU with a failing phase."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backend.gpucheck import kit
from backend.gpucheck.ingest import ingest_report
from backend.result import RunResult, Status

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("sqlalchemy", "streamlit", "plotly", "pandas", "typer", "alembic")


def test_device_path_imports_none_of_the_dashboard_packages():
    """The device image has torch, numpy, psutil and pytest only: what the kit, the probe, the ranks and the trace
    import must not pull in the store or the dashboard (pydantic travels as a wheel)."""
    code = ("import sys; import backend.gpucheck.kit, backend.gpucheck.kit_runs, backend.gpucheck.env_probe, "
            "backend.bench.hw_probe, backend.bench.op_profile, backend.engine.rank, backend.launch.launcher, "
            "backend.frameworks.assemblers, backend.trace.trace_spec, backend.trace.rank, backend.analytic.steptime.model; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _files(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.is_file()]


@pytest.mark.slow
def test_cpu_kit_end_to_end_with_a_failing_phase(tmp_path, monkeypatch):
    """The kit on the CPU: every report key, a loadable profile, real runs stored as results, and the injected
    failure of the trace phase recorded while the tests phase after it still runs."""
    from backend.analytic.steptime.hardware import get_hardware

    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{kit.FAULT_ENV: "trace"})
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--out", str(out),
                           "--budget-s", "240"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: a phase failed (the injected one)
    report = json.loads((out / "report.json").read_text())
    assert set(kit.REPORT_KEYS) <= set(report)
    phases = report["phases"]
    assert phases["trace"]["status"] == "failed" and "injected failure" in phases["trace"]["error"]
    assert "RuntimeError" in phases["trace"]["traceback_tail"]
    assert {phases[p]["status"] for p in ("env", "probe", "runs", "diag", "tests", "late_runs")} == {"ok"}, phases
    # the measured profile is a hardware.json profile the product loads
    key = report["profile"]["key"]
    monkeypatch.setenv("SHARDLAB_HARDWARE", str(out / "profile.json"))
    hw = get_hardware(key)
    assert hw.kind == "cpu" and hw.peak("bf16-mixed") > 0
    assert all({"m", "k", "n", "flops_per_s"} <= set(r) for r in report["profile"]["measured"]["gemm_bf16"]["rows"])
    # every run is an ordinary RunResult with the check's comparisons
    assert [r["gpu_check"]["run"] for r in report["runs"]] == ["ddp", "zero3-offload"]
    for run in report["runs"]:
        result = RunResult.model_validate(run)
        assert result.status == Status.OK and result.step_s_median > 0
        assert result.per_rank[0].measured.params_bytes > 0 and result.per_rank[0].predicted.params_bytes > 0
        assert run["step_time"]["measured_profile"]["step_s"] > 0 and run["step_time"]["measured_profile"]["hardware"] == key
    assert [r["per_rank"][0]["step_s"].__len__() for r in report["runs"]] == [6, 1]  # offload: one timed step
    # diag: the saved-tensor listing of one block in both precision modes, the autocast block equal to the analytic
    # term on the CPU (the model was validated there), and a profiled step of ddp and zero3 by category
    blocks = {b["mode"]: b for b in report["diag"]["activation_gap"]["blocks"]}
    assert set(blocks) == {"autocast", "bf16_params"} and blocks["autocast"]["diff_pct"] == pytest.approx(0.0)
    assert blocks["autocast"]["weight_cast_bytes"] > 0 and blocks["bf16_params"]["weight_cast_bytes"] == 0
    prof = {r["run"]: r for r in report["diag"]["step_profile"]}
    assert set(prof) == {"ddp", "zero3"} and all(r["status"] == "ok" for r in prof.values())
    assert prof["zero3"]["categories"]["gemm"]["count"] > 0 and prof["zero3"]["unprofiled_step_s_median"] > 0
    assert any(k.startswith("FSDP::") for k in prof["zero3"]["cpu_ranges"])
    assert "## Diag" in (out / "summary.md").read_text()
    assert report["tests"]["gpu"]["counts"].get("skipped", 0) >= 1  # no CUDA here: the gpu tests skip, not fail
    assert report["tests"]["torch_compat"]["counts"].get("failed", 0) == 0
    # what comes back from the device: at most 8 files, 2 folders deep, plain names
    files = _files(out)
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    summary = (out / "summary.md").read_text()
    runs_table = summary.split("## Diag")[0]  # the diag section has its own ddp / zero3 rows
    assert runs_table.count("\n| ddp |") == 1 and "| zero3-offload |" in runs_table
    # and ingest stores them
    from db.session import open_db

    rows = ingest_report(open_db(f"sqlite:///{tmp_path / 'store.db'}"), report)
    assert [r["action"] for r in rows] == ["stored", "stored"]
