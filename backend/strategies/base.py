"""What every strategy module provides: `prepare(ctx, model) -> Prepared`.

A strategy file (`backend/strategies/<name>.py`) wraps the seeded full model for this rank with torch's
own parallel API and returns a `train_step` that runs one optimizer step on this rank's share of the
global batch. The engine owns everything else (data, timing, memory and comm measurement, results).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from backend.spec import ExperimentSpec, Strategy


@dataclass
class RankContext:
    spec: ExperimentSpec
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Any = None
    """DeviceMesh of shape (pp, dp, tp) named ("pp", "dp", "tp") (size-1 dims kept), laid out as
    `ParallelSpec.coords`; None when world_size == 1."""

    def coords(self) -> dict[str, int]:
        return self.spec.parallel.coords(self.rank)

    def dp_rank(self) -> int:
        return self.coords().get("dp", 0)


class LocalLoss(NamedTuple):
    """One rank's part of the step's loss: the global mean is sum(loss_sum) / sum(count) over the world."""
    loss_sum: float | torch.Tensor
    count: float = 1.0


@dataclass
class Prepared:
    modules: list[nn.Module]
    """The model part(s) that live on this rank (tracked for memory, counted for parameters)."""
    optimizer: torch.optim.Optimizer
    train_step: Callable[[torch.Tensor, torch.Tensor], LocalLoss]
    """(inputs, targets), both the FULL global batch (B, T); runs one optimizer step and returns this rank's
    share of the loss, which `global_mean_loss(*share)` turns into the global mean outside the timed step."""
    fsdp: bool = False
    """True when FSDP2 is used, so the engine tracks memory with FSDPMemTracker."""
    timeline: list[dict] = field(default_factory=list)
    """Pipeline strategies append {rank, stage, microbatch, pass, start_s, end_s} records here."""
    notes: list[str] = field(default_factory=list)
    """Anything the strategy knows makes measurement differ from the textbook (shown with the result)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable data the strategy measured, for engine/assemble.py (e.g. ep's "moe_routing" of the
    memory-tracked step); travels in the rank payload under "extra"."""


def module_name_for(spec: ExperimentSpec) -> str:
    """Which strategy file runs this spec: the outermost model-parallel dimension owns the mix."""
    p = spec.parallel
    if p.pp > 1:
        return "pp"
    if p.tp > 1:
        return "tp"
    if p.ep > 1:
        return "ep"
    flavour = p.dp_flavour
    return "fsdp" if flavour in (Strategy.ZERO3, Strategy.FSDP) else str(flavour)


def prepare(ctx: RankContext, model: nn.Module) -> Prepared:
    mod = importlib.import_module(f"backend.strategies.{module_name_for(ctx.spec)}")
    return mod.prepare(ctx, model)


def dp_slice(batch: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """This data-parallel rank's contiguous rows of the global batch."""
    dp = ctx.spec.parallel.dp
    per = batch.shape[0] // dp
    r = ctx.dp_rank()
    return batch[r * per:(r + 1) * per]


def make_optimizer(params, spec: ExperimentSpec) -> torch.optim.Optimizer:
    """The spec's optimizer (AdamW, or SGD with momentum 0.9) at spec.train.lr: same in every strategy and the reference."""
    return optimizer_class(spec)(params, **optimizer_kwargs(spec))


def optimizer_class(spec: ExperimentSpec) -> type[torch.optim.Optimizer]:
    return torch.optim.AdamW if spec.train.optimizer == "adamw" else torch.optim.SGD


def optimizer_kwargs(spec: ExperimentSpec) -> dict[str, Any]:
    kw: dict[str, Any] = {"lr": spec.train.lr}
    if spec.train.optimizer == "sgd":
        kw["momentum"] = 0.9
    return kw


def compute_dtype(spec: ExperimentSpec) -> torch.dtype | None:
    """The 16-bit compute dtype of bf16/fp16 mixed precision (autocast, FSDP2 MixedPrecisionPolicy); None for fp32."""
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(str(spec.train.precision))


def autocast(spec: ExperimentSpec, device: torch.device):
    """torch.autocast for bf16/fp16 mixed precision of non-FSDP strategies; a no-op context for fp32."""
    import contextlib

    dtype = compute_dtype(spec)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def global_mean_loss(loss_sum: float | torch.Tensor, count: float = 1.0) -> float:
    """Mean over all ranks that hold a loss: one all-reduce of [loss_sum, count] (16 bytes) over the world,
    kept out of the comm counts (bookkeeping for the report, not training comm). The one loss path of
    every strategy: dp ranks each pass their local mean with count 1; TP replicas each hold the same dp-share
    mean (count 1 each); non-last pipeline stages pass count 0."""
    import torch.distributed as dist

    from backend.bench.comm import uncounted

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(loss_sum / max(count, 1e-30))
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces only CUDA tensors
    buf = torch.tensor([float(loss_sum), float(count)], dtype=torch.float64, device=device)
    with uncounted():
        dist.all_reduce(buf)
    return float(buf[0] / buf[1])
