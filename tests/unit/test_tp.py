"""Tensor parallelism: the plan covers every Linear and embedding (one process); at world 2 (± sequence parallel,
dense and MoE, and the vocab-parallel loss) loss and parameter parity with the single-process reference (the farm's
ranks)."""

import pytest

from backend.models.gpt import build_model
from backend.strategies.tp import tp_plan
from tests.helpers.farm import assert_parity, params, parity_job, uses
from tests.helpers.specs import tiny


def test_plan_covers_every_linear_and_embedding():
    spec = tiny("plan", strategy="tp", world_size=2, sequence_parallel=True)
    model = build_model(spec.model, seed=0)
    plan = tp_plan(model, sp=True)
    sharded = {"tok_emb", "pos_emb", "lm_head", "norm"}
    for i in range(spec.model.n_layers):
        sharded |= {f"layers.{i}.{n}" for n in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc_in", "mlp.fc_out",
                                                "ln1", "ln2")}
    assert sharded <= set(plan)
    no_sp = tp_plan(model, sp=False)
    assert "norm" not in no_sp and "layers.0.ln1" not in no_sp


PARITY = {s.name: parity_job(s) for s in [
    tiny("tp", strategy="tp", world_size=2),
    # SGD with a large step: a Partial (unreduced) LayerNorm grad under SP would show in the parameters
    tiny("tp_sp", strategy="tp", world_size=2, sequence_parallel=True, train={"optimizer": "sgd", "lr": 0.5}),
    tiny("tp_moe_sp", model={"n_experts": 4, "top_k": 2}, strategy="tp", world_size=2, sequence_parallel=True),
    # issue 34: the vocab-parallel loss (torch's loss_parallel over lm_head's vocab-sharded DTensor logits)
    tiny("tp_loss_parallel", strategy="tp", world_size=2, train={"loss_parallel": True}),
    tiny("tp_sp_loss_parallel", strategy="tp", world_size=2, sequence_parallel=True,
         train={"loss_parallel": True, "optimizer": "sgd", "lr": 0.5}),
]}


@pytest.mark.slow
@pytest.mark.parametrize("name", params(PARITY))
def test_tp_parity(farm, name):
    assert_parity(farm.result(PARITY[name]))


@pytest.mark.slow
@uses(PARITY["tp"], PARITY["tp_loss_parallel"], PARITY["tp_sp_loss_parallel"])
def test_loss_parallel_keeps_the_logits_sharded(farm):
    for name in ("tp_loss_parallel", "tp_sp_loss_parallel"):
        notes = farm.result(PARITY[name])["notes"]
        assert any("loss parallel: lm_head keeps the logits sharded" in n for n in notes), name
    assert any("all-gathers full logits" in n for n in farm.result(PARITY["tp"])["notes"])
