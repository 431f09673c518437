"""Classic DistributedDataParallel in the full-scale trace: a stand-in with DDP's gradient buckets, nothing else.

DDP's C++ Reducer reads parameter storage (it checks `data_ptr`s when it builds its buckets and when it
prepares a forward), which fake tensors do not have, so torch's DDP cannot run on FakeTensorMode (torchtitan's
estimator says the same). For memory, what DDP adds to a rank with `gradient_as_bucket_view=True` (how
ShardLab runs it, strategies/data_parallel.py) is its buckets: flat buffers, one per bucket, in the
parameters' dtype, holding every gradient that is reduced (parameters DDP ignores, e.g. EP experts, excluded),
with each `param.grad` a view of its bucket slice. So the gradients occupy exactly one copy of the reduced
parameter bytes, and the all-reduce works in place on the buckets (no extra buffer).

`BucketedDDP` builds exactly those buffers: DDP's bucket assignment (`dist._compute_bucket_assignment_by_size`
with DDP's caps: a 1 MiB first bucket, then `bucket_cap_mb` = 25 MiB, parameters in reverse order) and the
grads as views of them, set at construction. The all-reduce itself is not issued: on the fake process group
it moves nothing and allocates nothing. Installed by `standing_in()` beside `compat.fake_world()`, in the
trace's own process only; the prediction it is compared with is the analytic model's for real DDP.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from backend.trace.torch_private import ddp_bucket_assignment

NOTE = ("Classic DDP traced with a stand-in for its C++ Reducer (which reads parameter storage, absent on fake "
        "tensors): DDP's own gradient buckets (bucket assignment of dist._compute_bucket_assignment_by_size, "
        "1 MiB first bucket then 25 MiB, gradient_as_bucket_view) are allocated and every .grad is a view of its "
        "bucket, as in a real run; the in-place bucket all-reduce is not issued (backend/trace/ddp_standin.py).")
FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed.constants / DDP: dist._DEFAULT_FIRST_BUCKET_BYTES


class BucketedDDP(nn.Module):
    """Same constructor surface as DistributedDataParallel (as ShardLab calls it), `module`, `no_sync()`."""

    def __init__(self, module: nn.Module, process_group: Any = None, gradient_as_bucket_view: bool = True,
                 bucket_cap_mb: float = 25.0, **_: Any) -> None:
        super().__init__()
        if not gradient_as_bucket_view:
            raise ValueError("the trace's DDP stand-in models gradient_as_bucket_view=True only")
        self.module = module
        self.process_group = process_group
        self.require_backward_grad_sync = True
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        params = [p for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
        self._buckets = bucket_buffers(params, int(bucket_cap_mb * 1024 * 1024))  # plain attribute: not a buffer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old


@contextmanager
def standing_in() -> Iterator[None]:
    """strategies/data_parallel builds a BucketedDDP wherever it would build torch's DDP; restored on exit."""
    from backend.strategies import data_parallel

    real = data_parallel.DDP
    data_parallel.DDP = BucketedDDP
    try:
        yield
    finally:
        data_parallel.DDP = real


def bucket_buffers(params: list[nn.Parameter], cap_bytes: int) -> list[torch.Tensor]:
    """DDP's buckets for `params`: one flat buffer per bucket, each param's .grad set to a view of its slice."""
    if not params:
        return []
    order = list(reversed(range(len(params))))  # DDP builds buckets from the last parameter (backward order)
    rev = [params[i] for i in order]
    groups = ddp_bucket_assignment(rev, [FIRST_BUCKET_BYTES, cap_bytes])
    buffers = []
    with torch.no_grad():
        for idx in groups:
            members = [rev[i] for i in idx]
            flat = torch.zeros(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
            off = 0
            for p in members:
                p.grad = flat[off:off + p.numel()].view_as(p)
                off += p.numel()
            buffers.append(flat)
    return buffers
