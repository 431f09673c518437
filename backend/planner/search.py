"""Plan: enumerate layouts (space.py), evaluate them all at once with the prediction core (the worst-rank memory of
analytic/memory/rank_memory.py on arrays of layouts, the step-time screen of analytic/steptime/screen.py), keep every
layout that fits, then re-time a pool of the fastest with the step-time model (steptime.model) and confirm the reported
ones' memory with the same core on each one alone (estimate.worst_rank_bytes), fastest first by that model (retime.py).

Each layout is priced on the ranks of the profile (analytic/device.profile_device: CUDA ranks on a GPU profile, as
`estimate --hardware` prices its fit), and its spec says so (runtime.device).
Fits = analytic/device.fits_device, the one rule `estimate`'s fit line applies too: the worst rank's bytes at its
fullest moment (the activation peak, optimizer.step, the start of the loss's backward or inside backward: `estimate`'s
RankEstimate.fullest_bytes, the same number) + the runtime allowance (CUDA context, NCCL buffers per communicator,
allocator slack: analytic/device.RuntimeOverhead, measured on the H200) <= device memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.analytic.device import RuntimeOverhead, fits_device, profile_device
from backend.analytic.expert_layout import folds_experts
from backend.analytic.layout import DEGREES, Layout, PipelineSchedule
from backend.analytic.memory.rank_memory import worst_rank_memory
from backend.analytic.memory.state_floor import state_floor_groups
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.screen import screen_step_s
from backend.planner.allowance import device_bytes_of, overhead_of
from backend.planner.capacity import candidates, capacity_problem, drop_note, factor_label, with_factor
from backend.planner.held import HeldTraining
from backend.planner.none_fit import closest_layout
from backend.planner.retime import Screened, config_row, retime_pools
from backend.planner.space import DEFAULT_LIMITS, Limits, enumerate_layouts
from backend.spec import ModelSpec
from backend.spec.run_rules import LayoutView, rule_hits

ALLOWANCE_DOC = ("fits = fullest moment + CUDA context + NCCL buffers + allocator slack <= device memory, the rule of "
                 "`estimate --hardware`'s fit line (analytic/device.fits_device; RuntimeOverhead: context 527 MiB and "
                 "slack 13% of the fullest moment measured on the H200, NCCL_BUFFSIZE 4 MiB x 8 channels x 2 peers per "
                 "communicator from the NCCL docs); --reserve-gb / --fragmentation override the context + NCCL and "
                 "the slack")
STEP_ASSUMES = "step time assumes: "
"""The prefix of a note saying what the reported layouts' times assume in place of what they ask for (StepTime.caveats,
e.g. FlashAttention-3 on a non-Hopper GPU timed as FlashAttention-2): the Plan page shows these as warnings."""
POOL_FACTOR, POOL_MIN = 3, 10
"""Layouts re-timed with steptime.model: the POOL_FACTOR x top fastest by the vectorised step-time screen (at least
POOL_MIN)."""


@dataclass
class Plan:
    searched: int
    feasible: int
    """Layouts whose worst-rank memory (the core's, on arrays of layouts) fits (fits_device): all of them, not a
    sample."""
    seconds: float
    configs: list[dict[str, Any]]
    predicted_only_left_out: int = 0
    """Fitting layouts this engine cannot run, left out of the ranking (plan(include_predicted=False))."""
    predicted_only_by_rule: dict[str, int] = field(default_factory=dict)
    """{run rule label (backend/spec/run_rules.py): fitting layouts it leaves out}; a layout may count under two."""
    screened_per_s: float = 0.0
    """searched / search_seconds: every layout's memory and screen time, feasibility and ranking."""
    confirmed: int = 0
    """Layouts re-timed with steptime.model (the pool)."""
    search_seconds: float = 0.0
    confirm_seconds: float = 0.0
    """Re-timing the pool and confirming the reported layouts' memory with the core on each alone."""
    notes: list[str] = field(default_factory=list)
    attention: str = "math"
    """The attention kernel every layout was planned with (the model's `attention`)."""
    device_bytes: float = 0.0
    """The device memory per GPU each layout's need (fullest moment + allowance: fits_device) must fit in."""
    overhead: RuntimeOverhead = field(default_factory=RuntimeOverhead)
    """The runtime allowance the fit rule adds (analytic/device.RuntimeOverhead; the flags' overrides)."""
    device: str = "cpu"
    """Where the layouts' ranks run ("cuda" on a GPU profile: analytic/device.profile_device); no allowance on cpu."""
    failed_checks: list[dict[str, str]] = field(default_factory=list)
    """[{"layout": name, "why": ...}]: pool layouts left out because an internal consistency check of the prediction
    failed on them (a defect of ShardLab's model, named here instead of a traceback)."""
    capacity_factors: list[float | None] = field(default_factory=lambda: [None])
    """The capacity factors searched (planner/capacity.py; None = dropless): the model's own unless asked for more."""
    untimed: str | None = None
    """Why no layout could be ranked: the step-time model does not time the held training on this profile
    (steptime.model.untimed_reason, e.g. fp8 on a CPU profile); the layouts that fit are counted, none is ranked."""
    none_fit: dict[str, Any] | None = None
    """Where layouts were searched and none fits: the closest one and what it lacks (planner/none_fit.py)."""

    def to_dict(self) -> dict[str, Any]:
        return {"searched": self.searched, "feasible": self.feasible, "seconds": self.seconds, "configs": self.configs,
                "predicted_only_left_out": self.predicted_only_left_out,
                "predicted_only_by_rule": self.predicted_only_by_rule,
                "screened_per_s": self.screened_per_s, "confirmed": self.confirmed,
                "search_seconds": self.search_seconds, "confirm_seconds": self.confirm_seconds, "notes": self.notes,
                "failed_checks": self.failed_checks, "attention": self.attention, "device_bytes": self.device_bytes,
                "capacity_factors": self.capacity_factors, "none_fit": self.none_fit,
                "device": self.device, "allowance": {"cuda_context_bytes": self.overhead.cuda_context_bytes,
                              "nccl_bytes_per_communicator": self.overhead.nccl_bytes_per_communicator(),
                              "fragmentation_frac": self.overhead.fragmentation_frac}}


def planned_attention(model: ModelSpec, hw: Hardware, asked: str | None = None) -> tuple[str, str]:
    """(attention kernel, why, in words) a plan uses: the one asked for; else flash on a GPU profile (what GPU
    training runs, and the kernel context parallelism needs: a long sequence planned with the math kernel never sees
    a cp layout), unless the model has attention sinks (no flash kernel with sinks in this engine: every flash layout
    would be prediction-only); else the model's own."""
    own = str(getattr(model, "attention", "math"))
    if asked:
        return asked, "chosen"
    if hw.kind != "gpu":
        return own, "the model's; flash is the default on GPU profiles only"
    if getattr(model, "attention_sinks", False):
        return own, ("the model's: its attention sinks have no flash kernel in this engine, so every flash layout "
                     "would be prediction-only; choose flash to plan it anyway")
    return "flash", "the default on GPU profiles: what GPU training runs, and the kernel context parallelism needs; " \
                    "math stays a choice"


def search(model: ModelSpec, *, gpus: int, gpus_per_node: int, hw: Hardware, global_batch: int, memory_bytes: float,
           precision: str = "bf16-mixed", limits: Limits = DEFAULT_LIMITS, held: HeldTraining | None = None,
           overhead: RuntimeOverhead | None = None, prune: bool = True) -> tuple[Layout, np.ndarray, np.ndarray]:
    """(every layout, its worst-rank bytes, the indices of those that fit memory_bytes per GPU (fits_device), fastest
    first by the screen): the per-layout work of a plan (benchmarks/planner_speed.py times exactly this). held: the
    training settings every layout keeps (planner/held.py; its precision replaces `precision`). The layouts are priced
    on the profile's ranks (profile_device: CUDA on a GPU profile), as `estimate --hardware` prices its fit.
    prune: drop the layouts that cannot fit before the full memory model, by two lower bounds of their worst-rank
    bytes (memory/state_floor.py's resting model state, then the full model at pipeline rank 0 alone; fits_device
    grows with the bytes, so a bound that does not fit rules the layout out); a pruned layout's bytes are that bound.
    The layouts left with pp > 1 then get their later pipeline ranks (the worst rank: the larger of rank 0 and those).
    The layouts that fit, their bytes and their order are the same as without (tests/unit/test_plan_prune.py)."""
    held = held or HeldTraining(precision=precision)
    device = profile_device(hw.kind)
    layouts = enumerate_layouts(model, gpus=gpus, gpus_per_node=gpus_per_node, global_batch=global_batch, limits=limits,
                                precision=held.precision, optimizer=held.optimizer,
                                extra_recompute=held.extra_recompute(), sac_ops=held.recompute_ops, device=device,
                                stack=held.stack_memory(model, device),  # estimate's own stack terms, on that device
                                repertoire=held.repertoire(), compiled=held.engine_compile())
    if not len(layouts):
        return layouts, np.zeros(0), np.zeros(0, dtype=np.int64)

    def fits(nbytes: np.ndarray, of: Layout) -> np.ndarray:  # elementwise: a subset's rows are its own layouts'
        return np.broadcast_to(fits_device(nbytes, of, device, memory_bytes, overhead), nbytes.shape)

    if prune:  # lower bounds first, cheapest first: the full model sees only layouts that may fit
        floor, states, state_of = state_floor_groups(model, layouts)  # the fit rule reads the bytes and degrees:
        memory, keep = floor[state_of], np.nonzero(fits(floor, states)[state_of])[0]  # once per distinct state
        if len(keep):
            # exact where pp == 1
            first, _ = worst_rank_memory(model, nearby := layouts.take(keep), first_rank_only=True)
            memory[keep] = np.maximum(memory[keep], first)  # two lower bounds: the larger is one
            maybe = fits(memory[keep], nearby).copy()  # only these may fit: the others' bound does not
            later = maybe & (nearby.pp > 1)  # the worst rank may be a later pipeline rank: those ranks too
            if later.any():
                rest = nearby.take(np.nonzero(later)[0], with_memo=True)  # its part sums and block terms come along
                worst = np.maximum(first[later], worst_rank_memory(model, rest, later_ranks_only=True)[0])
                memory[keep[later]] = worst
                maybe[later] = fits(worst, rest)
            keep = keep[maybe]
    else:
        memory, _ = worst_rank_memory(model, layouts)
        keep = np.nonzero(fits(memory, layouts))[0]
    if not len(keep):
        return layouts, memory, keep
    # the screen of the layouts that fit only (each layout's screen is its own row's: the same numbers as on all of
    # them; a MoE search keeps a few thousand of ~1M); their memoised part sums come along
    step = np.broadcast_to(screen_step_s(model, layouts.take(keep, with_memo=True), hw, gpus_per_node=gpus_per_node),
                           (len(keep),))
    return layouts, memory, keep[np.argsort(step, kind="stable")]


def _run_view(layouts: Layout, model: ModelSpec) -> LayoutView:
    split = (layouts.schedule == PipelineSchedule.ZERO_BUBBLE) | (layouts.schedule == PipelineSchedule.ZBV) \
        | (layouts.schedule == PipelineSchedule.DUALPIPEV)
    return LayoutView(degrees={d: getattr(layouts, d) for d in DEGREES}, zero_stage=layouts.zero_stage,
                      split_backward=split, precision=str(layouts.precision), model=model,
                      expert_fold=folds_experts(layouts.stack))


def run_rule_hits(layouts: Layout, model: ModelSpec) -> dict[str, np.ndarray]:
    """{rule label: where it blocks} for every rule of backend/spec/run_rules.py (the ones `checks.run_blockers`
    applies to one spec), evaluated once on the layout arrays."""
    return {label: np.broadcast_to(hits, len(layouts)) for label, hits in rule_hits(_run_view(layouts, model)).items()}


def run_blocked(layouts: Layout, model: ModelSpec) -> np.ndarray:
    """True where this engine cannot run the layout. tests/unit/test_prediction_only.py checks it against run_blockers
    on every enumerated layout."""
    return np.logical_or.reduce(list(run_rule_hits(layouts, model).values()))


def mark_runnable(configs: list[dict[str, Any]]) -> None:
    """Post-step on the reported layouts: "runnable" (this engine can run the layout, given as many ranks) and
    "why_not" (backend.spec.checks.run_blockers, joined; None when runnable)."""
    from backend.spec import ExperimentSpec
    from backend.spec.checks import run_blockers

    for c in configs:
        blockers = run_blockers(ExperimentSpec.for_prediction(c["spec"]))
        c["runnable"], c["why_not"] = not blockers, "; ".join(blockers) or None


def _screen(model: ModelSpec, include_predicted: bool, pool_size: int, **kw: Any) -> Screened:
    layouts, memory, order = search(model, **kw)
    left_out, fitting, by_rule = 0, len(order), {}
    if len(layouts) and not include_predicted:
        hits = run_rule_hits(layouts, model)
        runnable = order[~np.logical_or.reduce(list(hits.values()))[order]]
        by_rule = {label: n for label, where in hits.items() if (n := int(np.count_nonzero(where[order])))}
        left_out, order = len(order) - len(runnable), runnable
    return Screened(model, layouts, memory, order, fitting, left_out, by_rule, order[:pool_size])


def plan(model: ModelSpec, *, gpus: int, gpus_per_node: int, hw: Hardware, global_batch: int,
         memory_bytes: float | None = None, top: int = 10, precision: str = "bf16-mixed",
         band: tuple[float, float] | None = None, reserve_bytes: float | None = None,
         fragmentation: float | None = None, limits: Limits = DEFAULT_LIMITS, enough: int | None = None,
         include_predicted: bool = False, held: HeldTraining | None = None, prune: bool = True,
         capacity_factors: tuple[float | None, ...] | None = None) -> Plan:
    """`enough`: pool size override (default max(POOL_FACTOR x top, POOL_MIN)). Only layouts this engine runs are
    ranked unless `include_predicted` (the others come back marked "runnable": false with "why_not"). `held`: the
    training settings every layout keeps (planner/held.py: precision, optimizer, a recompute policy searched too, fp8
    recipe; an imported config's); without it, `precision` and the defaults. reserve_bytes / fragmentation: override
    the fit rule's allowance (overhead_of). prune: search()'s (the same plan either way; False only to check that).
    capacity_factors: a MoE model's capacity factors to search (None in it: dropless; planner/capacity.py), each a
    search of the model with that factor and its own pool, ranked together; None: the model's own factor only."""
    t0 = time.perf_counter()
    held = held or HeldTraining(precision=precision)
    device_bytes = device_bytes_of(hw, memory_bytes)
    overhead = overhead_of(reserve_bytes, fragmentation)
    if problem := capacity_problem(model, capacity_factors):
        raise ValueError(problem)
    if problems := held.problems():
        raise ValueError("; ".join(problems))
    factors = candidates(model, capacity_factors)
    pool_size = enough or max(POOL_FACTOR * top, POOL_MIN)
    screens = [_screen(with_factor(model, f), include_predicted, pool_size, gpus=gpus, gpus_per_node=gpus_per_node,
                       hw=hw, global_batch=global_batch, memory_bytes=device_bytes, limits=limits, held=held,
                       overhead=overhead, prune=prune) for f in factors]
    layouts = screens[0].layouts  # the same layouts at every factor: a factor changes no degree
    if not len(layouts):
        return Plan(searched=0, feasible=0, seconds=time.perf_counter() - t0, configs=[],
                    notes=[f"no layout of {gpus} GPUs divides the model and batch {global_batch}"],
                    attention=str(getattr(model, "attention", "math")), device_bytes=device_bytes, overhead=overhead,
                    device=profile_device(hw.kind), capacity_factors=list(factors))
    left_out, fitting = sum(x.left_out for x in screens), sum(x.fitting for x in screens)
    by_rule: dict[str, int] = {}
    for x in screens:
        for label, n in x.by_rule.items():
            by_rule[label] = by_rule.get(label, 0) + n
    searched, pooled = sum(len(x.layouts) for x in screens), sum(len(x.pool) for x in screens)
    t_search = time.perf_counter() - t0
    retimed = retime_pools(screens, held, named_by_factor=len(factors) > 1, hw=hw, gpus_per_node=gpus_per_node,
                      band=band)
    failed, untimed = retimed.failed, retimed.untimed
    configs, mismatch = [], []
    for t in retimed.timed[:top]:
        row, miss = config_row(t, device_bytes, overhead)
        configs.append(row)
        mismatch += miss
    mark_runnable(configs)
    seconds = time.perf_counter() - t0
    fit_note = f" ({left_out} of them prediction-only, left out)" if left_out else ""
    by_factor = f" ({len(layouts)} at each of {len(factors)} capacity factors: " \
        f"{', '.join(map(factor_label, factors))})" if len(factors) > 1 else ""
    per_factor = " (per capacity factor)" if len(factors) > 1 else ""
    notes = [ALLOWANCE_DOC, f"layouts priced on {layouts.device} ranks, each fitting {device_bytes / 2**30:.1f} GiB "
             f"(a {device_bytes / 1e9:.0f} GB device) with its allowance",
             f"searched {searched} layouts{by_factor} in {t_search:.3f} s: worst-rank memory of every layout (the "
             f"estimator's own model, on arrays of layouts), {fitting} fit{fit_note}; the {pooled} fastest by a "
             f"step-time screen{per_factor} re-timed with the step-time model in {seconds - t_search:.3f} s, the top "
             f"{len(configs)} by that model reported, their memory confirmed on each layout alone"]
    notes += [f"array and single-layout memory disagree (> 0.5%): {m}" for m in mismatch]
    notes += [f"internal check failed, layout left out of the ranking: {f['why']}" for f in failed]
    notes += [f"{STEP_ASSUMES}{c}" for c in dict.fromkeys(c for t in retimed.timed[:top] for c in t.caveats)]
    notes.append("every layout trains with " + held.words())
    if held.stack != "shardlab" or held.stack_settings:
        notes.append(f"stack {held.stack}: each layout is timed with that stack's kernels and overlaps "
                     "(spec/stacks.py); layouts whose stack settings this engine does not run are ranked, marked "
                     "prediction only with the reason")
    if str(getattr(model, "attention", "math")) != "flash":
        notes.append(f"context parallelism not searched: attention={model.attention} (ring attention needs flash "
                     "attention; plan with flash to search cp)")
    if left_out:
        why = ", ".join(f"{label}: {n}" for label, n in by_rule.items())
        notes.append(f"{left_out} fitting layouts this engine cannot run (prediction only) left out of the ranking "
                     f"({why}); --include-predicted (the Plan page's toggle) ranks them too, marked")
    if dropping := drop_note(configs):
        notes.append(dropping)
    return Plan(searched=searched, feasible=fitting, seconds=seconds, configs=configs,
                predicted_only_left_out=left_out, predicted_only_by_rule=by_rule,
                screened_per_s=searched / t_search if t_search else 0.0, confirmed=pooled,
                search_seconds=t_search, confirm_seconds=seconds - t_search, notes=notes, failed_checks=failed,
                untimed=untimed, attention=str(getattr(model, "attention", "math")), device_bytes=device_bytes,
                overhead=overhead, device=profile_device(hw.kind), capacity_factors=list(factors),
                none_fit=None if fitting else closest_layout(screens, held, device_bytes, overhead))
