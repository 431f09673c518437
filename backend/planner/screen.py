"""Vectorised evaluation of every layout (numpy): the exact worst-rank memory and an approximate step time.

Memory: vmemory.worst_rank_bytes_v, the exact estimator's arithmetic (estimate.estimate's worst rank, to the byte
on tests/test_planner_vmemory.py's 1,000 random layouts), so feasibility is decided here for every layout.
Time ranks only: executed FLOPs / (peak · gemm_efficiency_max) (Narayanan 2021 Eq. 3 counting), TP all-reduces
exposed (Narayanan 2021 Sec 3.2), DP gradient sync exposed beyond the last backward, analytic bubble
(pipeline.bubble_over_ideal). It is a proxy of steptime.model (no per-op efficiency, no simulated schedule,
no optimizer time): search.plan re-times a pool of the fastest candidates with steptime.model and reports that
model's order (tests/test_planner_vmemory.py checks that the exact best sits inside the pool).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from backend.analytic import pipeline as PL
from backend.analytic.params import block_params, count_params
from backend.analytic.steptime.hardware import Hardware
from backend.planner.space import SCHEDULES
from backend.planner.vmemory import worst_rank_bytes_v


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
    """(exact worst-rank bytes, approximate step seconds) per layout row of L (space.COLUMNS)."""
    mem, _ = worst_rank_bytes_v(model, L, global_batch=global_batch, precision=precision)
    return mem, approx_step_s(model, L, hw=hw, global_batch=global_batch, gpus_per_node=gpus_per_node,
                              precision=precision)


def approx_step_s(model: Any, L: np.ndarray, *, hw: Hardware, global_batch: int, gpus_per_node: int,
                  precision: str = "bf16-mixed") -> np.ndarray:
    """The ranking proxy of steptime.model's step_s per layout row (see the module docstring)."""
    m = model
    tp, pp, dp, ep, zero, b, rc, sched, v, sp = (L[:, i].astype(np.float64) for i in range(10))
    cb = 4 if precision == "fp32" else 2
    P_l, P = float(block_params(m)), float(count_params(m))
    P_emb = float(m.vocab_size * m.d_model + m.seq_len * m.d_model)
    layers0 = np.ceil(m.n_layers / (pp * v)) * v  # the earlier stages get the extra layers (sharding.layer_split)
    n_loc = (layers0 * P_l + P_emb + np.where(pp == 1, P_emb, 0.0)) / tp
    mb = global_batch / (b * dp)
    mbi = (global_batch // (b * dp)).astype(np.int64)
    pkeys, _, pinv = _unique_rows(np.stack([sched, pp, mbi, v], axis=1).astype(np.int64))
    bubble = np.array([_bubble(*map(int, k)) for k in pkeys])[pinv]
    # time
    tokens = global_batch * m.seq_len
    rc_f = np.select([rc == 2, rc == 1], [4 / 3, 1 + m.seq_len / (6 * m.d_model) / 3], 1.0)
    flops = (6 * P + 12 * m.n_layers * m.seq_len * m.d_model) * tokens * rc_f / (tp * pp * dp)
    compute = flops / (hw.peak(precision) * hw.tune.gemm_efficiency_max)
    intra = hw.intra_bytes_per_s * hw.tune.intra_efficiency
    inter = hw.inter_bytes_per_s * hw.tune.inter_efficiency
    tp_bw = np.where(tp <= gpus_per_node, intra, inter)
    tp_s = np.where(tp > 1, 6 * layers0 * mb * b * m.seq_len * m.d_model * cb * 2 * (tp - 1) / tp / tp_bw, 0.0)
    per_node = np.clip(gpus_per_node // tp, 1, None)
    dp_bw = np.where(tp * dp <= gpus_per_node, intra, np.minimum(intra, per_node * inter))
    grad_bytes = 4 * n_loc
    dp_s = np.where(dp > 1, grad_bytes * 2 * (dp - 1) / dp / dp_bw * np.where(zero == 3, 1.5, 1.0), 0.0)
    dp_exposed = np.maximum(dp_s - hw.tune.overlap_efficiency * compute / np.maximum(mb, 1) * 2 / 3, 0.05 * dp_s)
    return (compute + tp_s) * (1 + bubble) + dp_exposed + hw.tune.step_overhead_s
