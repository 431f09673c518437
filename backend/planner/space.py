"""The search space: every layout of a model on N GPUs that the analytic model can predict (pure Python + numpy).

Columns of a layout table (numpy int arrays, one row per layout): tp, pp, dp, ep, zero (0 ddp, 1 zero1,
2 zero2, 3 zero3), b (micro-batch), rc (0 none, 1 selective, 2 full), sched (index into SCHEDULES), v
(virtual stages), sp (0/1). Only arithmetic constraints are applied here (divisibility, the spec's schedule
rules); "runnable on this machine" is not a constraint (ExperimentSpec.for_prediction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FLAVOURS = ("ddp", "zero1", "zero2", "zero3")
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv")
COLUMNS = ("tp", "pp", "dp", "ep", "zero", "b", "rc", "sched", "v", "sp")


@dataclass(frozen=True)
class Limits:
    max_tp: int | None = None
    """Largest tp (default: GPUs per node: TP across nodes is never competitive, Narayanan 2021 Sec 3.3 takeaway 1)."""
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    virtual_stages: tuple[int, ...] = (2, 4)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, n_layers: int, vs: tuple[int, ...]) -> list[tuple[int, int]]:
    """(schedule index, virtual stages) pairs a pp degree admits (spec_checks._check_pipeline)."""
    if pp == 1:
        return [(0, 1)]
    out = [(0, 1), (1, 1)] + [(2, v) for v in vs if pp * v <= n_layers]
    out += [(3, v) for v in vs[:1] if pp * v <= n_layers]  # zero_bubble (torch's interleaved ZB-H1)
    return out + ([(4, 2)] if pp * 2 <= n_layers else [])


def _grid(*cols: list[int]) -> np.ndarray:
    return np.stack(np.meshgrid(*[np.asarray(c, dtype=np.int64) for c in cols], indexing="ij"), -1).reshape(-1, len(cols))


def enumerate_layouts(model: Any, *, gpus: int, gpus_per_node: int, global_batch: int, limits: Limits = Limits()) -> np.ndarray:
    """(n, len(COLUMNS)) int array of every valid layout: the degree pairs in Python, then one numpy grid over
    (pair, ep, flavour, micro-batch, schedule, recompute, SP) with the pair-dependent choices padded and masked,
    rows in that nesting order."""
    m = model
    max_tp = limits.max_tp or gpus_per_node
    pairs = []
    for tp in _divisors(gpus):
        if tp > max_tp or m.n_heads % tp or m.kv_heads % tp or m.ffn % tp:
            continue
        for pp in _divisors(gpus // tp):
            if pp > m.n_layers:
                continue
            dp = gpus // (tp * pp)
            eps = [e for e in _divisors(dp) if m.n_experts % e == 0] if m.is_moe and tp == 1 and pp == 1 else [1]
            pairs.append((tp, pp, dp, eps, _schedules(pp, m.n_layers, limits.virtual_stages)))
    if not pairs:
        return np.zeros((0, len(COLUMNS)), dtype=np.int64)
    n_ep, n_sv = max(len(x[3]) for x in pairs), max(len(x[4]) for x in pairs)
    deg = np.array([x[:3] for x in pairs], dtype=np.int64)  # (pairs, 3): tp, pp, dp
    ep_t = np.array([x[3] + [0] * (n_ep - len(x[3])) for x in pairs], dtype=np.int64)  # 0 = padding
    sv_t = np.array([x[4] + [(-1, 0)] * (n_sv - len(x[4])) for x in pairs], dtype=np.int64)  # -1 = padding
    g = _grid(range(len(pairs)), range(n_ep), range(4), limits.micro_batches, range(n_sv), range(3), (0, 1))
    pi, ei, zero, b, si, rc, sp = g.T
    tp, pp, dp = deg[pi].T
    ep, sched, v = ep_t[pi, ei], sv_t[pi, si, 0], sv_t[pi, si, 1]
    ok = (ep > 0) & (sched >= 0) & ((sp == 0) | (tp > 1)) & (global_batch % (b * dp) == 0)
    mb = np.where(ok, global_batch // (b * dp), 0)
    ok &= (pp == 1) | (sched == 1) | (mb >= pp)
    ok &= (pp == 1) | ~np.isin(sched, (2, 3, 4)) | (mb % pp == 0)
    return np.stack([tp, pp, dp, ep, zero, b, rc, sched, v, sp], axis=1)[ok]


def layout_spec_dict(model: Any, row: np.ndarray | tuple, *, global_batch: int, precision: str = "bf16-mixed",
                     optimizer: str = "adamw") -> dict[str, Any]:
    """The full experiment spec (as a dict) of one layout row."""
    tp, pp, dp, ep, zero, b, rc, sched, v, sp = (int(x) for x in row)
    return {"name": f"plan dp{dp}·tp{tp}·pp{pp}{'·ep' + str(ep) if ep > 1 else ''} {FLAVOURS[zero]}",
            "model": model.model_dump(),
            "train": {"global_batch": global_batch, "micro_batch": b, "precision": precision, "optimizer": optimizer,
                      "recompute": RECOMPUTE[rc]},
            "parallel": {"strategy": FLAVOURS[zero], "world_size": tp * pp * dp, "dp": dp, "tp": tp, "pp": pp, "ep": ep,
                         "sequence_parallel": bool(sp), "pp_schedule": SCHEDULES[sched], "virtual_stages": v}}
