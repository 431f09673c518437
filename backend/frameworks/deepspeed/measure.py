"""The memory-tracked DeepSpeed step: torch's MemTracker around the engine (its module, its client optimizer's
states, and the fp32 master partitions ZeRO keeps beside the module's parameters), comm counted at the dispatcher.

Private torch symbols used here (tests/unit/test_deepspeed_layout.py checks each exists):
`MemTracker._update_and_maybe_create_winfos` and `_MemRefType.OPT` — track_external books bare tensors as
"Other", while ZeRO's fp32 master partition is optimizer state (ZeRO paper §3.1: the fp32 copy in K=12).
"""

from __future__ import annotations

from typing import Any

import torch

from backend.bench import comm as comm_bench
from backend.bench import memory, timing
from backend.engine import global_batch, progress
from backend.frameworks.deepspeed.engine import master_tensors, partitions
from backend.runtime.faults import maybe_inject
from backend.strategies.base import Prepared, RankContext
from backend.strategies.context import local_batch


def make_tracker(prep: Prepared, engine: Any) -> memory.CategoryMemTracker:
    from torch.distributed._tools.mem_tracker import _MemRefType

    tracker = memory.CategoryMemTracker()
    tracker.track_external(engine.module, prep.optimizer)
    for t in master_tensors(engine):
        tracker._update_and_maybe_create_winfos(t, _MemRefType.OPT)
    for t in partitions(engine):  # ZeRO-3: the partitions are parameter storage the module does not show
        tracker._update_and_maybe_create_winfos(t, _MemRefType.PARAM)
    return tracker


def memory_step(ctx: RankContext, prep: Prepared, engine: Any,
                step: int) -> tuple[dict[str, Any], comm_bench.CommCounter]:
    maybe_inject(ctx.rank, step)
    batch = local_batch(ctx, *global_batch(ctx.spec, step))
    tracker = make_tracker(prep, engine)
    memory.track_inputs(tracker, batch)
    timing.fence(ctx.device)
    full = comm_bench.CommCounter()
    with memory.tracking(tracker, prep.modules), full:
        prep.train_step(*batch)
    timing.fence(ctx.device)
    out = memory.breakdown(tracker, ctx.device)
    out["cuda_max_allocated_bytes"], out["cuda_max_reserved_bytes"] = memory.cuda_peaks(ctx.device)
    out["rss_bytes"] = memory.rss_bytes()
    out["model_states"] = model_state_bytes(engine)
    progress(ctx, 1, 1, "memory")
    return out, full


def model_state_bytes(engine: Any) -> dict[str, int]:
    """Persistent state after the step, by storage (each counted once): the module's parameters (for ZeRO-1/2
    DeepSpeed's flat buffer incl. alignment padding; for ZeRO-3 this rank's partitions plus persistent
    parameters), the fp32 master partitions, and the client optimizer's states."""
    seen: set[int] = set()

    def size(ts: list[torch.Tensor]) -> int:
        n = 0
        for t in ts:
            s = t.untyped_storage()
            if s.data_ptr() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                n += s.nbytes()
        return n

    params = partitions(engine) + [p for p in engine.module.parameters() if p.numel()]
    opt = engine.optimizer
    states = [v for st in _inner(opt).state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"params_bytes": size(params), "master_bytes": size(master_tensors(engine)),
            "optimizer_state_bytes": size(states)}


def _inner(opt: Any) -> torch.optim.Optimizer:
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt
