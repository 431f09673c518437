"""The one typed experiment spec that flows UI -> DB -> launcher -> ranks -> results -> plots.

Every rejection names the offending values and shows the arithmetic, in the style of torchtitan's
`ParallelDims`: "dp(2) * tp(3) * pp(1) = 6 != world_size(4)".
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_DIM = 1_000_000
MAX_LAYERS = 10_000
MAX_VOCAB = 10_000_000
MAX_SEQ = 10_000_000
MAX_WORLD = 1_000_000
MAX_BATCH = 100_000_000
MAX_STEPS = 1_000_000


class Strategy(StrEnum):
    """Headline strategy. ddp..fsdp name the data-parallel flavour; tp/pp/ep are the pure model-parallel ones."""

    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP = "fsdp"
    TP = "tp"
    PP = "pp"
    EP = "ep"


class Schedule(StrEnum):
    """Pipeline schedules, each backed by a `torch.distributed.pipelining` schedule class."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"  # ScheduleInterleavedZeroBubble
    ZBV = "zbv"  # ScheduleZBVZeroBubble (V-shaped, 2 stages per rank)


class Precision(StrEnum):
    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"


class Optimizer(StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Backend(StrEnum):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


class Device(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


DP_FLAVOURS = (Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3, Strategy.FSDP)
ZERO_STAGE = {Strategy.DDP: 0, Strategy.ZERO1: 1, Strategy.ZERO2: 2, Strategy.ZERO3: 3, Strategy.FSDP: 3}
MULTI_STAGE_SCHEDULES = (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE, Schedule.ZBV)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=False)


class ModelSpec(_Section):
    vocab_size: int = Field(256, ge=2, le=MAX_VOCAB)
    """Vocabulary size V (token embedding rows and LM-head outputs)."""
    d_model: int = Field(128, ge=1, le=MAX_DIM)
    """Hidden size h."""
    n_layers: int = Field(2, ge=1, le=MAX_LAYERS)
    """Number of transformer blocks L."""
    n_heads: int = Field(4, ge=1, le=MAX_DIM)
    """Attention (query) heads a."""
    n_kv_heads: int | None = Field(None, ge=1, le=MAX_DIM)
    """Key/value heads for GQA; None means n_heads (plain multi-head attention)."""
    ffn_hidden: int | None = Field(None, ge=1, le=16 * MAX_DIM)
    """MLP hidden size; None means 4 * d_model."""
    seq_len: int = Field(64, ge=1, le=MAX_SEQ)
    """Sequence length s (also the number of learned positions)."""
    n_experts: int = Field(0, ge=0, le=100_000)
    """MoE experts per layer; 0 means a dense MLP."""
    top_k: int = Field(2, ge=1, le=100_000)
    """Experts each token is routed to (MoE only)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


class TrainSpec(_Section):
    global_batch: int = Field(8, ge=1, le=MAX_BATCH)
    """Sequences per optimizer step, summed over data-parallel ranks."""
    micro_batch: int = Field(2, ge=1, le=MAX_BATCH)
    """Sequences per microbatch on one data-parallel rank."""
    microbatches: int | None = Field(None, ge=1, le=MAX_BATCH)
    """Microbatches per step per data-parallel rank; None derives global_batch / (micro_batch * dp)."""
    steps: int = Field(5, ge=1, le=MAX_STEPS)
    """Timed training steps (after warm-up)."""
    warmup_steps: int = Field(1, ge=0, le=MAX_STEPS)
    """Untimed steps before timing starts."""
    precision: Precision = Precision.FP32
    """fp32, or bf16/fp16 mixed precision (fp32 master weights: ZeRO's K=12)."""
    optimizer: Optimizer = Optimizer.ADAMW
    """AdamW (2 states) or SGD with momentum (1 state)."""
    lr: float = Field(1e-3, gt=0, le=10)
    """Learning rate."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation: none, selective (attention core) or full (whole block)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed for weights and synthetic data: every strategy starts from identical weights."""


class ParallelSpec(_Section):
    strategy: Strategy = Strategy.DDP
    """Headline strategy; mixes combine a data-parallel flavour (ddp..fsdp) with tp/pp/ep degrees."""
    world_size: int | None = Field(None, ge=1, le=MAX_WORLD)
    """Total ranks; None means dp * tp * pp."""
    dp: int | None = Field(None, ge=1, le=MAX_WORLD)
    """Data-parallel degree; None derives world_size / (tp * pp)."""
    tp: int = Field(1, ge=1, le=MAX_WORLD)
    """Tensor-parallel degree."""
    pp: int = Field(1, ge=1, le=MAX_WORLD)
    """Pipeline-parallel degree (stages = pp * virtual_stages)."""
    ep: int = Field(1, ge=1, le=MAX_WORLD)
    """Expert-parallel degree; experts are split over ep ranks carved out of the dp dimension."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence (needs tp > 1)."""
    pp_schedule: Schedule = Schedule.ONE_F_ONE_B
    """Pipeline schedule (used when pp > 1)."""
    virtual_stages: int = Field(1, ge=1, le=1024)
    """Model chunks per pipeline rank (interleaved schedules need >= 2)."""

    @property
    def zero_stage(self) -> int:
        return ZERO_STAGE.get(self.strategy, 0)

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank. The mesh is (pp, dp, tp), row-major, tp fastest-varying;
        expert-parallel groups are consecutive blocks of ep ranks along dp."""
        tp, dp = self.tp, self.dp or 1
        c = {"pp": rank // (dp * tp), "dp": (rank // tp) % dp, "tp": rank % tp}
        c["ep"] = c["dp"] % self.ep
        return c

    @property
    def dp_flavour(self) -> Strategy:
        """The data-parallel wrapper used for the dp dimension (plain DDP for the pure tp/pp/ep strategies)."""
        return self.strategy if self.strategy in DP_FLAVOURS else Strategy.DDP


class RuntimeSpec(_Section):
    backend: Backend = Backend.AUTO
    """Process-group backend: auto picks nccl when CUDA is present, else gloo."""
    device: Device = Device.AUTO
    """Device: auto picks cuda (one rank per GPU) when present, else cpu."""
    nnodes: int = Field(1, ge=1, le=100_000)
    """Machines in the job (torchrun --nnodes)."""
    node_rank: int = Field(0, ge=0, le=100_000)
    """This machine's index (torchrun --node-rank)."""
    rdzv_endpoint: str | None = Field(None, max_length=255)
    """host:port of the c10d rendezvous for multi-node jobs; None runs standalone."""
    timeout_s: float = Field(600.0, gt=0, le=7 * 24 * 3600)
    """Wall-clock limit for the whole job; also bounds hung collectives."""


class SpecError(ValueError):
    """A spec that cannot run, with every problem listed."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class ExperimentSpec(_Section):
    name: str = Field("", max_length=200)
    """Free-text label shown in the history."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """Transformer shape."""
    train: TrainSpec = Field(default_factory=TrainSpec)
    """Batch, steps, precision, optimizer, recompute, seed."""
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    """Strategy and degrees."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """Backend, device, nodes and timeout."""

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentSpec:
        problems = _derive_and_check(self)
        if problems:
            raise SpecError(problems)
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.model.seq_len

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> ExperimentSpec:
        return cls.model_validate_json(text)


def _derive_and_check(s: ExperimentSpec) -> list[str]:
    m, t, p, r = s.model, s.train, s.parallel, s.runtime
    problems: list[str] = []
    problems += _check_model(m)
    problems += _derive_degrees(p)
    if problems:
        return problems
    problems += _check_degrees(m, p)
    problems += _derive_batch(t, p)
    problems += _check_pipeline(m, t, p)
    if r.node_rank >= r.nnodes:
        problems.append(f"node_rank={r.node_rank} must be < nnodes={r.nnodes}")
    if r.nnodes > 1 and not r.rdzv_endpoint:
        problems.append(f"nnodes={r.nnodes} needs rdzv_endpoint host:port for the c10d rendezvous")
    if r.nnodes > 1 and p.world_size % r.nnodes:
        problems.append(f"world_size={p.world_size} is not divisible by nnodes={r.nnodes}")
    return problems


def _check_model(m: ModelSpec) -> list[str]:
    out = []
    if m.d_model % m.n_heads:
        out.append(f"n_heads={m.n_heads} does not divide d_model={m.d_model} ({m.d_model} % {m.n_heads} = {m.d_model % m.n_heads})")
    if m.kv_heads > m.n_heads or m.n_heads % m.kv_heads:
        out.append(f"n_kv_heads={m.kv_heads} must divide n_heads={m.n_heads} (GQA groups query heads evenly)")
    if m.is_moe and m.top_k > m.n_experts:
        out.append(f"top_k={m.top_k} exceeds n_experts={m.n_experts}")
    return out


def _derive_degrees(p: ParallelSpec) -> list[str]:
    st = p.strategy
    pure = {Strategy.TP: "tp", Strategy.PP: "pp", Strategy.EP: "ep"}
    if st in pure and getattr(p, pure[st]) == 1 and p.world_size:
        # `--strategy tp --world 4` means tp = 4: the pure strategy's degree is the whole world.
        setattr(p, pure[st], p.world_size)
    if p.dp is None:
        if p.world_size is None:
            p.dp = p.ep if st == Strategy.EP else 1
        elif p.world_size % (p.tp * p.pp):
            return [f"world_size({p.world_size}) is not divisible by tp({p.tp}) * pp({p.pp}) = {p.tp * p.pp}"]
        else:
            p.dp = p.world_size // (p.tp * p.pp)
    if p.world_size is None:
        p.world_size = p.dp * p.tp * p.pp
    if p.dp * p.tp * p.pp != p.world_size:
        return [f"dp({p.dp}) * tp({p.tp}) * pp({p.pp}) = {p.dp * p.tp * p.pp} != world_size({p.world_size})"]
    return []


def _check_degrees(m: ModelSpec, p: ParallelSpec) -> list[str]:
    out = []
    for name in ("tp", "pp", "ep"):
        if p.strategy == name and getattr(p, name) < 2:
            out.append(f"strategy {name} needs {name} >= 2 (got {name}={getattr(p, name)}, world_size={p.world_size})")
    if p.tp > 1:
        if m.n_heads % p.tp:
            out.append(f"tp={p.tp} does not divide n_heads={m.n_heads}")
        if m.kv_heads % p.tp:
            out.append(f"tp={p.tp} does not divide n_kv_heads={m.kv_heads}")
        if m.ffn % p.tp:
            out.append(f"tp={p.tp} does not divide ffn_hidden={m.ffn}")
    mp = {k: v for k, v in (("tp", p.tp), ("pp", p.pp), ("ep", p.ep)) if v > 1}
    if p.strategy == Strategy.ZERO1 and mp:
        degrees = ", ".join(f"{k}={v}" for k, v in mp.items())
        out.append(f"zero1 (ZeroRedundancyOptimizer) cannot shard DTensor, pipeline-stage or expert parameters ({degrees}): "
                   "use ddp, zero2 or zero3/fsdp for the dp dimension of a model-parallel mix")
    split_backward = p.pp_schedule in (Schedule.ZERO_BUBBLE, Schedule.ZBV)
    if p.pp > 1 and split_backward and p.dp > 1 and p.dp_flavour in (Strategy.ZERO2, Strategy.ZERO3, Strategy.FSDP):
        # Measured on torch 2.13: the split input/weight backward leaves the last stage's FSDP2 grads unset.
        out.append(f"{p.pp_schedule} with {p.strategy} on dp={p.dp} is not supported: torch's split backward drops "
                   "FSDP2 gradients of the last stage; use ddp for the dp dimension or a 1f1b/interleaved schedule")
    if p.ep > 1 and (p.tp > 1 or p.pp > 1):
        out.append(f"ep={p.ep} with tp={p.tp}, pp={p.pp} is not supported: expert parallelism runs over the dp dimension only (tp=1, pp=1)")
    if p.sequence_parallel and p.tp < 2:
        out.append(f"sequence_parallel needs tp >= 2 (got tp={p.tp})")
    if p.ep > 1:
        if not m.is_moe:
            out.append(f"ep={p.ep} needs a MoE model (n_experts > 0, got n_experts=0)")
        elif m.n_experts % p.ep:
            out.append(f"ep={p.ep} does not divide n_experts={m.n_experts} ({m.n_experts} % {p.ep} = {m.n_experts % p.ep})")
        if p.dp % p.ep:
            out.append(f"ep={p.ep} does not divide dp={p.dp} (expert-parallel ranks are carved out of the data-parallel ranks)")
    return out


def _derive_batch(t: TrainSpec, p: ParallelSpec) -> list[str]:
    per_step = t.micro_batch * p.dp
    if t.global_batch % per_step:
        return [f"global batch {t.global_batch} is not divisible by micro-batch {t.micro_batch} * dp {p.dp} = {per_step}"]
    derived = t.global_batch // per_step
    if t.microbatches is None:
        t.microbatches = derived
    elif t.microbatches != derived:
        return [
            f"microbatches={t.microbatches} != global batch {t.global_batch} / (micro-batch {t.micro_batch} * dp {p.dp}) = {derived}"
        ]
    return []


def _check_pipeline(m: ModelSpec, t: TrainSpec, p: ParallelSpec) -> list[str]:
    out = []
    multi = p.pp_schedule in MULTI_STAGE_SCHEDULES
    if p.pp == 1:
        if p.virtual_stages > 1:
            out.append(f"virtual_stages={p.virtual_stages} needs pp > 1")
        return out
    if multi and p.virtual_stages < 2:
        out.append(f"{p.pp_schedule} needs virtual_stages >= 2 (got {p.virtual_stages})")
    if not multi and p.virtual_stages > 1:
        out.append(f"{p.pp_schedule} runs one stage per rank: virtual_stages must be 1 (got {p.virtual_stages})")
    if p.pp_schedule == Schedule.ZBV and p.virtual_stages != 2:
        out.append(f"zbv runs exactly 2 stages per rank (got virtual_stages={p.virtual_stages})")
    stages = p.pp * p.virtual_stages
    if m.n_layers < stages:
        out.append(f"n_layers={m.n_layers} < pp({p.pp}) * virtual_stages({p.virtual_stages}) = {stages} stages: every stage needs a layer")
    mb = t.microbatches or 0
    if p.pp_schedule != Schedule.GPIPE and mb < p.pp:
        out.append(f"{p.pp_schedule.upper()} needs microbatches >= pp (got microbatches={mb}, pp={p.pp})")
    if multi and mb % p.pp:
        out.append(f"{p.pp_schedule} needs microbatches divisible by pp (got {mb} % {p.pp} = {mb % p.pp})")
    return out


def validate_spec(data: dict[str, Any] | str) -> tuple[ExperimentSpec | None, list[str]]:
    """Parse a spec from a dict or JSON text; return (spec, []) or (None, problems). Never raises."""
    try:
        spec = ExperimentSpec.model_validate_json(data) if isinstance(data, str) else ExperimentSpec.model_validate(data)
        return spec, []
    except SpecError as e:
        return None, list(e.problems)
    except ValidationError as e:
        problems: list[str] = []
        for err in e.errors():
            ctx_err = (err.get("ctx") or {}).get("error")
            # pydantic wraps the model validator's SpecError: keep its problems as separate items
            problems += ctx_err.problems if isinstance(ctx_err, SpecError) else [_format_pydantic(err)]
        return None, problems


def _format_pydantic(err: dict[str, Any]) -> str:
    loc = ".".join(str(x) for x in err.get("loc", ())) or "spec"
    msg = err.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{loc}: {msg} (got {err.get('input')!r})"
