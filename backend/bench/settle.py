"""The memory-tracked step's gloo all-gathers, reduce-scatters and all-to-alls end where they are issued, so its peak
follows program order and not gloo's worker threads.

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

The all-to-alls (ring attention's K/V and dK/dV rotation, `c10d.alltoall_base_`; the expert-parallel dispatch's rows,
`_c10d_functional.all_to_all_single` under all_to_all_single_autograd, and its counts) have the first hold: measured
on a world-2 gloo run, a functional all-to-all's input and output were still held by the Work right after
`wait_tensor` returned (use counts 6 and 4, then 5 and 1 once the worker let go). CI caught it twice as a moment
chosen by the race: cp2_x_tp2_sp_alltoall's backward ring (+24 KB of activations) and zero3 x ep's activation peak
landing in another block (tests/multiprocess/test_pp_engine.py).

`SettledCollectives` is the innermost dispatch mode of the memory step (entered before the tracker). For each gloo
all-gather / reduce-scatter / all-to-all it waits as the op is issued, with no mode above it (the copy-out and its
views are never tracked), waits until gloo's worker has let go of the Work (the buffers' use counts are back to what
they were before the op), and hands back a Work that is already complete with the same output (a functional
collective: its output, already waited), so later waits copy nothing. Waiting
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
SETTLED_WORK_ONLY = frozenset({"alltoall_base_"})
"""c10d collectives with args (output, input, group, ...) that return the Work alone (dist.all_to_all_single)."""
SETTLED_FUNCTIONAL = frozenset({"all_to_all_single"})
"""_c10d_functional collectives with args (input, ...) that return their output, waited by `wait_tensor`."""
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
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        if func.namespace == "_c10d_functional" and name in SETTLED_FUNCTIONAL:
            return self._functional(func, args, kwargs, name)
        if not (func.namespace == "c10d" and name in SETTLED | SETTLED_WORK_ONLY):
            return func(*args, **kwargs)
        output, buffers = args[0], args[:2]
        before = [tensor_use_count(t) for t in buffers]
        out = func(*args, **kwargs)
        (out if name in SETTLED_WORK_ONLY else out[1]).wait()
        del out
        _until_let_go(buffers, before, name)
        self.settled += 1
        done = completed_work([output])
        return done if name in SETTLED_WORK_ONLY else (output, done)

    def _functional(self, func, args, kwargs, name: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """A functional collective waited as issued (its later `wait_tensor` finds no Work and returns at once)."""
        before = tensor_use_count(args[0])
        out = func(*args, **kwargs)
        torch.ops._c10d_functional.wait_tensor(out)
        _until_let_go((args[0], out), [before, 1], name)  # 1: `out`, this frame's own reference
        self.settled += 1
        return out


def _until_let_go(buffers: tuple[torch.Tensor, ...], before: list[int], op: str) -> None:
    """Sleep (the GIL released: the worker may need it to free what it held) until no buffer has more holders than
    before the op."""
    deadline = time.monotonic() + LET_GO_S
    while any(tensor_use_count(t) > n for t, n in zip(buffers, before, strict=True)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gloo still held the buffers of a finished {op} after {LET_GO_S:.0f} s "
                               f"(use counts {[tensor_use_count(t) for t in buffers]}, before the op {before})")
        time.sleep(1e-4)
