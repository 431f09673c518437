"""The CUDA/NCCL path, kept honest on a CPU-only machine: torch.cuda is monkeypatched with fakes that record
what is called, so each test proves the CUDA branch is taken and computes what it should (review
../shared/reviews/gpu-path-and-structure.md, section 1)."""

from __future__ import annotations

import math

import pytest
import torch

from backend.analytic import device as D
from backend.analytic.estimate import estimate
from backend.analytic.memory import activations as A
from backend.analytic.params import param_list
from backend.spec import ExperimentSpec

TINY = {"model": {"d_model": 24, "n_layers": 2, "n_heads": 4, "seq_len": 8, "vocab_size": 40},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2, "warmup_steps": 1}}


def spec(parallel=None, train=None, runtime=None) -> ExperimentSpec:
    return ExperimentSpec.model_validate({**TINY, "train": {**TINY["train"], **(train or {})},
                                          "parallel": parallel or {"strategy": "ddp", "world_size": 2},
                                          "runtime": runtime or {}})


class FakeClock:
    """A device clock the fake events read: advanced by the code under test, never by the host."""

    def __init__(self):
        self.now_ms = 1000.0
        self.calls: list[str] = []


class FakeEvent:
    clock: FakeClock

    def __init__(self, enable_timing=False):
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.t = None

    def record(self, stream=None):
        self.t = self.clock.now_ms
        self.clock.calls.append("record")

    def synchronize(self):
        self.clock.calls.append("event.synchronize")

    def elapsed_time(self, end):
        assert self.t is not None and end.t is not None, "elapsed_time on an unrecorded event"
        return end.t - self.t


@pytest.fixture
def fake_cuda(monkeypatch):
    clock = FakeClock()
    FakeEvent.clock = clock
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: clock.calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: clock.calls.append(f"set_device {i}"))
    return clock


# ---- 1. timing --------------------------------------------------------------------------------------

def test_step_time_on_cuda_comes_from_events(fake_cuda):
    from backend.bench import timing

    def step():
        fake_cuda.calls.append("step")
        fake_cuda.now_ms += 250.0  # device work the step enqueued
        return "out"

    out, s = timing.timed(step, torch.device("cuda", 0))
    assert out == "out" and s == pytest.approx(0.25)
    calls = fake_cuda.calls
    assert calls.index("record") < calls.index("step") < len(calls) - 1 - calls[::-1].index("record")
    assert "event.synchronize" in calls and calls[0] == "synchronize"  # fenced before, event waited for after


def test_step_time_on_cpu_uses_no_cuda(fake_cuda):
    from backend.bench import timing

    _, s = timing.timed(lambda: None, torch.device("cpu"))
    assert s >= 0 and fake_cuda.calls == []


def test_pipeline_spans_on_cuda_are_events_relative_to_the_barrier(fake_cuda):
    from backend.strategies import timeline

    class Stage:
        stage_index = 1

    def forward_one_chunk(self, chunk_id):
        fake_cuda.now_ms += 40.0  # queued forward
        return chunk_id

    def wait(*_):
        fake_cuda.now_ms += 5.0  # the stream stalls on a recv

    fwd, wt = timeline._wrap_chunk(forward_one_chunk, "F"), timeline._wrap_wait(wait)
    out: list[dict] = []
    with timeline.capture(out, step=2, device="cuda"):
        fake_cuda.now_ms += 10.0
        wt()
        fwd(Stage(), 3)
        assert "start_s" not in out[0]  # not read before the step's work has run
    assert out == [
        {"rank": 0, "stage": -1, "microbatch": -1, "pass": "wait", "step": 2, "start_s": pytest.approx(0.010),
         "end_s": pytest.approx(0.015)},
        {"rank": 0, "stage": 1, "microbatch": 3, "pass": "F", "step": 2, "start_s": pytest.approx(0.015),
         "end_s": pytest.approx(0.055)},
    ]
    assert fake_cuda.calls.count("synchronize") >= 2  # before t0 and before the spans are read


def test_timeline_captures_a_later_timed_step():
    from backend.strategies.timeline import capture_call

    assert capture_call(1, 3) == 2  # warm-up 0, first timed 1 (lazy init), recorded: 2
    assert capture_call(0, 2) == 1
    assert capture_call(2, 1) == 2  # one timed step: the only choice


# ---- 1. comm seconds on nccl ---------------------------------------------------------------------------

class FakeWork:
    def __init__(self, ms=None, done=True):
        self.ms, self.done = ms, done

    def is_completed(self):
        return self.done

    def _get_duration(self):
        if self.ms is None:
            raise RuntimeError("Timing is not enabled (TORCH_NCCL_ENABLE_TIMING)")
        return self.ms

    def get_future(self):  # the gloo path's launch-time callback must never be used on nccl
        raise AssertionError("host-side future used on nccl")


def nccl_tally(monkeypatch):
    from backend.bench import comm

    monkeypatch.setattr(comm, "_backend_name", lambda: "nccl")
    t = comm.Tally()
    assert t.device_timed
    return t


def test_nccl_c10d_seconds_come_from_the_works_cuda_events(monkeypatch):
    t = nccl_tally(monkeypatch)
    for ms in (12.0, 8.0):
        t.record("all_reduce", 1024, 2)
        t.time_work("all_reduce", 0.0, 1e-6, FakeWork(ms))
    s = t.summary(2)["all_reduce"]
    assert s["seconds"] == pytest.approx(0.010) and "seconds_note" not in s


def test_nccl_unmeasurable_seconds_are_null_with_a_note(monkeypatch):
    t = nccl_tally(monkeypatch)
    t.record("all_gather", 64, 2)
    t.pend(torch.zeros(2), "all_gather", 0.0)  # functional collective: its Work is not reachable
    t.record("all_reduce", 64, 2)
    t.time_work("all_reduce", 0.0, 1e-6, FakeWork(None))  # timing off
    t.record("broadcast", 64, 2)
    t.time_work("broadcast", 0.0, 1e-6, FakeWork(3.0, done=False))
    summary = t.summary(1)
    for k in ("all_gather", "all_reduce", "broadcast"):
        assert summary[k]["seconds"] is None and summary[k]["seconds_note"], k
    assert "functional" in summary["all_gather"]["seconds_note"]
    assert "TORCH_NCCL_ENABLE_TIMING" in summary["all_reduce"]["seconds_note"]


def test_null_comm_seconds_flow_to_result_rows_and_ui():
    from backend.result import CommStat, RankResult, RunResult, Status
    from dashboard import detail_view as dv
    from db.result_rows import rank_rows

    s = spec()
    rr = RankResult(rank=0, comm={"all_reduce": CommStat(calls=1, bytes=8, seconds=0.5),
                                  "all_gather": CommStat(calls=1, bytes=8, seconds=None, seconds_note="functional")})
    res = RunResult(status=Status.OK, spec=s, per_rank=[rr], env={"backend": "nccl"})
    assert rank_rows(1, res)[0]["comm_seconds"] is None
    frame = dv.comm_frame(res).set_index("collective")
    assert frame.loc["all_gather", "time in collective / step"] == "n/a"
    assert frame.loc["all_reduce", "time in collective / step"] != "n/a"
    assert "CUDA events" in dv.comm_caption(res) and "functional" in dv.comm_caption(res)
    assert "issue to completion" in dv.comm_caption(res.model_copy(update={"env": {"backend": "gloo"}}))


# ---- 2. the estimator resolves `auto` like the engine ------------------------------------------------

def test_auto_resolves_like_pick_backend_device(fake_cuda, monkeypatch):
    from backend.engine.device_facts import host_device
    from backend.engine.mesh import pick_backend_device

    s = spec()
    backend, device = pick_backend_device(s, 1)
    assert (backend, device) == ("nccl", torch.device("cuda", 1)) and "set_device 1" in fake_cuda.calls
    assert host_device("auto") == device.type == D.resolve_device("auto", cuda_available=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert host_device("auto") == pick_backend_device(s, 0)[1].type == "cpu"


def test_auto_on_cuda_predicts_foreach_temporaries():
    s = spec()
    cuda, cpu = estimate(s, device="cuda").per_rank[0], estimate(s).per_rank[0]
    assert estimate(spec(runtime={"device": "cuda"})).to_dict() == estimate(s, device="cuda").to_dict()
    elems = sum(q.numel for q in param_list(s.model))
    assert cuda.optimizer_temp_bytes == 4 * elems  # foreach: a sqrt copy of every exp_avg_sq
    assert cpu.optimizer_temp_bytes < cuda.optimizer_temp_bytes


# ---- 3/4. CUDA memory: 512-B blocks, AdamW step on the host, fp32 softmax under autocast --------------

def test_cuda_rounds_storages_and_keeps_adamw_step_on_host():
    s = spec()
    cuda, cpu = estimate(s, device="cuda").per_rank[0], estimate(s, device="cpu").per_rank[0]
    sizes = [4 * q.numel for q in param_list(s.model)]
    assert cpu.params_bytes == sum(sizes) and cpu.optimizer_bytes == 2 * sum(sizes) + 4 * len(sizes)
    assert cuda.params_bytes == sum(math.ceil(b / 512) * 512 for b in sizes) > cpu.params_bytes
    assert cuda.optimizer_bytes == 2 * cuda.params_bytes  # m and v rounded; no `step` on the device
    assert cuda.grads_bytes == cpu.grads_bytes  # classic DDP: grads are views of its buckets
    z3 = spec({"strategy": "zero3", "world_size": 2})
    fsdp, fsdp_cpu = estimate(z3, device="cuda").per_rank[0], estimate(z3).per_rank[0]
    assert fsdp.params_bytes > fsdp_cpu.params_bytes and fsdp.params_bytes % 512 == 0  # one storage per shard
    assert fsdp.grads_bytes == fsdp_cpu.grads_bytes  # views of each unit's reduce-scatter output
    assert any("host" in n for n in estimate(s, device="cuda").notes)


def test_cuda_autocast_saves_softmax_twice():
    kw = dict(s=8, b=2, h=24, a=4, kv_heads=4, ffn=96, dtype_bytes=2, autocast=True)
    cpu = A.model_layer_activation_bytes(**kw, device="cpu")
    cuda = A.model_layer_activation_bytes(**kw, device="cuda")
    assert cuda - cpu == 4 * 4 * 8 * 8 * 2  # + 4 B (fp32 probs) per score: a*s*s*b scores
    assert D.softmax_saved_bytes_per_score(2, autocast=True, device="cuda") == 6
    assert D.softmax_saved_bytes_per_score(2, autocast=True, device="cpu") == 2
    no_ac = dict(kw, autocast=False)
    assert A.model_layer_activation_bytes(**no_ac, device="cuda") == A.model_layer_activation_bytes(**no_ac)
    bf16 = spec(train={"precision": "bf16-mixed"})
    assert estimate(bf16, device="cuda").per_rank[0].activations_bytes > estimate(bf16).per_rank[0].activations_bytes
    fsdp = spec({"strategy": "zero3", "world_size": 2}, train={"precision": "bf16-mixed"})  # no autocast
    assert estimate(fsdp, device="cuda").per_rank[0].activations_bytes == estimate(fsdp).per_rank[0].activations_bytes


# ---- 5. peaks by exact name, MFU vs HFU -------------------------------------------------------------------

def test_exact_device_names_give_their_own_peak():
    from backend.engine.device_facts import peak_flops

    bf16 = {n: peak_flops(n, "bf16-mixed") for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
                                                       "NVIDIA H200", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB",
                                                       "NVIDIA B200", "AMD Instinct MI300X")}
    assert bf16["NVIDIA H100 80GB HBM3"] == 989e12 and bf16["NVIDIA H100 PCIe"] == 756e12
    assert bf16["NVIDIA H100 NVL"] == 835e12
    assert len({bf16["NVIDIA H100 80GB HBM3"], bf16["NVIDIA H100 PCIe"], bf16["NVIDIA H100 NVL"]}) == 3
    assert bf16["NVIDIA A100-SXM4-40GB"] == bf16["NVIDIA A100-SXM4-80GB"] == 312e12
    assert bf16["NVIDIA B200"] == 2250e12 and bf16["AMD Instinct MI300X"] == 1307.4e12
    assert peak_flops("NVIDIA H100 PCIe", "fp32") == 51e12
    assert peak_flops("NVIDIA H100", "bf16-mixed") is None  # no substring guess
    assert peak_flops("NVIDIA GeForce RTX 4090", "bf16-mixed") is None


def _payload(s, device_name, step_s=0.5):
    est = estimate(s)
    ranks = [{"rank": r, "coords": s.parallel.coords(r), "losses": [2.0], "step_s": [step_s], "comm": {},
              "memory": {"categories": {}, "peak_bytes": 0}, "timeline": [],
              "env": {"hostname": "h", "device_type": "cuda", "device_name": device_name}}
             for r in range(len(est.per_rank))]
    return {"version": 1, "world_size": len(ranks), "backend": "nccl", "ranks": ranks, "loss_reference": []}


def test_mfu_excludes_recompute_and_hfu_includes_it():
    from backend.engine.assemble import assemble_result, model_flops_per_step

    s = spec(train={"recompute": "full", "precision": "bf16-mixed"})
    res = assemble_result(s, _payload(s, "NVIDIA H100 PCIe"))
    peak = 756e12 * 2 * 0.5
    assert res.model_flops_per_step == model_flops_per_step(s) < res.flops_per_step
    assert res.mfu == pytest.approx(res.model_flops_per_step / peak)
    assert res.hfu == pytest.approx(res.flops_per_step / peak) and res.hfu > res.mfu
    plain = spec(train={"precision": "bf16-mixed"})
    res2 = assemble_result(plain, _payload(plain, "NVIDIA H100 PCIe"))
    assert res2.mfu == pytest.approx(res2.hfu)
    assert assemble_result(plain, _payload(plain, "NVIDIA H100")).mfu is None

    from dashboard import detail_view as dv

    shown = dv.headline(res)["achieved FLOP/s (MFU · HFU)"]
    assert f"MFU {res.mfu * 100:.1f} %" in shown and f"HFU {res.hfu * 100:.1f} %" in shown


def test_assemble_predicts_for_the_device_the_ranks_ran_on():
    from backend.engine.assemble import assemble_result

    s = spec()
    res = assemble_result(s, _payload(s, "NVIDIA H100 80GB HBM3"))
    assert res.per_rank[0].predicted.params_bytes == estimate(s, device="cuda").per_rank[0].params_bytes


# ---- 6. fp16 loss scaling ---------------------------------------------------------------------------------

def _linear_and_opt():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def test_fp16_scaler_unscales_and_skips_overflow():
    from backend.strategies.scaler import LossScaling

    x = torch.randn(3, 4)
    ref, ref_opt = _linear_and_opt()
    ref(x).sum().backward()
    ref_opt.step()
    m, opt = _linear_and_opt()
    scaling = LossScaling(spec(train={"precision": "fp16-mixed"}), torch.device("cpu"))
    assert scaling.enabled and scaling.scale_value() == 2.0**16
    scaled = scaling.scale(m(x).sum())
    scaled.backward()
    assert scaling.step(opt)
    torch.testing.assert_close(m.weight, ref.weight)  # gradients were unscaled before the step
    before = m.weight.detach().clone()
    opt.zero_grad()
    scaling.scale(m(x).sum() * float("inf")).backward()
    assert not scaling.step(opt) and scaling.steps_skipped == 1
    torch.testing.assert_close(m.weight, before)  # skipped: no update from inf gradients
    assert scaling.scale_value() == 2.0**15


def test_scaler_is_a_pass_through_without_fp16():
    from backend.strategies.scaler import LossScaling

    m, opt = _linear_and_opt()
    scaling = LossScaling(spec(train={"precision": "bf16-mixed"}), torch.device("cpu"))
    loss = m(torch.randn(3, 4)).sum()
    assert scaling.scale(loss) is loss and not scaling.enabled
    loss.backward()
    assert scaling.step(opt) and scaling.scale_value() == 1.0


def test_fp16_scaler_agrees_over_a_process_group(tmp_path):
    import torch.distributed as dist

    from backend.strategies.scaler import LossScaling

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        m, opt = _linear_and_opt()
        scaling = LossScaling(spec(train={"precision": "fp16-mixed"}), torch.device("cpu"))
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        from backend.torch_compat import LocalShardGradScaler

        # torch's ShardedGradScaler, checking each grad's local shard (DTensor and plain grads mix under TP / EP)
        assert isinstance(scaling._scaler, ShardedGradScaler) and type(scaling._scaler) is LocalShardGradScaler
        scaling.scale(m(torch.randn(3, 4)).sum() * float("nan")).backward()
        assert not scaling.step(opt)
    finally:
        dist.destroy_process_group()


# ---- 7. NCCL launch settings, per-slot GPUs, gloo+cuda rejected ----------------------------------------

def test_nccl_jobs_get_flight_recorder_and_event_timing(tmp_path):
    from backend.launch import nccl

    nccl_spec = spec(runtime={"backend": "nccl", "device": "cuda"})
    env = nccl.job_env(nccl_spec, tmp_path, {"PATH": "/bin", "TORCH_NCCL_TRACE_BUFFER_SIZE": "7"}, cuda_available=False)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_ENABLE_TIMING"] == "1"
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "7"  # the user's own value is kept
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(tmp_path))
    assert nccl.job_env(spec(), tmp_path, {"PATH": "/bin"}, cuda_available=True)["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in nccl.job_env(spec(), tmp_path, {}, cuda_available=False)  # auto -> gloo


def test_group_timeout_fires_before_the_job_timeout():
    from backend.runtime.timeouts import group_timeout_s

    assert group_timeout_s(600, "nccl") == 300 and group_timeout_s(60, "nccl") == 30
    assert group_timeout_s(7200, "nccl") == 300
    assert group_timeout_s(600, "gloo") == 600
    # under SLURM the scheduler's limit ends an over-time gloo job (TIMEOUT), not the process group's recv timeout
    assert group_timeout_s(20, "gloo", scheduler_limit=True) > 20 + 60
    for job in (2, 10, 600, 86400):
        assert group_timeout_s(job, "nccl") < job


def test_worker_slots_get_disjoint_gpus(monkeypatch, tmp_path):
    from backend.result import RunResult, Status
    from backend.worker.service import Worker, gpu_slots

    assert gpu_slots(2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert gpu_slots(3, ["0", "1", "2", "3"]) == ["0", "1", "2"]
    assert gpu_slots(2, []) == [None, None]
    with pytest.raises(ValueError, match="2 < 3"):
        gpu_slots(3, ["0", "1"])
    seen = {}

    def runner(s, **kw):
        seen[kw["extra_env"]["SHARDLAB_WORKER_ID"]] = kw["extra_env"].get("CUDA_VISIBLE_DEVICES")
        return RunResult(status=Status.OK, spec=s)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    w = Worker(None, runs_dir=tmp_path, runner=runner)
    w.assign_gpus(2)
    import threading

    for slot in (0, 1):
        w._run(spec(), 1, w.slot_id(slot), threading.Event())
    assert seen == {w.slot_id(0): "4", w.slot_id(1): "5"}


def test_gloo_with_cuda_is_rejected_with_the_reason():
    with pytest.raises(ValueError, match="gloo implements neither reduce_scatter nor all_to_all"):
        spec(runtime={"backend": "gloo", "device": "cuda"})
    with pytest.raises(ValueError, match="NCCL only reduces CUDA tensors"):
        spec(runtime={"backend": "nccl", "device": "cpu"})
    spec(runtime={"backend": "gloo", "device": "cpu"})


# ---- 8. "fits" allows for the CUDA runtime ---------------------------------------------------------------

def test_fit_on_cuda_counts_context_nccl_and_fragmentation():
    from dashboard import predict_view as pv

    s = spec({"strategy": "ddp", "dp": 2, "tp": 2, "world_size": 4}, runtime={"device": "cuda"})
    est, rows = pv.predict(s)
    o = rows[0]["overhead"]
    comms = D.communicators(s.parallel)
    assert comms == 3  # world, dp, tp
    assert o["nccl_buffers"] == comms * D.RuntimeOverhead().nccl_bytes_per_communicator()
    assert o["cuda_context"] == D.RuntimeOverhead().cuda_context_bytes and o["fragmentation"] > 0
    need = rows[0]["fullest_bytes"] + o["total"]  # the estimate's own fullest moment (RankEstimate.fullest_bytes)
    fit = pv.fit_check(rows, need - 1)
    assert not fit.fits and "CUDA context" in fit.message() and "NCCL buffers" in fit.message()
    assert pv.fit_check(rows, need).fits
    cpu_rows = pv.predict(spec(runtime={"device": "cpu"}))[1]
    assert cpu_rows[0]["overhead"]["total"] == 0


def test_detail_view_shows_cuda_allocated_and_reserved():
    from backend.result import RankResult, RunResult, Status
    from dashboard import detail_view as dv

    rr = RankResult(rank=0, cuda_max_allocated_bytes=3 * 2**30, cuda_max_reserved_bytes=4 * 2**30)
    frame = dv.memory_error_frame(RunResult(status=Status.OK, spec=spec(), per_rank=[rr]))
    assert {"CUDA max allocated", "CUDA max reserved"} <= set(frame.columns)
    cpu = dv.memory_error_frame(RunResult(status=Status.OK, spec=spec(), per_rank=[RankResult(rank=0)]))
    assert "CUDA max reserved" not in cpu.columns


# ---- 9. `other` as this rank's dp slice -------------------------------------------------------------------

def test_other_is_the_dp_slice_once_the_engine_moves_only_it(monkeypatch):
    from backend.analytic.memory import rank_memory

    s = spec({"strategy": "ddp", "world_size": 2})
    # the engine copies only this rank's rows, on the CPU too (context.local_batch)
    assert rank_memory.OTHER_IS_DP_SLICE
    assert estimate(s).per_rank[0].other_bytes == 2 * (4 // 2) * 8 * 8
    monkeypatch.setattr(rank_memory, "OTHER_IS_DP_SLICE", False)
    assert estimate(s).per_rank[0].other_bytes == rank_memory.input_batch_bytes(4, 8)  # before: the global batch


def test_local_batch_is_a_copy_of_this_ranks_rows_on_the_cpu():
    """A row slice alone is a view that keeps the global batch's storage alive (MemTracker counts storages)."""
    from backend.strategies.context import RankContext, local_batch

    s = spec({"strategy": "ddp", "world_size": 2})
    ctx = RankContext(spec=s, rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    x, y = torch.arange(4 * 8, device="cpu").view(4, 8), torch.arange(4 * 8, device="cpu").view(4, 8) + 1
    lx, ly = local_batch(ctx, x, y)
    torch.testing.assert_close(lx, x[2:])
    torch.testing.assert_close(ly, y[2:])
    assert lx.untyped_storage().nbytes() == ly.untyped_storage().nbytes() == 2 * 8 * 8  # B/dp rows, not B


def test_nccl_timeout_points_at_the_flight_recorder_not_the_stacks(tmp_path):
    from backend.launch import outcome
    from backend.launch.nccl import TRACE_FILE_PREFIX

    (tmp_path / f"{TRACE_FILE_PREFIX}0").write_text("fr dump")
    f = outcome.timed_out(tmp_path, 60, 61.0, nccl=True)
    assert f.failing_rank is None and f"{TRACE_FILE_PREFIX}0" in f.error and "first collective" in f.error
    assert "flight-recorder" not in outcome.timed_out(tmp_path, 60, 61.0).error  # gloo: unchanged


def test_nccl_tally_lets_go_of_finished_works(monkeypatch):
    """A kept Work keeps its tensors: finished ones are read and dropped at the next collective."""
    t = nccl_tally(monkeypatch)
    pending = FakeWork(2.0, done=False)
    t.record("all_gather", 8, 2)
    t.time_work("all_gather", 0.0, 0.0, FakeWork(1.0))
    t.record("all_gather", 8, 2)
    t.time_work("all_gather", 0.0, 0.0, pending)
    assert [w for _, w in t._works] == [pending]  # the finished one was harvested
    pending.done = True
    assert t.summary(1)["all_gather"]["seconds"] == pytest.approx(0.003) and t._works == []


def test_engine_reads_only_the_cuda_device_snapshot(monkeypatch):
    """The measured side of the AdamW-step prediction: host tensors (the `step` scalars) are not in the
    categories of a CUDA rank, and both CUDA allocator peaks are read."""
    from backend.bench import memory

    snaps = {torch.device("cpu"): {"Optstate": 4 * 10}, torch.device("cuda", 1): {"Optstate": 2048},
             torch.device("cuda", 0): {"Optstate": 1}}
    assert memory._for_device(snaps, torch.device("cuda", 1)) == {"Optstate": 2048}
    assert memory._for_device(snaps, torch.device("cpu")) == {"Optstate": 40}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 4 * 2**30)
    assert memory.cuda_peaks(torch.device("cuda", 0)) == (3 * 2**30, 4 * 2**30)
    assert memory.cuda_peaks(torch.device("cpu")) == (None, None)


# ---- 8. FSDP2 CPU offload on CUDA: model states on the host, compute on the device -----------------------

class FakeStream:
    """torch.cuda.Stream for FSDP2's lazy init (it creates its all-gather / reduce-scatter streams there)."""

    def __init__(self, *args, **kwargs):
        pass


@pytest.fixture
def fake_cuda_world(fake_cuda, monkeypatch):
    """Rank 0 of a fake process group of 2 on "cuda": what a CUDA rank runs up to its first kernel, on fake tensors
    (FakeTensorMode makes CUDA tensors on this CPU build; autograd on them cannot run here, so no step)."""
    import torch.distributed as dist

    from backend.trace import torch_private

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    assert not dist.is_initialized()
    torch_private.init_fake_pg(0, 2)
    try:
        with torch_private.fake_world(lambda: None):
            yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()


def test_offload_params_on_cuda_materializes_the_sharded_params_on_the_host(fake_cuda_world):
    """zero3 + offload=params on CUDA (run 2 on the H200 failed at FSDP2's lazy init: "FSDP parameters should be
    materialized on CPU when enabling CPU offloading ... tok_emb.weight (cuda:0)"): every sharded parameter is on the
    host, FSDP2's own lazy init (the call that raised) accepts them, and the placement check knows where things go."""
    from backend.engine import build_mesh
    from backend.models.gpt import build_model
    from backend.strategies.base import RankContext, prepare
    from backend.strategies.materialize import misplaced

    s = ExperimentSpec.model_validate({
        "model": {**TINY["model"], "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none",
                  "attention": "flash"}, "train": {**TINY["train"], "precision": "bf16-mixed"},
        "parallel": {"strategy": "zero3", "world_size": 2, "offload": "params"},
        "runtime": {"device": "cuda", "backend": "nccl"}})
    dev = fake_cuda_world
    ctx = RankContext(spec=s, rank=0, world_size=2, local_rank=0, device=dev, mesh=build_mesh(s, dev))
    assert (ctx.placement.compute, ctx.placement.states) == (dev, torch.device("cpu"))
    prep = prepare(ctx, build_model(s.model, seed=0, recompute="none", device="meta"))
    root = prep.modules[0]
    params = dict(root.named_parameters())
    assert params and all(p.device_mesh.device_type == "cuda" and p.to_local().device.type == "cpu"
                          for p in params.values())
    root._get_fsdp_state()._lazy_init()  # raised on the H200 before
    assert misplaced(ctx.placement, prep.modules, prep.optimizer) == []
    # every parameter is where a plain CUDA run would not want it
    assert len(misplaced(dev, prep.modules)) == len(params)


def test_offload_measurement_adds_the_host_states_at_the_device_activation_peak():
    """CUDA + offload: the tracker's categories are the device's plus the host's (sharded params, grads, optimizer
    state), the host's taken at the device's activation peak; without offload only the device is read."""
    from backend.bench import memory

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)

    class Tracker:
        at_act_peak = {cuda: {"Activation": 100, "Unsharded Param": 40, "Total": 140}}
        others_at_act_peak = {cuda: {cpu: {"Sharded Param": 10, "Sharded Grad": 10, "OptState": 20, "Total": 40}}}
        high_water = {cuda: {"Activation": 120, "Total": 160}, cpu: {"Sharded Param": 10, "Total": 50}}

        def get_tracker_snapshot(self, kind):
            return {cuda: {"Activation": 100, "Temp": 30, "Total": 170}, cpu: {"OptState": 20, "Total": 45}}

    both = memory.breakdown(Tracker(), cuda, cpu)
    assert both["categories"] == {"params_bytes": 50, "grads_bytes": 10, "optimizer_bytes": 20,
                                  "activations_bytes": 100, "other_bytes": 0}
    assert both["peak_bytes"] == 215 and both["tracker_at_activation_peak"]["Sharded Param"] == 10
    assert memory.breakdown(Tracker(), cuda, cuda)["categories"]["params_bytes"] == 40
    assert memory.breakdown(Tracker(), cuda)["peak_bytes"] == 170
