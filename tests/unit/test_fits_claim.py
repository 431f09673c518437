"""The "fits" verdict (the New-experiment page's fit_check, the GPU check's memory_fit) against the committed real H200
runs (benchmarks/results/gpu/2026-11-26-h200-run{1,2}/report.json): its need (the fullest predicted moment plus the
CUDA runtime allowance, analytic/device.RuntimeOverhead) is never below the measured peak reserved, so "fits" is
never claimed on a device smaller than what the run reserved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.analytic.device import RuntimeOverhead
from backend.analytic.estimate import estimate
from backend.gpucheck.kit_runs import memory_fit
from backend.result import RunResult
from backend.spec import ExperimentSpec

GPU_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu"
H200_RUNS = ("2026-11-26-h200-run1", "2026-11-26-h200-run2")


def ok_runs() -> list[tuple[str, dict, float]]:
    out = []
    for name in H200_RUNS:
        report = json.loads((GPU_RESULTS / name / "report.json").read_text())
        device_bytes = float(report["env"]["torch"]["memory_bytes"])
        out += [(f"{name}/{run['gpu_check']['run']}", run, device_bytes) for run in report["runs"]
                if run.get("status") == "ok"]
    return out


RUNS = ok_runs()


def replay(run: dict, device_bytes: float) -> tuple[ExperimentSpec, dict]:
    spec = ExperimentSpec.model_validate(run["spec"])
    result = RunResult.model_validate({k: v for k, v in run.items() if k in RunResult.model_fields})
    return spec, memory_fit(spec, result, device_bytes)


def test_the_committed_runs_are_there():
    assert len(RUNS) == 10 and all(r["per_rank"][0]["cuda_max_reserved_bytes"] for _, r, _ in RUNS)


@pytest.mark.parametrize(("name", "run", "device_bytes"), RUNS, ids=[n for n, _, _ in RUNS])
def test_need_covers_the_measured_reserved_peak(name, run, device_bytes):
    """need >= peak reserved on every run (zero3-full was 4.7% below: the loss's backward, the step's fullest moment
    at V = 128,256, was not a candidate moment, and the 10% fragmentation allowance was short of the measured 13%);
    and "fits" is never claimed on a device smaller than the reserved peak, on the H200 or any smaller one."""
    spec, fit = replay(run, device_bytes)
    reserved = fit["measured_peak_reserved_bytes"]
    assert fit["need_bytes"] >= reserved, (name, fit)
    assert fit["fits_claim_ok"] and fit["fits"]  # 141 GB H200: the runs ran
    for frac in (0.5, 0.9, 0.99, 0.999999):
        smaller = memory_fit(spec,
                             RunResult.model_validate({k: v for k, v in run.items() if k in RunResult.model_fields}),
                             reserved * frac)
        assert smaller["fits"] is False and smaller["fits_claim_ok"], (name, frac)


@pytest.mark.parametrize(("name", "run", "device_bytes"), RUNS, ids=[n for n, _, _ in RUNS])
def test_the_fullest_moment_is_the_measured_peak_and_the_reserve_covers_the_allocator(name, run, device_bytes):
    """The fullest predicted moment (here the start of the loss's backward) is the tracker's measured peak within
    1%; the fragmentation allowance covers the measured reserved - allocated gap; the context term covers the
    device memory CUDA initialisation took on that H200 (env: memory_bytes - memory_free_bytes)."""
    spec, fit = replay(run, device_bytes)
    rank = run["per_rank"][0]
    assert fit["moment"] == "loss_backward"
    assert fit["predicted_fullest_bytes"] == pytest.approx(rank["measured"]["peak_bytes"], rel=0.01), name
    reserve = fit["reserve_bytes"]
    assert reserve["fragmentation"] >= rank["cuda_max_reserved_bytes"] - rank["cuda_max_allocated_bytes"], name
    torch_env = json.loads((GPU_RESULTS / name.split("/")[0] / "report.json").read_text())["env"]["torch"]
    assert reserve["cuda_context"] >= torch_env["memory_bytes"] - torch_env["memory_free_bytes"]
    r = estimate(spec, device="cuda").per_rank[0]
    assert r.fullest_bytes() == r.total_bytes + r.loss_backward_temp_bytes > r.total_bytes
    assert RuntimeOverhead().fragmentation_frac * fit["predicted_fullest_bytes"] == reserve["fragmentation"]


@pytest.mark.parametrize("mode", ["fp32-held", "fp32-free", "bf16-free", "autocast-held"])
def test_loss_backward_extra_is_what_the_tracker_sees_on_the_cpu(mode):
    """MemTracker's peak over forward + loss + backward minus its peak over forward + loss = loss_backward_extra_bytes
    (one block, V = 4096 >> h: the loss's backward is the step's fullest moment), for fp32 and 16-bit logits, held by
    the caller or not (backend/models/gpt.loss_fn: `.float()` copy of 16-bit logits, log_softmax)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from backend.analytic.memory.activations import loss_backward_extra_bytes
    from backend.models.gpt import build_model, loss_fn
    from backend.spec import ModelSpec

    torch.manual_seed(0)
    ms = ModelSpec(d_model=32, n_heads=2, seq_len=32, vocab_size=4096, n_layers=1)
    model = build_model(ms, seed=0)
    if mode == "bf16-free":
        model = model.to(torch.bfloat16)
    x, y = torch.randint(0, 4096, (2, 32)), torch.randint(0, 4096, (2, 32))
    tracker = MemTracker()
    tracker.track_external(model, x, y)

    def total(kind: str) -> int:
        snap = tracker.get_tracker_snapshot(kind)
        return sum(v for dev in snap.values() for k, v in dev.items() if str(getattr(k, "value", k)) == "Total")

    with tracker:
        if mode == "fp32-free" or mode == "bf16-free":
            loss = loss_fn(model(x), y)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast-held"):
                logits = model(x)
            loss = loss_fn(logits, y)
        forward_peak = total("peak")
        loss.backward()
    extra = loss_backward_extra_bytes(s=32, b=2, vocab=4096, dtype_bytes=4 if mode.startswith("fp32") else 2,
                                      logits_held=mode.endswith("held"))
    assert total("peak") - forward_peak == extra
