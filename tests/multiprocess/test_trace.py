"""Full-scale traced memory (issue 11): the engine's own set-up and step on fake tensors over the fake PG.

Traced bytes are compared with backend/analytic's prediction for the same rank (and, for zero3, with a
real measured run of the same spec), by the issue's bounds: params / grads / optimizer within 1 %,
activations within 10 %.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.spec import ExperimentSpec
from backend.trace.trace_spec import UNEXPLAINED, representative_ranks, trace_spec

ROOT = Path(__file__).resolve().parents[2]
TINY = {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 256}
STATE = ("params_bytes", "grads_bytes", "optimizer_bytes")


def tiny(parallel: dict, model: dict | None = None, **train) -> ExperimentSpec:
    t = {"global_batch": 8, "micro_batch": 2} | train
    return ExperimentSpec.model_validate({"model": TINY | (model or {}), "train": t, "parallel": parallel})


def assert_within(row: dict, keys=STATE, act: bool = True) -> None:
    for k in keys:
        assert abs(row["error_pct"][k]) <= 1.0, (k, row["traced"][k], row["predicted"][k])
    if act:
        assert abs(row["error_pct"]["activations_bytes"]) <= 10.0, (row["traced"], row["predicted"])


@pytest.mark.parametrize("parallel", [
    {"strategy": "zero3", "world_size": 4},
    {"strategy": "zero2", "world_size": 4},
    {"strategy": "ddp", "world_size": 4, "tp": 2},
    {"strategy": "ddp", "world_size": 4, "tp": 4, "sequence_parallel": True},
], ids=["zero3", "zero2", "ddp_tp2", "tp4_sp"])
def test_small_spec_traced_matches_prediction(parallel: dict) -> None:
    res = trace_spec(tiny(parallel), ranks=[parallel["world_size"] - 1])
    assert res["status"] == "ok", res
    (row,) = res["per_rank"]
    assert row["rank"] == parallel["world_size"] - 1
    assert_within(row)
    assert row["traced"]["peak_bytes"] >= sum(row["traced"][k] for k in (*STATE, "activations_bytes"))


PP_SPEC = dict(parallel={"strategy": "zero3", "world_size": 8, "tp": 2, "pp": 2, "pp_schedule": "1f1b"},
               model={"n_layers": 4}, micro_batch=1)
EP_SPEC = dict(parallel={"strategy": "zero3", "world_size": 4, "ep": 2}, model={"n_experts": 4, "top_k": 2})


@pytest.mark.parametrize("case", [
    PP_SPEC,
    EP_SPEC,
], ids=["pp_tp_zero3", "moe_ep_zero3"])
def test_pipeline_and_moe_ep_trace_every_state_category(case: dict) -> None:
    """pp (1f1b, with tp and zero3 on the other dims) and MoE with ep: gradients and optimizer state exact,
    activations within 10 %; where params miss (FSDP2 buffers at the moment of the peak) a note says why."""
    for spec in (tiny(case["parallel"], case["model"], **({"micro_batch": case["micro_batch"]}
                                                          if "micro_batch" in case else {})),):
        ranks = representative_ranks(spec)
        res = trace_spec(spec, ranks=ranks[:1])
        assert res["status"] == "ok", res
        (row,) = res["per_rank"]
        assert_within(row, keys=("grads_bytes", "optimizer_bytes"))
        if abs(row["error_pct"]["params_bytes"]) > 1.0:
            assert any(n.startswith(f"rank {row['rank']}: traced params_bytes") and not n.endswith(UNEXPLAINED)
                       for n in res["notes"]), res["notes"]


def test_representative_ranks_split_pipeline_stages_and_merge_equal_dp_ranks() -> None:
    spec = tiny({"strategy": "zero3", "world_size": 8, "tp": 2, "pp": 2, "pp_schedule": "1f1b"},
                {"n_layers": 4}, micro_batch=1)
    ranks = representative_ranks(spec)
    stages = {spec.parallel.coords(r)["pp"] for r in ranks}
    assert stages == {0, 1} and len(ranks) < 8, ranks
    assert representative_ranks(tiny({"strategy": "zero3", "world_size": 4})) == [0]


@pytest.mark.parametrize("parallel,model", [
    ({"strategy": "ddp", "world_size": 2}, None),
    ({"strategy": "zero1", "world_size": 2}, None),
    ({"strategy": "ddp", "world_size": 4, "ep": 2}, {"n_experts": 4, "top_k": 2}),  # experts left out of DDP
], ids=["ddp", "zero1", "ddp_ep"])
def test_classic_ddp_traces_with_the_bucket_standin_and_says_so(parallel: dict, model: dict | None) -> None:
    """torch's DDP Reducer cannot run on fake tensors; the trace's stand-in allocates DDP's buckets (grads as bucket
    views), so gradients, optimizer state (ZeRO-1 partitions) and the rest match the prediction for real DDP."""
    from backend.trace.ddp_standin import NOTE

    res = trace_spec(tiny(parallel, model), ranks=[1])
    assert res["status"] == "ok", res
    (row,) = res["per_rank"]
    assert_within(row)
    assert NOTE in res["notes"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "backend", "trace", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_json_is_one_object_with_the_contract_keys(tmp_path: Path) -> None:
    spec = tmp_path / "s.json"
    data = json.loads(tiny({"strategy": "zero3", "world_size": 2}).to_json())
    data["parallel"]["dp"] = None  # derived fields: --world overrides world_size, dp and microbatches follow
    data["train"]["microbatches"] = None
    spec.write_text(json.dumps(data))
    p = _cli("--spec", str(spec), "--ranks", "1", "--json", "--world", "4")
    assert p.returncode == 0, p.stderr[-3000:]
    obj = json.loads(p.stdout)
    assert {"status", "error", "spec", "per_rank", "seconds", "notes"} <= obj.keys()
    assert obj["status"] == "ok" and obj["error"] is None and obj["spec"]["parallel"]["world_size"] == 4
    (row,) = obj["per_rank"]
    keys = {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes"}
    assert row["rank"] == 1 and keys <= row["traced"].keys() and keys <= row["predicted"].keys()
    assert all(isinstance(row["traced"][k], int) and row["traced"][k] > 0 for k in keys)


def test_cli_rejects_bad_ranks_and_invalid_specs_before_tracing() -> None:
    p = _cli("--strategy", "zero3", "--world", "2", "--ranks", "0,5")
    assert p.returncode == 2 and "0..1" in p.stderr, p.stderr
    p = _cli("--strategy", "ddp", "--world", "4", "--tp", "3", "--heads", "4")
    assert p.returncode == 2 and "nothing traced" in p.stderr, p.stderr


SEVEN_B = {"n_layers": 32, "d_model": 4096, "n_heads": 32, "vocab_size": 32000, "seq_len": 2048}


@pytest.mark.slow
def test_7b_zero3_world64_traced_within_bounds() -> None:
    """The issue's first full-scale spec: 7B-class GPT, bf16-mixed, micro-batch 1, zero3 at world 64."""
    spec = ExperimentSpec.model_validate({"model": SEVEN_B, "train": {"global_batch": 64, "micro_batch": 1,
                                          "precision": "bf16-mixed"}, "parallel": {"strategy": "zero3", "world_size": 64}})
    res = trace_spec(spec, ranks=[63])
    assert res["status"] == "ok", res
    (row,) = res["per_rank"]
    assert_within(row)
    assert row["max_rss_bytes"] < 4 * 1024**3


@pytest.mark.slow
def test_zero3_trace_equals_a_real_measured_run(tmp_path: Path) -> None:
    from backend.launch.launcher import run_experiment

    spec = tiny({"strategy": "zero3", "world_size": 2}, steps=1, warmup_steps=1)
    real = run_experiment(spec, workdir=tmp_path / "run")
    assert str(real.status) == "ok", real.error
    traced = trace_spec(spec, ranks=[0, 1])
    for row, measured in zip(traced["per_rank"], real.per_rank):
        for k in STATE:
            assert row["traced"][k] == getattr(measured.measured, k), k
        m_act = measured.measured.activations_bytes
        assert abs(row["traced"]["activations_bytes"] - m_act) <= 0.1 * m_act


@pytest.mark.parametrize("vocab, in_block", [(64, True), (8192, False)])
def test_fsdp_x_ep_peak_moment_follows_the_larger_of_dispatch_and_head(vocab: int, in_block: bool) -> None:
    """zero3 x ep2: the activation peak falls inside the last MoE block's dispatch when its buffers outweigh what
    the head and loss add after the blocks (small vocab), else at the loss, where zero3 holds no unsharded
    parameter (large vocab; the 7B-class MoE mix of issue 11). The traced params follow the predicted moment."""
    from backend.analytic.memory.activations import ep_peaks_in_last_block

    spec = ExperimentSpec.model_validate({
        "model": {"n_layers": 2, "d_model": 256, "n_heads": 4, "seq_len": 128, "vocab_size": vocab, "n_experts": 4,
                  "top_k": 2},
        "train": {"global_batch": 2, "micro_batch": 1}, "parallel": {"strategy": "zero3", "world_size": 2, "ep": 2}})
    assert ep_peaks_in_last_block(spec) is in_block
    res = trace_spec(spec, ranks=[0])
    assert res["status"] == "ok", res
    (row,) = res["per_rank"]
    assert_within(row, keys=STATE)
    assert row["traced"]["params_bytes"] == row["predicted"]["params_bytes"]


def test_context_parallel_traced_matches_prediction() -> None:
    """cp2 x tp2 (+SP) under zero3 on fake tensors: the hand-written ring attention runs over the fake PG, model states
    exact (FSDP over the dp x cp ranks), activations at seq_len / cp within the bound."""
    spec = tiny({"strategy": "zero3", "world_size": 4, "tp": 2, "cp": 2, "sequence_parallel": True},
                {"attention": "flash"}, micro_batch=1)
    res = trace_spec(spec, ranks=[3])
    assert res["status"] == "ok", res
    (row,) = res["per_rank"]
    assert row["coords"]["cp"] == 1
    assert all(row["traced"][k] == row["predicted"][k] for k in STATE), (row["traced"], row["predicted"])
    assert_within(row)
