"""The full in-rank engine (warm-up, timed step, memory-tracked step, reference) on the cases whose memory
step used to crash: multi-stage pipelines (interleaved, zero-bubble, ZBV), PP×FSDP with two stages per
rank, and FSDP with EP experts as ignored params. Loss parity with the single-process reference, and the
tracked params / grads / optimizer bytes against the analytic prediction (the farm's engine jobs)."""

from __future__ import annotations

import pytest

from backend.analytic.sharding import local_params
from backend.spec import ExperimentSpec
from tests.helpers.farm import engine_job, params, uses

STATE = ("params_bytes", "grads_bytes", "optimizer_bytes")
LOSS_TOL = 1e-4
STATE_TOL_PCT = 2.0


def spec(name: str, *, model: dict | None = None, **parallel) -> ExperimentSpec:
    m = {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "seq_len": 16} | (model or {})
    t = {"global_batch": 4, "micro_batch": 1, "steps": 1, "warmup_steps": 0}
    return ExperimentSpec.model_validate({"name": name, "model": m, "train": t, "parallel": parallel})


PP2 = {"strategy": "pp", "world_size": 2, "virtual_stages": 2}
JOBS = {s.name: engine_job(s) for s in [
    spec("interleaved", **PP2, pp_schedule="interleaved_1f1b"),
    spec("zero_bubble", **PP2, pp_schedule="zero_bubble"),
    spec("zbv", **PP2, pp_schedule="zbv"),
    spec("zero3_ep", model={"n_experts": 4, "n_layers": 2}, strategy="zero3", world_size=2, ep=2),
    spec("fsdp_pp_interleaved", strategy="fsdp", world_size=4, pp=2, virtual_stages=2, pp_schedule="interleaved_1f1b"),
]}


def _ok_and_parity(run: dict) -> None:
    res = run["result"]
    assert res.status == "ok", res.error
    assert res.loss_max_abs_diff is not None and res.loss_max_abs_diff <= LOSS_TOL, (res.loss, res.loss_reference)


def _storage(run: dict, rank: int) -> int:
    """fp32 bytes of this rank's sharded parameter storage (FSDP2 padded shards + EP's ignored experts)."""
    return 4 * sum(q.storage_numel for q in local_params(run["result"].spec, rank))


def _within(measured: int, predicted: int) -> bool:
    return predicted > 0 and abs(measured - predicted) <= STATE_TOL_PCT / 100 * predicted


@pytest.mark.slow
@pytest.mark.parametrize("name", params({k: JOBS[k] for k in ("interleaved", "zero_bubble", "zbv")}))
def test_multi_stage_pipelines_measure_state_like_the_estimate(farm, name):
    """Bug 1 (interleaved: a stage's backward after the other stage's next forward) and bug 2 (split
    backward: hookless tracker); two stage modules per rank, both counted."""
    run = farm.result(JOBS[name])
    _ok_and_parity(run)
    for r in run["result"].per_rank:
        for cat in STATE:
            assert _within(getattr(r.measured, cat), getattr(r.predicted, cat)), (name, r.rank, cat, r.measured,
                                                                                  r.predicted)
        assert r.measured.activations_bytes > 0


@pytest.mark.slow
@uses(JOBS["zero3_ep"])
def test_fsdp_ignored_expert_params_are_counted(farm):
    """Bug 4: EP experts are fully_shard's ignored_params; they are this rank's own params and grads."""
    run = farm.result(JOBS["zero3_ep"])
    _ok_and_parity(run)
    for r, payload in zip(run["result"].per_rank, run["ranks"], strict=False):
        raw = payload["memory"]["tracker_at_activation_peak"]
        storage = _storage(run, r.rank)  # fp32 sharded + ignored experts
        assert _within(raw["Sharded Param"], storage), (raw, storage)
        assert _within(raw["Sharded Grad"], r.predicted.grads_bytes), (raw, r.predicted)
        # the peak is predicted inside the last MoE block (root + block unsharded); a rank whose routed tokens are
        # fewer peaks at the loss instead and holds only the sharded storage (estimate notes say so)
        assert any(_within(r.measured.params_bytes, p) for p in (r.predicted.params_bytes, storage)), (
            r.measured, r.predicted)
        assert _within(r.measured.optimizer_bytes, r.predicted.optimizer_bytes), (r.measured, r.predicted)


@pytest.mark.slow
@uses(JOBS["fsdp_pp_interleaved"])
def test_pp_fsdp_tracks_every_local_stage(farm, name="fsdp_pp_interleaved"):
    """Bug 3: both stage modules of a rank are FSDP-instrumented (before: only the first). The sharded
    state matches the estimate; FSDP's unsharded / in-flight buffers are reported next to it."""
    run = farm.result(JOBS[name])
    _ok_and_parity(run)
    for r, payload in zip(run["result"].per_rank, run["ranks"], strict=False):
        raw = payload["memory"]["tracker_at_activation_peak"]
        storage = _storage(run, r.rank)
        assert _within(raw["Sharded Param"], storage), (name, r.rank, raw, storage)
        assert _within(raw["Sharded Grad"], storage), (name, r.rank, raw, storage)
        for cat in ("params_bytes", "optimizer_bytes"):  # grads at m=2: see the PP x FSDP note in estimate._notes
            assert _within(getattr(r.measured, cat), getattr(r.predicted, cat)), (name, r.rank, cat, r.measured,
                                                                                  r.predicted)
