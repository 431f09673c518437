"""The named layout type of the prediction core: one parallel layout (Python scalars) or many (numpy arrays).

`Layout` holds the degrees and per-layout choices (tp, pp, dp, ep, cp, ZeRO stage, micro-batch, recompute, pipeline
schedule, virtual stages, sequence parallel) and the per-call constants (global batch, precision, optimizer,
device). `estimate` builds one from a spec (`Layout.of`); the planner builds one whose fields are arrays, one
entry per candidate (`Layout.table`), and both call the same memory and time functions. Choices are small ints
named by the ZeroStage / RecomputeMode / PipelineSchedule constants (plain ints compare elementwise and cheaply);
their spec names are in the *_NAMES tuples.
`RankPosition` says which rank of a layout: its pipeline rank and its tp / dp / ep indices (dp: in the dp x cp group).
Context parallelism: dp is the batch split and cp the sequence split; the dp x cp ranks hold the same parameters
(`dp_cp`: the group FSDP / ZeRO shard and gradients are averaged over), each rank sees seq_len / cp tokens
(`seq_local`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, fields, make_dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from backend.analytic.scalar_or_array import Num, logical_and, logical_not, logical_or
from backend.analytic.stack_memory import NO_COMPILE, EngineCompile, StackMemory, engine_compile, stack_memory
from backend.recompute_policy import DEFAULT_SAC_OPS, KINDS, spelled
from backend.recompute_policy import parse as parse_recompute
from backend.spec import dims

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec, ModelSpec


class ZeroStage:
    """The data-parallel flavour: DDP, ZeroRedundancyOptimizer (zero1), FSDP2 without / with resharding."""
    DDP, ZERO1, ZERO2, ZERO3 = range(4)
    ALL = range(4)


class RecomputeMode:
    """backend/recompute_policy.KINDS; LAYERS / BLOCK / UNIFORM take `Layout.recompute_layers` (K or N)."""
    NONE, SELECTIVE, FULL, OP, LAYERS, BLOCK, UNIFORM = range(7)
    ALL = range(7)


class PipelineSchedule:
    ONE_F_ONE_B, GPIPE, INTERLEAVED_1F1B, ZERO_BUBBLE, ZBV, DUALPIPEV = range(6)
    ALL = range(6)


ZERO_STAGE_NAMES = ("ddp", "zero1", "zero2", "zero3")
RECOMPUTE_NAMES = KINDS
SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
DEGREES = dims.degree_names(dims.DIMS)
"""The parallel degrees (dp, tp, pp, ep, cp): one `Layout` field each, from the dimension table."""
WORLD_DEGREES = tuple(d.name for d in dims.world_dims(dims.DIMS))
"""The degrees whose product is the world size."""
CHOICES = (*DEGREES, "zero_stage", "micro_batch", "recompute", "schedule", "virtual_stages", "sequence_parallel",
           "recompute_layers")
"""The per-layout fields, in the planner table's column order."""

LayoutDegrees = make_dataclass("LayoutDegrees", [(d, Num, field(default=1)) for d in DEGREES], frozen=True)
"""A degree field per dimension of backend/spec/dims.py (1 by default); `Layout` adds the per-layout choices."""


@dataclass(frozen=True)
class Layout(LayoutDegrees):
    zero_stage: Num = ZeroStage.DDP
    micro_batch: Num = 1
    recompute: Num = RecomputeMode.NONE
    schedule: Num = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: Num = 1
    sequence_parallel: Num = False
    recompute_layers: Num = 0
    """K of layers:K, N of block:N / uniform:N (0 for the other policies)."""
    microbatches: Num = 1
    """Microbatches per step = global_batch / (micro_batch · dp)."""
    global_batch: int = 1
    precision: str = "fp32"
    optimizer: str = "adamw"
    cp_load_balance: bool = True
    """Head-tail sequence chunks (every cp rank does the same attention work); the planner always balances."""
    device: str = "cpu"
    """Where the ranks run ("cpu" or "cuda"): CUDA rounds storages to 512 B and keeps AdamW's step on the host."""
    sac_ops: tuple[str, ...] = DEFAULT_SAC_OPS
    """The ops `op` recompute saves (recompute_policy.py)."""
    stack: StackMemory | None = None
    """What a non-default stack keeps (memory/stack_states.py, stack_activations.py); None = this engine's own model."""
    compiled: EngineCompile = NO_COMPILE
    """What this engine runs under torch.compile (stack shardlab: stack_memory.engine_compile). Other stacks carry
    theirs in StackMemory (loss_compiled, compiled_blocks)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_memo", {})

    @property
    def loss_compiled(self) -> bool:
        """This engine's cross-entropy runs under torch.compile (stack shardlab's `loss_compiled`, not over
        vocab-parallel logits): its memory is the fused loss's (memory/activations.py FUSED_LOSS_ROW_BYTES)."""
        return self.compiled.loss

    @property
    def blocks_compiled(self) -> bool:
        """This engine's blocks run under torch.compile (stack shardlab's elementwise compiled): a block that
        recomputes nothing keeps what Inductor saves (memory/compiled_block.py, where measured)."""
        return self.compiled.blocks

    def memoised(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """compute(), once per key for this table of layouts; restricting the table (take) restricts the stored
        per-layout values along with it, so a value computed for every layout serves each group of them."""
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = compute()
        return hit

    def _carry_memo(self, out: Layout, rows: np.ndarray | slice, reshape: bool) -> Layout:
        n = len(self)
        for key, value in self._memo.items():
            out._memo[key] = _rows_of(value, rows, n, reshape)
        return out

    @classmethod
    def of(cls, spec: ExperimentSpec) -> Layout:
        """The layout of a validated spec (runtime.device read as given: `auto` counts as cpu)."""
        p, t = spec.parallel, spec.train
        device = str(spec.runtime.device)
        kind, layers = parse_recompute(str(t.recompute))
        return cls(**{d: getattr(p, d) for d in DEGREES}, zero_stage=p.zero_stage, micro_batch=t.micro_batch,
                   recompute=RECOMPUTE_NAMES.index(kind), recompute_layers=layers,
                   schedule=SCHEDULE_NAMES.index(str(p.pp_schedule)),
                   virtual_stages=p.virtual_stages, sequence_parallel=bool(p.sequence_parallel),
                   microbatches=t.microbatches, global_batch=t.global_batch, precision=str(t.precision),
                   optimizer=str(t.optimizer), cp_load_balance=bool(p.cp_load_balance),
                   device="cuda" if device == "cuda" else "cpu", sac_ops=tuple(getattr(t, "sac_ops", DEFAULT_SAC_OPS)),
                   stack=stack_memory(spec, "cuda" if device == "cuda" else "cpu"),
                   compiled=engine_compile(spec, "cuda" if device == "cuda" else "cpu"))

    @classmethod
    def table(cls, columns: np.ndarray, *, global_batch: int, precision: str = "bf16-mixed", optimizer: str = "adamw",
              device: str = "cpu", sac_ops: tuple[str, ...] = DEFAULT_SAC_OPS,
              stack: StackMemory | None = None, compiled: EngineCompile = NO_COMPILE) -> Layout:
        """Many layouts from an (n, len(CHOICES)) int array (the planner's enumeration)."""
        by_column = np.ascontiguousarray(columns.T)  # one contiguous array per field: strided columns are ~4x slower
        return cls.of_columns(dict(zip(CHOICES, by_column, strict=False)), global_batch=global_batch,
                              precision=precision, optimizer=optimizer, device=device, sac_ops=sac_ops, stack=stack,
                              compiled=compiled)

    @classmethod
    def of_columns(cls, columns: dict[str, np.ndarray], *, global_batch: int, precision: str = "bf16-mixed",
                   optimizer: str = "adamw", device: str = "cpu", sac_ops: tuple[str, ...] = DEFAULT_SAC_OPS,
                   stack: StackMemory | None = None, compiled: EngineCompile = NO_COMPILE) -> Layout:
        """Many layouts from one int array per CHOICES field (contiguous: every field is read over all layouts)."""
        cols = {name: columns[name] for name in CHOICES}
        cols["sequence_parallel"] = cols["sequence_parallel"].astype(bool)
        mb = global_batch // np.maximum(cols["micro_batch"] * cols["dp"], 1)
        return cls(**cols, microbatches=mb, global_batch=global_batch, precision=precision, optimizer=optimizer,
                   device=device, sac_ops=tuple(sac_ops), stack=stack, compiled=compiled)

    def take(self, index: int | np.ndarray | slice, *, with_memo: bool = False) -> Layout:
        """The layouts at `index` (arrays: fancy index or mask; an int gives a scalar Layout); with_memo: their
        rows of every memoised per-layout value too."""
        out = {}
        for name in _FIELD_NAMES:
            v = getattr(self, name)
            if isinstance(v, np.ndarray):
                v = v[index]
                if np.ndim(v) == 0:
                    v = bool(v) if name == "sequence_parallel" else int(v)
            out[name] = v
        taken = Layout(**out)
        return self._carry_memo(taken, index, False) if with_memo and isinstance(index, np.ndarray) else taken

    def group(self, rows: np.ndarray) -> Layout:
        """take(rows, with_memo=True).broadcast() in one pass: the layouts at `rows` as (k, 1) columns that
        broadcast against a trailing rank axis, a field equal on all of them as that scalar."""
        out = {}
        for name in _FIELD_NAMES:
            v = getattr(self, name)
            if isinstance(v, np.ndarray):
                v = v[rows]
                v = v[0].item() if (v == v[0]).all() else v[:, None]
            out[name] = v
        return self._carry_memo(Layout(**out), rows, True)

    def broadcast(self) -> Layout:
        """Every array field as an (n, 1) column, so that it broadcasts against a trailing rank axis; a field that
        is the same for every layout becomes that scalar (its choices then branch once, not per layout)."""
        out = {}
        for name in _FIELD_NAMES:
            v = getattr(self, name)
            if isinstance(v, np.ndarray) and len(v):
                flat = v.reshape(len(v), -1)[:, 0]
                if (flat == flat[0]).all():
                    v = flat[0].item()
                else:
                    v = flat[:, None]
            out[name] = v
        return self._carry_memo(Layout(**out), slice(None), True)

    def __len__(self) -> int:
        for f in CHOICES:
            v = getattr(self, f)
            if isinstance(v, np.ndarray):
                return len(v)
        return 1

    # ---- derived facts, elementwise (a scalar when every layout agrees) ----
    @cached_property
    def world_size(self) -> Num:
        return _settled(math.prod(getattr(self, d) for d in WORLD_DEGREES))

    @cached_property
    def dp_cp(self) -> Num:
        """Ranks holding the same parameters (dp x cp): FSDP / ZeRO shard over them, gradients are averaged over
        them."""
        return _settled(self.dp * self.cp)

    def seq_local(self, model: ModelSpec) -> Num:
        """Tokens of each sequence on one rank: seq_len / cp (spec.checks makes it exact)."""
        return model.seq_len // self.cp

    @cached_property
    def n_stages(self) -> Num:
        return _settled(self.pp * self.virtual_stages)

    @cached_property
    def pipelined(self) -> Num:
        return _settled(self.pp > 1)

    @cached_property
    def fsdp(self) -> Num:
        """FSDP2 (zero2 / zero3) shards parameters, gradients and optimizer state."""
        return _settled(self.zero_stage >= ZeroStage.ZERO2)

    @cached_property
    def zbv(self) -> Num:
        """The V placement of ZBV and DualPipeV (rank r holds stages r and 2p-1-r); without pipelining the schedule is
        ignored."""
        return _settled(logical_and(logical_or(self.schedule == PipelineSchedule.ZBV,
                                               self.schedule == PipelineSchedule.DUALPIPEV), self.pp > 1))

    @cached_property
    def ep_overlap(self) -> Num:
        """Megatron's combined 1F1B EP overlap runs on this layout: the stack sets ep_overlap and the layout is one
        Megatron-Core runs it on (transformer_config.py @d98e8a64 3002-3046: ep > 1, virtual stages under pp, no
        recompute or selective). spec/stack_rules.py refuses a validated spec that sets it elsewhere; the planner's
        unvalidated layouts meet the rule here. Read by the step time (steptime/ep_overlap.py) and the memory
        (memory/stack_activations.py)."""
        on = self.stack is not None and self.stack.ep_overlap
        return _settled(logical_and(on, self.ep > 1, logical_or(self.pp == 1, self.virtual_stages > 1),
                                    logical_or(self.recompute == RecomputeMode.NONE,
                                               self.recompute == RecomputeMode.SELECTIVE)))

    @cached_property
    def is_mix(self) -> Num:
        """tp/pp/ep > 1: the dp dimension is wrapped by data_parallel.composable_wrap (FSDP2 `replicate` for ddp,
        `fully_shard` without a MixedPrecisionPolicy for zero2/zero3)."""
        return _settled(logical_or(self.tp > 1, self.pp > 1, self.ep > 1))

    @cached_property
    def uses_replicate(self) -> Num:
        """ddp on the dp dimension of a tp/pp mix is FSDP2 `replicate`; ep alone uses classic DDP."""
        return _settled(logical_and(self.dp_cp > 1, self.zero_stage == ZeroStage.DDP,
                                    logical_or(self.tp > 1, self.pp > 1)))

    @cached_property
    def distributed_optimizer(self) -> Num:
        """zero1 on the dp dimension of a tp / pp / ep mix: Megatron's distributed optimizer (distributed_optimizer.py;
        the experts in buckets of their own over edp)."""
        return _settled(logical_and(self.zero_stage == ZeroStage.ZERO1, logical_or(self.tp > 1, self.pp > 1,
                                                                                   self.ep > 1)))

    @cached_property
    def half_params(self) -> Num:
        """Parameters stored in the 16-bit compute dtype (the distributed optimizer under mixed precision: its
        module runs in that dtype without autocast, fp32 masters in the optimizer)."""
        return False if self.precision == "fp32" else self.distributed_optimizer

    @property
    def compute_bytes(self) -> int:
        """Bytes of activations / unsharded FSDP params / TP and PP payloads: 2 under bf16/fp16 mixed, else 4."""
        return 4 if self.precision == "fp32" else 2

    @cached_property
    def uses_autocast(self) -> Num:
        """16-bit precision through torch.autocast: ddp / zero1 and every tp/pp/ep mix; the pure FSDP strategies
        cast through MixedPrecisionPolicy instead (the saved weight is the unsharded parameter itself) and the
        distributed optimizer's module holds 16-bit parameters (`half_params`)."""
        if self.precision == "fp32":
            return False
        return _settled(logical_not(logical_or(logical_and(self.fsdp, logical_not(self.is_mix)), self.half_params)))

    @cached_property
    def fsdp_param_bytes(self) -> Num:
        """Bytes per unsharded FSDP2 element: MixedPrecisionPolicy.param_dtype in the pure fsdp/zero2 strategies,
        fp32 in the mixes (no policy)."""
        mix = self.is_mix
        return (np.where(mix, 4, self.compute_bytes) if isinstance(mix, np.ndarray)
                else (4 if mix else self.compute_bytes))

    @property
    def te_ring(self) -> bool:
        """Transformer Engine's context-parallel attention runs the ring (stack megatron), not torch's."""
        return self.stack is not None and self.stack.te_ring

    def _cp_rotate(self, cp: int) -> dict[str, str]:
        """Transformer Engine's ring is planned as Megatron's default --cp-comm-type p2p (cp_rotate alltoall);
        torch's keeps the spec's default (allgather)."""
        return {"cp_rotate": "alltoall"} if cp > 1 and self.te_ring else {}

    def spec_dict(self, model: ModelSpec) -> dict[str, Any]:
        """The full experiment spec (as a dict) of a scalar layout, its ranks on the layout's device (the one its
        memory was priced on)."""
        degrees = {d: int(getattr(self, d)) for d in DEGREES}
        tp, pp, dp, zero = degrees["tp"], degrees["pp"], degrees["dp"], int(self.zero_stage)
        extra = "".join(f"·{d}{n}" for d, n in degrees.items() if d not in ("dp", "tp", "pp") and n > 1)
        return {"name": f"plan dp{dp}·tp{tp}·pp{pp}{extra} {ZERO_STAGE_NAMES[zero]}",
                "model": model.model_dump(),
                "train": {"global_batch": self.global_batch, "micro_batch": int(self.micro_batch),
                          "precision": self.precision, "optimizer": self.optimizer,
                          "recompute": spelled(RECOMPUTE_NAMES[int(self.recompute)], int(self.recompute_layers))},
                "parallel": {"strategy": ZERO_STAGE_NAMES[zero],
                             "world_size": math.prod(degrees[d] for d in WORLD_DEGREES), **degrees,
                             "sequence_parallel": bool(self.sequence_parallel),
                             "pp_schedule": SCHEDULE_NAMES[int(self.schedule)],
                             "virtual_stages": int(self.virtual_stages), **self._cp_rotate(degrees["cp"])},
                "runtime": {"device": self.device}}


_FIELD_NAMES = tuple(f.name for f in fields(Layout))


def _settled(value: Num) -> Num:
    """A derived fact the same for every layout as that scalar (its choices then branch once, not per layout)."""
    if isinstance(value, np.ndarray) and value.size and (value == value.flat[0]).all():
        return value.flat[0].item()
    return value


def _rows_of(value: Any, rows: np.ndarray | slice, n: int, column: bool) -> Any:
    """A memoised per-layout value (an array whose first axis runs over the layouts) restricted to `rows`
    (column=True: with a unit axis after the rows, so that it broadcasts against a trailing rank axis)."""
    if isinstance(value, np.ndarray) and value.ndim and value.shape[0] == n:
        value = value[rows]
        return value.reshape((len(value), 1) + value.shape[1:]) if column else value
    return value


@dataclass(frozen=True)
class RankPosition:
    """Which rank of a layout: pipeline rank and tp / dp / ep indices (scalars, or arrays that broadcast
    against the layout's (n, 1) columns, e.g. every pipeline rank as a (1, pp) row)."""
    pp_rank: Num = 0
    tp_index: Num = 0
    dp_index: Num = 0
    """Index in the dp x cp group (`ParallelSpec.data_parallel_index`): the FSDP shard and ZeRO-1 share."""
    ep_index: Num = 0
    largest_zero1_share: bool = False
    """ZeRO-1: the optimizer share of the dp index that owns the most (the worst rank), not dp_index's own."""

    def take(self, rows: np.ndarray) -> RankPosition:
        """The positions at `rows` of a table whose rows they run along (an array whose first axis has length 1,
        or a scalar, is shared by every row)."""
        pick = lambda v: v[rows] if isinstance(v, np.ndarray) and v.ndim and v.shape[0] > 1 else v  # noqa: E731
        return replace(self, pp_rank=pick(self.pp_rank), tp_index=pick(self.tp_index), dp_index=pick(self.dp_index),
                       ep_index=pick(self.ep_index))

    @classmethod
    def of_rank(cls, spec: ExperimentSpec, rank: int) -> RankPosition:
        c = spec.parallel.coords(rank)
        return cls(pp_rank=c["pp"], tp_index=c["tp"], dp_index=spec.parallel.data_parallel_index(rank),
                   ep_index=c["ep"])
