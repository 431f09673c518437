"""The tensor-parallel plan covers every Linear and embedding."""

from backend.models.gpt import build_model
from backend.strategies.tp import tp_plan
from tests.helpers.mp_launch import tiny


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
