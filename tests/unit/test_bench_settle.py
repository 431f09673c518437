"""backend/bench/settle.py: a gloo all-gather or reduce-scatter in the memory step ends as it is issued; the copy
out of gloo's scratch runs below the tracker (tests/multiprocess/test_fullest_moment.py holds the grid's measured peaks
to the prediction with it)."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from backend.bench.settle import SETTLED, SettledCollectives


@pytest.fixture(scope="module")
def pg():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        yield
        dist.destroy_process_group()
    else:
        yield


class OpLog(TorchDispatchMode):
    """Stands in for the memory tracker: the ops it would see."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func._schema.name.split("::", 1)[-1])
        return func(*args, **(kwargs or {}))


def waits_that_run_ops(collectives: dict) -> dict[str, list[str]]:
    out = {}
    for name, issue in collectives.items():
        with OpLog() as log:
            work = issue()
            n = len(log.ops)
            work.wait()
        out[name] = log.ops[n:]
    return out


COLLECTIVES = {
    "allreduce_": lambda: dist.all_reduce(torch.ones(8), async_op=True),
    "_allgather_base_": lambda: dist.all_gather_into_tensor(torch.empty(8), torch.ones(8), async_op=True),
    "_reduce_scatter_base_": lambda: dist.reduce_scatter_tensor(torch.empty(8), torch.ones(8), async_op=True),
    "reduce_scatter_": lambda: dist.reduce_scatter(torch.empty(8), [torch.ones(8)], async_op=True),
    "alltoall_base_": lambda: dist.all_to_all_single(torch.empty(8), torch.ones(8), async_op=True),
    "broadcast_": lambda: dist.broadcast(torch.ones(8), 0, async_op=True),
}


def test_only_gloos_reduce_scatter_copies_out_on_wait(pg) -> None:
    assert {name for name, ops in waits_that_run_ops(COLLECTIVES).items() if ops} == {"_reduce_scatter_base_"}


def test_fsdp2s_collectives_are_the_settled_ones_and_their_buffers_are_let_go(pg) -> None:
    out, full = torch.empty(8), torch.ones(8)
    before = (out._use_count(), full._use_count())
    with SettledCollectives(torch.device("cpu")) as settle:
        work = dist.all_gather_into_tensor(out, full, async_op=True)
        assert work.is_completed() and (out._use_count(), full._use_count()) == before  # gloo let go already
        work.wait()
    del work
    assert (out._use_count(), full._use_count()) == before
    assert settle.settled == 1 and SETTLED == {"_allgather_base_", "_reduce_scatter_base_"}  # FSDP2's two


def test_under_the_mode_the_tracker_sees_no_copy_out_and_the_result_is_there(pg) -> None:
    out, full = torch.empty(8), torch.full((8,), 3.0)
    with SettledCollectives(torch.device("cpu")) as settle, OpLog() as log:
        work = dist.reduce_scatter_tensor(out, full, async_op=True)
        assert work.is_completed()
        work.wait()
        work.wait()
    assert settle.settled == 1
    assert log.ops == ["_reduce_scatter_base_"]
    torch.testing.assert_close(out, torch.full((8,), 3.0))


def test_off_the_cpu_the_mode_does_nothing(pg) -> None:
    out, full = torch.empty(8), torch.ones(8)
    with SettledCollectives(torch.device("meta")) as settle, OpLog() as log:
        dist.reduce_scatter_tensor(out, full, async_op=True).wait()
    assert settle.settled == 0 and log.ops == ["_reduce_scatter_base_", "split", "copy_"]


def test_all_to_alls_are_settled_with_their_buffers_let_go(pg) -> None:
    """dist.all_to_all_single (ring attention, the EP counts) comes back complete; the EP dispatch's functional,
    autograd all-to-all comes back already waited, its gradient flowing as before (gloo's worker can hold a functional
    all-to-all's input and output past wait_tensor: settle.py)."""
    from backend.torch_compat import all_to_all_single_autograd

    out, full = torch.empty(8), torch.full((8,), 2.0)
    before = (out._use_count(), full._use_count())
    x = torch.arange(6.0, requires_grad=True)
    with SettledCollectives(torch.device("cpu")) as settle:
        work = dist.all_to_all_single(out, full, async_op=True)
        assert work.is_completed() and (out._use_count(), full._use_count()) == before
        work.wait()
        rows = x * 1.0
        held = rows._use_count()
        y = all_to_all_single_autograd(rows, [6], [6], dist.group.WORLD)
        assert rows._use_count() == held
        (y * torch.arange(6.0)).sum().backward()
    assert settle.settled == 3  # the forward all-to-all, the c10d one and the backward's
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(y.detach(), torch.arange(6.0))
    torch.testing.assert_close(x.grad, torch.arange(6.0))
