"""Issue 35: the local experts as grouped GEMMs (models/grouped_experts.py) compute what the per-expert loop computes,
for every expert MLP kind, with and without biases, fp32 and bf16 autocast; the reasons a layer keeps the loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backend.models import grouped_experts as G
from backend.models.gpt import MoE, build_model, loss_fn
from backend.spec import ModelSpec

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16, n_experts=4, top_k=2)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: q.grad for n, q in model.named_parameters()}


@pytest.mark.parametrize("mlp", ["gelu", "swiglu", "geglu", "swiglu_clamped"])
@pytest.mark.parametrize("bias", ["all", "none"])
def test_grouped_gemm_equals_the_expert_loop(mlp, bias):
    loop = build_model(ModelSpec(**BASE, mlp=mlp, bias=bias), seed=0)
    grouped = build_model(ModelSpec(**BASE, mlp=mlp, bias=bias, moe_grouped_gemm=True), seed=0)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    lo, gr = loss_fn(loop(x), x), loss_fn(grouped(x), x)
    lo.backward()
    gr.backward()
    torch.testing.assert_close(gr, lo)
    a, b = _grads(loop), _grads(grouped)
    assert {n for n, g in a.items() if g is None} == {n for n, g in b.items() if g is None}
    for n, g in a.items():
        if g is not None:
            torch.testing.assert_close(b[n], g, msg=n)
    assert all(blk.mlp.grouped_reason is None for blk in grouped.layers.values())


def test_grouped_linear_bf16_autocast_matches_linear_and_leaves_empty_experts_without_grad():
    torch.manual_seed(0)
    lins = [nn.Linear(16, 8) for _ in range(3)]
    x = torch.randn(10, 16, requires_grad=True)
    counts = torch.tensor([4, 0, 6])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = G.grouped_linear(x, offs, torch.bfloat16, lins)
        ref = torch.cat([lins[0](x[:4]), lins[2](x[4:])])
    assert y.dtype == ref.dtype == torch.bfloat16
    # bf16 tolerance: F.linear adds the bias inside addmm's fp32 accumulation, grouped_mm's output gets it after the
    # bf16 rounding (one bf16 ulp apart at most)
    torch.testing.assert_close(y, ref, atol=1e-2, rtol=2e-2)
    y.float().sum().backward()
    assert lins[1].weight.grad is None and lins[1].bias.grad is None  # no row reached expert 1
    assert lins[0].weight.grad.dtype == torch.float32
    x2 = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        G.grouped_linear(x2, offs, torch.bfloat16, lins, zero_empty=True).float().sum().backward()
    assert lins[1].weight.grad is not None and not lins[1].weight.grad.any()


def test_grouped_reason_names_the_stride_rule():
    experts = [nn.ModuleDict({"fc_in": nn.Linear(6, 8), "fc_out": nn.Linear(8, 6)}) for _ in range(2)]
    reason = G.grouped_reason("gelu", experts, torch.float32)
    assert reason == "fc_in's in_features=6 x 4 B = 24 B is not a multiple of 16 B (grouped_mm's row stride)"
    assert "float32, bfloat16 or float16" in G.grouped_reason("gelu", experts, torch.float64)


def test_a_model_whose_widths_break_the_stride_rule_runs_the_loop_and_says_why():
    model = build_model(ModelSpec(**BASE | {"d_model": 30, "n_heads": 3, "ffn_hidden": 64}, moe_grouped_gemm=True),
                        seed=0)
    x = torch.randint(0, 64, (1, 16))
    loss_fn(model(x), x).backward()
    moe = model.layers["0"].mlp
    assert isinstance(moe, MoE)
    assert (moe.grouped_reason
            == "fc_in's in_features=30 x 4 B = 120 B is not a multiple of 16 B (grouped_mm's row stride)")


def test_clamped_constants_are_gpt_oss_clamped_swiglu():
    from backend.models.gpt import ClampedSwiGLU
    assert (G.CLAMP_LIMIT, G.CLAMP_ALPHA) == (ClampedSwiGLU.LIMIT, ClampedSwiGLU.ALPHA)
