"""Tensor parallelism (± sequence parallel, dense and MoE) at world 2: loss and parameter parity with the
single-process reference, plus the per-rank parameter layout the analytic model relies on."""

import pytest

from tests.helpers.mp_launch import assert_parity, run_specs, tiny

SPECS = [
    tiny("tp", strategy="tp", world_size=2),
    # SGD with a large step: a Partial (unreduced) LayerNorm grad under SP would show in the parameters
    tiny("tp_sp", strategy="tp", world_size=2, sequence_parallel=True, train={"optimizer": "sgd", "lr": 0.5}),
    tiny("tp_moe_sp", model={"n_experts": 4, "top_k": 2}, strategy="tp", world_size=2, sequence_parallel=True),
    # issue 34: the vocab-parallel loss (torch's loss_parallel over lm_head's vocab-sharded DTensor logits)
    tiny("tp_loss_parallel", strategy="tp", world_size=2, train={"loss_parallel": True}),
    tiny("tp_sp_loss_parallel", strategy="tp", world_size=2, sequence_parallel=True,
         train={"loss_parallel": True, "optimizer": "sgd", "lr": 0.5}),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_specs(2, SPECS, tmp_path_factory.mktemp("tp"))


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_tp_parity(results, name):
    assert_parity(results[name])


@pytest.mark.slow
def test_loss_parallel_keeps_the_logits_sharded(results):
    for name in ("tp_loss_parallel", "tp_sp_loss_parallel"):
        assert any("loss parallel: lm_head keeps the logits sharded" in n for n in results[name]["notes"]), name
    assert any("all-gathers full logits" in n for n in results["tp"]["notes"])
