"""What the model-parallel strategies (tp, pp, ep) share: optimizer, microbatch split, the global loss,
and the data-parallel wrapper for the dp mesh dimension of a 2D/3D mix.

Data-parallel flavours on the dp dimension of a mix (all torch-native, all accept DTensor parameters and
`torch.distributed.pipelining` stages):
  ddp            -> `replicate` (FSDP2-style DDP, `torch.distributed._composable.replicate_with_fsdp`):
                    classic `DistributedDataParallel` does not take DTensor (TP) parameters, and the
                    pipelining stages drive `replicate`/`fully_shard` modules through their own hooks.
  zero2          -> `fully_shard(..., reshard_after_forward=False)`
  zero3 / fsdp   -> `fully_shard(..., reshard_after_forward=True)`
Each transformer block is one replicate/fully_shard unit, then the root (embeddings, norm, head).

Gradients are persistent buffers (`zero_grad(set_to_none=False)`, as DDP's bucket views are): they stay
resident through the whole step, so the memory peak always holds one gradient per local parameter
(with set_to_none=True a GPipe peak, reached before the first backward, would hold none). MoE experts
that no token reached in a step have their grad hidden during optimizer.step (`ExpertUsage`), as the
dense reference (grad None) skips them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from backend.bench.comm import uncounted
from backend.spec import ExperimentSpec, Strategy
from backend.strategies import base
from backend.strategies.base import RankContext

SYNC_EVERY_MICROBATCH = (Strategy.ZERO2, Strategy.ZERO3, Strategy.FSDP)
"""Sharded-gradient flavours reduce-scatter after every microbatch (grads stay sharded, as ZeRO-2/3
intend); ddp all-reduces once per step, on the last microbatch (DDP `no_sync` semantics)."""


def make_optimizer(spec: ExperimentSpec, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return base.make_optimizer([p for p in params if p.requires_grad], spec)


def split_microbatches(x: torch.Tensor, spec: ExperimentSpec) -> list[torch.Tensor]:
    """This dp rank's rows -> `microbatches` chunks of `micro_batch` rows each."""
    t = spec.train
    n, mb = t.microbatches or 1, t.micro_batch
    if x.shape[0] != n * mb:
        raise ValueError(f"dp share has {x.shape[0]} rows != microbatches {n} * micro_batch {mb} = {n * mb}")
    return list(x.split(mb))


def blocks(module: nn.Module) -> list[nn.Module]:
    layers = getattr(module, "layers", None)
    return list(layers.values()) if layers is not None else []


def dp_wrap(ctx: RankContext, module: nn.Module, ignored: set[nn.Parameter] | None = None) -> bool:
    """Apply the dp flavour over ctx.mesh["dp"] to `module` in place; returns True when FSDP2-style
    wrappers (fully_shard / replicate) were applied (the engine then tracks memory with FSDPMemTracker)."""
    p = ctx.spec.parallel
    if p.dp == 1:
        return False
    flavour = p.dp_flavour
    mesh = ctx.mesh["dp"]
    if flavour == Strategy.ZERO1:
        raise ValueError(
            "zero1 (ZeroRedundancyOptimizer) in a model-parallel mix is not supported: it cannot shard "
            "DTensor or pipeline-stage parameters; use ddp, zero2 or zero3/fsdp for the dp dimension"
        )
    if flavour == Strategy.DDP:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for b in blocks(module):
            replicate(b, mesh=mesh, ignored_params=ignored)
        replicate(module, mesh=mesh, ignored_params=ignored)
        return True
    from torch.distributed.fsdp import fully_shard

    reshard = flavour != Strategy.ZERO2
    for b in blocks(module):
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored)
    return True


class ExpertUsage:
    """Which MoE experts ran this step (forward pre-hooks), so an expert no token reached can be skipped
    by the optimizer exactly as in the dense reference (there its grad is None), while every other
    gradient stays a persistent buffer that the memory peak always holds."""

    def __init__(self, modules: list[nn.Module]):
        self.experts: list[tuple[nn.Module, list[nn.Parameter]]] = []
        self.used: set[int] = set()
        for m in modules:
            for name, sub in m.named_modules():
                parent = name.rsplit(".", 2)
                if len(parent) == 3 and parent[1] == "experts":
                    self.experts.append((sub, list(sub.parameters())))
                    sub.register_forward_pre_hook(self._mark)

    def _mark(self, module: nn.Module, args) -> None:
        self.used.add(id(module))

    def flags(self) -> list[float]:
        """1.0 per expert parameter tensor whose expert ran since the last `skip_unused`."""
        return [float(id(sub) in self.used) for sub, params in self.experts for _ in params]

    def skip_unused(self, flags: list[float] | None = None) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Hide the grads of unused experts (grad None) for optimizer.step; returns them for `restore`."""
        flags = self.flags() if flags is None else flags
        params = [q for _, ps in self.experts for q in ps]
        hidden = [(q, q.grad) for q, f in zip(params, flags) if f == 0 and q.grad is not None]
        for q, _ in hidden:
            q.grad = None
        self.used.clear()
        return hidden

    @staticmethod
    def restore(hidden: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        for q, g in hidden:
            q.grad = g.zero_()


@contextmanager
def grad_sync(module: nn.Module, ctx: RankContext, last: bool) -> Iterator[None]:
    """DDP: no_sync on all but the last microbatch; FSDP2 / replicate: see set_grad_sync."""
    if hasattr(module, "no_sync"):
        with (nullcontext() if last else module.no_sync()):
            yield
        return
    set_grad_sync([module], ctx, last)
    yield


def set_grad_sync(modules: list[nn.Module], ctx: RankContext, last: bool) -> None:
    """ddp: sync only on the last microbatch; sharded flavours: every microbatch."""
    sync = last or ctx.spec.parallel.dp_flavour in SYNC_EVERY_MICROBATCH
    for m in modules:
        if hasattr(m, "set_requires_gradient_sync"):
            m.set_requires_gradient_sync(sync)


def reduce_partial_grads(modules: list[nn.Module]) -> list[tuple[nn.Parameter, tuple]]:
    """Turn Partial DTensor grads into Replicate with one explicit all-reduce each, once per step; returns
    (param, placements) of those grads for `repartial_grads`.

    Under SP the replicated LayerNorm params (SequenceParallel) get Partial(sum) grads over tp: each rank
    saw only its sequence shard. Left alone, DTensor would reduce them implicitly inside every optimizer
    op that reads the grad (several times per step). With a dp wrapper FSDP2/replicate already
    redistributes them in post-backward; then this is a no-op.
    """
    from torch.distributed.tensor import DTensor, Replicate

    done = []
    for m in modules:
        for q in m.parameters():
            g = q.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                done.append((q, g.placements))
                q.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
    return done


def repartial_grads(done: list[tuple[nn.Parameter, tuple]]) -> None:
    """After zero_grad: relabel those (zeroed) persistent grads Partial again, so the next step's
    microbatches accumulate Partial + Partial locally (adding into a Replicate grad would all-reduce
    every microbatch) and `reduce_partial_grads` reduces them once. Zeros are a valid Partial sum."""
    from torch.distributed.tensor import DTensor

    for q, placements in done:
        g = q.grad
        if isinstance(g, DTensor):
            q.grad = DTensor.from_local(g.to_local(), g.device_mesh, placements, run_check=False,
                                        shape=g.shape, stride=g.stride())
