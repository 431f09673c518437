"""Per-microbatch pipeline timeline: start/end of every F, B and W pass of every stage on this rank.

torch.distributed.pipelining runs each microbatch's work through three methods of
`_PipelineStageBase`; we wrap them (once per process) and record while a capture is active:
  forward_one_chunk          -> "F"
  backward_one_chunk         -> "B" (input grads; with full_backward it also computes weight grads)
  backward_weight_one_chunk  -> "W" (zero-bubble schedules only)
and the waits on peer-to-peer work (`schedules._wait_batch_p2p`) -> "wait" (stage -1, microbatch -1:
the wait is for a batch of sends/recvs the schedule issued, not one microbatch).

One clock for all ranks: `capture()` starts with a world barrier and takes t0 = time.time() right after
it, so every rank's seconds are relative to (nearly) the same instant; on one machine time.time() is one
clock anyway. Records: {rank, stage, microbatch, pass, start_s, end_s, step}.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import wraps
from typing import Iterator

import torch.distributed as dist
from backend.torch_compat import pipelining_schedules as _schedules
from backend.torch_compat import pipelining_stage as _stage

_state: dict = {"records": None, "t0": 0.0, "rank": 0, "step": None}
_installed = False


def _record(pass_: str, stage: int, microbatch: int, start: float, end: float) -> None:
    recs = _state["records"]
    if recs is not None:
        recs.append({"rank": _state["rank"], "stage": stage, "microbatch": microbatch, "pass": pass_,
                     "start_s": start - _state["t0"], "end_s": end - _state["t0"], "step": _state["step"]})


def _wrap_chunk(fn, pass_: str):
    @wraps(fn)
    def inner(self, chunk_id, *args, **kwargs):
        if _state["records"] is None:
            return fn(self, chunk_id, *args, **kwargs)
        start = time.time()
        try:
            return fn(self, chunk_id, *args, **kwargs)
        finally:
            _record(pass_, self.stage_index, int(chunk_id), start, time.time())

    inner._shardlab_timeline = True
    return inner


def _wrap_wait(fn):
    @wraps(fn)
    def inner(*args, **kwargs):
        if _state["records"] is None:
            return fn(*args, **kwargs)
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            _record("wait", -1, -1, start, time.time())

    inner._shardlab_timeline = True
    return inner


def install() -> None:
    """Wrap the stage methods once per process (idempotent)."""
    global _installed
    if _installed:
        return
    base = _stage._PipelineStageBase
    for meth, pass_ in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        fn = getattr(base, meth)
        if not getattr(fn, "_shardlab_timeline", False):
            setattr(base, meth, _wrap_chunk(fn, pass_))
    if hasattr(_schedules, "_wait_batch_p2p") and not getattr(_schedules._wait_batch_p2p, "_shardlab_timeline", False):
        _schedules._wait_batch_p2p = _wrap_wait(_schedules._wait_batch_p2p)
    _installed = True


@contextmanager
def capture(out: list[dict], step: int | None = None, group=None) -> Iterator[None]:
    """Record every pass run inside the block into `out` (seconds relative to a barrier-synchronised t0),
    each record tagged with `step` (the train_step call index)."""
    install()
    _state["step"] = step
    if dist.is_initialized():
        dist.barrier(group=group)
        _state["rank"] = dist.get_rank()
    _state["t0"] = time.time()
    _state["records"] = out
    try:
        yield
    finally:
        _state["records"] = None
