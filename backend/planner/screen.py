"""Vectorised evaluation of every layout (numpy): the exact worst-rank memory and an approximate step time.

Memory: vmemory.worst_rank_bytes_v, the exact estimator's arithmetic (estimate.estimate's worst rank, to the byte
on tests/test_planner_vmemory.py's 1,000 random layouts), so feasibility is decided here for every layout.
Time ranks only (approx_step_s): a proxy of steptime.model with its main terms vectorised (per-GEMM
size-dependent efficiency, flash attention, element-wise traffic, the head on its rank, the busiest pipeline
rank's layers, analytic bubble instead of the simulated schedule, TP / DP traffic and overlap without
per-collective latency, the optimizer pass). search.plan re-times a pool of the fastest candidates with
steptime.model and reports that model's order. Measured agreement with steptime.model over every fitting layout:
Spearman 0.985 (Llama-2-70B, 1,024 H100), 0.976 / 0.967 (TinyLlama, 32 / 64 A100), proxy / exact 0.86-1.10
(5th-95th percentile); tests/test_planner_vmemory.py checks that the exact top 5 fall inside the top-5 pool.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from backend.analytic.textbook import pipeline as PL
from backend.analytic.params import block_param_list, block_params
from backend.analytic.sharding import expert_of, tp_local_shape
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.traffic import DDP_BUCKET_BYTES, compute_bytes
from backend.planner.space import SCHEDULES
from backend.planner.vfsdp import unique_map
from backend.planner.vmemory import worst_rank_bytes_v
from backend.spec import ModelSpec


@lru_cache(maxsize=65536)
def _bubble(sched: int, p: int, m: int, v: int) -> float:
    return PL.bubble_over_ideal(SCHEDULES[sched], p=p, m=m, v=v) if p > 1 else 0.0


def screen(model: Any, L: np.ndarray, *, hw: Hardware, global_batch: int, gpus_per_node: int,
           precision: str = "bf16-mixed") -> tuple[np.ndarray, np.ndarray]:
    """(exact worst-rank bytes, approximate step seconds) per layout row of L (space.COLUMNS)."""
    mem, _ = worst_rank_bytes_v(model, L, global_batch=global_batch, precision=precision)
    return mem, approx_step_s(model, L, hw=hw, global_batch=global_batch, gpus_per_node=gpus_per_node,
                              precision=precision)


@lru_cache(maxsize=256)
def _block_gemms(mj: str, tp: int) -> tuple[tuple[int, int, bool], ...]:
    """(out, in, is_expert) of one block's local Linear weights at tp index 0 (sharding.tp_local_shape)."""
    m = ModelSpec.model_validate_json(mj)
    return tuple((*tp_local_shape(q, tp, 0), expert_of(q.name) is not None)
                 for q in block_param_list(m, 0) if len(q.shape) == 2)


def _gemm_s(hw: Hardware, peak: float, rows, k: float, n: float, cb: float):
    """compute.gemm_s elementwise over rows: roofline with eff(F) = e_max · F / (F + F_half)."""
    t = hw.tune
    flops = 2 * rows * k * n
    moved = (rows * k + k * n + rows * n) * cb
    return np.maximum((flops + t.gemm_half_flops) / (peak * t.gemm_efficiency_max),
                      moved / (hw.hbm_bytes_per_s * t.memory_efficiency)) + t.kernel_launch_s


def approx_step_s(model: Any, L: np.ndarray, *, hw: Hardware, global_batch: int, gpus_per_node: int,
                  precision: str = "bf16-mixed") -> np.ndarray:
    """The ranking proxy of steptime.model's step_s per layout row: its compute terms per op class (GEMMs with the
    size-dependent efficiency, flash attention, element-wise traffic, the head) for the rank with the most layers,
    analytic bubble instead of the simulated schedule, TP / DP traffic without per-collective latency, optimizer
    and zero_grad passes."""
    m = model
    tp, pp, dp, ep, zero, b, rc, sched, v, sp = (L[:, i].astype(np.float64) for i in range(10))
    cb = compute_bytes(precision)
    peak, t = hw.peak(precision), hw.tune
    P_l = float(block_params(m))
    P_emb = float(m.vocab_size * m.d_model + m.seq_len * m.d_model)
    # layers of the busiest pipeline rank (sharding.layer_split: the first `extra` stages get one more; looped
    # ranks hold stages r + k·pp, rank 0 the most; ZBV rank r holds r and 2pp-1-r)
    base, extra = m.n_layers // (pp * v), m.n_layers % (pp * v)
    layers0 = v * base + np.where(sched == 4, (extra > 0) + (extra > pp), np.minimum(v, np.ceil(extra / pp)))
    n_loc = (layers0 * P_l + P_emb + np.where(pp == 1, P_emb, 0.0)) / tp
    mb = global_batch / (b * dp)
    mbi = (global_batch // (b * dp)).astype(np.int64)
    bubble = unique_map(_bubble, [sched, pp, mbi, v])[:, 0]
    tokens = b * m.seq_len
    mj = m.model_dump_json()
    gemm = np.zeros(len(L))
    for tpv in np.unique(L[:, 0]).tolist():  # compute._weights_cost per block
        rows = L[:, 0] == tpv
        for n_out, k, expert in _block_gemms(mj, tpv):
            r_ = tokens[rows] * (m.top_k * ep[rows] / m.n_experts if expert else 1)
            gemm[rows] += _gemm_s(hw, peak, r_, k, n_out, cb)
    attn = 4 * b * (m.n_heads / tp) * m.seq_len ** 2 * m.head_dim / (peak * t.attention_flash_efficiency) + t.kernel_launch_s
    kb = np.where(sp == 1, tokens * m.d_model / tp * 34, tokens * m.d_model * (10 + 24 / tp))  # Korthikanti Table 2 (selective)
    hbm = hw.hbm_bytes_per_s * t.memory_efficiency
    elem = kb * cb / 2 * 2 / hbm + 12 * t.kernel_launch_s
    head = (_gemm_s(hw, peak, tokens, m.d_model, m.vocab_size / tp, cb) * 3  # lm_head fwd + dgrad + wgrad,
            + 2 * 3 * tokens * m.vocab_size / tp * 4 / hbm)  # + softmax passes
    per_layer = (gemm + attn + elem) * (1 + (rc == 2)) \
        + 2 * gemm + 2.5 * attn + 2 * elem + np.where(rc == 1, attn, 0.0)  # fwd (+ recompute) + bwd (FLASH_BWD_FACTOR)
    # the busiest pipeline rank: rank 0 (most layers; under ZBV also the last stage, the head) or the rank with
    # the last stage and the head (looped: rank pp-1, stages pp-1 + k·pp)
    layers_last = v * base + np.minimum(v, np.maximum(0, np.ceil((extra - (pp - 1)) / pp)))
    head0 = (pp == 1) | (sched == 4)
    busiest = np.maximum(layers0 * per_layer + head0 * head, np.where(head0, 0.0, layers_last * per_layer + head))
    bwd = layers0 * (2 * gemm + 2.5 * attn + 2 * elem)
    compute = mb * busiest
    intra = hw.intra_bytes_per_s * t.intra_efficiency
    inter = hw.inter_bytes_per_s * t.inter_efficiency
    tp_bw = np.where(tp <= gpus_per_node, intra, inter)
    tp_s = np.where(tp > 1, np.where(rc == 2, 1.5, 1.0) * 4 * layers0 * mb * tokens * m.d_model * cb * 2 * (tp - 1) / tp / tp_bw, 0.0)
    per_node = np.clip(gpus_per_node // tp, 1, None)
    dp_bw = np.where(tp * dp <= gpus_per_node, intra, np.minimum(intra, per_node * inter))
    ring = (dp - 1) / dp / dp_bw  # seconds per payload byte of a ring all-gather / reduce-scatter / broadcast
    # dp_sync.dp_exposed: DDP / ZeRO-1 bucketed all-reduce behind the last backward (the last 25 MB bucket
    # exposed), ZeRO-1's parameter broadcast after the step, FSDP2 gathers / reduce-scatters behind the whole
    # step's compute (the first gather and last reduce-scatter exposed) plus their copy-in / copy-out passes
    ar = 2 * 4 * n_loc * ring
    ddp_exp = np.maximum(ar - t.overlap_efficiency * bwd, 2 * np.minimum(4 * n_loc, DDP_BUCKET_BYTES) * ring)
    ddp_exp = ddp_exp + np.where(zero == 1, 4 * n_loc * ring, 0.0)
    gathers = np.where(pp > 1, np.where(zero == 2, 1, 1 + mb), np.where(zero == 2, 1, 2) * mb)  # fsdp_gathers_per_step
    scatters = np.where(pp > 1, 1, mb)
    fpb = np.where((tp > 1) | (pp > 1) | (ep > 1), 4, cb)  # traffic.fsdp_param_bytes
    g_s, rs_s = fpb * n_loc * ring, 4 * n_loc * ring
    fsdp = gathers * g_s + scatters * rs_s
    copies = 2 * (gathers * fpb + scatters * 4) * n_loc / hbm
    fsdp_exp = copies + np.maximum(fsdp - t.overlap_efficiency * compute, 2 * np.maximum(g_s, rs_s) / (layers0 + 1))  # one unit
    dp_exposed = np.where(dp > 1, np.where(zero >= 2, fsdp_exp, ddp_exp), 0.0)
    owned = n_loc / np.where(zero >= 1, dp, 1)
    optim = (28 * owned + 4 * n_loc / np.where(zero >= 2, dp, 1)) / hbm
    return (compute + tp_s) * (1 + bubble) + dp_exposed + optim + t.step_overhead_s
