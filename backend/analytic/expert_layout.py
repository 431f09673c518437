"""Where the routed experts live: the expert layout of a spec (or of arrays of layouts), beside the dense one.

Megatron-Core builds two grids over the same ranks (parallel_state.py @ core_v0.19.0 l. 815-897): the dense
tp x cp x dp x pp and the expert etp x ep x edp x pp, with edp = world / (etp x ep x pp); torchtitan's sparse mesh is
(pp, dp_replicate, efsdp, ep, etp) (parallel_dims.py @ v0.2.2). ShardLab lays the experts out as etp x ep x edp over a
stage's tp x cp x dp ranks:
- ep = 1: the experts split over tp like the dense MLP (each expert's fc_in / gate / up colwise, fc_out / down
  rowwise: etp = tp, Megatron's default etp);
- ep > 1: E / ep experts per rank, ep carved out of the dp x cp ranks (ep | dp x cp); each expert split over
  `parallel.etp` ranks of the tp group (etp | tp; 1: whole experts, the default). The MoE input is the whole
  microbatch on every tp rank (all-gathered over tp under sequence parallelism: the all-gather over etp before
  dispatch is that block-level one, as torchtitan's ExpertTensorParallel, expert_parallel.py @ v0.2.2), so the
  tp / etp ranks holding the same expert shard (`tp_replicas`) compute the same gradients and reduce over the ep
  group's replicas only; at etp = tp this is Megatron's default fold (etp = tp, ep over dp x cp).
edp (expert data-parallel degree) = the ranks holding the same expert shard within one tp column = dp x cp / ep
(Megatron: world / (etp x ep x pp) at etp = tp); the expert gradients reduce over edp (an all-reduce, or the
distributed optimizer's reduce-scatter: Megatron's _EXPERT_DATA_PARALLEL_GROUP) and zero1 shards the experts'
optimizer state over it.

The megatron stack (`folded`) lays the experts out as Megatron-Core does, on a grid of their own over the same ranks
(MoE parallel folding): etp x ep x edp covers a stage's tp x cp x dp ranks, so ep may span the tp ranks (ep larger
than dp x cp, etp < tp), and edp = tp x cp x dp / (etp x ep) (Megatron-LM parallel_state.py @ core_v0.19.0
`initialize_model_parallel`: expert_data_parallel_size = world_size // (etp x ep x pp)). Each tp rank routes its own
sequence-parallel tokens (ep_dispatch.Dispatch.tokens), so no two ranks compute the same expert gradients: tp_replicas
= 1, and the expert gradients reduce, and the distributed optimizer shards the experts' state, over all edp ranks. Its
EP all-to-all groups are strided by etp (ep_dispatch.Dispatch.ep_stride). This engine cannot run that fold
(spec/run_rules.py says so with the arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.scalar_or_array import where
from backend.spec.choices import FOLDED_EXPERT_STACKS

if TYPE_CHECKING:
    from backend.analytic.layout import Layout
    from backend.analytic.scalar_or_array import Num
    from backend.analytic.stack_memory import StackMemory
    from backend.spec import ExperimentSpec

MEGATRON_MECHANISM = "megatron"
"""The stack memory mechanism (analytic/stack_memory.py) of the stacks in FOLDED_EXPERT_STACKS."""


@dataclass(frozen=True)
class ExpertLayout:
    ep: Num
    """Expert-parallel degree: each rank holds n_experts / ep routed experts of every MoE layer."""
    etp: Num
    """Expert tensor-parallel degree: the tp ranks each expert's weights are split over (1: whole experts)."""
    edp: Num
    """Expert data-parallel degree: ranks of one tp column holding the same experts (dp x cp / ep)."""
    tp_replicas: Num
    """tp ranks that hold the same experts whole and compute the same expert gradients (tp / etp)."""

    @classmethod
    def of(cls, tp: Num, dp_cp: Num, ep: Num, etp: Num = 1, folded: Num = False) -> ExpertLayout:
        """folded: Megatron-Core's expert grid (the module docstring), else this engine's ep carved out of dp x cp."""
        etp = where(ep > 1, etp, tp)
        return cls(ep=ep, etp=etp, edp=where(folded, tp * dp_cp // (etp * ep), dp_cp // ep),
                   tp_replicas=where(folded, 1, tp // etp))

    @classmethod
    def of_spec(cls, spec: ExperimentSpec) -> ExpertLayout:
        p = spec.parallel
        return cls.of(p.tp, p.dp_cp, p.ep, p.etp, folded=spec.train.stack in FOLDED_EXPERT_STACKS)

    @classmethod
    def of_layout(cls, layout: Layout) -> ExpertLayout:
        return cls.of(layout.tp, layout.dp_cp, layout.ep, layout.etp, folded=folds_experts(layout.stack))

    @property
    def whole_experts(self) -> Num:
        """Each expert's weights unsplit on the rank (etp = 1 under ep > 1)."""
        return (self.ep > 1) & (self.etp == 1)


def folds_experts(stack: StackMemory | None) -> bool:
    """The stack lays its experts out on Megatron-Core's folded grid (None: this engine, which does not)."""
    return stack is not None and stack.mechanism == MEGATRON_MECHANISM


def rank_coords(spec: ExperimentSpec, rank: int) -> dict[str, int]:
    """The rank's mesh coordinates (ParallelSpec.coords) with its place on the stack's expert grid: on the folded grid
    the ep and etp indices are Megatron's, etp innermost, then ep, over a stage's ranks in tp-cp-dp order (the same
    stage-local order as this mesh's), not this engine's ep block along the dp index."""
    p = spec.parallel
    coords = p.coords(rank)
    if p.ep > 1 and spec.train.stack in FOLDED_EXPERT_STACKS:
        local = rank % (p.tp * p.dp_cp)
        coords["ep"] = (local // p.etp) % p.ep
        if "etp" in coords:
            coords["etp"] = local % p.etp
    return coords
