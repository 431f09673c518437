"""Context parallelism through the real engine at world 4 (the farm's engine jobs), judged like
benchmarks/mp_accuracy.py and tighter: loss parity with the single-process reference, model states and comm payloads
exact, activations within 0.1% (the prediction is the non-CP one at seq_len / cp tokens per rank: ring attention saves
what the flash kernel saves; the TP+SP layout misses by 256 B, as it does without cp at seq 32: that is TP+SP's own),
and the K/V traffic on the cp group as strategies/cp.py documents it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from mp_accuracy import misses  # noqa: E402

from backend.engine.accuracy_notes import PARITY_BOUND  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402
from tests.helpers.farm import engine_job, params  # noqa: E402

LLAMA = {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none"}


def _spec(name: str, model: dict, train: dict, **parallel) -> ExperimentSpec:
    m = {"vocab_size": 128, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "attention": "flash"} | model
    t = {"global_batch": 4, "micro_batch": 1, "steps": 2, "warmup_steps": 1} | train
    return ExperimentSpec.model_validate({"name": name, "model": m, "train": t,
                                          "parallel": {"world_size": 4, **parallel}})


JOBS = {s.name: engine_job(s, 1200) for s in [
    _spec("cp2_x_fsdp2_llama_gqa", LLAMA | {"n_kv_heads": 2}, {}, strategy="fsdp", cp=2),
    _spec("cp2_x_tp2_sp_alltoall", {}, {"micro_batch": 2}, strategy="tp", tp=2, cp=2, sequence_parallel=True,
          cp_rotate="alltoall"),
    _spec("cp4_contiguous_bf16", {}, {"precision": "bf16-mixed"}, strategy="ddp", cp=4, cp_load_balance=False),
]}


def _ring_backward_moment(spec, rr) -> bool:
    """The tracker kept a moment inside a backward ring attention instead of the forward peak: activations above the
    forward peak by no more than the ring's fp32 dK/dV accumulators of one layer (sent and received: 2 x dkv,
    estimate_notes.cp_note), with gradients not all there yet, or all there when the step accumulates microbatches
    (the last microbatch's backward starts with every gradient the earlier ones made, so the gradients cannot tell
    its moments from its forward's). Which moment wins is a race with gloo's worker thread, which drops its
    reference to the async all-to-all's buffers after wait() returns (ProcessGroupGloo::runLoop). Seen under load
    on cp2_x_tp2_sp_alltoall (2 microbatches), activations 436,748-436,752 against 412,424 B: rank 1 with grads
    242,944 of 510,464 B (first microbatch's backward), and rank 1 with all 510,464 B (CI, stop 48)."""
    from backend.analytic.traffic import cp_kv_bytes

    _, dkv = cp_kv_bytes(spec)
    extra = rr.measured.activations_bytes - rr.predicted.activations_bytes
    grads_ok = rr.measured.grads_bytes < rr.predicted.grads_bytes or (
        (spec.train.microbatches or 1) > 1 and rr.measured.grads_bytes == rr.predicted.grads_bytes)
    return grads_ok and 0 < extra <= 2 * dkv


@pytest.mark.slow
@pytest.mark.parametrize("name", params(JOBS))
def test_cp_memory_and_comm_match_the_prediction(farm, name):
    run = farm.result(JOBS[name])
    res = run["result"]
    spec = res.spec
    bound = PARITY_BOUND[str(spec.train.precision)]  # misses() asks fp32's 1e-4 of every run
    assert res.loss_max_abs_diff is not None and res.loss_max_abs_diff <= bound, (res.loss, res.loss_reference)
    backward_moment = {rr.rank for rr in res.per_rank if _ring_backward_moment(spec, rr)}
    assert not [m for m in misses(res) if not m.startswith("loss parity")
                and not any(m.startswith(f"r{r} ") for r in backward_moment)], misses(res)
    for rr in res.per_rank:
        states = ("params_bytes", "optimizer_bytes", "other_bytes") if rr.rank in backward_moment else \
            ("params_bytes", "grads_bytes", "optimizer_bytes", "other_bytes")
        for cat in states:
            assert getattr(rr.measured, cat) == getattr(rr.predicted, cat), (rr.rank, cat)
        if rr.rank not in backward_moment:
            assert abs(rr.error_pct["activations_bytes"]) < 0.1, (rr.rank, rr.measured, rr.predicted)
        for kind, stat in rr.comm.items():
            assert stat.bytes == rr.comm_predicted[kind], (rr.rank, kind, stat.bytes, rr.comm_predicted)
    ring = ("all_to_all", "all_gather") if str(spec.parallel.cp_rotate) == "allgather" else ("all_to_all",)
    for payload in run["ranks"]:  # the ring's collectives run on the cp group
        assert all(spec.parallel.cp in payload["comm_group_sizes"][kind] for kind in ring), payload["comm_group_sizes"]
    assert any(n.startswith(f"CP: each sequence split over cp={spec.parallel.cp}") for n in res.notes)
