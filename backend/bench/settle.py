"""The memory-tracked step's gloo all-gathers and reduce-scatters end where they are issued, so its peak follows program
order and not gloo's worker threads.

Two holds on a collective's buffers outlive the program's own on gloo, and both end on gloo's worker thread:
- the Work: the worker keeps it (and its output) until just after it marked it done. FSDP2 drops an all-gather's output
  after the copy-out; when the worker lets go later, the buffer is still alive in whatever the main thread does next.
- the scratch: `_reduce_scatter_base_` reduces into a scratch of the input's size and copies the result out of it on
  every wait (`aten.split` + `aten.copy_` on the waiting thread), so the memory tracker books it as a temporary that
  lives as long as the Work.
On a loaded host the worker sometimes lets go after the main thread unsharded the next unit or ran the next block's
backward, and the buffer lands on the peak: CI measured the world-2 grid 92-131 KB (3-3.9%) above the prediction on
zero2 / zero3 layouts (tests/multiprocess/test_fullest_moment.py), each time with a buffer freed off the main thread; no
idle run repeats it. On CUDA, FSDP2's stream events and the caching allocator order the same buffers in program order,
and NCCL has no scratch the allocator sees: that is the program the prediction describes.

`SettledCollectives` is the innermost dispatch mode of the memory step (entered before the tracker). For each gloo
all-gather / reduce-scatter it waits as the op is issued, with no mode above it (the copy-out and its views are never
tracked), waits until gloo's worker has let go of the Work (the buffers' use counts are back to what they were before
the op), and hands back a Work that is already complete with the same output, so later waits copy nothing. Waiting
changes no tensor's lifetime in program order; it takes the overlap away, which the memory step does not time
(backend/engine/loop.py times steps without instruments). Written by hand: torch has no switch for it.
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.torch_compat import completed_work, tensor_use_count

SETTLED = frozenset({"_allgather_base_", "_reduce_scatter_base_"})
"""FSDP2's collectives (c10d schema names): args (output, input, group, ...), returns (output, Work)."""
LET_GO_S = 60.0
"""How long gloo's worker may keep a finished Work before the step fails (it lets go microseconds after finishing)."""


class SettledCollectives(TorchDispatchMode):
    """`with SettledCollectives(device):` gloo all-gathers and reduce-scatters end as issued (a CPU device only)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.active = device.type == "cpu"
        self.settled = 0
        """Collectives ended as issued (a test reads it)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name.split("::", 1)[-1]
        if not (self.active and func.namespace == "c10d" and name in SETTLED):
            return func(*args, **(kwargs or {}))
        output, buffers = args[0], args[:2]
        before = [tensor_use_count(t) for t in buffers]
        out = func(*args, **(kwargs or {}))
        out[1].wait()
        del out
        _until_let_go(buffers, before, name)
        self.settled += 1
        return output, completed_work([output])


def _until_let_go(buffers: tuple[torch.Tensor, ...], before: list[int], op: str) -> None:
    """Sleep (the GIL released: the worker may need it to free what it held) until no buffer has more holders than
    before the op."""
    deadline = time.monotonic() + LET_GO_S
    while any(tensor_use_count(t) > n for t, n in zip(buffers, before, strict=True)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gloo still held the buffers of a finished {op} after {LET_GO_S:.0f} s "
                               f"(use counts {[tensor_use_count(t) for t in buffers]}, before the op {before})")
        time.sleep(1e-4)
