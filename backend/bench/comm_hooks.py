"""`KernelCommCounter`: count collectives with Python kernels on the collective ops only (comm-timing steps).

- `c10d.*` ops get a kernel at their Autograd keys (they have no autograd of their own). Every
  ProcessGroup call passes the dispatcher there: DDP's reducer, ZeroRedundancyOptimizer, FSDP2,
  pipelining p2p, dist.*.
- `_c10d_functional.*` ops (DTensor/TP, the MoE all-to-all) are differentiable since torch 2.10 (their
  Autograd kernels come from `torch.library.register_autograd`), so their kernel sits one key lower, at
  ADInplaceOrView: it sees the forward call and the backward's own collective alike. Their seconds run
  from issue to the `wait_tensor` on the output (hooked the same way). Their C++ implementations call
  c10d below autograd, so nothing is counted twice.

The kernels exist only inside the outermost counter: `Library._destroy()` gives torch its own kernels
back. Each counted collective costs ~0.1 ms here (boxing the call into Python; a completion callback
that needs the GIL), which is why the engine keeps these hooks off its timed steps.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from backend.bench.comm import (
    C10D_OPS,
    FUNCTIONAL_OPS,
    Tally,
    functional_op_group_size,
    op_group_size,
    op_payload_bytes,
)

_LIBS: list[Any] = []
_TALLY: Tally | None = None


def _c10d_kernel(op: Any, key: str, how: str):  # type: ignore[no-untyped-def]
    def kernel(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        with torch._C._AutoDispatchBelowAutograd():
            out = op(*args, **kwargs)
        tally = _TALLY
        if tally is not None and tally.record(key, op_payload_bytes(how, args, out), op_group_size(args, kwargs)):
            tally.time_work(key, t0, time.perf_counter(), out)
        return out
    return kernel


def _functional_kernel(op: Any, name: str, key: str, how: str):  # type: ignore[no-untyped-def]
    def kernel(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = op(*args, **kwargs)
        tally = _TALLY
        if tally is not None and tally.record(key, op_payload_bytes(how, args, out),
                                              functional_op_group_size(name, args)):
            tally.pend(out, key, t0)
        return out
    return kernel


def _wait_kernel(op: Any):  # type: ignore[no-untyped-def]
    def kernel(*args, **kwargs):  # type: ignore[no-untyped-def]
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = op(*args, **kwargs)
        if _TALLY is not None:
            _TALLY.waited(args[0])
        return out
    return kernel


def _install() -> list[Any]:
    c10d = torch.library.Library("c10d", "IMPL")
    for name, (key, how) in C10D_OPS.items():
        for dispatch_key in ("AutogradCPU", "AutogradCUDA"):
            c10d.impl(name, _c10d_kernel(getattr(torch.ops.c10d, name).default, key, how), dispatch_key)
    funcol = torch.library.Library("_c10d_functional", "IMPL")
    ops = torch.ops._c10d_functional
    for name, (key, how) in FUNCTIONAL_OPS.items():
        if hasattr(ops, name):
            funcol.impl(name, _functional_kernel(getattr(ops, name).default, name, key, how), "ADInplaceOrView")
    funcol.impl("wait_tensor", _wait_kernel(ops.wait_tensor.default), "ADInplaceOrView")
    return [c10d, funcol]


class KernelCommCounter(Tally):
    """`with KernelCommCounter() as c:` counts c10d and functional collectives (calls, bytes, seconds); the
    hooks exist only inside the outermost such block, so code outside it runs torch's own kernels untouched."""

    def __enter__(self) -> KernelCommCounter:
        global _TALLY
        if not _LIBS:
            import torch.distributed._functional_collectives  # noqa: F401 - registers the ops we hook

            _LIBS.extend(_install())
        self._prev = _TALLY
        _TALLY = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _TALLY
        _TALLY = self._prev
        if self._prev is None:
            while _LIBS:
                _LIBS.pop()._destroy()
