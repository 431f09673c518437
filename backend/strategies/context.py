"""What the engine and the parallelisms share: the rank's context, the prepared step, and the per-spec
training choices (optimizer, mixed precision, the one loss reduction)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from backend.bench.comm import uncounted
from backend.spec import ExperimentSpec
from backend.strategies.cp_layout import build_cp_mesh, shard_sequence
from backend.strategies.ep_mesh import build_ep_mesh


@dataclass(frozen=True)
class Placement:
    """Where a rank's tensors live. `compute`: the batch, buffers, activations and the parameters a step computes
    with; `states`: the parameters as the optimizer holds them (FSDP2: the sharded ones), their gradients and the
    optimizer state: the host under FSDP2's CPUOffloadPolicy (offload=params), which refuses sharded parameters
    anywhere else (fully_shard/_fsdp_param_group.py `_validate_cpu_offload_params`) and all-gathers them to
    `compute` itself; `compute` otherwise."""
    compute: torch.device
    states: torch.device

    @classmethod
    def on(cls, device: torch.device) -> Placement:
        return cls(compute=device, states=device)


@dataclass
class RankContext:
    spec: ExperimentSpec
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Any = None
    """DeviceMesh of shape (pp, dp x cp, tp) named ("pp", "dp", "tp") (size-1 dims kept), laid out as
    `ParallelSpec.coords`: its "dp" dim holds every rank with the same parameters (dp x cp); None when world_size ==
    1."""
    _ep_mesh: Any = field(default=None, repr=False)
    _cp_mesh: Any = field(default=None, repr=False)

    def ep_mesh(self):  # -> DeviceMesh
        """`mesh` with dp unflattened into (dp_mod_ep, ep) (strategies/ep_mesh.build_ep_mesh: named dims "pp",
        "dp_mod_ep", "ep", "tp"); created on first use, which is collective (every rank, same order)."""
        if self._ep_mesh is None:
            self._ep_mesh = build_ep_mesh(self.spec, self.mesh)
        return self._ep_mesh

    def cp_mesh(self):  # -> DeviceMesh
        """`mesh` with dp unflattened into (dp_mod_cp, cp) (strategies/cp_layout.build_cp_mesh: named dims "pp",
        "dp_mod_cp", "cp", "tp"); created on first use, which is collective (every rank, same order)."""
        if self._cp_mesh is None:
            self._cp_mesh = build_cp_mesh(self.spec, self.mesh)
        return self._cp_mesh

    def cp_rank(self) -> int:
        return self.coords().get("cp", 0)

    def coords(self) -> dict[str, int]:
        return self.spec.parallel.coords(self.rank)

    def dp_rank(self) -> int:
        return self.coords().get("dp", 0)

    @property
    def placement(self) -> Placement:
        """`device` for everything, except the model states under offload=params (`Placement`)."""
        host = str(self.spec.parallel.offload) == "params"
        return Placement(compute=self.device, states=torch.device("cpu") if host else self.device)


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
    """(inputs, targets): THIS data-parallel rank's rows (B/dp, T), already on ctx.device (`local_batch`);
    runs one optimizer step and returns this rank's share of the loss, which `global_mean_loss(*share)` turns
    into the global mean outside the timed step."""
    fsdp: bool = False
    """True when FSDP2 is used, so the engine tracks memory with FSDPMemTracker."""
    timeline: list[dict] = field(default_factory=list)
    """Pipeline strategies append {rank, stage, microbatch, pass, start_s, end_s} records here."""
    notes: list[str] = field(default_factory=list)
    """Anything the strategy knows makes measurement differ from the textbook (shown with the result)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable data the strategy measured, for engine/assemble.py; travels in the rank payload under
    "extra". engine/loop.py keeps the objects the memory-tracked step left here: replace a per-step record each step
    (ep's "moe_routing"), update a running value in place (fp16's "loss_scaling")."""
    resident: Callable[[], list[torch.Tensor]] = list
    """Tensors the strategy keeps from step to step beside the modules and the optimizer state, made during a step
    (the pipeline stages' receive buffers): a memory-tracked step counts them from its start."""


def dp_slice(batch: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """This data-parallel rank's contiguous rows of the global batch."""
    dp = ctx.spec.parallel.dp
    per = batch.shape[0] // dp
    r = ctx.dp_rank()
    return batch[r * per:(r + 1) * per]


def local_batch(ctx: RankContext, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch -> a copy of this dp rank's rows on ctx.device, and of its cp rank's share of the sequence:
    (B/dp, T/cp) each, on the CPU too (a row slice alone would be a view that keeps the whole global batch's storage
    alive through the step), so the tracked `other` is that share on every device (analytic/memory/rank_memory.py
    OTHER_IS_DP_SLICE)."""
    def mine(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(ctx.spec, ctx.cp_rank(), dp_slice(x, ctx)).to(ctx.device, copy=True)

    return mine(inputs), mine(targets)


def make_optimizer(params, spec: ExperimentSpec) -> torch.optim.Optimizer:
    """The spec's optimizer (AdamW, or SGD with momentum 0.9) at spec.train.lr, over the trainable params:
    the same in every strategy and the reference."""
    return optimizer_class(spec)([p for p in params if p.requires_grad], **optimizer_kwargs(spec))


def optimizer_class(spec: ExperimentSpec) -> type[torch.optim.Optimizer]:
    return torch.optim.AdamW if spec.train.optimizer == "adamw" else torch.optim.SGD


def optimizer_kwargs(spec: ExperimentSpec) -> dict[str, Any]:
    kw: dict[str, Any] = {"lr": spec.train.lr}
    if spec.train.optimizer == "sgd":
        kw["momentum"] = 0.9
    return kw


def compute_dtype(spec: ExperimentSpec) -> torch.dtype | None:
    """The 16-bit compute dtype of bf16/fp16 mixed precision (autocast, FSDP2 MixedPrecisionPolicy; fp8: bf16 around its
    float8 linears); None for fp32."""
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16,
            "fp8": torch.bfloat16}.get(str(spec.train.precision))


def autocast(spec: ExperimentSpec, device: torch.device):
    """torch.autocast for bf16/fp16 mixed precision of non-FSDP strategies; a no-op context for fp32."""
    dtype = compute_dtype(spec)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def global_mean_loss(loss_sum: float | torch.Tensor, count: float = 1.0) -> float:
    """Mean over all ranks that hold a loss: one all-reduce of [loss_sum, count] (16 bytes) over the world,
    kept out of the comm counts (bookkeeping for the report, not training comm). The one loss path of
    every strategy: dp ranks each pass their local mean with count 1; TP replicas each hold the same dp-share
    mean (count 1 each); non-last pipeline stages pass count 0."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(loss_sum / max(count, 1e-30))
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces only CUDA tensors
    buf = torch.tensor([float(loss_sum), float(count)], dtype=torch.float64, device=device)
    with uncounted():
        dist.all_reduce(buf)
    return float(buf[0] / buf[1])
