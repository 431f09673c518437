"""Per-rank sharding of the family variants (pure Python): SwiGLU / shared experts under TP, tied embeddings
under PP (Megatron's copy on the last stage), shared experts replicated under EP."""

from __future__ import annotations

from backend.analytic import sharding as S
from backend.analytic.params import count_params
from backend.analytic.tp_placement import REPLICATE
from backend.spec import ExperimentSpec

LLAMA = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=16, norm="rmsnorm", mlp="swiglu",
             positions="rope", bias="none")


def mk(model: dict, **parallel) -> ExperimentSpec:
    return ExperimentSpec.model_validate({"model": model, "train": {"global_batch": 8, "micro_batch": 1},
                                          "parallel": parallel})


def test_swiglu_and_shared_experts_split_over_tp():
    m = LLAMA | dict(n_experts=4, top_k=2, expert_ffn_hidden=48, n_shared_experts=1, shared_ffn_hidden=64,
                     shared_expert_gate=True)
    s = mk(m, strategy="tp", world_size=2)
    local = {q.name: q.local_shape for q in S.local_params(s, 0)}
    assert local["layers.0.mlp.experts.1.gate.weight"] == (24, 32)
    assert local["layers.0.mlp.experts.1.up.weight"] == (24, 32)
    assert local["layers.0.mlp.experts.1.down.weight"] == (32, 24)
    assert local["layers.0.mlp.shared.up.weight"] == (32, 32) and local["layers.0.mlp.shared.down.weight"] == (32, 32)
    assert local["layers.0.mlp.shared_gate.weight"] == (1, 32)  # replicated
    assert local["layers.0.ln1.weight"] == (32,)  # RMSNorm: weight only
    # every element lives on exactly one tp rank, except the replicated ones (norms, router, gate)
    both = sum(q.local_numel for r in (0, 1) for q in S.local_params(s, r))
    replicated = sum(q.local_numel for q in S.local_params(s, 0) if S.tp_style(q.name) == REPLICATE)
    assert both - replicated == count_params(s.model)


def test_tied_embeddings_copy_on_the_last_stage():
    m = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, seq_len=16, tie_embeddings=True)
    s = mk(m, strategy="pp", world_size=2)
    first = [q.name for q in S.local_params(s, 0)]
    last = [q.name for q in S.local_params(s, 1)]
    assert "tok_emb.weight" in first and "lm_head.weight" not in first
    assert last[-1] == "lm_head.weight" and "tok_emb.weight" not in last
    total = sum(q.local_numel for r in (0, 1) for q in S.local_params(s, r))
    assert total == count_params(s.model) + 64 * 32  # Megatron: the last stage holds its own copy
    zbv = mk(m, strategy="pp", world_size=2, pp_schedule="zbv", virtual_stages=2)
    rank0 = [q.name for q in S.local_params(zbv, 0)]
    assert "tok_emb.weight" in rank0 and "lm_head.weight" in rank0  # two stage modules, two copies


def test_tied_single_stage_has_one_weight():
    s = mk(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16, tie_embeddings=True), strategy="ddp",
           world_size=2)
    names = [q.name for q in S.local_params(s, 0)]
    assert "lm_head.weight" not in names and sum(q.local_numel for q in S.local_params(s, 0)) == count_params(s.model)


def test_shared_experts_replicated_over_ep():
    m = LLAMA | dict(n_experts=4, top_k=2, n_shared_experts=2, shared_ffn_hidden=16)
    s = mk(m, strategy="ep", world_size=2)
    r0 = {q.name: q for q in S.local_params(s, 0)}
    r1 = {q.name: q for q in S.local_params(s, 1)}
    assert "layers.0.mlp.shared.gate.weight" in r0 and "layers.0.mlp.shared.gate.weight" in r1
    assert not r0["layers.0.mlp.shared.down.weight"].is_expert
    assert ("layers.0.mlp.experts.0.up.weight" in r0) != ("layers.0.mlp.experts.0.up.weight" in r1)
