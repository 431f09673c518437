"""Count collectives: calls, payload bytes, ring wire bytes and seconds per collective type.

Two counters share one tally:
- `CommCounter` (the memory-tracked step): a TorchDispatchMode over `c10d.*` and `_c10d_functional.*`
  that sees everything, but runs Python for every op (several-fold slower on small steps).
- `KernelCommCounter` (backend/bench/comm_hooks.py, the comm-timing steps): Python kernels on the
  collective ops only.

Payload bytes follow docs/ARCHITECTURE.md: all_reduce the tensor; all_gather the gathered output;
reduce_scatter the full input; all_to_all the input; broadcast/send/recv the tensor.

Seconds, per backend (a duration that cannot be measured is None with a note, never a launch latency):
- gloo: c10d ops are asynchronous (they return a Work); we time from issue until the Work's future
  completes (a done-callback, no extra waiting): gloo completes it when its thread finished the collective.
  Functional ops are timed from issue until their `wait_tensor`. Overlapping collectives each count their
  own span, so the sum can exceed wall time.
- nccl: a Work's future completes at enqueue and `wait_tensor` only makes the stream wait, so host clocks
  measure launches. c10d ops are timed by `Work._get_duration()`: CUDA events NCCL records around the
  collective on its own stream (needs TORCH_NCCL_ENABLE_TIMING=1, which the launcher sets for nccl jobs),
  read after the step's closing synchronize. Functional ops (DTensor/TP, the MoE all-to-all) hide their
  Work from Python: their seconds are None with a note.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.analytic.textbook.comm_volume import ring_wire_bytes

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = None
_local = threading.local()

# op name (without overload) -> (collective key, how to find the payload)
C10D_OPS = {
    "allreduce_": ("all_reduce", "tensors0"),
    "allreduce_coalesced_": ("all_reduce", "tensors0"),
    "allgather_": ("all_gather", "out_lists0"),
    "allgather_coalesced_": ("all_gather", "out_lists0"),
    "_allgather_base_": ("all_gather", "arg0"),
    "allgather_into_tensor_coalesced_": ("all_gather", "tensors0"),
    "reduce_scatter_": ("reduce_scatter", "out_lists1"),
    "_reduce_scatter_base_": ("reduce_scatter", "arg1"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "tensors1"),
    "broadcast_": ("broadcast", "tensors0"),
    "alltoall_": ("all_to_all", "tensors1"),
    "alltoall_base_": ("all_to_all", "arg1"),
    "send": ("send", "tensors0"),
    "recv_": ("recv", "tensors0"),
    "recv_any_source_": ("recv", "tensors0"),
    "reduce_": ("all_reduce", "tensors0"),  # the contract has no "reduce" key: a reduce-to-root counts here
}
FUNCTIONAL_OPS = {
    "all_reduce": ("all_reduce", "arg0"),
    "all_reduce_": ("all_reduce", "arg0"),
    "all_reduce_coalesced": ("all_reduce", "tensors0"),
    "all_reduce_coalesced_": ("all_reduce", "tensors0"),
    "all_gather_into_tensor": ("all_gather", "result"),
    "all_gather_into_tensor_out": ("all_gather", "result"),
    "all_gather_into_tensor_coalesced": ("all_gather", "result"),
    "reduce_scatter_tensor": ("reduce_scatter", "arg0"),
    "reduce_scatter_tensor_out": ("reduce_scatter", "arg0"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "tensors0"),
    "all_to_all_single": ("all_to_all", "arg0"),
    "broadcast": ("broadcast", "arg0"),
    "broadcast_": ("broadcast", "arg0"),
    "isend": ("send", "arg0"),
    "irecv": ("recv", "arg0"),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def op_payload_bytes(how: str, args: tuple, result: Any) -> int:
    if how == "result":
        return _nbytes(result)
    kind, idx = how[:-1], int(how[-1])
    arg = args[idx]
    if kind in ("arg", "tensors", "out_lists"):
        return _nbytes(arg)
    raise ValueError(how)


def op_group_size(args: tuple, kwargs: dict) -> int:
    from torch.distributed.distributed_c10d import ProcessGroup

    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith("c10d.ProcessGroup"):
            return int(ProcessGroup.unbox(a).size())
    return 0


def functional_op_group_size(name: str, args: tuple) -> int:
    import torch.distributed as dist

    from backend.torch_compat import resolve_process_group as _resolve_process_group

    for a in args:
        if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product"):
            try:
                return dist.get_world_size(_resolve_process_group(a))
            except Exception:  # noqa: BLE001 - not a group name
                continue
    return 0


def _wait_key(t: torch.Tensor) -> int:
    """Which collective output a wait is for: the storage address, seen through funcol's AsyncCollectiveTensor
    wrapper (a Python-level wait gets the wrapper; autograd may hand on a new tensor object, same storage)."""
    inner = getattr(t, "elem", t)
    return inner.data_ptr() if isinstance(inner, torch.Tensor) else id(t)


def _backend_name() -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else ""
    except Exception:  # noqa: BLE001 - no default group
        return ""


def wire_bytes(collective: str, payload_bytes: float, n: int) -> float:
    """Ring-model bytes sent per rank (docs/ARCHITECTURE.md), from the analytic model's one definition."""
    return float(ring_wire_bytes(collective, payload_bytes, n))


class Tally:
    """Per collective type: calls, payload bytes, ring wire bytes, seconds; plus excluded bookkeeping bytes."""

    def __init__(self) -> None:
        self.counting = True
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.wire: dict[str, float] = defaultdict(float)
        self.seconds: dict[str, float] = defaultdict(float)
        self.excluded: dict[str, int] = defaultdict(int)
        """Payload bytes of collectives issued inside `uncounted()` (e.g. the loss report), by type."""
        self.group_sizes: dict[str, set[int]] = defaultdict(set)
        self._pending: dict[int, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self.device_timed = _backend_name() == "nccl"
        """True on NCCL: seconds come from the collectives' CUDA events (`Work._get_duration`), not host clocks."""
        self._works: list[tuple[str, Any]] = []
        self.untimed: dict[str, str] = {}
        """Collective -> why its seconds could not be measured (its seconds are then None)."""

    def record(self, key: str, payload: int, n: int) -> bool:
        """Count one collective; False when it is not training comm (counting off, or `uncounted()`)."""
        if not self.counting:
            return False
        if getattr(_local, "uncounted", False):
            self.excluded[key] += payload
            return False
        with self._lock:
            self.calls[key] += 1
            self.bytes[key] += payload
            self.wire[key] += wire_bytes(key, payload, n) if n else 0.0
            if n:
                self.group_sizes[key].add(n)
        return True

    def time_work(self, key: str, t0: float, issued: float, out: Any) -> None:
        """Seconds from issue until the c10d Work completes (a done-callback on its future: no extra waiting);
        on NCCL the Work is kept and its CUDA-event duration read in `summary` (after the step's synchronize)."""
        work = out[1] if isinstance(out, tuple) else out
        if self.device_timed:
            self._harvest(final=False)  # read (and let go of) the Works that finished: never hold their tensors
            with self._lock:
                self._works.append((key, work))
            return
        try:
            fut = work.get_future()
        except Exception:  # noqa: BLE001 - no future on this backend: issue time is all we can honestly record
            self.add_seconds(key, issued - t0)
            return
        fut.add_done_callback(lambda _f: self.add_seconds(key, time.perf_counter() - t0))

    def add_seconds(self, key: str, s: float) -> None:
        with self._lock:
            self.seconds[key] += s

    def pend(self, out: Any, key: str, t0: float) -> None:
        """A functional collective issued at t0: its seconds end at the `wait_tensor` on its output."""
        if self.device_timed:
            self.untimed.setdefault(key, "functional collective on nccl: its Work (and CUDA events) are not "
                                         "reachable from Python, and the host's wait only orders streams")
            return
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                self._pending[_wait_key(t)] = (key, t0)

    def waited(self, t: Any) -> None:
        """`wait_tensor(t)` returned: close the span of the collective that produced t (if it was counted)."""
        entry = self._pending.pop(_wait_key(t), None) if isinstance(t, torch.Tensor) else None
        if entry is not None:
            self.add_seconds(entry[0], time.perf_counter() - entry[1])

    def collect_device_durations(self) -> None:
        """NCCL: add each kept Work's CUDA-event duration to its collective; a Work that is not complete or has
        no timing events makes its collective's seconds unmeasured. Call after a device synchronize."""
        self._harvest(final=True)

    def _harvest(self, *, final: bool) -> None:
        with self._lock:
            works, self._works = self._works, []
        for key, work in works:
            try:
                if not work.is_completed():
                    if not final:
                        with self._lock:
                            self._works.append((key, work))
                        continue
                    raise RuntimeError("the collective had not completed when its duration was read")
                self.add_seconds(key, float(work._get_duration()) / 1e3)  # ms between NCCL's start/end events
            except Exception as e:  # noqa: BLE001 - e.g. TORCH_NCCL_ENABLE_TIMING unset: no events were recorded
                self.untimed.setdefault(key, f"nccl Work duration unavailable ({type(e).__name__}: {e})")

    def summary(self, steps: int) -> dict[str, dict[str, Any]]:
        """Per-step means: {collective: {calls, bytes, wire_bytes, seconds}}; seconds None (with seconds_note)
        for a collective whose duration could not be measured on this backend."""
        self.collect_device_durations()
        steps = max(steps, 1)
        out: dict[str, dict[str, Any]] = {}
        for k in sorted(self.calls):
            out[k] = {"calls": self.calls[k] / steps, "bytes": self.bytes[k] / steps,
                      "wire_bytes": self.wire[k] / steps, "seconds": self.seconds[k] / steps}
            if k in self.untimed:
                out[k].update(seconds=None, seconds_note=self.untimed[k])
        return out

    def excluded_per_step(self, steps: int) -> dict[str, float]:
        return {k: v / max(steps, 1) for k, v in self.excluded.items()}


class CommCounter(Tally, TorchDispatchMode):
    """`with CommCounter() as c:` sees every collective, c10d and functional (DTensor) alike.

    A dispatch mode runs Python for every op, which slows small steps down several-fold: use it on an
    untimed step. `KernelCommCounter` is the cheaper one (collectives only).
    """

    def __init__(self) -> None:
        Tally.__init__(self)
        TorchDispatchMode.__init__(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _DTensor is not None and any(t is _DTensor for t in types):
            # let DTensor desugar to local ops (and functional collectives) first, as MemTracker does
            return NotImplemented
        ns = func.namespace
        name = func._schema.name.split("::", 1)[-1]
        if name == "wait_tensor" and ns == "_c10d_functional":
            out = func(*args, **kwargs)
            self.waited(args[0])
            return out
        table = C10D_OPS if ns == "c10d" else \
            FUNCTIONAL_OPS if ns in ("_c10d_functional", "_c10d_functional_autograd") else None
        if table is None or name not in table:
            return func(*args, **kwargs)
        key, how = table[name]
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        issued = time.perf_counter()
        n = op_group_size(args, kwargs) if ns == "c10d" else functional_op_group_size(name, args)
        if not self.record(key, op_payload_bytes(how, args, out), n):
            return out
        if ns == "c10d":
            self.time_work(key, t0, issued, out)
        else:
            self.pend(out, key, t0)
        return out


@contextmanager
def uncounted() -> Iterator[None]:
    """Collectives issued inside are bookkeeping (e.g. averaging the loss for the report), not training comm."""
    prev = getattr(_local, "uncounted", False)
    _local.uncounted = True
    try:
        yield
    finally:
        _local.uncounted = prev
