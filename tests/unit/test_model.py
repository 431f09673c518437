"""The model counts what backend.analytic.params counts, and a seed fixes every weight."""

import pytest
import torch

from backend.analytic.params import count_params, param_list
from backend.models.gpt import build_model
from backend.spec import ModelSpec

SHAPES = [
    dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, seq_len=32),
    dict(vocab_size=100, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, seq_len=17),  # GQA, odd sizes
    dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, ffn_hidden=80, seq_len=8),
    dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16, n_experts=4, top_k=2),  # MoE
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_numel_matches_analytic_count(shape):
    m = ModelSpec(**shape)
    model = build_model(m, seed=0)
    assert sum(p.numel() for p in model.parameters()) == count_params(m)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(q.name, q.shape) for q in param_list(m)]


def test_same_seed_same_weights_other_seed_differs():
    m = ModelSpec(**SHAPES[0])
    a, b, c = build_model(m, seed=3), build_model(m, seed=3), build_model(m, seed=4)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=False):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=na)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=False))


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(ModelSpec(**SHAPES[2]), seed=9)
    torch.testing.assert_close(torch.rand(3), expected)


def test_top1_router_gradient_is_exactly_zero():
    """Top-1's renormalised weight is w / w = 1: the router gets a gradient of exactly 0, not rounding noise that
    Adam would scale up to full steps (issue 20 item 6: EP vs dense loss drift 6.6e-4 with AdamW)."""
    spec = ModelSpec(vocab_size=32, d_model=16, n_layers=1, n_heads=2, seq_len=8, n_experts=4, top_k=1)
    model = build_model(spec, seed=0)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens).sum().backward()
    router = model.layers["0"].mlp.router.weight.grad
    assert router is not None and torch.count_nonzero(router) == 0
    assert torch.count_nonzero(model.layers["0"].attn.q.weight.grad) > 0
