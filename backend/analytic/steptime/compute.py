"""Compute time of one microbatch on one pipeline stage, by operation class (pure Python).

- GEMMs: one per local 2-D weight (Linear; tok/pos embeddings are lookups), M = tokens that pass through it,
  FLOPs = 2·M·K·N (Narayanan 2021 Sec 5.1: a (M, K) x (K, N) GEMM costs 2MKN), backward = 2 GEMMs of the
  same shape (dgrad + wgrad, Narayanan 2021 Sec 5.1 "backward pass is twice the forward").
  Time = max(FLOPs / (peak · eff(F)), bytes / HBM) + launch: the roofline (Williams et al. 2009, CACM,
  "Roofline", Sec 2), with a size-dependent efficiency eff(F) = e_max · F / (F + F_half) (a saturating fit;
  Calculon, Isaev et al. SC'23 Sec 4, uses measured per-size tables instead; calibrate fits e_max, F_half).
  A profile with a measured table (the CPU probe's gemm_flops_by_size) uses it instead: eff(F) = e_max · table(F).
- attention core: eager = two batched GEMMs (QKᵀ, P·V: 2·2·b·(a/t)·s²·d_head FLOPs, PaLM App. B) plus the
  softmax/dropout on the (b, a/t, s, s) scores as memory traffic; flash = the same FLOPs at
  `attention_flash_efficiency` of peak, no s² traffic, backward 2.5x forward (FlashAttention-2, Dao 2023
  Sec 3.1: 5 matmuls in backward vs 2 in forward).
- element-wise (norms, GELU, residual, bias, dropout): memory bound, each activation written once and read
  once in forward (2x the Korthikanti 2022 Table 2 bytes per layer), backward twice that.
- recompute: full re-runs the block's forward, selective the attention core (Korthikanti 2022 Sec 5).
- context parallelism: a rank's GEMMs, element-wise passes and head see its seq_len / cp tokens (smaller M); its
  attention is its queries against every key, 1/cp of the layer's; without load balancing the cp ranks do unequal
  causal work and the ring waits for the busiest, rank cp-1: (2cp-1)/cp of the average (cp_imbalance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from backend.analytic.layout import Layout
from backend.analytic.sharding import LocalParam, derived, expert_of, stage_layers
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.textbook.korthikanti import korthikanti_layer_bytes
from backend.analytic.traffic import compute_bytes
from backend.analytic.vector import is_array, maximum, per_distinct

ATTENTION = ("eager", "flash")
FLASH_BWD_FACTOR = 2.5  # FlashAttention-2 (Dao 2023) Sec 3.1: backward 5 matmuls / forward 2


@dataclass
class PassCost:
    """Seconds and FLOPs of one microbatch through one stage."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    recompute_s: float = 0.0
    fwd_flops: float = 0.0

    def add(self, other: PassCost) -> None:
        self.fwd_s += other.fwd_s
        self.bwd_s += other.bwd_s
        self.recompute_s += other.recompute_s
        self.fwd_flops += other.fwd_flops


def gemm_s(hw: Hardware, peak: float, m: Any, k: Any, n: Any, dtype_bytes: float) -> Any:
    """One (m, k) x (k, n) GEMM: roofline with the size-dependent efficiency (module docstring); sizes may be
    arrays (one GEMM per entry)."""
    t = hw.tune
    flops = 2 * m * k * n  # Narayanan 2021 Sec 5.1
    if hw.gemm_curve:
        fraction = np.vectorize(lambda f: curve_fraction(hw.gemm_curve, f))(flops) if is_array(flops) else \
            curve_fraction(hw.gemm_curve, flops)
    else:
        fraction = flops / (flops + t.gemm_half_flops)
    eff = t.gemm_efficiency_max * fraction
    moved = (m * k + k * n + m * n) * dtype_bytes
    return maximum(flops / (peak * eff), moved / (hw.hbm_bytes_per_s * t.memory_efficiency)) + t.kernel_launch_s


def curve_fraction(curve: tuple[tuple[float, float], ...], flops: float) -> float:
    """Fraction of peak of a GEMM of `flops` from a measured table: linear in log(FLOPs) between sizes, the end
    values outside them (Calculon, Isaev et al. SC'23 Sec 4: measured per-size efficiency tables)."""
    if flops <= curve[0][0]:
        return curve[0][1]
    for (f0, e0), (f1, e1) in zip(curve, curve[1:]):
        if flops <= f1:
            w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return e0 + w * (e1 - e0)
    return curve[-1][1]


def memory_s(hw: Hardware, n_bytes: float, kernels: int = 1) -> float:
    """A memory-bound pass over n_bytes (roofline's bandwidth roof, Williams 2009 Sec 2)."""
    return n_bytes / (hw.hbm_bytes_per_s * hw.tune.memory_efficiency) + kernels * hw.tune.kernel_launch_s


def _gemm_rows(spec: Any, q: LocalParam, tokens: int) -> float:
    """Tokens that go through a weight: experts see tokens·top_k·ep/E each under uniform routing (GShard Sec 3.1)."""
    m, p = spec.model, spec.parallel
    if expert_of(q.name) is not None:
        return tokens * m.top_k * p.ep / m.n_experts
    return tokens


def _weights_cost(spec: Any, hw: Hardware, params: list[LocalParam], tokens: int) -> PassCost:
    cb, peak = compute_bytes(spec.train.precision), hw.peak(spec.train.precision)
    out = PassCost()
    seen: dict[tuple, float] = {}  # a model's blocks repeat the same weight shapes: same inputs, same seconds
    for q in params:
        if len(q.local_shape) != 2 or q.name.startswith(("tok_emb", "pos_emb")):
            continue
        n_out, k = q.local_shape  # nn.Linear weight (out, in)
        rows = _gemm_rows(spec, q, tokens)
        f = seen.get((rows, k, n_out))
        if f is None:
            f = seen[(rows, k, n_out)] = gemm_s(hw, peak, rows, k, n_out, cb)
        out.fwd_s += f
        out.bwd_s += 2 * f  # dgrad + wgrad, same shape
        out.fwd_flops += 2 * rows * k * n_out
    return out


def cp_imbalance(layout: Layout) -> Any:
    """The busiest cp rank's causal attention work over the average: 1 with head-tail chunks (each rank's two chunks
    cost the same in sum, torch's load-balance note); contiguous chunks give rank r r + 1/2 blocks of cp/2 on
    average, so the last rank does (cp - 1/2) / (cp / 2) = (2cp - 1) / cp of it."""
    return 1.0 if layout.cp_load_balance else (2 * layout.cp - 1) / layout.cp


def attention_pass(model: Any, layout: Layout, hw: Hardware, attention: str) -> PassCost:
    """QKᵀ and P·V of one layer and microbatch on one tp rank (+ eager: softmax/dropout traffic); under context
    parallelism the rank's s/cp queries against all s keys, at the busiest cp rank's share (cp_imbalance)."""
    cb, peak = layout.compute_bytes, hw.peak(layout.precision)
    b, s, a, hd = layout.micro_batch, model.seq_len, model.n_heads // layout.tp, model.head_dim
    rows, skew = s // layout.cp, cp_imbalance(layout)
    flops = 2 * 2 * b * a * rows * s * hd  # PaLM (Chowdhery 2022) App. B: QKᵀ + P·V
    if attention == "flash":
        f = skew * flops / (peak * hw.tune.attention_flash_efficiency) + hw.tune.kernel_launch_s
        return PassCost(fwd_s=f, bwd_s=FLASH_BWD_FACTOR * f, fwd_flops=flops)
    bmm = 2 * gemm_s(hw, peak, b * a * rows, hd, s, cb)  # one batched GEMM each: b·a problems of (s, d) x (d, s)
    scores = 5 * a * rows * s * b * cb / 2  # Korthikanti 2022 Eq. 1 5as²b (16-bit scores/probs + 1-byte mask)
    soft = memory_s(hw, 2 * scores, kernels=3)  # written once, read once
    return PassCost(fwd_s=skew * (bmm + soft), bwd_s=2 * skew * (bmm + soft), fwd_flops=flops)


def elementwise_pass(model: Any, layout: Layout, hw: Hardware) -> PassCost:
    """Norms, GELU, residual adds, bias, dropout of one layer: 2x Korthikanti Table 2 bytes without the
    attention-score term (counted in attention_pass), scaled from 16-bit to the compute dtype."""
    kb = per_distinct(lambda b, tp, sp, cp: korthikanti_layer_bytes(  # selective: without 5as²b
        s=model.seq_len // cp, b=b, h=model.d_model, a=model.n_heads, t=tp, sp=bool(sp), recompute="selective"),
        layout.micro_batch, layout.tp, layout.sequence_parallel, layout.cp)
    f = memory_s(hw, 2 * kb * layout.compute_bytes / 2, kernels=12)
    return PassCost(fwd_s=f, bwd_s=2 * f)


def head_pass(model: Any, layout: Layout, hw: Hardware, *, kernel_launches: bool = True) -> PassCost:
    """Cross-entropy over the (b·s, V/t) logits: softmax read/written in fp32 (the lm_head GEMM is a weight);
    kernel_launches=False: the memory traffic alone (the planner's proxy)."""
    logits = layout.micro_batch * layout.seq_local(model) * model.vocab_size / layout.tp * 4
    f = memory_s(hw, 3 * logits, kernels=4 if kernel_launches else 0)
    return PassCost(fwd_s=f, bwd_s=f)


def stage_cost(spec: Any, hw: Hardware, stage: int, params: list[LocalParam], attention: str, layout: Layout) -> PassCost:
    """One microbatch through one stage of this rank: its layers' weights, attention, element-wise, head
    (`layout` = Layout.of(spec))."""
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r} not in {ATTENTION}")
    m, t, p = spec.model, spec.train, spec.parallel
    n_stages = p.pp * p.virtual_stages
    layers = stage_layers(m.n_layers, n_stages, stage)
    names = tuple(f"layers.{i}." for i in layers)
    last = stage == n_stages - 1
    tokens = t.micro_batch * m.seq_len // p.cp  # this rank's share of each sequence

    def weights(ps: Any) -> PassCost:
        mine = [q for q in ps if q.name.startswith(names) or (last and q.name.startswith("lm_head"))]
        return _weights_cost(spec, hw, mine, tokens)

    # memoised per shared params tuple on every input _weights_cost reads
    cost = replace(derived(params, ("weights", stage, n_stages, tokens, str(t.precision), id(hw), m.top_k, p.ep,
                                    m.n_experts), weights, keep=hw))
    attn, elem = attention_pass(m, layout, hw, attention), elementwise_pass(m, layout, hw)
    n = len(layers)
    cost.fwd_s += n * (attn.fwd_s + elem.fwd_s)
    cost.bwd_s += n * (attn.bwd_s + elem.bwd_s)
    cost.fwd_flops += n * attn.fwd_flops
    rc = str(t.recompute)
    if rc == "full":
        cost.recompute_s = cost.fwd_s  # Korthikanti 2022 Sec 5 / Narayanan Eq. 3: one extra forward
    elif rc == "selective":
        cost.recompute_s = n * attn.fwd_s  # Korthikanti 2022 Sec 5: only the attention core
    if last:
        cost.add(head_pass(m, layout, hw))
    return cost
