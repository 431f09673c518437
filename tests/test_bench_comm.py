"""The comm counters on a one-rank gloo group: payload bytes per collective, exclusions, ring wire bytes."""

import pytest
import torch
import torch.distributed as dist

from backend.bench.comm import CommCounter, KernelCommCounter, uncounted, wire_bytes


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


def test_dispatch_counter_sees_functional_collectives(pg):
    import torch.distributed._functional_collectives as fc

    with CommCounter() as c:
        out = fc.all_reduce(torch.ones(5), "sum", dist.group.WORLD)
        torch.ops._c10d_functional.wait_tensor(out)
    assert c.calls["all_reduce"] == 1 and c.bytes["all_reduce"] == 20


def test_kernel_counter_is_inactive_outside_its_context(pg):
    with KernelCommCounter() as c:
        pass
    dist.all_reduce(torch.ones(10))
    assert not c.calls


@pytest.mark.parametrize("kind,factor", [("all_reduce", 2 * 3 / 4), ("all_gather", 3 / 4), ("reduce_scatter", 3 / 4),
                                         ("all_to_all", 3 / 4), ("send", 1.0)])
def test_ring_wire_bytes(kind, factor):
    assert wire_bytes(kind, 1000, 4) == pytest.approx(1000 * factor)
    assert wire_bytes(kind, 1000, 1) == 0
