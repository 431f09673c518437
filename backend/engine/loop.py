"""The in-rank training loop: warm-up, timed steps, one memory-tracked step, a few comm-timing steps.

Step indices are global across phases (warm-up 0..w-1, timed w..w+n-1, memory w+n, comm-timing
w+n+1..w+n+c) so data and fault injection address the same step everywhere. Only rank 0 reports progress.
The timed steps run the strategy's step and nothing else: every instrument (memory tracker, comm counters)
runs on steps of its own, so measuring never inflates the step time.
"""

from __future__ import annotations

from typing import Any

import torch

from backend.bench import comm as comm_bench
from backend.bench import memory, timing
from backend.bench.comm_hooks import KernelCommCounter
from backend.bench.settle import SettledCollectives
from backend.engine.data import global_batch
from backend.runtime.faults import maybe_inject
from backend.runtime.protocol import Progress, emit_progress, mark_progress
from backend.spec import Schedule
from backend.strategies.base import Prepared, RankContext, global_mean_loss, local_batch
from backend.strategies.compiled import memory_step_stance
from backend.strategies.materialize import check_placement

COMM_STEPS = 3
"""Comm-timing steps after the memory step (at most spec.train.steps): collectives' seconds are their mean."""


def progress(ctx: RankContext | None, step: int, of: int, phase: str) -> None:
    """One progress line on stderr from rank 0 (or a one-process program: ctx None) when step `step` (1-based)
    of `of` in `phase` has finished; every rank marks its own progress file (the launcher's hang report)."""
    if ctx is not None:
        mark_progress(phase, step, of)
    if ctx is None or ctx.rank == 0:
        emit_progress(Progress(step=step, of=of, phase=phase))


def _batch(ctx: RankContext, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's rows of step `step`'s global batch, on ctx.device (the engine owns placement)."""
    batch = local_batch(ctx, *global_batch(ctx.spec, step))
    check_placement(ctx.placement, [], None, batch)
    return batch


def run_loop(ctx: RankContext, prep: Prepared) -> dict[str, Any]:
    """Run every phase on this rank; return this rank's payload (see engine/assemble.py for the format).

    Comm: the memory-tracked step also runs the dispatch-mode counter, which sees every collective incl.
    DTensor's functional ones: reported calls/bytes come from that complete count (one steady-state step).
    Seconds come from the comm-timing steps, which count collectives with kernel hooks on the collective ops
    only (a dispatch mode slows every op several-fold, which would stretch the spans it times)."""
    t = ctx.spec.train
    losses: list[float] = []
    for i in range(t.warmup_steps):
        maybe_inject(ctx.rank, i)
        losses.append(global_mean_loss(*prep.train_step(*_batch(ctx, i))))
        progress(ctx, i + 1, t.warmup_steps, "warmup")
        if i == 0:  # optimizer state and grads exist now: check them too (set-up checked the parameters)
            check_placement(ctx.placement, prep.modules, prep.optimizer)
    step_s = timed_steps(ctx, prep, losses)
    if t.warmup_steps == 0:
        check_placement(ctx.placement, prep.modules, prep.optimizer)
    mem, full = _memory_step(ctx, prep, t.warmup_steps + t.steps)
    # The objects the memory-tracked step published: a per-step record is replaced by each step (ep: its routing),
    # so this keeps the tracked step's, which memory and comm describe; a running value is updated in place (the
    # fp16 scaler's steps and skips), so it stays live through the comm-timing steps.
    tracked = dict(prep.extra)
    n_comm = min(COMM_STEPS, t.steps)
    counted = comm_steps(ctx, prep, t.warmup_steps + t.steps + 1, n_comm)
    prep.extra.clear()
    prep.extra.update(tracked)
    return {"losses": losses, "step_s": step_s, **comm_payload(full, counted, n_comm), "memory": mem}


def comm_payload(full: comm_bench.CommCounter, counted: KernelCommCounter, n_comm: int) -> dict[str, Any]:
    """The payload's comm keys from the memory-tracked step's complete count (`full`: calls, bytes, group sizes)
    and the `n_comm` comm-timing steps' kernel count (`counted`: seconds). A collective the kernel hooks did not
    see keeps the tracked step's own timing, marked `seconds_from: "memory_step"`."""
    comm = full.summary(1)
    counted_summary = counted.summary(n_comm)
    for k, v in comm.items():
        if k in counted_summary:
            v["seconds"] = counted_summary[k]["seconds"]
        else:
            v["seconds_from"] = "memory_step"
    return {"comm": comm, "comm_kernel": counted_summary, "comm_excluded": full.excluded_per_step(1),
            "comm_group_sizes": {k: sorted(v) for k, v in full.group_sizes.items()}}


def timed_steps(ctx: RankContext, prep: Prepared, losses: list[float]) -> list[float]:
    """Seconds of each timed step on this rank (fenced start); appends each step's global mean loss to losses."""
    t = ctx.spec.train
    step_s: list[float] = []
    for k in range(t.steps):
        i = t.warmup_steps + k
        maybe_inject(ctx.rank, i)
        batch = _batch(ctx, i)
        share, s = timing.timed(lambda: prep.train_step(*batch), ctx.device)  # noqa: B023 - timed calls it here
        losses.append(global_mean_loss(*share))  # reported outside the timed step, as a bare loop would
        step_s.append(s)
        progress(ctx, k + 1, t.steps, "timed")
    return step_s


def comm_steps(ctx: RankContext, prep: Prepared, first: int, n: int) -> KernelCommCounter:
    """Run steps first..first+n-1 with the kernel comm counter on (calls, bytes and seconds of every collective)."""
    counter = KernelCommCounter()
    counter.counting = False
    with counter:
        for k in range(n):
            maybe_inject(ctx.rank, first + k)
            batch = _batch(ctx, first + k)
            timing.fence(ctx.device)
            counter.counting = True
            prep.train_step(*batch)
            counter.counting = False
            timing.fence(ctx.device)  # let async collectives' completion callbacks land inside this step's tally
            progress(ctx, k + 1, n, "comm")
    return counter


def has_split_backward(ctx: RankContext) -> bool:
    """Schedules whose backward runs autograd.grad(inputs=...), which module-hook trackers break; decided
    before the step on every rank alike (a tracker failing mid-step would leave the peers hanging)."""
    p = ctx.spec.parallel
    return p.pp > 1 and p.pp_schedule in (Schedule.ZERO_BUBBLE, Schedule.ZBV, Schedule.DUALPIPEV)


def _memory_step(ctx: RankContext, prep: Prepared, step: int) -> tuple[dict[str, Any], comm_bench.CommCounter]:
    maybe_inject(ctx.rank, step)
    batch = _batch(ctx, step)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # reserved memory must not include what set-up left in the pool
        torch.cuda.reset_peak_memory_stats(ctx.device)
    tracker = memory.make_tracker(prep.modules, prep.optimizer, fsdp=prep.fsdp, hookless=has_split_backward(ctx),
                                  skip_gathers=ctx.spec.parallel.pp == 1)
    memory.track_inputs(tracker, batch)
    memory.track_resident(tracker, prep.resident())
    timing.fence(ctx.device)
    full = comm_bench.CommCounter()
    # entered first: the innermost mode, below the tracker (backend/bench/settle.py says why)
    with (memory_step_stance(ctx.spec), SettledCollectives(ctx.device), memory.tracking(tracker, prep.modules),
          full):
        prep.train_step(*batch)
    timing.fence(ctx.device)  # let async collectives' completion callbacks land
    out = memory.breakdown(tracker, ctx.device, ctx.placement.states)
    out["cuda_max_allocated_bytes"], out["cuda_max_reserved_bytes"] = memory.cuda_peaks(ctx.device)
    out["rss_bytes"] = memory.rss_bytes()
    progress(ctx, 1, 1, "memory")
    return out, full
