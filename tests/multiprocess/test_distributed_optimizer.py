"""Megatron's distributed optimizer (zero1 x tp / pp, issue 26) in ranks: the traced model states equal the prediction
and the torchrun runs match the single-process reference (the formulas: tests/unit/test_distributed_optimizer.py)."""

from __future__ import annotations

import pytest

from backend.spec import ExperimentSpec
from backend.trace.trace_spec import trace_spec
from tests.helpers.mp_launch import assert_parity, run_specs, tiny

MODEL = {"vocab_size": 128, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32}


MEGATRON = {"stack": "megatron", "attention_kernel": "flash2", "elementwise": "eager"}
"""Megatron-Core's memory layout as an engine option (issue 34 part 4): the megatron stack with the kernels this
engine runs; its zero1 is the distributed optimizer whatever the degrees, sharded over dp x cp."""


def spec_of(precision: str, train: dict | None = None, model: dict | None = None, **parallel) -> ExperimentSpec:
    return ExperimentSpec.model_validate({"model": MODEL | (model or {}),
                                          "train": {"global_batch": 8, "micro_batch": 2, "precision": precision,
                                                    **(train or {})},
                                          "parallel": {"strategy": "zero1", "world_size": 4, **parallel}})


@pytest.mark.parametrize("parallel", [{"tp": 2, "sequence_parallel": True}, {"pp": 2},
                                      {"train": MEGATRON}, {"cp": 2, "train": MEGATRON, "model": {"attention": "flash"}}],
                         ids=["dp2xtp2-sp", "dp2xpp2", "megatron-dp4", "megatron-dp2xcp2"])
def test_traced_model_states_equal_the_prediction(parallel):
    """The engine's own set-up and tracker on fake tensors (the real bf16 run at world 4 gave the same bytes: dp2 x tp2
    params 119,424 / grads 238,848 / optimizer 358,288 on every rank)."""
    res = trace_spec(spec_of("bf16-mixed", **parallel))
    assert res["status"] == "ok", res
    # The megatron stack is predicted as Megatron-Core keeps it on a GPU (memory/stack_states.megatron_state): AdamW's
    # `step` on the host. On CPU ranks torch keeps one 4-B step tensor per optimizer tensor on the device: one per
    # bucket of this engine's distributed optimizer (each block, the embeddings, the head).
    steps = 4 * (MODEL["n_layers"] + 2) if parallel.get("train") == MEGATRON else 0
    for row in res["per_rank"]:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            extra = steps if key == "optimizer_bytes" else 0
            assert row["traced"][key] == row["predicted"][key] + extra, (row["rank"], key, row)


SPECS = [
    tiny("zero1_dp2_tp2_sp_tied", model={"tie_embeddings": True}, strategy="zero1", world_size=4, tp=2,
         sequence_parallel=True),
    tiny("zero1_dp2_pp2_tied", model={"tie_embeddings": True, "n_layers": 4}, strategy="zero1", world_size=4, pp=2,
         pp_schedule="interleaved_1f1b", virtual_stages=2),
    # split backward: the weight passes assign .grad by hand (no hook fires), swept in at step
    tiny("zero1_dp2_pp2_zbv", model={"n_layers": 4}, strategy="zero1", world_size=4, pp=2, pp_schedule="zbv",
         virtual_stages=2, train={"global_batch": 8, "micro_batch": 1}),
    # the megatron stack's zero1 without tp / pp: the distributed optimizer over dp, and over dp x cp
    tiny("megatron_zero1_dp4", strategy="zero1", world_size=4, train=MEGATRON),
    tiny("megatron_zero1_dp2_cp2", model={"attention": "flash"}, strategy="zero1", world_size=4, cp=2, train=MEGATRON),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_specs(4, SPECS, tmp_path_factory.mktemp("distopt"), timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_parity_with_the_single_process_reference(results, name):
    """fp32: the owned slices step exactly as the whole parameters do (AdamW is elementwise); 1e-4 as every mix."""
    assert_parity(results[name])
    assert any("Megatron's distributed optimizer" in n for n in results[name]["notes"])
