"""Issue 23: ONE tensor-parallel placement table (backend/analytic/tp_placement.py) builds both the analytic sharding
and the DTensor plan the engine applies (strategies/tp.tp_plan). For every family (GPT, Llama-style SwiGLU/RMSNorm/
RoPE, MoE with shared experts and gate, tied embeddings), with and without sequence parallelism: every parameter's
analytic split is the split of its module's DTensor style, and the layouts Megatron's layout prescribes (Shoeybi
2019 Sec 3; Korthikanti 2022 Sec 4.2.2 for SP) are the ones applied. The parity of the plan with a single-process
run is tests/multiprocess/test_tp.py."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from backend.analytic.sharding import tp_style
from backend.analytic.tp_placement import COLWISE, REPLICATE, ROWWISE, VOCAB_ROWWISE, module_rule
from backend.models.gpt import build_model
from backend.spec import ModelSpec
from backend.strategies.tp import MoESequenceParallel, tp_plan

FAMILIES = {
    "gpt": ModelSpec(n_layers=2),
    "llama": ModelSpec(n_layers=2, mlp="swiglu", norm="rmsnorm", bias="none", positions="rope", n_kv_heads=2),
    "moe": ModelSpec(n_layers=2, n_experts=4, top_k=2, n_shared_experts=1, shared_expert_gate=True, mlp="swiglu"),
    "tied": ModelSpec(n_layers=2, tie_embeddings=True),
}
STYLE_OF = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel, VOCAB_ROWWISE: RowwiseParallel}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("sp", [False, True])
def test_analytic_split_of_every_parameter_is_its_modules_dtensor_style(family, sp):
    model = build_model(FAMILIES[family], seed=0)
    plan = tp_plan(model, sp)
    for name, _ in model.named_parameters():
        module, style = name.rsplit(".", 1)[0], tp_style(name)
        if style == REPLICATE:
            assert module not in plan or isinstance(plan[module], SequenceParallel), (name, plan.get(module))
        else:
            assert type(plan[module]) is STYLE_OF[style], (name, style, plan.get(module))
    assert set(plan) <= {n for n, _ in model.named_modules()}  # nothing for a module the model does not have


def _layouts(style) -> tuple:
    return tuple(getattr(style, a, None) for a in ("input_layouts", "output_layouts"))


def test_megatron_layouts_with_and_without_sequence_parallel():
    model = build_model(FAMILIES["moe"], seed=0)
    gpt = build_model(FAMILIES["gpt"], seed=0)
    for sp, seq in ((False, Replicate()), (True, Shard(1))):
        plan, dense = tp_plan(model, sp), tp_plan(gpt, sp)
        assert _layouts(dense["tok_emb"]) == ((Replicate(),), (seq,))
        assert _layouts(dense["pos_emb"]) == ((Replicate(),), ((Shard(0) if sp else Replicate()),))
        assert _layouts(dense["lm_head"]) == ((seq,), (Replicate(),))  # logits gathered for the loss
        assert (type(dense["layers.0.attn.q"]) is ColwiseParallel
                and type(dense["layers.1.mlp.fc_in"]) is ColwiseParallel)
        assert (dense["layers.0.attn.o"].output_layouts == (seq,)
                and dense["layers.0.mlp.fc_out"].output_layouts == (seq,))
        # experts and shared experts: split like the MLP, inside the MoE's own gather / scatter (no SP output)
        assert plan["layers.0.mlp.experts.3.down"].output_layouts == (Replicate(),)
        assert type(plan["layers.0.mlp.shared.gate"]) is ColwiseParallel
        assert "layers.0.mlp.router" not in plan and "layers.0.mlp.shared_gate" not in plan
        assert isinstance(plan["layers.0.attn"], PrepareModuleInput)
        assert isinstance(dense["layers.0.mlp"], PrepareModuleInput)
        assert isinstance(plan.get("layers.0.mlp"), MoESequenceParallel) == sp
        norms = ("layers.0.ln1", "layers.1.ln2", "norm")
        assert all(isinstance(dense.get(n), SequenceParallel) for n in norms) == sp
        assert not sp or all(n in dense for n in norms)
        assert sp or not any(n in dense for n in norms)


def test_unmatched_modules_are_replicated():
    assert module_rule("layers.3.mlp.router") is None and tp_style("layers.3.mlp.router.weight") == REPLICATE
    assert tp_style("layers.0.ln1.weight") == REPLICATE and tp_style("norm.bias") == REPLICATE
    assert tp_style("layers.11.mlp.experts.7.up.weight") == COLWISE
    assert tp_style("lm_head.weight") == COLWISE and tp_style("tok_emb.weight") == VOCAB_ROWWISE
