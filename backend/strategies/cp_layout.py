"""Where context parallelism puts things: the cp mesh dim and each cp rank's share of the sequence.

Mesh: the engine's (pp, dp, tp) mesh has a dp dim of dp x cp ranks (every rank holding the same parameters:
gradients are averaged and FSDP / ZeRO state is sharded over all of them, torchtitan's dp_shard_cp); the cp view
unflattens it into (dp_mod_cp, cp), cp fastest, which is torchtitan's (pp, dp, cp, tp) order (ParallelSpec.coords).

Sequence: with load balancing the sequence is cut into 2cp equal chunks and cp rank r holds chunks r and 2cp-1-r
(head-tail, torch's _HeadTailLoadBalancer, Megatron's get_batch_on_this_cp_rank), so causal attention costs every
rank the same; without it, cp contiguous chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from backend.spec import ExperimentSpec
from backend.torch_compat import unflatten_mesh

CP_MESH_DIMS = ("pp", "dp_mod_cp", "cp", "tp")


def build_cp_mesh(spec: ExperimentSpec, mesh):  # -> DeviceMesh
    """`mesh` (pp, dp, tp) viewed as CP_MESH_DIMS: cp groups are consecutive data-parallel ranks. Collective (creates
    process groups: every rank, same order). The cp groups are always fresh: a dim spanning the world would reuse
    the default group, which the data-parallel gradient reduction may use in a different order."""
    p = spec.parallel
    return unflatten_mesh(mesh, "dp", (p.dp, p.cp), CP_MESH_DIMS[1:3], backend_override={"cp": dist.get_backend()})


def sequence_chunks(seq_len: int, cp: int, cp_index: int, load_balance: bool) -> list[tuple[int, int]]:
    """[start, stop) token ranges of the global sequence that cp rank `cp_index` holds, in local order."""
    if cp == 1:
        return [(0, seq_len)]
    if load_balance:
        c = seq_len // (2 * cp)
        return [(cp_index * c, (cp_index + 1) * c), ((2 * cp - 1 - cp_index) * c, (2 * cp - cp_index) * c)]
    c = seq_len // cp
    return [(cp_index * c, (cp_index + 1) * c)]


def sequence_positions(spec: ExperimentSpec, cp_index: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions (int64) of this cp rank's tokens, in local order."""
    p = spec.parallel
    chunks = sequence_chunks(spec.model.seq_len, p.cp, cp_index, p.cp_load_balance)
    return torch.cat([torch.arange(a, b, device=device) for a, b in chunks])


def shard_sequence(spec: ExperimentSpec, cp_index: int, x: torch.Tensor) -> torch.Tensor:
    """Rows (.., seq_len) -> this cp rank's columns (a copy; the tensor itself when cp = 1)."""
    if spec.parallel.cp == 1:
        return x
    return torch.cat([x[:, a:b] for a, b in sequence_chunks(spec.model.seq_len, spec.parallel.cp, cp_index,
                                                             spec.parallel.cp_load_balance)], dim=1)
