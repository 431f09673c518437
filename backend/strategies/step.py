"""The one training step of every non-pipeline layout and of the single-process reference.

`MicrobatchStep` runs this rank's rows as `microbatches` chunks of `micro_batch` rows: forward under autocast
(unless FSDP2's MixedPrecisionPolicy casts), loss scaled by 1/chunks (and by the fp16 loss scale, strategies/scaler.py;
the reported loss is the unscaled one), backward with the dp wrapper's gradient
sync only where the flavour reduces, then `OptimizerTail`. Pipeline schedules run their own microbatches
(pp.py) and share the tail.

Gradients are persistent buffers (`zero_grad(set_to_none=False)`, as DDP's bucket views are): they stay
resident through the whole step, so the memory peak always holds one gradient per local parameter. MoE
experts that no token reached in a step have their grad hidden during optimizer.step (`ExpertUsage`), as
the dense reference (grad None) skips them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from backend.models.gpt import loss_fn
from backend.spec import ExperimentSpec, Strategy
from backend.strategies.context import LocalLoss, autocast
from backend.strategies.moe_stats import set_aux_loss_scale
from backend.strategies.scaler import LossScaling
from backend.strategies.tp import loss_context

SYNC_EVERY_MICROBATCH = (Strategy.ZERO2, Strategy.ZERO3, Strategy.FSDP)
"""Sharded-gradient flavours reduce-scatter after every microbatch (grads stay sharded, as ZeRO-2/3
intend); ddp all-reduces once per step, on the last microbatch (DDP `no_sync` semantics)."""


def split_microbatches(x: torch.Tensor, spec: ExperimentSpec, chunks: int | None = None) -> list[torch.Tensor]:
    """Rows -> `chunks` (default: `microbatches`) chunks of `micro_batch` rows each."""
    t = spec.train
    n, mb = chunks or t.microbatches or 1, t.micro_batch
    if x.shape[0] != n * mb:
        raise ValueError(f"batch share has {x.shape[0]} rows != chunks {n} * micro_batch {mb} = {n * mb}")
    return list(x.split(mb))


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
                if hasattr(sub, "mark_used"):  # gpt.MoE: its dispatch names the experts real rows reached
                    sub.usage = self

    def mark(self, expert: nn.Module) -> None:
        """An expert received real rows (not the 0 rows of an unused expert under a dp wrapper, nor padding)."""
        self.used.add(id(expert))

    def flags(self) -> list[float]:
        """1.0 per expert parameter tensor whose expert ran since the last `skip_unused`."""
        return [float(id(sub) in self.used) for sub, params in self.experts for _ in params]

    def skip_unused(self, flags: list[float] | None = None) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Hide the grads of unused experts (grad None) for optimizer.step; returns them for `restore`."""
        flags = self.flags() if flags is None else flags
        params = [q for _, ps in self.experts for q in ps]
        hidden = [(q, q.grad) for q, f in zip(params, flags, strict=False) if f == 0 and q.grad is not None]
        for q, _ in hidden:
            q.grad = None
        self.used.clear()
        return hidden

    @staticmethod
    def restore(hidden: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        for q, g in hidden:
            q.grad = g.zero_()


@contextmanager
def grad_sync(module: nn.Module, spec: ExperimentSpec, last: bool) -> Iterator[None]:
    """Classic DDP: no_sync on all but the last microbatch; FSDP2 / replicate: see set_grad_sync."""
    if hasattr(module, "no_sync"):
        with (nullcontext() if last else module.no_sync()):
            yield
        return
    set_grad_sync([module], spec, last)
    yield


def set_grad_sync(modules: list[nn.Module], spec: ExperimentSpec, last: bool) -> None:
    """ddp: sync only on the last microbatch; sharded flavours: every microbatch."""
    sync = last or spec.parallel.dp_flavour in SYNC_EVERY_MICROBATCH
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
    for q, placements in done:
        g = q.grad
        if isinstance(g, DTensor):
            q.grad = DTensor.from_local(g.to_local(), g.device_mesh, placements, run_check=False,
                                        shape=g.shape, stride=g.stride())


class OptimizerTail:
    """After the last backward: reduce Partial grads once, skip unused experts, step through the loss scaling (fp16:
    unscale, skip the step on every rank when any rank's grads overflowed), zero the persistent grads."""

    def __init__(self, modules: list[nn.Module], optimizer: torch.optim.Optimizer, usage: ExpertUsage,
                 expert_sync: Callable[[list[float]], list[float]] | None = None, *, scaling: LossScaling,
                 after_backward: Callable[[], None] | None = None):
        self.modules, self.optimizer, self.usage, self.expert_sync = modules, optimizer, usage, expert_sync
        self.scaling, self.after_backward = scaling, after_backward

    def __call__(self) -> None:
        if self.after_backward is not None:
            self.after_backward()
        used = self.expert_sync(self.usage.flags()) if self.expert_sync else None
        partial = reduce_partial_grads(self.modules)
        hidden = self.usage.skip_unused(used)
        self.scaling.step(self.optimizer)  # = optimizer.step() unless fp16-mixed
        self.optimizer.zero_grad(set_to_none=False)  # persistent grad buffers: grads resident all step
        self.usage.restore(hidden)
        repartial_grads(partial)


@dataclass(frozen=True)
class LoopStyle:
    """Tensor lifetimes inside the microbatch loop that differ by layout. The measured memory categories at the
    activation peak depend on them (the held logits, and which 4-byte loss scalars exist decide which moment a
    tie in activation bytes resolves to), and the analytic predictions are calibrated against exactly these,
    so the one loop keeps them per layout instead of changing what is measured.

    pure ddp / zero1 / reference: LoopStyle(hold_logits=True, loss_scaled_in_graph=True)
    pure zero2 / zero3 / fsdp:   LoopStyle(hold_logits=False, loss_scaled_in_graph=True)
    tp mixes:                    LoopStyle(hold_logits=False, loss_scaled_in_graph=False)
    ep mixes:                    LoopStyle(hold_logits=True, loss_scaled_in_graph=False)
    Without held logits the loss is computed inside the autocast region (it runs on fp32 logits either way)."""

    hold_logits: bool = True
    """Keep the (mb, T, V) logits bound until the next microbatch's forward."""
    loss_scaled_in_graph: bool = True
    """backward() from loss / chunks and sum those (else backward of loss / chunks, sum the unscaled losses)."""


DEFAULT_LOOP_STYLE = LoopStyle()
"""The loop of pure ddp / zero1 / reference runs when a caller gives no style (one frozen instance, as the former
`LoopStyle()` default was)."""


class MicrobatchStep:
    """One optimizer step over this rank's rows (x, y), both (rows, T) on the model's device."""

    def __init__(self, model: nn.Module, spec: ExperimentSpec, device: torch.device, tail: OptimizerTail, *,
                 use_autocast: bool, style: LoopStyle = DEFAULT_LOOP_STYLE, chunks: int | None = None,
                 on_microbatch: Callable[[int], None] | None = None,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn):
        self.model, self.spec, self.device, self.tail, self.loss = model, spec, device, tail, loss
        self.use_autocast, self.style, self.chunks, self.on_microbatch = use_autocast, style, chunks, on_microbatch

    def _autocast(self):
        return autocast(self.spec, self.device) if self.use_autocast else nullcontext()

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> LocalLoss:
        st = self.style
        xs = split_microbatches(inputs, self.spec, self.chunks)
        ys = split_microbatches(targets, self.spec, self.chunks)
        n = len(xs)
        if self.spec.model.moe_aux_loss_coeff:  # the load-balancing loss's gradient at the main loss's scale
            set_aux_loss_scale([self.model], self.tail.scaling.scale_value() / n)
        total = torch.zeros((), device=self.device)  # summed on the device: one host sync per step
        logits = loss = None  # loop-scoped on purpose: see LoopStyle
        for i, (x, y) in enumerate(zip(xs, ys, strict=False)):
            if self.on_microbatch:
                self.on_microbatch(i)
            with grad_sync(self.model, self.spec, last=i == n - 1), loss_context(self.spec):
                # Each branch is one expression on purpose: the previous microbatch's `loss` stays bound
                # until the new one is assigned, exactly as the calibrated loops had it.
                if st.hold_logits:
                    with self._autocast():
                        logits = self.model(x)  # (mb, T, V)
                    loss = self.loss(logits, y) / n if st.loss_scaled_in_graph else self.loss(logits, y)
                else:
                    with self._autocast():
                        loss = (self.loss(self.model(x), y) / n if st.loss_scaled_in_graph
                                else self.loss(self.model(x), y))
                scale = self.tail.scaling.scale  # fp16-mixed: x loss scale; else the identity
                if st.loss_scaled_in_graph:
                    scale(loss).backward()
                else:
                    scale(loss / n).backward()
            total += loss.detach() if st.loss_scaled_in_graph else loss.detach().float()
        if st.loss_scaled_in_graph:
            del logits, loss  # the dp layouts returned from their accumulation before optimizer.step
        self.tail()
        return LocalLoss(total if st.loss_scaled_in_graph else total / n)
