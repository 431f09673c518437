"""The torch model builds every family variant with named_parameters() equal to the analytic list, name for
name and shape for shape; flash and math attention compute the same function; RoPE is a rotation."""

from __future__ import annotations

import pytest
import torch

from backend.analytic.params import count_params, param_list
from backend.models.gpt import apply_rope, build_model, loss_fn, rope_cos_sin
from backend.presets import PRESETS, preset_model, scaled_for_cpu
from backend.spec import ModelSpec

VARIANTS = {
    "gpt": ModelSpec(),
    "gpt-tied-moe": ModelSpec(tie_embeddings=True, n_experts=4),
    "llama-gqa": ModelSpec(norm="rmsnorm", mlp="swiglu", positions="rope", bias="none", n_kv_heads=2),
    "qwen2-qkv-tied": ModelSpec(norm="rmsnorm", mlp="swiglu", positions="rope", bias="qkv", tie_embeddings=True),
    "shared-experts": ModelSpec(norm="rmsnorm", mlp="swiglu", positions="rope", bias="all", n_experts=4,
                                n_shared_experts=2, expert_ffn_hidden=32, shared_ffn_hidden=16, attention="flash"),
    **{f"preset-{n}": ModelSpec(**scaled_for_cpu(preset_model(n))) for n in PRESETS},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_named_parameters_equal_analytic(name):
    m = VARIANTS[name]
    model = build_model(m, seed=0)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(p.name, p.shape) for p in param_list(m)]
    assert sum(p.numel() for p in model.parameters()) == count_params(m)


@pytest.mark.parametrize("name", ["gpt", "llama-gqa", "shared-experts"])
def test_flash_equals_math(name):
    m = VARIANTS[name]
    x = torch.randint(0, m.vocab_size, (2, m.seq_len))
    losses, grads = [], []
    for impl in ("math", "flash"):
        model = build_model(m.model_copy(update={"attention": impl}), seed=3)
        loss = loss_fn(model(x), x)
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.layers["0"].attn.q.weight.grad)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_rope_is_a_rotation_with_relative_scores():
    cos, sin = rope_cos_sin(8, 16, torch.device("cpu"), torch.float32)
    q, k = torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    rq = apply_rope(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))  # rotation keeps norms
    # same content at every position: q_i . k_j depends only on i - j
    qc, kc = q[..., :1, :].expand_as(q), k[..., :1, :].expand_as(k)
    s = apply_rope(qc, cos, sin) @ apply_rope(kc, cos, sin).transpose(-2, -1)
    torch.testing.assert_close(s[0, 0, 3, 1], s[0, 0, 5, 3])


def test_tied_embeddings_share_storage():
    model = build_model(VARIANTS["qwen2-qkv-tied"], seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
