"""The result of one experiment: what the engine measured, next to what the analytic model predicted.

This is the JSON written by the launcher (`result.json`), printed by `run --json`, stored by the worker
and plotted by the dashboard. Keys named in the issues (`status`, `per_rank[].measured.params_bytes`,
`comm.<collective>.bytes`, `bubble_measured`, ...) are a contract: keep them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from backend.spec import READ_BACK, ExperimentSpec

MEMORY_CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv")


class Status(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"
    TIMEOUT = "timeout"
    OOM = "oom"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


FINISHED = (Status.OK, Status.FAILED, Status.TIMEOUT, Status.OOM, Status.CANCELLED, Status.INTERRUPTED)


class _R(BaseModel):
    # A diverged run's losses are NaN or inf: JSON has no such numbers, and pydantic's default wrote them as null,
    # which no float field reads back (issue 31). "NaN" / "Infinity" / "-Infinity" strings are valid JSON, and
    # pydantic reads them (and the bare NaN / Infinity tokens Python's json writes) back as the same floats.
    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True, ser_json_inf_nan="strings")


def _null_loss_is_nan(value: Any) -> Any:
    return math.nan if value is None else value


Loss = Annotated[float, BeforeValidator(_null_loss_is_nan)]
"""One step's loss, possibly NaN or +-inf (a diverged run). A null in a loss list was written by a version that
turned every non-finite number into null: it reads as NaN (which non-finite value it was is lost)."""


def first_non_finite(values: Sequence[float]) -> int | None:
    """Index of the first NaN or +-inf in values, None when all are finite."""
    return next((i for i, v in enumerate(values) if not math.isfinite(v)), None)


class MemoryBreakdown(_R):
    params_bytes: int = 0
    """Parameter storage resident on this rank at the peak."""
    grads_bytes: int = 0
    """Gradient storage (incl. DDP buckets / FSDP unsharded grads) at the peak."""
    optimizer_bytes: int = 0
    """Optimizer state (Adam m and v, SGD momentum, fp32 master copies)."""
    activations_bytes: int = 0
    """Tensors saved for backward plus live intermediates at the peak."""
    other_bytes: int = 0
    """Buffers, inputs and temporaries not in the categories above."""
    peak_bytes: int = 0
    """Total tracked bytes at the peak of the step."""


class CommStat(_R):
    calls: float = 0
    """Calls per step (mean over counted steps)."""
    bytes: float = 0
    """Payload bytes per step per rank: the size of the buffer handed to the collective."""
    wire_bytes: float = 0
    """Bytes a ring algorithm sends per rank for that payload, e.g. 2(N-1)/N * S for all-reduce."""
    seconds: float | None = 0
    """Seconds per step in this collective, mean over the comm-timing steps run after the timed ones
    (engine/loop.py). gloo: from issue to completion (includes waiting for peers; overlapping collectives each
    count their own span). nccl: the collective's own CUDA-event time on NCCL's stream (Work._get_duration);
    None where that cannot be measured (functional collectives on nccl), with `seconds_note` saying why."""
    seconds_note: str | None = None
    """Why `seconds` is None (not measurable on this backend); None when it was measured."""


class RoutingAdjusted(_R):
    """EP only: the analytic prediction recomputed from the routing measured on the memory-tracked step
    (backend/analytic/measured/moe_routing.py), next to `predicted`, which assumes uniform routing."""
    activations_bytes: int = 0
    all_to_all_bytes: float = 0
    """all_to_all payload bytes per step for the measured token counts."""
    received_token_slots: int = 0
    """Token-slots this rank's experts received over the step (all MoE layers and microbatches)."""
    uniform_token_slots: float = 0
    """The same under uniform routing (N·top_k per layer and microbatch)."""


class FrameworkEstimate(_R):
    """A framework's own memory estimate for this rank (issue 14: DeepSpeed's estimator functions)."""
    source: str = ""
    """Who estimated, e.g. "DeepSpeed 0.19.8 estimate_zero2_model_states_mem_needs"."""
    device_bytes: int = 0
    """Model-state bytes it expects on the accelerator per rank."""
    host_bytes: int = 0
    """Host (CPU) bytes it expects per node."""


class ModelStates(_R):
    """Resident model-state storage after a step (each storage counted once), measured and predicted."""
    params_bytes: int = 0
    master_bytes: int = 0
    """fp32 master partition the optimizer steps on (DeepSpeed); 0 where it steps on the parameters."""
    optimizer_state_bytes: int = 0
    total_bytes: int = 0


class OffloadSplit(_R):
    """torch FSDP2 CPUOffloadPolicy runs: host- vs device-resident bytes at the activation peak (issue 14)."""
    host_bytes_measured: int = 0
    """Sharded params + sharded grads + optimizer state, as FSDPMemTracker tags them."""
    device_bytes_measured: int = 0
    """Everything else the tracker saw (unsharded params/grads, all-gather/reduce-scatter buffers, activations)."""
    host_bytes_predicted: int = 0
    device_bytes_predicted: int = 0


class RankResult(_R):
    rank: int
    measured: MemoryBreakdown = Field(default_factory=MemoryBreakdown)
    predicted: MemoryBreakdown = Field(default_factory=MemoryBreakdown)
    error_pct: dict[str, float | None] = Field(default_factory=dict)
    """(measured - predicted) / predicted * 100 per category; None where predicted is 0."""
    step_s: list[float] = Field(default_factory=list)
    """Wall time of each timed step (warm-up and the memory-tracked step excluded)."""
    comm: dict[str, CommStat] = Field(default_factory=dict)
    """Counted communication per collective type, per step."""
    comm_predicted: dict[str, float] = Field(default_factory=dict)
    """Analytic payload bytes per step per collective type for this rank."""
    rss_bytes: int | None = None
    """Process RSS after the run (a cross-check only: ~300 MB is torch itself)."""
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None
    coords: dict[str, int] = Field(default_factory=dict)
    """This rank's coordinates on the device mesh, e.g. {"pp": 0, "dp": 1, "tp": 0}."""
    predicted_given_routing: RoutingAdjusted | None = None
    """EP runs: the prediction for the routing this rank actually saw (None elsewhere and in older results)."""
    framework_estimate: FrameworkEstimate | None = None
    """The framework's own estimate ("DeepSpeed's estimate"), where it has one (issue 14)."""
    model_states_measured: ModelStates | None = None
    """DeepSpeed runs: resident params + fp32 master + optimizer state after the step, by storage."""
    model_states_predicted: ModelStates | None = None
    """DeepSpeed runs: the same from backend/analytic/frameworks/deepspeed_layout.py."""
    offload: OffloadSplit | None = None
    """torch offload=params runs: host vs device bytes, measured and predicted
    (backend/analytic/frameworks/offload.py)."""


class ImportFacts(_R):
    """A run measured elsewhere and imported from its framework's config and log (issue 25, backend/importers/)."""
    framework: str
    """The importer's name (backend/importers/registry.py): torchtitan, megatron, deepspeed, ..."""
    source_format: str = ""
    """How the config was written, one of its importer's formats: torchtitan-toml, megatron-args, nemo-yaml, ..."""
    config_file: str = ""
    log_file: str = ""
    gpus: int | None = None
    """GPUs of the job (all of them: a context-parallel slice's spec holds fewer)."""
    hardware: str | None = None
    """The step-time profile the prediction used (from --hardware or the device the log names)."""
    device_name: str | None = None
    """The device the log names (torchtitan's "CUDA capacity: ..."), None where the log does not say."""
    warmup_rule: str = ""
    warmup_cut_step: int = 0
    """Logged steps up to and including this one are excluded."""
    records_used: int = 0
    records_total: int = 0
    first_step: int = 0
    last_step: int = 0
    partial: bool = False
    """The log was read only in part (cut, garbled or over-long lines): the import says so and why."""
    partial_reasons: list[str] = Field(default_factory=list)
    peak_allocated_bytes: int | None = None
    """Max over the ranks the log reports of torch.cuda.max_memory_allocated, as the framework printed it."""
    peak_reserved_bytes: int | None = None
    """Max over the ranks the log reports of the peak reserved (caching allocator) bytes."""
    memory_source: str = ""
    """Which log lines the peaks come from, with their rounding."""
    reported: dict[str, float] = Field(default_factory=dict)
    """The framework's own figures (medians over the used steps): tps_per_device, tflops_per_device, mfu_pct."""
    step_prediction: dict[str, Any] = Field(default_factory=dict)
    """The step-time model on `hardware` at import: step_s, low_s, high_s and its breakdown, calibration,
    extrapolation."""
    unmapped: dict[str, Any] = Field(default_factory=dict)
    """Config fields the spec does not hold (import-config's "unmapped"): the prediction ignores them."""
    ignored: dict[str, Any] = Field(default_factory=dict)
    lines: dict[str, Any] = Field(default_factory=dict)
    """What was read: lines, bytes, over-long lines skipped, a cut last line, rank prefixes seen, garbled lines."""
    facts: dict[str, Any] = Field(default_factory=dict)


class TimelineEvent(_R):
    rank: int
    stage: int
    microbatch: int
    pass_: str = Field(alias="pass")
    """F (forward), B (backward, input grads), W (weight grads), send, recv."""
    start_s: float
    end_s: float


class RunResult(_R):
    status: Status
    error: str | None = None
    """One-line cause for any status other than ok."""
    failing_rank: int | None = None
    traceback: str | None = None
    log_tail: str | None = None
    spec: ExperimentSpec
    env: dict[str, Any] = Field(default_factory=dict)
    """torch/python versions, backend, device name, cores/GPUs, hostnames."""
    per_rank: list[RankResult] = Field(default_factory=list)
    step_s_median: float | None = None
    step_time_predicted_s: float | None = None
    """The step-time model's prediction for this run at run time (backend/analytic/steptime) on the 'cpu' profile for
    CPU ranks, before any calibration; None without a profile for the run's device."""
    tokens_per_s: float | None = None
    flops_per_step: float | None = None
    achieved_flops: float | None = None
    mfu: float | None = None
    """Model FLOPs utilization: model FLOPs (no recompute) per second / peak FLOP/s of the devices, where the
    exact device's peak is known (backend/engine/device_facts.py), else None."""
    hfu: float | None = None
    """Hardware FLOPs utilization: flops_per_step (recompute included) per second / peak; = mfu without recompute."""
    model_flops_per_step: float | None = None
    """Model FLOPs per optimizer step (6N + attention per token, recompute excluded): MFU's numerator."""
    loss: list[Loss] = Field(default_factory=list)
    """The global mean loss of each step (warm-up, then timed), NaN / inf kept as such when the run diverged."""
    loss_reference: list[Loss] = Field(default_factory=list)
    loss_max_abs_diff: float | None = None
    loss_scaling_skipped_steps: list[int] | None = None
    """fp16-mixed only: the engine's steps (0 = first warm-up step, then timed, memory and comm-timing steps in
    order) whose optimizer step the dynamic loss scaler skipped on every rank because some rank's gradients held
    inf/NaN (the scale was halved, the parameters left unchanged); None when no loss scaling ran."""
    tokens_dropped: int | None = None
    """MoE with a capacity factor: (token, expert) slots the capacity limit dropped in one training step (the
    memory-tracked one), over every MoE layer, microbatch and dp x cp rank (tp replicas, which route the same tokens,
    counted once); None when nothing can drop (dropless or dense)."""
    timeline: list[TimelineEvent] = Field(default_factory=list)
    bubble_measured: float | None = None
    bubble_predicted: float | None = None
    notes: list[str] = Field(default_factory=list)
    """Explanations where a measurement misses its prediction (never hidden)."""
    framework_facts: dict[str, Any] = Field(default_factory=dict)
    """Non-torch frameworks: the ds_config DeepSpeed ran with, or XLA's memory analysis and HLO collectives."""
    imported: ImportFacts | None = None
    """Set on runs of kind "imported" (measured by another framework, read from its log); None for ShardLab's runs."""
    started_at: str | None = None
    finished_at: str | None = None
    wall_s: float | None = None

    @property
    def diverged_at(self) -> int | None:
        """Index of the first loss that is NaN or +-inf (the run diverged there); None when every loss is finite."""
        return first_non_finite(self.loss)

    @property
    def memory_measured(self) -> bool:
        """Whether per_rank[].measured holds measurements. A run that did not finish ok measured nothing, and an
        imported run's log gives allocator peaks (cuda_max_*_bytes), not these categories: their measured breakdowns
        are the zero defaults, which mean unknown (the store's rank rows hold NULL; show and the run report print -)."""
        return self.status == Status.OK and self.imported is None

    def divergence(self) -> str | None:
        """'the loss is nan from step 2 of 11 on (10 steps not finite)' (steps 1-based, warm-up first), or None."""
        at = self.diverged_at
        if at is None:
            return None
        bad = sum(not math.isfinite(v) for v in self.loss)
        return (f"the loss is {self.loss[at]} from step {at + 1} of {len(self.loss)} on ({bad} "
                f"step{'s' if bad != 1 else ''} not finite)")

    @classmethod
    def of_spec(cls, spec: ExperimentSpec, **fields: Any) -> RunResult:
        """A result of `spec` as it is (READ_BACK): `RunResult(spec=...)` runs the spec's model validator again with
        today's rules for new specs, so a run that failed because its spec breaks one would raise instead of keeping
        its error."""
        return cls.model_validate({**fields, "spec": spec}, context=READ_BACK)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        return cls.model_validate_json(text)


def rank_step_s_median(step_s: Sequence[float]) -> float | None:
    """One rank's median step time, None when it timed no step. `show`, the run report and the stored rank rows
    (export --long) all read this one, so they cannot disagree on an even count (the mean of the middle two)."""
    return statistics.median(step_s) if step_s else None


def error_pct(measured: float, predicted: float) -> float | None:
    return None if not predicted else (measured - predicted) / predicted * 100.0


PARITY_BOUND = {"fp32": 1e-4, "bf16-mixed": 5e-2, "fp16-mixed": 5e-2, "fp8": 5e-2}
"""Largest |loss - single-process reference| of a correct run, by precision. fp32 runs match to ~1e-6; 16-bit autocast
rounds differently per shard. fp8 runs bf16 autocast around its float8 linears, so bf16's rounding applies: FSDP2's
MixedPrecisionPolicy casts the weights to bf16 before their float8 cast where the reference casts fp32 weights
(tests/multiprocess/test_fp8.py measured 1.2e-3 after 2 steps), which fp32's 1e-4 called a failed parity."""
PARITY_FAILS, PARITY_OK = "fails", "ok"


def parity_bound(precision: str) -> float:
    return PARITY_BOUND.get(str(precision), PARITY_BOUND["fp32"])


def parity_verdict(precision: str, diff: float | None) -> str | None:
    """'ok', 'fails' (over the precision's bound, or not a number) or None (no reference ran): the run's loss parity,
    the same everywhere it is shown (Runs, Run detail, the CLI, the export)."""
    if diff is None:
        return None
    return PARITY_OK if diff <= parity_bound(precision) else PARITY_FAILS  # NaN compares False: fails


def parity_failure_text(precision: str, diff: float) -> str:
    return (f"LOSS PARITY FAILS: max |loss - single-process reference| = {diff:.3g} > {parity_bound(precision):g} "
            f"({precision}): this distributed run does not compute the same training step as one process.")
