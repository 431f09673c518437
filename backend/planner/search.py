"""Plan: enumerate layouts, screen them all (screen.py), then confirm the promising ones with the exact
worst-rank memory (memory.py) and the step-time model (steptime.model), fastest first.

Fits = worst-rank bytes + reserve <= device memory. The reserve (RESERVE_DOC) covers what the estimator does
not count on a GPU: the CUDA context, NCCL's buffers and allocator fragmentation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.model import step_time
from backend.planner.memory import light_spec, worst_rank_bytes
from backend.planner.screen import screen
from backend.planner.space import FLAVOURS, Limits, enumerate_layouts, layout_spec_dict

RESERVE_FIXED_BYTES = 2.5e9
RESERVE_FRACTION = 0.05
RESERVE_DOC = ("reserve = 2.5 GB (CUDA context ~0.5-1 GB, NCCL buffers ~1-1.5 GB per communicator set; PyTorch "
               "CUDA semantics docs / NCCL_BUFFSIZE 4 MiB x channels x peers) + 5% of the device for allocator fragmentation; "
               "override with --reserve-gb / --fragmentation")
SCREEN_MARGIN = 1.3
"""Screened memory may be this far below the exact worst rank; layouts above budget x margin are pruned."""


@dataclass
class Plan:
    searched: int
    feasible: int
    seconds: float
    configs: list[dict[str, Any]]
    screened_per_s: float = 0.0
    confirmed: int = 0
    feasible_screened: int = 0
    """Layouts whose screened (approximate) memory fits: an estimate of how many of all searched fit."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"searched": self.searched, "feasible": self.feasible, "seconds": self.seconds, "configs": self.configs,
                "screened_per_s": self.screened_per_s, "confirmed": self.confirmed,
                "feasible_screened": self.feasible_screened, "notes": self.notes}


def budget_bytes(memory_bytes: float, *, reserve_bytes: float = RESERVE_FIXED_BYTES, fragmentation: float = RESERVE_FRACTION) -> float:
    return memory_bytes * (1 - fragmentation) - reserve_bytes


def plan(model: Any, *, gpus: int, gpus_per_node: int, hw: Hardware, global_batch: int, memory_bytes: float | None = None,
         top: int = 10, precision: str = "bf16-mixed", band: tuple[float, float] | None = None,
         reserve_bytes: float = RESERVE_FIXED_BYTES, fragmentation: float = RESERVE_FRACTION,
         max_confirm: int = 150, limits: Limits = Limits(), enough: int | None = None) -> Plan:
    t0 = time.perf_counter()
    L = enumerate_layouts(model, gpus=gpus, gpus_per_node=gpus_per_node, global_batch=global_batch, limits=limits)
    if not len(L):
        return Plan(searched=0, feasible=0, seconds=time.perf_counter() - t0, configs=[],
                    notes=[f"no layout of {gpus} GPUs divides the model and batch {global_batch}"])
    budget = budget_bytes(memory_bytes or hw.memory_bytes, reserve_bytes=reserve_bytes, fragmentation=fragmentation)
    mem, step = screen(model, L, hw=hw, global_batch=global_batch, gpus_per_node=gpus_per_node, precision=precision)
    t_screen = time.perf_counter() - t0
    keep = np.nonzero(mem <= budget * SCREEN_MARGIN)[0]
    order = keep[np.argsort(step[keep], kind="stable")]
    configs, feasible, confirmed = [], 0, 0
    enough = enough or max(3 * top, 20)
    for i in order[:max_confirm]:
        if feasible >= enough:
            break
        data = layout_spec_dict(model, L[i], global_batch=global_batch, precision=precision)
        spec = light_spec(data)
        worst, rank = worst_rank_bytes(spec)
        confirmed += 1
        if worst > budget:
            continue
        feasible += 1
        st = step_time(spec, hw, gpus_per_node=gpus_per_node, band=band)
        configs.append({"spec": data, "mem_bytes_max": int(worst), "step_time": st.summary,
                        "strategy": FLAVOURS[int(L[i, 4])], "worst_rank": rank.rank,
                        "breakdown_bytes": {k: getattr(rank, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                                          "activations_bytes", "other_bytes")}})
    configs.sort(key=lambda c: c["step_time"]["step_s"])
    notes = [RESERVE_DOC, f"budget {budget / 1e9:.1f} GB of {((memory_bytes or hw.memory_bytes) / 1e9):.0f} GB",
             f"screened {len(L)} layouts in {t_screen:.3f} s; confirmed the {confirmed} fastest screened ones under "
             f"{SCREEN_MARGIN:.1f}x the budget with the exact worst-rank memory and step-time model (stopping at "
             f"{enough} that fit)",
             "feasible counts confirmed layouts only"]
    return Plan(searched=len(L), feasible=feasible, seconds=time.perf_counter() - t0, configs=configs[:top],
                screened_per_s=len(L) / t_screen if t_screen else 0.0, confirmed=confirmed,
                feasible_screened=int((mem <= budget).sum()), notes=notes)
