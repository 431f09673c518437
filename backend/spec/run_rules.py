"""What this engine can predict but not run, written once for one spec and for numpy arrays of layouts.

A rule is a predicate over a `LayoutView` plus the sentence a person reads. The view's fields are plain scalars for
one spec (`checks.run_blockers`, through `LayoutView.of_spec`) or numpy arrays for the planner
(`planner.search.run_blocked` builds the view from its layout arrays), and every predicate combines them with `&`, `|`
and comparisons only, so the same expression answers both. The model's own features (sinks, chunked windows, what
ring attention computes) are scalars in both cases: a plan searches one model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from backend.spec.choices import FOLDED_EXPERT_STACKS, ZERO_STAGE, Schedule
from backend.spec.dims import DIMS, degree_names
from backend.spec.model_spec import ModelSpec
from backend.spec.parallel_spec import ParallelSpec
from backend.spec.spec_parts import SpecParts
from backend.spec.stack_rules import stack_blockers

SPLIT_BACKWARD_SCHEDULES = (Schedule.ZERO_BUBBLE, Schedule.ZBV, Schedule.DUALPIPEV)


@dataclass(frozen=True)
class LayoutView:
    """The fields the run rules read: each a scalar (one spec) or a numpy array (one entry per layout). The degrees
    of backend/spec/dims.py read as attributes (`v.tp`, `v.cp`)."""

    degrees: Mapping[str, Any]
    """{dimension: degree} for every dimension of the table."""
    zero_stage: Any
    """0 ddp, 1 zero1 (ZeroRedundancyOptimizer, or the distributed optimizer under tp/pp), 2 zero2, 3 zero3/fsdp."""
    split_backward: Any
    """The pipeline schedule splits the input and weight backward (zero_bubble, zbv)."""
    precision: str
    model: ModelSpec
    expert_fold: bool = False
    """The stack lays the routed experts out on Megatron-Core's folded grid (spec/choices.FOLDED_EXPERT_STACKS): one
    value per spec or plan."""

    def __getattr__(self, name: str) -> Any:
        degrees = self.__dict__.get("degrees", {})
        if name in degrees:
            return degrees[name]
        raise AttributeError(f"LayoutView has no field or degree {name!r}")

    @classmethod
    def of_spec(cls, parallel: ParallelSpec, precision: str, model: ModelSpec, expert_fold: bool = False) -> LayoutView:
        return cls(degrees={d: getattr(parallel, d) for d in degree_names(DIMS)},
                   zero_stage=ZERO_STAGE[parallel.dp_flavour],
                   split_backward=parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES, precision=str(precision),
                   model=model, expert_fold=expert_fold)


@dataclass(frozen=True)
class RunRule:
    label: str
    """What the rule refuses, in a few words (the planner's note counts the layouts each rule leaves out)."""
    blocks: Callable[[LayoutView], Any]
    """True (or a bool array) where the engine cannot run the layout."""
    why: Callable[[ParallelSpec, ModelSpec], str]
    """The sentence for one spec, with its numbers."""


def _windowed(m: ModelSpec) -> bool:
    return m.window is not None and m.window < m.seq_len


def _ring_misses(m: ModelSpec) -> list[str]:
    """What the engine's ring attention (plain causal attention) would compute wrongly under cp."""
    return [name for name, on in (("a sliding / chunked window", _windowed(m)), ("attention sinks", m.attention_sinks),
                                  ("multi-head latent attention", m.is_mla)) if on]


def _folds_over_tp(v: LayoutView) -> Any:
    """Megatron-Core's expert grid with etp < tp covering the stage (etp x ep | tp x cp x dp): its ep index runs over
    the tp ranks first (expert_layout.rank_coords), so even an ep that divides dp x cp is not this engine's ep block
    along dp; a grid that does not cover the stage is an invalid spec (checks.py says why, no edp of 0 here)."""
    return (v.etp < v.tp) & ((v.tp * v.dp * v.cp) % (v.etp * v.ep) == 0)


LAYOUT_RULES = (
    RunRule("fp8 x tp", lambda v: (v.precision == "fp8") & (v.tp > 1),
            lambda p, m: f"fp8 with tp={p.tp} is not wired here: torchao's float8 TP styles (Float8ColwiseParallel / "
            "Float8RowwiseParallel) are not applied; use tp=1 (dp / fsdp / pp) to run fp8"),
    RunRule("fp8 x ep", lambda v: (v.precision == "fp8") & (v.ep > 1),
            lambda p, m: f"fp8 with ep={p.ep} is not wired here: the experts' all-to-all dispatch runs bf16 linears "
                         "only"),
    RunRule("etp < tp x ep", lambda v: (v.etp > 1) & (v.ep > 1) & (v.etp != v.tp),
            lambda p, m: f"etp={p.etp} with ep={p.ep} is prediction-only at tp={p.tp}: the engine splits each expert "
            "colwise / rowwise over the whole tp mesh dimension (etp = tp, strategies/tp.py) or not at all (etp = 1); "
            "an expert-tp group smaller than tp is not wired"),
    RunRule("ep spanning tp", lambda v: (v.ep > 1) & v.expert_fold & _folds_over_tp(v),
            lambda p, m: f"ep={p.ep} spans the tp ranks (Megatron-Core's MoE parallel folding, stack megatron: etp x "
            f"ep x edp = {p.etp} x {p.ep} x {p.tp * p.dp_cp // (p.etp * p.ep)} over tp x cp x dp = {p.tp} x {p.cp} x "
            f"{p.dp}) and is prediction-only: this engine carves ep out of dp x cp = {p.dp_cp} ranks "
            "(analytic/expert_layout.py)"),
    RunRule("zero1 x tp/pp under fp16-mixed",
            lambda v: (v.zero_stage == 1) & ((v.tp > 1) | (v.pp > 1)) & (v.precision == "fp16-mixed"),
            lambda p, m: f"zero1 with tp={p.tp}, pp={p.pp} (the distributed optimizer) runs fp32 and bf16-mixed: fp16 "
            "loss scaling over its fp32 main-grad buffers is not implemented; use bf16-mixed"),
    # Measured on torch 2.13: the split input/weight backward leaves the last stage's FSDP2 grads unset.
    RunRule("zero_bubble / zbv x FSDP2 on dp > 1",
            lambda v: (v.pp > 1) & v.split_backward & (v.dp > 1) & (v.zero_stage >= 2),
            lambda p, m: f"{p.pp_schedule} with {p.strategy} on dp={p.dp} is not supported: torch's split backward "
            "drops FSDP2 gradients of the last stage; use ddp for the dp dimension or a 1f1b/interleaved schedule"),
)
"""Layouts the engine cannot run, whatever the model."""

MODEL_RULES = (
    RunRule("attention sinks under flash attention", lambda v: v.model.attention_sinks and v.model.attention == "flash",
            lambda p, m: "attention_sinks with attention=flash: torch SDPA has no sink logit; run with attention=math "
            "(flash kernels with sinks exist on GPUs, so the prediction stands)"),
    RunRule("a chunk that does not divide seq_len",
            lambda v: v.model.window is not None and v.model.window_kind == "chunked"
            and v.model.window < v.model.seq_len and v.model.seq_len % v.model.window != 0,
            lambda p, m: f"chunked attention needs seq_len divisible by the chunk: {m.seq_len} % {m.window} = "
            f"{m.seq_len % m.window}"),
    RunRule("a MoE dispatcher other than all-to-all",
            lambda v: (v.ep > 1) & (str(v.model.moe_dispatcher) != "alltoall"),
            lambda p, m: f"moe_dispatcher={m.moe_dispatcher} with ep={p.ep}: this engine dispatches by all-to-all only "
            "(strategies/moe_dispatch.py); Megatron-Core's allgather and flex (DeepEP / HybridEP) dispatchers are "
            "predicted, not run"),
    # The engine's ring attention (strategies/ring_attention.py, and torch's context_parallel on CUDA) is plain causal
    # multi-head attention: windows, sinks and MLA under cp are predicted, not run.
    RunRule("cp with windows, sinks or MLA", lambda v: (v.cp > 1) & bool(_ring_misses(v.model)),
            lambda p, m: f"cp={p.cp} with {' and '.join(_ring_misses(m))}: ShardLab's ring attention is plain causal "
            "attention (no mask, sink or latent path); the prediction stands, the run would compute other attention"),
)
"""Model features the analytic model predicts but this engine's torch model (or its ring attention) cannot run."""

RULES = LAYOUT_RULES + MODEL_RULES


def blocking_reasons(spec: SpecParts) -> list[str]:
    """The sentence of every rule that blocks this spec, in RULES order, then the stack settings this engine does not
    run (stacks.stack_blockers: one plan holds one stack, so the planner applies them to all its layouts at once)."""
    view = LayoutView.of_spec(spec.parallel, spec.train.precision, spec.model,
                              expert_fold=str(spec.train.stack) in FOLDED_EXPERT_STACKS)
    return [rule.why(spec.parallel, spec.model) for rule in RULES if bool(rule.blocks(view))] + stack_blockers(spec)


def rule_hits(view: LayoutView) -> dict[str, Any]:
    """{rule label: True / False, or a bool array over the view's layouts} for every rule."""
    return {rule.label: rule.blocks(view) for rule in RULES}
