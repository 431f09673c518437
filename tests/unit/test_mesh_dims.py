"""Typed mesh dimensions (issue 11): expert parallelism comes from named DeviceMesh dims ("ep", "dp_mod_ep") of
the (pp, dp, tp) mesh with dp unflattened (strategies/ep_mesh.build_ep_mesh), with exactly the rank groups the
hand-built enumeration had, and "dp" still the full data-parallel dim. One process on the fake process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from backend import torch_compat as tc
from backend.engine.mesh import build_mesh
from backend.spec import ExperimentSpec
from backend.strategies.ep_mesh import EP_MESH_DIMS, build_ep_mesh


def _spec(world: int, ep: int, pp: int = 1, tp: int = 1, strategy: str = "zero3") -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "model": {"d_model": 32, "n_heads": 4, "n_layers": 2, "seq_len": 16, "vocab_size": 64, "n_experts": 4,
                  "top_k": 2},
        "train": {"global_batch": 8, "micro_batch": 1},
        "parallel": {"strategy": strategy, "world_size": world, "ep": ep, "pp": pp, "tp": tp}})


def _expected(spec: ExperimentSpec, rank: int) -> tuple[list[int], list[int]]:
    """The hand-built groups this replaced: ep = consecutive blocks of ep dp ranks, replicas = stride ep."""
    p = spec.parallel
    me = p.coords(rank)
    same = [r for r in range(p.world_size) if all(p.coords(r)[k] == me[k] for k in ("pp", "tp"))]
    ep = [r for r in same if p.coords(r)["dp"] // p.ep == me["dp"] // p.ep]
    replica = [r for r in same if p.coords(r)["dp"] % p.ep == me["dp"] % p.ep]
    return ep, replica


@pytest.mark.parametrize("world,ep,pp,tp", [(2, 2, 1, 1), (4, 2, 1, 1), (8, 2, 1, 1), (8, 4, 1, 1)])
def test_ep_dims_give_the_same_groups_as_before(world, ep, pp, tp):
    spec = _spec(world, ep, pp, tp)
    for rank in range(world):
        dist.init_process_group("fake", store=tc.fake_store(), rank=rank, world_size=world)
        try:
            mesh = build_mesh(spec, torch.device("cpu"))
            em = build_ep_mesh(spec, mesh)
            assert em.mesh_dim_names == EP_MESH_DIMS
            want_ep, want_replica = _expected(spec, rank)
            assert em["ep"].mesh.tolist() == want_ep, rank
            assert em["dp_mod_ep"].mesh.tolist() == want_replica, rank
            assert em["ep"].get_local_rank() == spec.parallel.coords(rank)["dp"] % ep  # = ExpertParallel.ep_rank
            assert mesh["dp"].mesh.tolist() == [r for r in range(world)]  # FSDP2 / DDP still over the full dp
            assert em["ep"].get_group() is not dist.group.WORLD  # never the group DDP's all-reduce may use
        finally:
            dist.destroy_process_group()


def test_rank_context_builds_the_ep_mesh_once():
    from backend.strategies.context import RankContext

    spec = _spec(4, 2)
    dist.init_process_group("fake", store=tc.fake_store(), rank=3, world_size=4)
    try:
        ctx = RankContext(spec=spec, rank=3, world_size=4, local_rank=0, device=torch.device("cpu"),
                          mesh=build_mesh(spec, torch.device("cpu")))
        assert ctx.ep_mesh() is ctx.ep_mesh()
        assert ctx.ep_mesh()["ep"].mesh.tolist() == [2, 3] and ctx.ep_mesh()["dp_mod_ep"].mesh.tolist() == [1, 3]
    finally:
        dist.destroy_process_group()
