"""Tensor parallelism (± sequence parallel, dense and MoE) at world 2: loss and parameter parity with the
single-process reference, plus the per-rank parameter layout the analytic model relies on."""

import pytest

from backend.models.gpt import build_model
from backend.strategies.tp import tp_plan
from tests.fixtures.mp_launch import assert_parity, run_specs, tiny

SPECS = [
    tiny("tp", strategy="tp", world_size=2),
    # SGD with a large step: a Partial (unreduced) LayerNorm grad under SP would show in the parameters
    tiny("tp_sp", strategy="tp", world_size=2, sequence_parallel=True, train={"optimizer": "sgd", "lr": 0.5}),
    tiny("tp_moe_sp", model={"n_experts": 4, "top_k": 2}, strategy="tp", world_size=2, sequence_parallel=True),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_specs(2, SPECS, tmp_path_factory.mktemp("tp"))


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_tp_parity(results, name):
    assert_parity(results[name])


def test_plan_covers_every_linear_and_embedding():
    spec = tiny("plan", strategy="tp", world_size=2, sequence_parallel=True)
    model = build_model(spec.model, seed=0)
    plan = tp_plan(model, sp=True)
    sharded = {"tok_emb", "pos_emb", "lm_head", "norm"}
    for i in range(spec.model.n_layers):
        sharded |= {f"layers.{i}.{n}" for n in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc_in", "mlp.fc_out", "ln1", "ln2")}
    assert sharded <= set(plan)
    no_sp = tp_plan(model, sp=False)
    assert "norm" not in no_sp and "layers.0.ln1" not in no_sp
