"""Issue 35: the capacity limit and the load-balancing loss (models/moe_capacity.py) against Megatron-Core's own
functions written out here by hand (moe_utils.py @ core_v0.19.0: get_capacity, apply_router_token_dropping,
switch_load_balancing_loss_func), and their effect on the MoE layer."""

from __future__ import annotations

import math

import pytest
import torch

from backend.analytic.moe_capacity import dropped_slots, expert_capacity, rows_per_expert_padded, sent_rows
from backend.models.gpt import build_model, loss_fn
from backend.models.moe_capacity import AuxLossScaler, capacity_keep, load_balancing_loss
from backend.spec import ModelSpec

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16, n_experts=4, top_k=2)


def megatron_drop(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float, pad: bool):
    """apply_router_token_dropping, drop_policy "probs", as written in moe_utils.py l. 958-1021."""
    num_tokens, num_experts = probs.shape
    cap = math.ceil((num_tokens * topk / num_experts) * factor)
    if cap > num_tokens:
        mask = torch.ones_like(probs).bool()
    else:
        idx = torch.topk(probs, k=cap, dim=0, sorted=False).indices
        mask = torch.zeros_like(probs).scatter(0, idx, 1).bool()
    return mask if pad else routing_map & mask


def test_capacity_formulas():
    assert expert_capacity(1024, 2, 8, 1.0) == 256  # Grok-1 at tp 4 x cp 2: T = 8192 / 8 (moe.md Sec 3.4)
    assert expert_capacity(10, 2, 4, 1.1) == math.ceil((10 * 2 / 4) * 1.1) == 6
    assert rows_per_expert_padded(4, 2, 4, 4.0) == 4  # C = 8 > T: the mask is all ones, every expert takes T
    assert dropped_slots([9, 1, 5, 5], tokens=10, top_k=2, factor=1.0) == 4  # C = 5
    assert dropped_slots([9, 1, 5, 5], tokens=10, top_k=2, factor=None) == 0
    assert sent_rows(tokens=10, top_k=2, n_experts=4, factor=1.0, pad=True) == 20
    assert sent_rows(tokens=10, top_k=2, n_experts=4, factor=0.5, pad=False) == 4 * 3


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5, 3.0])
def test_keep_equals_megatrons_token_dropping(factor):
    g = torch.Generator().manual_seed(3)
    n, e, k = 24, 4, 2
    logits = torch.randn(n, e, generator=g)
    logits[:, 0] += 1.5  # skewed: expert 0 overflows
    scores = logits.softmax(-1)
    w, idx = scores.topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    kept = capacity_keep(w, idx, e, factor, pad=False, groups=None)
    probs = torch.zeros(n, e).scatter(1, idx, w)
    routing_map = torch.zeros(n, e, dtype=torch.bool).scatter(1, idx, True)
    want = megatron_drop(probs, routing_map, k, factor, pad=False)
    assert torch.equal(kept.keep, want.gather(1, idx))
    counts = torch.bincount(idx.reshape(-1), minlength=e).tolist()
    assert int(kept.dropped) == dropped_slots(counts, tokens=n, top_k=k, factor=factor)
    assert (capacity_keep(w, idx, e, factor, pad=True, groups=None).padded_rows
            == rows_per_expert_padded(n, k, e, factor))


def test_groups_limit_each_group_on_its_own():
    g = torch.Generator().manual_seed(4)
    n, e, k = 16, 4, 2
    w = torch.rand(n, k, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    groups = torch.tensor([0, 1] * 8)
    kept = capacity_keep(w, idx, e, 0.5, pad=False, groups=groups)
    for grp in (0, 1):
        rows = (groups == grp).nonzero(as_tuple=True)[0]
        alone = capacity_keep(w[rows], idx[rows], e, 0.5, pad=False, groups=None)
        assert torch.equal(kept.keep[rows], alone.keep)


def test_load_balancing_loss_is_switch_transformers():
    g = torch.Generator().manual_seed(5)
    n, e, k, coeff = 12, 4, 2, 0.01
    scores = torch.rand(n, e, generator=g).softmax(-1)
    idx = scores.topk(k, dim=-1).indices
    tokens_per_expert = torch.bincount(idx.reshape(-1), minlength=e).float()
    megatron = torch.sum(scores.sum(dim=0) * tokens_per_expert) * (e * coeff / (k * n * n))
    torch.testing.assert_close(load_balancing_loss(scores, idx, e, coeff), megatron)
    # uniform routing and uniform scores give coeff exactly (Switch Transformer: the loss is 1 x coeff when balanced)
    flat = torch.full((8, 4), 0.25)
    torch.testing.assert_close(load_balancing_loss(flat, torch.tensor([[0, 1], [2, 3]] * 4), 4, coeff),
                               torch.tensor(coeff))


def test_aux_loss_scaler_hands_the_scaled_gradient_to_the_loss():
    a = torch.ones(3, requires_grad=True)
    s = torch.tensor(2.0, requires_grad=True)
    aux = s * 3.0
    AuxLossScaler.apply(a, aux, 0.25).sum().backward()
    assert float(s.grad) == 0.75 and a.grad.tolist() == [1.0, 1.0, 1.0]


def test_capacity_drops_and_is_counted_in_the_model_forward_only():
    model = build_model(ModelSpec(**BASE, capacity_factor=0.5, moe_aux_loss_coeff=0.01), seed=0)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    loss_fn(model(x), x).backward()
    for blk in model.layers.values():
        (routed, dropped), = [(n, int(d)) for n, d in blk.mlp.capacity_log]
        assert routed == 2 * 16 * 2 and dropped > 0
    # the aux loss reached the router: its gradient differs from a run without it
    plain = build_model(ModelSpec(**BASE, capacity_factor=0.5), seed=0)
    loss_fn(plain(x), x).backward()
    assert not torch.equal(model.layers["0"].mlp.router.weight.grad, plain.layers["0"].mlp.router.weight.grad)


def test_dropless_defaults_keep_the_original_dispatch():
    """No capacity, no aux loss, no grouped GEMM: MoE.forward takes the path the golden memory digests were read off."""
    model = build_model(ModelSpec(**BASE), seed=0)
    calls = []
    moe = model.layers["0"].mlp
    moe._routed = lambda *a: calls.append(a)  # noqa: E731 - would be the new path
    x = torch.randint(0, 64, (1, 16))
    model(x)
    assert calls == [] and moe.capacity_log == []


def test_assembled_tokens_dropped_counts_each_tp_column_once():
    from backend.engine.assemble import tokens_dropped

    rec = {"routed": 64, "dropped": 5, "tokens": 32, "capacity_factor": 1.0, "pad": True}
    ranks = [{"rank": r, "coords": {"tp": r % 2}, "extra": {"moe_capacity": rec | {"dropped": 5 + r}}}
             for r in range(4)]
    dropped, notes = tokens_dropped(ranks)
    assert dropped == 5 + 7  # ranks 0 and 2 (tp index 0)
    assert notes == ["Capacity factor 1 padded to capacity: 12 of 128 routed token-slots dropped in one step (9.38%), "
                     "per rank on 32 tokens per MoE call (Megatron's per-rank limit, lowest router probability first)."]
    assert tokens_dropped([{"rank": 0, "extra": {}}]) == (None, [])
