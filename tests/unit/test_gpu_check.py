"""The GPU check kit (benchmarks/gpu_check.py, issue 22 A) kept from rotting on a CPU-only machine: the whole kit
end to end on the CPU (gloo, world 1, tiny model), its output contract, a deliberately failing phase, the
probe's tables and profile, ingest, and that the device path needs none of the dashboard's packages (the kit and
that import check in child processes: multiprocess)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backend.bench import op_probe, op_profile
from backend.gpucheck import kit
from backend.gpucheck.ingest import ingest_report
from backend.result import MemoryBreakdown, RankResult, RunResult, Status
from backend.spec import ExperimentSpec

ROOT = Path(__file__).resolve().parents[2]


def test_gemm_grid_has_megatrons_sharded_shapes():
    sizes = op_probe.Sizes(**{**op_probe.TINY.__dict__, "hidden": (4096,), "tp": (2,), "tokens": (16384,)})
    shapes = {(r["m"], r["k"], r["n"]): r["uses"] for r in op_probe.gemm_shapes(sizes, sizes.tokens)}
    # column-parallel QKV / MLP-in split N by tp, row-parallel out-proj / MLP-out split K (ffn = 4h)
    assert shapes[(16384, 4096, 3 * 4096 // 2)] == ["qkv h=4096 tp=2 T=16384 fwd"]
    assert shapes[(16384, 4096 // 2, 4096)] == ["out_proj h=4096 tp=2 T=16384 fwd"]
    assert shapes[(16384, 4096, 4 * 4096 // 2)] == ["mlp_in h=4096 tp=2 T=16384 fwd"]
    assert shapes[(16384, 4 * 4096 // 2, 4096)] == ["mlp_out h=4096 tp=2 T=16384 fwd"]
    assert shapes[(4096, 16384, 3 * 4096 // 2)] == ["qkv h=4096 tp=2 T=16384 wgrad"]  # dW = X^T dY: (K, T) x (T, N)
    assert len(shapes) == 8
    tiny = op_probe.gemm_shapes(sizes, (8192,))  # the same (M, K, N) for two uses is measured once, for both
    assert ["mlp_out h=4096 tp=2 T=8192 fwd", "mlp_out h=4096 tp=2 T=8192 wgrad"] in [r["uses"] for r in tiny]


def test_half_flops_fit_recovers_the_saturating_curve():
    e_max, half = 0.8, 3.2e10
    points = [(f, e_max * f / (f + half)) for f in (1e9, 1e10, 1e11, 1e12, 1e13)]
    assert op_profile.fit_half_flops(points, e_max) == pytest.approx(half, rel=0.07)  # grid step 10^(1/20)


def test_profile_of_a_datasheet_device_keeps_its_peaks_and_measures_efficiencies():
    datasheet = json.loads((ROOT / "backend/analytic/steptime/hardware.json").read_text())["profiles"]["h200"]
    peak, hbm = datasheet["peak_flops"]["bf16"], datasheet["hbm_bytes_per_s"]
    tables = {"gemm_bf16": {"rows": [{"m": 8192, "k": 8192, "n": 8192, "flops": 1.1e12, "flops_per_s": 0.7 * peak},
                                     {"m": 2048, "k": 2048, "n": 2048, "flops": 1.7e10, "flops_per_s": 0.35 * peak}]},
              "attention": {"rows": [{"kernel": "flash", "fwd_flops": 4e12, "bwd_flops": 1e13, "fwd_s": 0.01,
                                      "bwd_s": 0.03, "fwd_flops_per_s": 4e14}]},
              "elementwise": {"rows": [{"op": "copy", "bytes_per_s": 0.85 * hbm}]},
              "launch": {"device_s_per_kernel": 2e-6, "host_s_per_launch": 5e-6}}
    facts = {"device_type": "cuda", "device_name": "NVIDIA H200", "date": "2026-11-26T00:00:00+00:00",
             "torch": "2.11.0+cu130", "cuda": "13.0", "memory_bytes": 150e9, "datasheet_key": "h200"}
    entry = op_profile.profile_entry(tables, facts, datasheet)
    assert entry["peak_flops"] == datasheet["peak_flops"] and entry["kind"] == "gpu"
    tune = entry["tune"]
    assert tune["gemm_efficiency_max"] == pytest.approx(0.7)
    assert tune["memory_efficiency"] == pytest.approx(0.85)
    assert tune["attention_flash_efficiency"] == pytest.approx(1.4e13 / 0.04 / peak)
    assert tune["kernel_launch_s"] == 5e-6
    assert entry["provenance"]["torch"] == "2.11.0+cu130" and entry["measured"] is tables
    assert op_profile.profile_key(facts) == "measured-nvidia-h200"


def test_unknown_phase_and_run_are_refused_before_anything_runs(capsys):
    from benchmarks import gpu_check

    assert gpu_check.main(["--device", "cpu", "--out", "/nonexistent/x", "--phases", "env,warp", "--runs", "ddp,fsdp9",
                           "--budget-s", "0"]) == 2
    err = capsys.readouterr().err
    assert "unknown phase(s) ['warp']" in err and "unknown run(s) ['fsdp9']" in err and "--budget-s must be > 0" in err


def _report_with(entries: list[dict]) -> dict:
    return {"kit": {"check_id": "20261126T000000Z-abc123", "device": "cuda"},
            "env": {"torch": {"device_name": "NVIDIA H200"}}, "runs": entries}


def _ok_entry(name: str) -> dict:
    spec = ExperimentSpec.model_validate({"name": f"gpu-check {name}", "runtime": {"device": "cuda"}})
    result = RunResult(status=Status.OK, spec=spec, step_s_median=0.25,
                       env={"device_name": "NVIDIA H200", "device_type": "cuda"},
                       per_rank=[RankResult(rank=0, measured=MemoryBreakdown(params_bytes=512),
                                            predicted=MemoryBreakdown(params_bytes=512))])
    return {**result.model_dump(mode="json", by_alias=True), "gpu_check": {"run": name},
            "step_time": {"datasheet": {"hardware": "h200", "step_s": 0.2}}}


def test_ingest_stores_each_run_once_tagged_with_its_gpu(store_urls):
    from db.queries import get_experiment, list_experiments

    engine = store_urls.engine()
    report = _report_with([_ok_entry("ddp"), {"status": "skipped", "error": "not started: 3 s left",
                                              "gpu_check": {"run": "zero3-offload"}}])
    first = ingest_report(engine, report)
    assert [(r["run"], r["action"]) for r in first] == [("ddp", "stored"), ("zero3-offload", "skipped")]
    again = ingest_report(engine, report)
    assert [(r["run"], r["action"]) for r in again] == [("ddp", "already"), ("zero3-offload", "skipped")]
    rows = list_experiments(engine, columns=["id", "status", "kind", "tags"])
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["kind"] == "measured"
    assert "gpu:NVIDIA H200" in rows[0]["tags"] and "gpu-check" in rows[0]["tags"]
    stored = get_experiment(engine, rows[0]["id"])
    assert stored["result"].step_s_median == 0.25
    assert json.loads(stored["result"].model_dump_json())["step_time"]["datasheet"]["hardware"] == "h200"


def test_kernel_categories_tie_kernels_to_their_launching_ops_and_measure_idle_time():
    """A synthetic Chrome trace: each kernel is tied to the CPU ops open at its launch (by correlation id), sorted
    into its category; busy time is the union of device spans, idle the rest of the step's wall time."""
    from backend.gpucheck.kernel_categories import category, summarize

    def cpu(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def launch(corr, ts, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": corr}}

    def kernel(name, corr, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        cpu("aten::linear", 0, 50), cpu("aten::mm", 10, 20), launch(1, 15), kernel("nvjet_tst_128x256", 1, 100, 300),
        cpu("aten::_scaled_dot_product_flash_attention", 60, 20), launch(2, 65),
        kernel("flash_fwd_kernel", 2, 400, 100),
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::pre_backward (layers.3)", "ts": 90, "dur": 40, "tid": 2},
        cpu("autograd::engine::evaluate_function: ScaledDotProductFlashAttentionBackward0", 100, 30, tid=2),
        launch(3, 110, tid=2), kernel("flash_bwd_dq_dk_dv_loop_kernel", 3, 600, 200),
        kernel("ncclDevKernel_ReduceScatter_Sum_f32", 4, 650, 250), cpu("aten::nll_loss_forward", 140, 5),
        launch(5, 141), kernel("void at::native::elementwise_kernel<...>", 5, 900, 10),
        kernel("Memcpy HtoD (Pinned -> Device)", 6, 950, 20, cat="gpu_memcpy")]}
    out = summarize(trace, step_wall_s=0.0015)
    cats = {k: round(v["seconds"] * 1e6) for k, v in out["categories"].items() if v["count"]}
    assert cats == {"gemm": 300, "attention_fwd": 100, "attention_bwd": 200, "nccl": 250, "cross_entropy": 10,
                    "memcpy_memset_copies": 20}
    assert out["device_busy_s"] == pytest.approx(730e-6) and out["idle_s"] == pytest.approx(770e-6)
    assert out["device_busy_without_nccl_s"] == pytest.approx(630e-6)
    assert out["top_kernels"][0]["name"] == "nvjet_tst_128x256" and out["basis"] == "cuda kernels"
    assert out["cpu_ranges"] == {"FSDP::pre_backward": {"seconds": 40e-6, "count": 1}}
    assert (category("multi_tensor_apply_kernel<...>", ["Optimizer.step#AdamW.step", "aten::_foreach_lerp_"])
            == "optimizer")
    assert category("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>", ["aten::add"]) == \
        "norm_elementwise"


def test_profile_reuse_skips_the_probe_and_is_not_used_on_another_gpu(tmp_path):
    """--profile: the probe is left out of the default phases (asking for both is refused); a profile measured on
    another GPU model is recorded but no prediction uses it."""
    from backend.gpucheck.kit_context import KitContext

    assert "probe" not in kit.parse_phases(None, reuse_profile=True) and "probe" in kit.parse_phases(None)
    with pytest.raises(ValueError, match="leave probe out"):
        kit.parse_phases("env,probe,runs", reuse_profile=True)
    ctx = KitContext(device="cuda", nproc=1, out=tmp_path, work=tmp_path, check_id="x")
    kit.reuse_profile(ctx, ROOT / "benchmarks/results/gpu/2026-11-26-h200-run1/profile.json")
    assert ctx.profile_key == "measured-nvidia-h200" and (tmp_path / "profile.json").is_file()
    ctx.device_name = "NVIDIA H200"
    kit.check_reused_profile(ctx)
    assert ctx.profile_key == "measured-nvidia-h200" and "not_used" not in ctx.report["profile"]
    ctx.device_name = "NVIDIA H100 80GB HBM3"
    kit.check_reused_profile(ctx)
    assert ctx.profile_key is None and ctx.profile_path is None
    assert ctx.report["profile"]["not_used"] == "measured on NVIDIA H200, this check runs on NVIDIA H100 80GB HBM3"


def test_diag_puts_the_prediction_cores_activation_terms_beside_the_saved_tensors():
    """The diag's "analytic" entry of each mode comes from the prediction core's per-block formula; it imported a
    module the core's split had moved (backend/analytic/activations.py), so every mode of the diag was an error."""
    from backend.analytic.memory.activations import LayerShape, layer_activation_bytes
    from backend.gpucheck import saved_tensors
    from backend.spec import ModelSpec

    shape = saved_tensors.SHAPES["tiny"]
    got = saved_tensors.analytic(shape, "cpu", "autocast")
    model = ModelSpec.model_validate({k: v for k, v in shape.items() if k != "source"})
    block = LayerShape.of(model, micro_batch=1, tp=1, sequence_parallel=False, dtype_bytes=2, autocast=True, ep=1,
                          device="cpu")
    assert got["block_bytes"] == layer_activation_bytes(block) > 0
    assert got["embedding_head_loss_bytes"] > 0


# ---- in processes of their own ----------------------------------------------------------------------------

HEAVY = ("sqlalchemy", "streamlit", "plotly", "pandas", "typer", "alembic")


@pytest.mark.multiprocess
def test_device_path_imports_none_of_the_dashboard_packages():
    """The device image has torch, numpy, psutil and pytest only: what the kit, the probe, the ranks and the trace
    import must not pull in the store or the dashboard (pydantic travels as a wheel)."""
    code = ("import sys; import backend.gpucheck.kit, backend.gpucheck.kit_runs, backend.gpucheck.env_probe, "
            "backend.bench.hw_probe, backend.bench.op_profile, backend.engine.rank, backend.launch.launcher, "
            "backend.frameworks.assemblers, backend.trace.trace_spec, backend.trace.rank, "
            "backend.analytic.steptime.model; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _files(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.is_file()]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cpu_kit_end_to_end_with_a_failing_phase(tmp_path, monkeypatch):
    """The kit on the CPU: every report key, a loadable profile, real runs stored as results, and the injected
    failure of the trace phase recorded while the tests phase after it still runs."""
    from backend.analytic.steptime.hardware import get_hardware

    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{kit.FAULT_ENV: "trace"})
    # the budget is a cap (~55 s quiet): on a loaded 2-core CI host the kit ran 147 s, and at 240 s diag's share
    # (~58 s) no longer held the compiled block's cold Inductor compile
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--out", str(out),
                           "--budget-s", "480"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: a phase failed (the injected one)
    report = json.loads((out / "report.json").read_text())
    assert set(kit.REPORT_KEYS) <= set(report)
    phases = report["phases"]
    assert phases["trace"]["status"] == "failed" and "injected failure" in phases["trace"]["error"]
    assert "RuntimeError" in phases["trace"]["traceback_tail"]
    ok = ("env", "probe", "runs", "diag", "tests", "late_runs", "allocator", "power")
    assert {phases[p]["status"] for p in ok} == {"ok"}, phases
    assert [r["status"] for r in report["allocator"]] == ["skipped", "skipped"]  # no CUDA allocator on the CPU
    assert report["power"]["status"] == "skipped"  # no GPU to draw power
    # the measured profile is a hardware.json profile the product loads
    key = report["profile"]["key"]
    monkeypatch.setenv("SHARDLAB_HARDWARE", str(out / "profile.json"))
    hw = get_hardware(key)
    assert hw.kind == "cpu" and hw.peak("bf16-mixed") > 0
    assert all({"m", "k", "n", "flops_per_s"} <= set(r) for r in report["profile"]["measured"]["gemm_bf16"]["rows"])
    rowwise = report["profile"]["measured"]["gemm_fp8_rowwise"]["rows"]  # torchao's rowwise recipe's GEMMs
    assert rowwise and all(r["scaling"] == "rowwise" and r["flops_per_s"] > 0 for r in rowwise)
    # every run is an ordinary RunResult with the check's comparisons
    assert [r["gpu_check"]["run"] for r in report["runs"]] == ["ddp", "zero3-offload"]
    for run in report["runs"]:
        result = RunResult.model_validate(run)
        assert result.status == Status.OK and result.step_s_median > 0
        assert result.per_rank[0].measured.params_bytes > 0 and result.per_rank[0].predicted.params_bytes > 0
        assert (run["step_time"]["measured_profile"]["step_s"] > 0
                and run["step_time"]["measured_profile"]["hardware"] == key)
    assert [r["per_rank"][0]["step_s"].__len__() for r in report["runs"]] == [6, 1]  # offload: one timed step
    # diag: the saved-tensor listing of one block in both precision modes, the autocast block equal to the analytic
    # term on the CPU (the model was validated there), and a profiled step of ddp and zero3 by category
    blocks = {b["mode"]: b for b in report["diag"]["activation_gap"]["blocks"]}
    assert set(blocks) == {"autocast", "bf16_params", "compiled"}, report["diag"]["parts"]
    assert blocks["autocast"]["diff_pct"] == pytest.approx(0.0)
    assert blocks["compiled"]["diff_pct"] == pytest.approx(0.0)  # Inductor's saved tensors: memory/compiled_block.py
    assert blocks["compiled"]["saved_block_bytes"] < blocks["bf16_params"]["saved_block_bytes"]
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
