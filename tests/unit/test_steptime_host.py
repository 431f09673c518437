"""Step-time model terms for CPU ranks on gloo (issue 13 calibration): host DTensor dispatch counts (torch.profiler
"PythonSubclass" events of this repo's GPT, torch 2.13 CPU: 2195 for TP h256 L4 mb4, 2509 with SP, 621 for ZeRO-2,
1489 for dp2 x tp2 ZeRO-2 mb2), per-collective gloo bandwidth, the per-collective / per-stage outputs the
calibration fits to, and the kind=cpu defaults."""

from __future__ import annotations

import json

import pytest

from backend.analytic.sharding import local_params
from backend.analytic.steptime import collectives as CO
from backend.analytic.steptime import host as H
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.calibration import fit as F
from backend.calibration.records import measured_phases
from backend.result import RunResult
from backend.spec import ExperimentSpec


def _spec(strategy: str, world: int = 2, global_batch: int = 8, **par) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "model": {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 4, "seq_len": 128},
        "train": {"global_batch": global_batch, "micro_batch": 2},
        "parallel": {"strategy": strategy, "world_size": world, **par}})


@pytest.mark.parametrize(("strategy", "par", "per_layer", "optimizer", "profiled"), [
    ("tp", {}, 108, 459, 2195),                                # 16 layer-microbatches
    ("tp", {"sequence_parallel": True}, 118, 621, 2509),
    ("zero2", {}, 0, 621, 621),
    ("ddp", {}, 0, 0, None),
    ("zero1", {}, 0, 0, None),
])
def test_dtensor_dispatch_counts_match_the_profiled_step(strategy, par, per_layer, optimizer, profiled):
    spec = _spec(strategy, **par)
    params = local_params(spec, 0)
    assert H.tp_dispatch_per_layer(spec, params, 0) == per_layer
    assert H.optimizer_dispatch(spec, params) == optimizer
    if profiled is not None:
        total = per_layer * spec.model.n_layers * spec.train.microbatches + optimizer
        assert abs(total - profiled) <= 0.01 * profiled


def test_dp2_tp2_zero2_dispatch_matches_the_profile():
    spec = _spec("zero2", world=4, tp=2)
    params = local_params(spec, 0)
    total = H.tp_dispatch_per_layer(spec, params, 0) * 4 * spec.train.microbatches + H.optimizer_dispatch(spec, params)
    assert abs(total - 1489) <= 0.01 * 1489


def test_dispatch_adds_count_times_cost_and_is_zero_on_gpus():
    gpu = get_hardware("a100-80gb-sxm")
    assert gpu.tune.dtensor_op_s == 0.0
    spec = _spec("tp")
    params = local_params(spec, 0)
    base = step_time(spec, gpu).summary["step_s"]
    slow = step_time(spec, gpu.with_tunables(dtensor_op_s=1e-3)).summary["step_s"]
    count = H.tp_dispatch_per_layer(spec, params, 0) * 4 * spec.train.microbatches + H.optimizer_dispatch(spec, params)
    assert slow - base == pytest.approx(1e-3 * count, rel=1e-6)
    ddp = _spec("ddp")
    assert step_time(ddp, gpu.with_tunables(dtensor_op_s=1e-3)).summary["step_s"] == pytest.approx(
        step_time(ddp, gpu).summary["step_s"])


def test_collective_efficiency_scales_only_its_bandwidth_term():
    hw = get_hardware("a100-80gb-sxm")
    half = hw.with_tunables(reduce_scatter_efficiency=0.5)
    lat = CO.collective_s(hw, CO.INTRA, "reduce_scatter", 1.0, 8)  # ~ latency only
    full = CO.collective_s(hw, CO.INTRA, "reduce_scatter", 1e9, 8)
    assert CO.collective_s(half, CO.INTRA, "reduce_scatter", 1e9, 8) - lat == pytest.approx(2 * (full - lat), rel=1e-6)
    assert CO.collective_s(half, CO.INTRA, "all_reduce", 1e9, 8) == CO.collective_s(hw, CO.INTRA, "all_reduce", 1e9, 8)


def test_per_collective_seconds_and_stage_times_for_the_fit():
    hw = get_hardware("a100-80gb-sxm")
    z2 = step_time(_spec("zero2"), hw)
    r0 = z2.per_rank[0]
    assert set(r0.comm_by_collective_s) == {"all_gather", "reduce_scatter"}
    assert sum(r0.comm_by_collective_s.values()) == pytest.approx(r0.comm_s["dp"])
    tp = step_time(_spec("tp"), hw).per_rank[0]
    assert set(tp.comm_by_collective_s) == {"all_reduce", "all_gather"}  # f/g all-reduces + lm_head's logits gather
    assert sum(tp.comm_by_collective_s.values()) == pytest.approx(tp.comm_s["tp"])
    pp = step_time(_spec("pp", pp_schedule="interleaved_1f1b", virtual_stages=2), hw)
    assert len(pp.stage_fwd_s) == len(pp.stage_bwd_s) == 4 and all(
        b > f > 0 for f, b in zip(pp.stage_fwd_s, pp.stage_bwd_s, strict=False))


def test_fit_loss_counts_collectives_and_phases():
    hw = get_hardware("a100-80gb-sxm")
    spec = _spec("pp", pp_schedule="1f1b")
    st = step_time(spec, hw)
    exact = F.Sample(run_id=1, spec=spec, step_s=st.summary["step_s"], comm_s=None,
                     phases={s: (st.stage_fwd_s[s], st.stage_bwd_s[s]) for s in range(2)})
    assert F.sample_loss(hw, exact) == pytest.approx(0.0, abs=1e-12)
    off = F.Sample(run_id=1, spec=spec, step_s=st.summary["step_s"], comm_s=None,
                   phases={0: (2 * st.stage_fwd_s[0], st.stage_bwd_s[0])})
    assert F.sample_loss(hw, off) == pytest.approx(F.PHASE_WEIGHT * 0.5 * 0.6931471805599453 ** 2)
    z2 = step_time(_spec("zero2"), hw).per_rank[0].comm_by_collective_s
    comm = F.Sample(run_id=2, spec=_spec("zero2"), step_s=step_time(_spec("zero2"), hw).summary["step_s"], comm_s=None,
                    comm_by_collective={"all_gather": z2["all_gather"] * 2, "reduce_scatter": z2["reduce_scatter"]})
    assert F.sample_loss(hw, comm) == pytest.approx(F.COMM_WEIGHT * 0.6931471805599453 ** 2)


def test_measured_phases_are_per_stage_medians():
    ev = [{"rank": 0, "stage": 0, "microbatch": k, "pass": "F", "start_s": 0.0, "end_s": d}
          for k, d in enumerate((1, 2, 9))]
    ev += [{"rank": 0, "stage": 0, "microbatch": k, "pass": "B", "start_s": 1.0, "end_s": 1.0 + d}
           for k, d in enumerate((3, 4, 5))]
    ev += [{"rank": 0, "stage": -1, "microbatch": 0, "pass": "wait", "start_s": 0.0, "end_s": 7.0}]
    res = RunResult.model_validate({"status": "ok", "spec": _spec("pp").model_dump(mode="json"), "timeline": ev})
    assert measured_phases(res) == {0: (2.0, 4.0)}


def test_cpu_defaults_fill_what_an_older_probe_did_not_measure(tmp_path, monkeypatch):
    prof = {"name": "old probe", "kind": "cpu", "peak_flops": {"fp32": 5e10}, "hbm_bytes_per_s": 1e10,
            "intra_bytes_per_s": 1e9, "inter_bytes_per_s": 1e9, "cores": 2, "tune": {"intra_latency_s": 4e-4}}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(prof))
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(path))
    cpu = get_hardware("cpu")
    assert cpu.tune.dtensor_op_s > 0 and cpu.tune.intra_latency_s == 4e-4
    path.write_text(json.dumps({**prof, "tune": {"dtensor_op_s": 7e-5}}))
    assert get_hardware("cpu").tune.dtensor_op_s == 7e-5


def test_measured_gemm_table_replaces_the_saturating_curve(tmp_path, monkeypatch):
    from backend.analytic.steptime.compute import curve_fraction, gemm_s
    curve = ((1e6, 0.4), (1e8, 0.8))
    assert curve_fraction(curve, 1e5) == 0.4 and curve_fraction(curve, 1e9) == 0.8
    assert curve_fraction(curve, 1e7) == pytest.approx(0.6)  # linear in log(FLOPs)
    prof = {"name": "probe", "kind": "cpu", "peak_flops": {"fp32": 1e11}, "hbm_bytes_per_s": 1e12,
            "intra_bytes_per_s": 1e9, "inter_bytes_per_s": 1e9, "cores": 2,
            "tune": {"gemm_efficiency_max": 1.0, "kernel_launch_s": 0.0},
            "measured": {"gemm_flops_by_size": [[1e8, 8e10], [1e6, 4e10]]}}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(prof))
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(path))
    cpu = get_hardware("cpu")
    assert cpu.gemm_curve == curve
    m = k = n = (1e7 / 2) ** (1 / 3)  # a 1e7-FLOP GEMM: 0.6 of peak
    assert gemm_s(cpu, 1e11, m, k, n, 4) == pytest.approx(1e7 / (0.6 * 1e11))
