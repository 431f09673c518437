"""Activation bytes of every family variant, formula vs torch's MemTracker (single process, fp32, tiny shapes):
RMSNorm, SwiGLU, RoPE, flash vs math attention (FlashAttention, Dao et al. 2022: q, k, v, out + logsumexp, no
s x s), routed SwiGLU experts, gated shared experts, and a tied Llama-style model."""

from __future__ import annotations

import pytest

from backend.analytic.memory.activations import (
    family_kwargs,
    model_embedding_head_activation_bytes,
    model_layer_activation_bytes,
)
from backend.spec import ModelSpec, Recompute
from tests.unit.test_activation_model import _measured_activation_bytes

BASE = dict(vocab_size=128, d_model=64, n_heads=4, seq_len=32, n_layers=2)
VARIANTS = {
    "rmsnorm": dict(norm="rmsnorm"),
    "swiglu": dict(mlp="swiglu"),
    "rope": dict(positions="rope"),
    "flash": dict(attention="flash"),
    "flash_gqa": dict(attention="flash", n_kv_heads=2),
    "moe_swiglu": dict(n_experts=4, top_k=2, mlp="swiglu", expert_ffn_hidden=96),
    "moe_shared_gate": dict(n_experts=4, top_k=2, n_shared_experts=2, shared_ffn_hidden=32, shared_expert_gate=True,
                            mlp="swiglu"),
    "llama_flash_tied": dict(norm="rmsnorm", mlp="swiglu", positions="rope", bias="none", n_kv_heads=2,
                             attention="flash", tie_embeddings=True),
}


def _predicted(m: ModelSpec, batch: int, rc: Recompute) -> float:
    fk = family_kwargs(m)
    layer = model_layer_activation_bytes(s=m.seq_len, b=batch, h=m.d_model, a=m.n_heads, kv_heads=m.kv_heads,
                                         ffn=m.expert_ffn if m.is_moe else m.ffn, dtype_bytes=4, n_experts=m.n_experts,
                                         top_k=m.top_k, recompute=str(rc), **fk)
    head = model_embedding_head_activation_bytes(s=m.seq_len, b=batch, h=m.d_model, vocab=m.vocab_size, dtype_bytes=4,
                                                 norm=fk["norm"], learned_pos=not fk["rope"])
    return m.n_layers * layer + head


@pytest.mark.parametrize("rc", [Recompute.NONE, Recompute.SELECTIVE])
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.heavy
def test_family_activation_formula_matches_memtracker(name, rc):
    m = ModelSpec(**BASE, **VARIANTS[name])
    measured = _measured_activation_bytes(m, 2, rc)
    assert _predicted(m, 2, rc) == pytest.approx(measured, rel=0.01), (name, measured)


def test_flash_drops_the_score_term():
    """Math saves the (b, a, s, s) probabilities + the (s, s) mask; flash saves a (b, a, s) fp32 logsumexp instead."""
    m = ModelSpec(**BASE)
    math_b = _measured_activation_bytes(m, 2, Recompute.NONE)
    flash_b = _measured_activation_bytes(m.model_copy(update={"attention": "flash"}), 2, Recompute.NONE)
    s, b, a, L = 32, 2, 4, 2
    assert math_b - flash_b == L * (a * s * s * b * 4 + s * s - a * s * b * 4)
