"""Context parallelism through the real engine at world 4 (one torchrun launch), judged like benchmarks/mp_accuracy.py
and tighter: loss parity with the single-process reference, model states and comm payloads exact, activations
within 0.1% (the prediction is the non-CP one at seq_len / cp tokens per rank: ring attention saves what the flash
kernel saves; the TP+SP layout misses by 256 B, as it does without cp at seq 32: that is TP+SP's own), and the K/V
traffic on the cp group as strategies/cp.py documents it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from mp_accuracy import misses  # noqa: E402

from backend.engine.notes import PARITY_BOUND  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402

LLAMA = {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none"}


def _spec(name: str, model: dict, train: dict, **parallel) -> ExperimentSpec:
    m = {"vocab_size": 128, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "attention": "flash"} | model
    t = {"global_batch": 4, "micro_batch": 1, "steps": 2, "warmup_steps": 1} | train
    return ExperimentSpec.model_validate({"name": name, "model": m, "train": t, "parallel": {"world_size": 4, **parallel}})


SPECS = [
    _spec("cp2_x_fsdp2_llama_gqa", LLAMA | {"n_kv_heads": 2}, {}, strategy="fsdp", cp=2),
    _spec("cp2_x_tp2_sp_alltoall", {}, {"micro_batch": 2}, strategy="tp", tp=2, cp=2, sequence_parallel=True,
          cp_rotate="alltoall"),
    _spec("cp4_contiguous_bf16", {}, {"precision": "bf16-mixed"}, strategy="ddp", cp=4, cp_load_balance=False),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.helpers.engine_batch import launch

    return launch(4, SPECS, tmp_path_factory.mktemp("cp_acc"), timeout_s=1200)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_cp_memory_and_comm_match_the_prediction(runs, spec):
    res = runs[spec.name]["result"]
    bound = PARITY_BOUND[str(spec.train.precision)]  # misses() asks fp32's 1e-4 of every run
    assert res.loss_max_abs_diff is not None and res.loss_max_abs_diff <= bound, (res.loss, res.loss_reference)
    assert not [m for m in misses(res) if not m.startswith("loss parity")], misses(res)
    for rr in res.per_rank:
        for cat in ("params_bytes", "grads_bytes", "optimizer_bytes", "other_bytes"):
            assert getattr(rr.measured, cat) == getattr(rr.predicted, cat), (rr.rank, cat)
        assert abs(rr.error_pct["activations_bytes"]) < 0.1, (rr.rank, rr.measured, rr.predicted)
        for kind, stat in rr.comm.items():
            assert stat.bytes == rr.comm_predicted[kind], (rr.rank, kind, stat.bytes, rr.comm_predicted)
    ring = ("all_to_all", "all_gather") if str(spec.parallel.cp_rotate) == "allgather" else ("all_to_all",)
    for payload in runs[spec.name]["ranks"]:  # the ring's collectives run on the cp group
        assert all(spec.parallel.cp in payload["comm_group_sizes"][kind] for kind in ring), payload["comm_group_sizes"]
    assert any(n.startswith(f"CP: each sequence split over cp={spec.parallel.cp}") for n in res.notes)
