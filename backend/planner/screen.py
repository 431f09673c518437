"""Vectorised screening of every layout (numpy): approximate worst-rank memory and step time in one pass.

Only for pruning and ordering: survivors are re-checked by planner.memory (the exact estimator's own code)
and steptime.model. Memory: ZeRO model states per device (Rajbhandari 2020 Sec 5: 16Ψ ddp, 4Ψ+12Ψ/N stage 1,
2Ψ+14Ψ/N... with ShardLab's fp32 params/grads), activations per layer from activations.model_layer_activation_bytes
(ShardLab's model) x in-flight microbatches (pipeline.in_flight_stage_activations). Time: executed FLOPs /
(peak · gemm_efficiency_max) (Narayanan 2021 Eq. 3 counting), TP all-reduces exposed (Narayanan 2021 Sec 3.2),
DP gradient sync exposed beyond the last backward, analytic bubble (pipeline.bubble_over_ideal).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from backend.analytic import pipeline as PL
from backend.analytic.activations import model_layer_activation_bytes
from backend.analytic.params import block_params, count_params
from backend.analytic.steptime.hardware import Hardware
from backend.planner.space import RECOMPUTE, SCHEDULES


@lru_cache(maxsize=65536)
def _layer_bytes(m_json: str, s: int, b: int, h: int, a: int, kv: int, ffn: int, cb: int, t: int, sp: int, rc: int,
                 ac: bool, ne: int, k: int) -> float:
    return model_layer_activation_bytes(s=s, b=b, h=h, a=a, kv_heads=kv, ffn=ffn, dtype_bytes=cb, t=t, sp=bool(sp),
                                        recompute=RECOMPUTE[rc], n_experts=ne, top_k=k, autocast=ac)


@lru_cache(maxsize=65536)
def _in_flight(sched: int, p: int, m: int, v: int) -> float:
    return PL.in_flight_stage_activations(SCHEDULES[sched], p=p, m=m, stage=0, v=v) if p > 1 else 1.0


@lru_cache(maxsize=65536)
def _bubble(sched: int, p: int, m: int, v: int) -> float:
    return PL.bubble_over_ideal(SCHEDULES[sched], p=p, m=m, v=v) if p > 1 else 0.0


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """np.unique(axis=0) via one mixed-radix int64 key per row (sorting void rows is ~50x slower)."""
    key = np.zeros(len(a), dtype=np.int64)
    for col in a.T:
        key = key * (int(col.max()) + 1) + col
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return a[first], first, inv.ravel()


def screen(model: Any, L: np.ndarray, *, hw: Hardware, global_batch: int, gpus_per_node: int,
           precision: str = "bf16-mixed") -> tuple[np.ndarray, np.ndarray]:
    """(approximate worst-rank bytes, approximate step seconds) per layout row of L (space.COLUMNS)."""
    m = model
    tp, pp, dp, ep, zero, b, rc, sched, v, sp = (L[:, i].astype(np.float64) for i in range(10))
    cb = 4 if precision == "fp32" else 2
    P_l, P = float(block_params(m)), float(count_params(m))
    P_emb = float(m.vocab_size * m.d_model + m.seq_len * m.d_model)
    n_stages = pp * v
    layers0 = np.ceil(m.n_layers / n_stages) * v  # the earlier stages get the extra layers (sharding.layer_split)
    n_loc = (layers0 * P_l + P_emb + np.where(pp == 1, P_emb, 0.0)) / tp
    mix = (tp > 1) | (pp > 1) | (ep > 1)
    states = np.select([zero == 0, zero == 1, zero == 2],
                       [np.where(mix & (dp > 1), 16 + 4 + 4, 16) * n_loc,
                        8 * n_loc + 8 * n_loc / dp,
                        16 * n_loc / dp + np.where(mix, 4, cb) * n_loc],
                       16 * n_loc / dp)
    mb = global_batch / (b * dp)
    ac = (precision != "fp32") & ~((zero >= 2) & ~mix)  # activations.uses_autocast
    mj = m.model_dump_json()
    keys, first, inv = _unique_rows(np.stack([b, tp, sp, rc, ac], axis=1).astype(np.int64))
    per = np.array([_layer_bytes(mj, m.seq_len, int(k[0]), m.d_model, m.n_heads, m.kv_heads, m.ffn, cb, int(k[1]),
                                 int(k[2]), int(k[3]), bool(k[4]), m.n_experts, m.top_k) for k in keys])[inv]
    mbi = (global_batch // (b * dp)).astype(np.int64)
    pkeys, _, pinv = _unique_rows(np.stack([sched, pp, mbi, v], axis=1).astype(np.int64))
    in_flight = np.array([_in_flight(*map(int, k)) for k in pkeys])[pinv]
    bubble = np.array([_bubble(*map(int, k)) for k in pkeys])[pinv]
    act = per * layers0 * in_flight
    head = np.where(pp == 1, b * m.seq_len * m.vocab_size / tp * (cb + 8), 0.0)
    mem = states + act + head
    # time
    tokens = global_batch * m.seq_len
    rc_f = np.select([rc == 2, rc == 1], [4 / 3, 1 + m.seq_len / (6 * m.d_model) / 3], 1.0)
    flops = (6 * P + 12 * m.n_layers * m.seq_len * m.d_model) * tokens * rc_f / (tp * pp * dp)
    compute = flops / (hw.peak(precision) * hw.tune.gemm_efficiency_max)
    intra = hw.intra_bytes_per_s * hw.tune.intra_efficiency
    inter = hw.inter_bytes_per_s * hw.tune.inter_efficiency
    tp_bw = np.where(tp <= gpus_per_node, intra, inter)
    tp_s = np.where(tp > 1, (6 if True else 4) * layers0 * mb * b * m.seq_len * m.d_model * cb * 2 * (tp - 1) / tp / tp_bw, 0.0)
    per_node = np.clip(gpus_per_node // tp, 1, None)
    dp_bw = np.where(tp * dp <= gpus_per_node, intra, np.minimum(intra, per_node * inter))
    grad_bytes = 4 * n_loc
    dp_s = np.where(dp > 1, grad_bytes * 2 * (dp - 1) / dp / dp_bw * np.where(zero == 3, 1.5, 1.0), 0.0)
    dp_exposed = np.maximum(dp_s - hw.tune.overlap_efficiency * compute / np.maximum(mb, 1) * 2 / 3, 0.05 * dp_s)
    step = (compute + tp_s) * (1 + bubble) + dp_exposed + hw.tune.step_overhead_s
    return mem, step
