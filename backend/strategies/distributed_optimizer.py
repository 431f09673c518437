"""Megatron's distributed optimizer: ZeRO-1 over the dp group for DTensor (TP) and pipeline-stage parameters.

Written here because torch has no public equivalent: ZeroRedundancyOptimizer assigns whole plain tensors to ranks
and cannot take DTensors or the modules a pipeline schedule drives. The design is Megatron-Core's
(megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer + megatron/core/distributed/
param_and_grad_buffer.py _ParamAndGradBuffer):

- Buckets: each stage module on this rank has one bucket for its embeddings, one per transformer block and one for
  the head (final norm + lm_head). A bucket is a contiguous buffer of its local (already TP-sharded) parameters,
  padded to a multiple of dp, so dp rank r owns the contiguous slice [r n/dp, (r+1) n/dp) of every bucket.
- Parameters are views of their bucket's param buffer: bf16 under bf16-mixed (the module then runs in bf16 without
  autocast, as Megatron's Float16Module does), fp32 otherwise. A DTensor parameter is rebuilt with the public
  DTensor.from_local over its view (same placements, global shape and stride).
- Gradients accumulate in one fp32 main-grad buffer per bucket (Megatron's `main_grad`, grads accumulated and
  reduced in fp32): a post-accumulate-grad hook adds the local gradient into the parameter's view and drops `.grad`.
  Gradients a schedule assigns by hand (split-backward weight passes, which fire no hook) are swept in at `step`.
- Overlap: on the last microbatch a bucket whose every gradient has arrived is reduce-scattered asynchronously
  while backward goes on; the rest at `step`. Partial(sum) gradients over tp (sequence-parallel norms) are
  all-reduced over tp first. The reduced slice is averaged over dp (and, under pipelining, the microbatches).
- The owned slice is stepped by a torch optimizer over one fp32 tensor per bucket: the fp32 master of the slice
  (bf16 params) or a view of the param buffer's slice (fp32 params: no copy). Then every bucket's param buffer is
  all-gathered in place over dp.

Model states per local parameter element: bf16 params 2 + fp32 grads 4 + (fp32 master 4 + AdamW m, v 8) / dp =
Megatron's 6 + 12/dp (fp32 params: 4 + 4 + 8/dp), plus each bucket's padding and one AdamW `step` per bucket
(analytic/memory/model_state.py distributed_optimizer_state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from backend.analytic.dp_buckets import bucket_of


@dataclass
class Bucket:
    """One contiguous group of local parameters and its buffers."""
    name: str
    params: list[nn.Parameter]
    offsets: list[int]
    param_data: torch.Tensor
    grad_data: torch.Tensor
    dp: int
    dp_rank: int
    group: Any = None
    """The group its gradients reduce-scatter and its params all-gather over: dp (x cp), or for an expert bucket the
    expert data-parallel group (None: edp = 1, no collective)."""
    master: torch.Tensor | None = None
    expected: int = 0
    """Gradient arrivals that complete the bucket on the last microbatch (params x microbatches)."""
    arrived: int = 0
    held: bool = False
    """Never launched early (a pre-reduction, e.g. the tied-embedding sum across stages, must come first)."""
    partial: set[int] = field(default_factory=set)
    work: Any = None

    @property
    def shard_numel(self) -> int:
        return self.grad_data.numel() // self.dp

    def shard(self, data: torch.Tensor) -> torch.Tensor:
        k = self.shard_numel
        return data[self.dp_rank * k:(self.dp_rank + 1) * k]

    def view(self, data: torch.Tensor, i: int) -> torch.Tensor:
        local = _local(self.params[i])
        return data[self.offsets[i]:self.offsets[i] + local.numel()].view(local.shape)


class _Done:
    """The finished work of a reduction that needed no collective."""

    @staticmethod
    def wait() -> None:
        return None


def _local(q: torch.Tensor) -> torch.Tensor:
    return q.to_local() if isinstance(q, DTensor) else q


def _slots(module: nn.Module) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(full name, owner module, attribute, parameter) of every parameter slot, tied ones included."""
    out = []
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for attr, q in sub._parameters.items():
            if q is not None:
                out.append((f"{mod_name}.{attr}" if mod_name else attr, sub, attr, q))
    return out


class DistributedOptimizer:
    """The optimizer the engine steps (OptimizerTail): `step()` finishes the reductions, steps the owned slices and
    all-gathers the params; `zero_grad()` zeroes the main-grad buffers. `optim` is the inner torch optimizer (its
    state is what the memory tracker reads); `tracked()` names the buffers it must count as grads and optimizer."""

    def __init__(self, modules: list[nn.Module], *, make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 dp_group: Any, tp_group: Any, microbatches: int, grad_divisor: float, param_dtype: torch.dtype,
                 overlap: bool = True, held_names: tuple[str, ...] = (), experts: set[int] = frozenset(),
                 expert_group: Any = None):
        self.dp_group, self.tp_group = dp_group, tp_group
        self.dp, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.experts, self.expert_group = experts, expert_group
        self.edp = dist.get_world_size(expert_group) if expert_group is not None else 1
        self.edp_rank = dist.get_rank(expert_group) if expert_group is not None else 0
        self.grad_divisor, self.overlap = grad_divisor, overlap
        self.buckets: list[Bucket] = []
        self._grad_of: dict[int, tuple[Bucket, int]] = {}
        for module in modules:
            self.buckets += self._build(module, param_dtype, microbatches, held_names)
        self.half = param_dtype != torch.float32
        masters = []
        for b in self.buckets:
            shard = b.shard(b.param_data)
            b.master = shard.detach().float().clone() if self.half else shard
            b.master.grad = b.shard(b.grad_data)
            masters.append(b.master)
        self.optim = make_inner(masters)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    def _build(self, module: nn.Module, dtype: torch.dtype, microbatches: int, held: tuple[str, ...]) -> list[Bucket]:
        groups: dict[str, tuple[int, list]] = {}
        seen: dict[int, nn.Parameter] = {}
        for name, _owner, _attr, q in _slots(module):
            if id(q) in seen:  # a tied slot: point it at the same rebuilt parameter
                continue
            order, key = bucket_of(name)
            if id(q) in self.experts:  # Megatron's expert buffer: its own bucket per block, over edp
                order, key = order + 0.5, f"{key}.experts"
            groups.setdefault(key, (order, []))[1].append((name, q))
            seen[id(q)] = q
        replaced: dict[int, nn.Parameter] = {}
        buckets = []
        for key, (_, members) in sorted(groups.items(), key=lambda kv: kv[1][0]):
            bucket = self._bucket(key, members, dtype, replaced)
            bucket.expected = len(bucket.params) * microbatches
            bucket.held = any(name in held for name, _ in members)
            buckets.append(bucket)
        for _, owner, attr, q in _slots(module):
            owner._parameters[attr] = replaced[id(q)]
        return buckets

    def _bucket(self, key: str, members: list[tuple[str, nn.Parameter]], dtype: torch.dtype,
                replaced: dict[int, nn.Parameter]) -> Bucket:
        expert = id(members[0][1]) in self.experts
        dp, dp_rank, group = (self.edp, self.edp_rank, self.expert_group) if expert else (self.dp, self.dp_rank,
                                                                                           self.dp_group)
        sizes = [_local(q).numel() for _, q in members]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        padded = -(-sum(sizes) // dp) * dp
        device = _local(members[0][1]).device
        param_data = torch.zeros(padded, dtype=dtype, device=device)
        grad_data = torch.zeros(padded, dtype=torch.float32, device=device)
        params = []
        for (_name, q), offset, n in zip(members, offsets, sizes, strict=False):
            local = _local(q)
            view = param_data[offset:offset + n].view(local.shape)
            with torch.no_grad():
                view.copy_(local)
            if isinstance(q, DTensor):
                value = DTensor.from_local(view, q.device_mesh, q.placements, run_check=False, shape=q.shape,
                                           stride=q.stride())
            else:
                value = view
            new = nn.Parameter(value, requires_grad=q.requires_grad)
            replaced[id(q)] = new
            params.append(new)
        bucket = Bucket(key, params, offsets, param_data, grad_data, dp, dp_rank, group)
        for i, q in enumerate(params):
            self._grad_of[id(q)] = (bucket, i)
            q.register_post_accumulate_grad_hook(self._hook(bucket, i))
        return bucket

    def _hook(self, bucket: Bucket, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad(q: torch.Tensor) -> None:
            self._take_grad(bucket, i, q)
            bucket.arrived += 1
            if self.overlap and not bucket.held and bucket.arrived == bucket.expected and bucket.work is None:
                self._launch(bucket)
        return on_grad

    def _take_grad(self, bucket: Bucket, i: int, q: torch.Tensor) -> None:
        g = q.grad
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                bucket.partial.add(i)
            g = g.to_local()
        with torch.no_grad():
            bucket.view(bucket.grad_data, i).add_(g)
        q.grad = None

    def main_grad(self, q: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient accumulated for parameter q (its view of the main-grad buffer)."""
        bucket, i = self._grad_of[id(q)]
        return bucket.view(bucket.grad_data, i)

    def _launch(self, bucket: Bucket) -> None:
        for i in sorted(bucket.partial):
            dist.all_reduce(bucket.view(bucket.grad_data, i), group=self.tp_group)
        if bucket.group is None:  # an expert bucket with edp = 1: the all-to-all backward already summed it
            bucket.work = _Done()
            return
        bucket.work = dist.reduce_scatter_tensor(bucket.shard(bucket.grad_data), bucket.grad_data,
                                                 group=bucket.group, async_op=True)

    def sweep(self) -> None:
        """Gradients assigned by hand (no hook fired) join the main-grad buffers."""
        for bucket in self.buckets:
            for i, q in enumerate(bucket.params):
                if q.grad is not None:
                    self._take_grad(bucket, i, q)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.sweep()
        for bucket in reversed(self.buckets):  # backward order: the head's gradients are ready first
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work, bucket.arrived = None, 0
            bucket.shard(bucket.grad_data).div_(self.grad_divisor)
        self.optim.step()
        gathers = []
        for bucket in self.buckets:
            own = bucket.shard(bucket.param_data)
            if self.half:
                own.copy_(bucket.master)
            if bucket.group is not None:
                gathers.append(dist.all_gather_into_tensor(bucket.param_data, own, group=bucket.group, async_op=True))
        for work in gathers:
            work.wait()

    def zero_grad(self, set_to_none: bool = False) -> None:
        del set_to_none  # the main-grad buffers are persistent (their views are the masters' .grad)
        for bucket in self.buckets:
            bucket.grad_data.zero_()

    def tracked(self) -> dict[str, list[torch.Tensor]]:
        """Long-lived storages a memory tracker cannot find through modules and optimizer state: the main-grad
        buffers (grads) and, with 16-bit params, the fp32 masters (optimizer)."""
        return {"grads": [b.grad_data for b in self.buckets],
                "optimizer": [b.master for b in self.buckets] if self.half else []}

    def notes(self) -> list[str]:
        sizes = [b.grad_data.numel() for b in self.buckets]
        experts = [b for b in self.buckets if b.name.endswith(".experts")]
        extra = (["Expert buckets (Megatron's expert buffers): one per MoE block, padded to a multiple of "
                  f"edp={self.edp}, their fp32 main grads reduce-scattered and optimizer state sharded over the expert "
                  f"data-parallel group ({len(experts)} buckets)."] if experts else [])
        return extra + [f"ZeRO-1 = Megatron's distributed optimizer over dp={self.dp}: {len(sizes)} buckets "
                f"(embeddings, one per block, head) of {min(sizes):,}-{max(sizes):,} elements padded to a multiple of "
                "dp; fp32 main grads reduce-scattered (a bucket complete on the last microbatch overlaps the rest of "
                "backward), the owned slices stepped" + (" on fp32 masters" if self.half else "") + ", params "
                                                                                                    "all-gathered."]
