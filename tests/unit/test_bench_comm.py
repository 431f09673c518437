"""The comm counters on a one-rank gloo group: payload bytes per collective, exclusions, ring wire bytes."""

import time

import pytest
import torch
import torch.distributed as dist

from backend.bench.comm import CommCounter, uncounted, wire_bytes
from backend.bench.comm_hooks import KernelCommCounter


@pytest.fixture(scope="module")
def pg():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        yield
        dist.destroy_process_group()
    else:
        yield


def issue_collectives():
    t = torch.ones(10)  # 40 B
    dist.all_reduce(t)
    out = torch.empty(6)
    dist.all_gather_single(out, torch.ones(6))  # gathered output: 24 B
    dist.reduce_scatter_single(torch.empty(4), torch.ones(4))  # full input: 16 B
    dist.broadcast(torch.ones(3), src=0)  # 12 B
    with uncounted():
        dist.all_reduce(torch.ones(1))  # bookkeeping: excluded


@pytest.mark.parametrize("counter_cls", [CommCounter, KernelCommCounter])
def test_counts_payload_bytes_per_collective(pg, counter_cls):
    with counter_cls() as c:
        issue_collectives()
        c.counting = False
        dist.all_reduce(torch.ones(100))  # not counted while counting is off
    s = c.summary(steps=1)
    assert {k: (v["calls"], v["bytes"]) for k, v in s.items()} == {
        "all_reduce": (1, 40), "all_gather": (1, 24), "reduce_scatter": (1, 16), "broadcast": (1, 12)}
    assert c.excluded == {"all_reduce": 4}
    assert all(v["wire_bytes"] == 0 for v in s.values())  # one rank sends nothing
    assert all(v["seconds"] >= 0 for v in s.values())
    assert c.summary(steps=2)["all_reduce"]["bytes"] == 20


@pytest.mark.parametrize("counter_cls", [CommCounter, KernelCommCounter])
def test_counters_see_functional_collectives_and_time_them_to_the_wait(pg, counter_cls):
    import torch.distributed._functional_collectives as fc

    with counter_cls() as c:
        out = fc.all_reduce(torch.ones(5), "sum", dist.group.WORLD)
        time.sleep(0.05)
        torch.ops._c10d_functional.wait_tensor(out)
    assert c.calls["all_reduce"] == 1 and c.bytes["all_reduce"] == 20
    assert c.seconds["all_reduce"] >= 0.05 and not c._pending


def test_kernel_counter_sees_differentiable_functional_collectives_both_ways(pg):
    import torch.distributed._functional_collectives as fc

    x = torch.ones(4, requires_grad=True)
    with KernelCommCounter() as c:
        y = fc.all_to_all_single_autograd(x * 3, None, None, dist.group.WORLD)
        torch.ops._c10d_functional.wait_tensor(y).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))  # autograd still flows through the hooked op
    assert c.calls["all_to_all"] == 2 and c.bytes["all_to_all"] == 32  # forward and backward, 16 B each
    assert not c._pending


def test_kernel_counter_is_inactive_outside_its_context(pg):
    with KernelCommCounter() as c:
        pass
    dist.all_reduce(torch.ones(10))
    assert not c.calls


def hooked() -> bool:
    """Whether a Python kernel overrides torch's own at c10d::allreduce_ / _c10d_functional::all_reduce."""
    c10d = "AutogradCPU" in torch._C._dispatch_dump("c10d::allreduce_")
    funcol = "ADInplaceOrView" in torch._C._dispatch_dump("_c10d_functional::all_reduce")
    assert c10d == funcol
    return c10d


def test_kernel_hooks_exist_only_inside_the_outermost_counter(pg):
    assert not hooked()
    with KernelCommCounter() as outer:
        with KernelCommCounter() as inner:
            dist.all_reduce(torch.ones(2))
        assert hooked()
        dist.all_reduce(torch.ones(3))
    assert not hooked()  # torch's own kernels again: code outside a counter pays nothing
    assert (inner.bytes["all_reduce"], outer.bytes["all_reduce"]) == (8, 12)


def test_timed_steps_run_uninstrumented_and_comm_steps_counted(pg, monkeypatch):
    from types import SimpleNamespace

    from backend.engine import loop
    from backend.strategies.base import LocalLoss

    monkeypatch.setattr(loop, "progress", lambda *a, **k: None)
    monkeypatch.setattr(loop, "_batch", lambda ctx, i: (torch.ones(1), torch.ones(1)))
    seen: list[bool] = []

    def train_step(x, y):
        seen.append(hooked())
        dist.all_reduce(torch.ones(4))
        return LocalLoss(1.0)

    ctx = SimpleNamespace(rank=0, device=torch.device("cpu"),
                          spec=SimpleNamespace(train=SimpleNamespace(steps=2, warmup_steps=1)))
    prep = SimpleNamespace(train_step=train_step)
    assert len(loop.timed_steps(ctx, prep, [])) == 2 and seen == [False, False]
    counter = loop.comm_steps(ctx, prep, first=4, n=3)
    assert seen[2:] == [True] * 3 and counter.summary(3)["all_reduce"]["bytes"] == 16


@pytest.mark.parametrize("kind,factor", [("all_reduce", 2 * 3 / 4), ("all_gather", 3 / 4), ("reduce_scatter", 3 / 4),
                                         ("all_to_all", 3 / 4), ("send", 1.0)])
def test_ring_wire_bytes(kind, factor):
    assert wire_bytes(kind, 1000, 4) == pytest.approx(1000 * factor)
    assert wire_bytes(kind, 1000, 1) == 0
