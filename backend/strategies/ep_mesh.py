"""The device mesh expert parallelism works on: the engine's (pp, dp, tp) mesh with dp unflattened into
(dp_mod_ep, ep), as torchtitan's ParallelDims splits dp_shard = dp_shard_mod_ep x dp_shard_in_ep (its `ep` with
cp = 1 and etp = tp): dp = dp_mod_ep x ep, ep fastest. Built on first use by `RankContext.ep_mesh()`."""

from __future__ import annotations

import torch.distributed as dist

from backend.spec import ExperimentSpec
from backend.torch_compat import unflatten_mesh

EP_MESH_DIMS = ("pp", "dp_mod_ep", "ep", "tp")


def build_ep_mesh(spec: ExperimentSpec, mesh):  # -> DeviceMesh
    """`mesh` (pp, dp, tp) (dp: the dp x cp ranks) viewed as EP_MESH_DIMS = (pp, dp_mod_ep, ep, tp): mesh["dp"] keeps
    the full data-parallel dim (FSDP2 / DDP still shard and reduce over all of dp); ep groups are consecutive dp ranks
    ({0..ep-1}, {ep..2ep-1}, ...), expert-replica groups (dp_mod_ep) the ranks holding the same experts ({j, j+ep,
    ...}). Collective (creates process groups): every rank calls it once, in the same order. The ep groups are always
    fresh: a dim spanning the world would otherwise reuse the default group, which DDP's gradient all-reduce
    may use, and that all-reduce and the dispatch all-to-all must not share a gloo group (their order differs
    by rank)."""
    p = spec.parallel
    return unflatten_mesh(mesh, "dp", (p.dp_cp // p.ep, p.ep), EP_MESH_DIMS[1:3],
                          backend_override={"ep": dist.get_backend()})
