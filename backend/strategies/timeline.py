"""Per-microbatch pipeline timeline: start/end of every F, B and W pass of every stage on this rank.

torch.distributed.pipelining runs each microbatch's work through three methods of
`_PipelineStageBase`; we wrap them (once per process) and record while a capture is active:
  forward_one_chunk          -> "F"
  backward_one_chunk         -> "B" (input grads; with full_backward it also computes weight grads)
  backward_weight_one_chunk  -> "W" (zero-bubble schedules only)
and the waits on peer-to-peer work (`schedules._wait_batch_p2p`) -> "wait" (stage -1, microbatch -1:
the wait is for a batch of sends/recvs the schedule issued, not one microbatch).

One clock for all ranks: `capture()` starts with a world barrier and takes t0 right after it, so every
rank's seconds are relative to (nearly) the same instant. Records: {rank, stage, microbatch, pass, start_s,
end_s, step}.
- CPU (gloo): t0 and every span from time.time(); the passes run synchronously, so the host clock is the
  work's clock (on one machine time.time() is one clock anyway).
- CUDA: the passes only enqueue kernels and a p2p wait only makes the stream wait, so host times would be
  launch latencies. Every span is a pair of CUDA events recorded on the current stream around the pass (or
  the wait: the stream's stall), t0 an event recorded after the (host-blocking) barrier; the seconds are read
  when the capture ends, after a synchronize: device time relative to the barrier.
Capture a step after the first timed one (`capture_call`): the first steps run lazy initialisation.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import torch
import torch.distributed as dist

from backend.torch_compat import pipelining_schedules as _schedules
from backend.torch_compat import pipelining_stage as _stage

_state: dict = {"records": None, "t0": 0.0, "rank": 0, "step": None, "cuda": False, "events": None}
_installed = False


def capture_call(warmup_steps: int, steps: int) -> int:
    """Which train_step call to record: the second timed step when there are two or more (the first may still
    run lazy initialisation: allocator growth, NCCL communicator set-up, autotuning), else the only one."""
    return warmup_steps + (1 if steps > 1 else 0)


def _now() -> Any:
    """A time stamp: host seconds on CPU, a recorded CUDA event under a CUDA capture."""
    if not _state["cuda"]:
        return time.time()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _record(pass_: str, stage: int, microbatch: int, start: Any, end: Any) -> None:
    recs = _state["records"]
    if recs is None:
        return
    rec = {"rank": _state["rank"], "stage": stage, "microbatch": microbatch, "pass": pass_, "step": _state["step"]}
    if _state["cuda"]:  # resolved to seconds when the capture ends (the events have not run yet)
        _state["events"].append((rec, start, end))
    else:
        rec.update(start_s=start - _state["t0"], end_s=end - _state["t0"])
    recs.append(rec)


def _resolve_cuda_spans() -> None:
    """After the step: wait for the device, then turn every (start, end) event pair into seconds since t0."""
    torch.cuda.synchronize()
    t0 = _state["t0"]
    for rec, start, end in _state["events"]:
        rec["start_s"] = t0.elapsed_time(start) / 1e3  # ms -> s
        rec["end_s"] = t0.elapsed_time(end) / 1e3
    _state["events"] = None


def _wrap_chunk(fn, pass_: str):
    @wraps(fn)
    def inner(self, chunk_id, *args, **kwargs):
        if _state["records"] is None:
            return fn(self, chunk_id, *args, **kwargs)
        start = _now()
        try:
            return fn(self, chunk_id, *args, **kwargs)
        finally:
            _record(pass_, self.stage_index, int(chunk_id), start, _now())

    inner._shardlab_timeline = True
    return inner


def _wrap_wait(fn):
    @wraps(fn)
    def inner(*args, **kwargs):
        if _state["records"] is None:
            return fn(*args, **kwargs)
        start = _now()
        try:
            return fn(*args, **kwargs)
        finally:
            _record("wait", -1, -1, start, _now())

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
def capture(out: list[dict], step: int | None = None, group=None, device: torch.device | None = None) -> Iterator[None]:
    """Record every pass run inside the block into `out` (seconds relative to a barrier-synchronised t0),
    each record tagged with `step` (the train_step call index). device cuda: CUDA-event spans (module doc)."""
    install()
    _state["step"] = step
    _state["cuda"] = _on_cuda(device)
    if _state["cuda"]:
        torch.cuda.synchronize()  # nothing earlier may still be queued when t0 is taken
    if dist.is_initialized():
        dist.barrier(group=group)
        _state["rank"] = dist.get_rank()
    _state["events"] = [] if _state["cuda"] else None
    _state["t0"] = _now()
    _state["records"] = out
    try:
        yield
        if _state["cuda"]:
            _resolve_cuda_spans()
    finally:
        if _state["events"] is not None:  # the block raised before its spans were read: drop the unresolved ones
            out[:] = [r for r in out if "start_s" in r]
            _state["events"] = None
        _state["records"] = None
        _state["cuda"] = False


def _on_cuda(device: torch.device | str | None) -> bool:
    """Whether the passes run on CUDA: the given device, else the default group's backend (nccl = CUDA)."""
    if device is not None:
        return torch.device(device).type == "cuda"
    return dist.is_initialized() and dist.get_backend() == "nccl"
