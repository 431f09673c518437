"""FSDP2 / replicate state at the engine's activation peak beyond the sharded storage (pure Python): which
units are unsharded and which unsharded gradients have accumulated, depending on where the peak falls
(inside the root's forward, at a pipeline stage's forward or backward, per local stage of an interleaved
rank). Used by estimate._memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.analytic.activations import ep_peaks_in_last_block
from backend.analytic.pipelining import interleaved_order
from backend.analytic.sharding import LocalParam, fsdp_units, layer_split, unsharded_grad_numel, unsharded_numel
from backend.analytic.traffic import compute_bytes


def peak_inside_forward(spec: Any) -> str | None:
    """Where the activation peak of a dp-mix without pipelining falls, when inside the FSDP2 root's forward:
    "block" = inside the last block (ep: the all_to_all dispatch buffers of the last MoE layer, when they outweigh
    the head and loss, activations.ep_peaks_in_last_block), "root" = in
    the root after the last block (tp, fp32 logits: lm_head's all-gather holds the local shard, the gathered
    buffer and the concatenated logits, at least what the loss adds after the root's post_forward), None =
    after the root's forward (the loss)."""
    return None if spec.parallel.pp > 1 else _head_peak(spec)


def _head_peak(spec: Any) -> str | None:
    """`peak_inside_forward` for the stage that computes the logits (the whole model without pipelining)."""
    m, p = spec.model, spec.parallel
    if p.ep > 1 and m.is_moe and ep_peaks_in_last_block(spec):
        return "block"
    if p.tp > 1 and compute_bytes(spec.train.precision) == 4:
        return "root"
    return None


@dataclass(frozen=True)
class PipelinePeak:
    """FSDP2 state of one pipeline rank at its activation peak (gpipe / 1f1b, one stage per rank)."""

    where: str | None
    """"block": the peak is inside the stage's last block's forward (the block's output and its last temporaries
    alive, before its post_forward): zero3 holds the stage root and that block unsharded, every earlier block
    resharded; "root": in the root after the last block (`peak_inside_forward`); None: after the stage's forward."""
    gathered: bool
    """That forward all-gathered (the stage was sharded before it): the last block's flat all-gather output is still
    referenced too (_fsdp_param_group.py: freed by the next unshard's wait or the root's post_forward)."""
    after_backward: bool
    """A backward of this step ran before: unsharded gradients accumulate (no sync until the last one)."""


def pipeline_peak(spec: Any, stages: list[int]) -> PipelinePeak | None:
    """Under pipelining (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`) every backward
    keeps its FSDP2 units unsharded (reshard_after_backward=False) and accumulates unsharded gradients
    (requires_gradient_sync=False) until `perform_reduce_grad` after the last one.
    Last stage: the peak is the start of a backward (loss seed made, every in-flight forward held): under
    1F1B each backward starts with one microbatch in flight and the last such moment (after m-1 backwards)
    is the one the engine keeps; under GPipe the first backward; where `peak_inside_forward` would place it inside
    the forward (tp fp32 logits, ep), inside that (last) forward instead. Other stages: inside the last block of the
    LAST forward that reaches the warm-up's in-flight count (1F1B: min(m, p - stage), GPipe: m; ties keep the later
    moment, bench/memory.py), before its post_forward frees the block's temporaries. Under 1F1B with m above that
    count it is a steady-state forward after a backward (schedules.py Schedule1F1B "1B1F"): the units are still
    unsharded from that backward, so nothing is all-gathered (zero3: the root and the last block unsharded, the
    accumulated unsharded grads held); otherwise the last warm-up forward, which all-gathered under zero3 (the last
    block's all-gather output alive too). zero2 keeps every unit unsharded and gathers only in a stage's first forward."""
    p, t = spec.parallel, spec.train
    sched, m = str(p.pp_schedule), t.microbatches
    if p.pp == 1 or p.zero_stage < 2 or sched not in ("gpipe", "1f1b") or len(stages) != 1:
        return None
    if stages[0] == p.pp - 1:
        after, where = sched == "1f1b" and m > 1, _head_peak(spec)
        first = m == 1  # zero2: the peak forward (the last) is the stage's first, the only one that gathers
        return PipelinePeak(where, where is not None and (first if p.zero_stage == 2 else not after), after)
    warm = m if sched == "gpipe" else min(m, p.pp - stages[0])
    steady = sched == "1f1b" and m > warm
    if p.zero_stage == 2:
        first = not steady and warm == 1
        return PipelinePeak("block" if first else None, first, steady)
    return PipelinePeak("block", not steady, steady)


@dataclass(frozen=True)
class StageState:
    """FSDP2 state of one local stage of a multi-stage pipeline rank at its activation peak."""

    unsharded: bool
    """zero3: the stage's units are unsharded (its latest action before the peak was a backward)."""
    grads: bool
    """A backward of this stage ran before the peak: its unsharded gradients are held (no sync until the last)."""
    in_forward: bool = False
    """The peak is inside this stage's forward, in its last block (PipelinePeak.where == "block")."""
    gathered: bool = False
    """That forward all-gathered (PipelinePeak.gathered)."""


def multi_stage_peak(spec: Any, stages: list[int]) -> dict[int, StageState] | None:
    """Per local stage of an interleaved-1F1B rank, the FSDP2 state at the activation peak: the rank's LAST
    forward that reaches its maximum in-flight chunk count (every later moment holds at least as many sent
    outputs, `_PipelineScheduleRuntime` keeps every send Work until the step ends; ties keep the later moment);
    on the last stage the start of the backward that follows, before its pre-backward unshard.
    A backward leaves its units unsharded (stage.py `backward_maybe_with_nosync`: reshard_after_backward=False)
    until the stage's next forward, whose post_forward reshards them (zero3, reshard_after_forward=True also on
    the stage root: _fsdp_state.py `_lazy_init` keeps a root unsharded only with the automatic default). A
    non-last peak forward's own stage is inside its last block (`PipelinePeak.where` "block"; it all-gathered unless
    its latest action was a backward); a last stage counts after it (its post_forward resharded before the loss
    backward starts)."""
    p = spec.parallel
    if p.pp == 1 or p.zero_stage < 2 or str(p.pp_schedule) != "interleaved_1f1b" or len(stages) < 2:
        return None
    rank = stages[0] % p.pp
    order = interleaved_order(p.pp, len(stages), spec.train.microbatches, rank)
    held, counts = 0, []
    for _, kind in order:
        held += 1 if kind == "F" else -1
        counts.append(held if kind == "F" else -1)
    top = max(counts)  # once: inside the generator it made this quadratic in the action count
    peak = max(i for i, c in enumerate(counts) if c == top)
    at = order[peak][0]
    last_stage = at == p.pp * p.virtual_stages - 1
    before = order[:peak + last_stage]  # last stage: after its forward
    last = {s: k for s, k in before}  # each stage's latest action before the peak
    out = {s: StageState(last.get(s) == "B", (s, "B") in before) for s in stages}
    if not last_stage:  # zero3 gathers unless a backward left the units unsharded; zero2 only in the first forward
        gathered = last.get(at) is None if p.zero_stage == 2 else last.get(at) != "B"
        out[at] = StageState(False, out[at].grads, True, gathered)
    return out


def stage_of(name: str, m: Any, n_stages: int) -> int:
    """Pipeline stage holding parameter `name` (backend/strategies/pp.py strip_to_stage)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return next(s for s, r in enumerate(layer_split(m.n_layers, n_stages)) if int(parts[1]) in r)
    return 0 if parts[0] in ("tok_emb", "pos_emb") else n_stages - 1


def forward_peak_numel(units: dict[str, list[LocalParam]], zero_stage: int, where: str, gathered: bool) -> int:
    """Unsharded parameter elements beyond zero2's all-units-unsharded of the FSDP2 units `units` (one stage or the
    whole model) when the peak is inside their forward: "block" = inside the last block, "root" = in the root after
    the last block's post_forward. The last block's flat all-gather output stays referenced until the next unshard's
    wait or the root's post_forward (_fsdp_param_group.py wait_for_unshard / _fsdp_state.py _post_forward); under
    zero3 the root is unsharded for its whole forward and the last block until its own post_forward
    (_fsdp_param_group.py post_forward)."""
    blocks = sorted((k for k in units if k != "root"), key=lambda k: int(k.split(".")[1]))
    last = unsharded_numel(units[blocks[-1]]) if blocks else 0
    out = last if gathered else 0
    if zero_stage != 2:
        out += unsharded_numel(units.get("root", [])) + (last if where == "block" else 0)
    return out


def fsdp_peak_extra(spec: Any, params: list[LocalParam], stages: list[int]) -> tuple[int, int]:
    """(unsharded parameter elements, unsharded gradient elements) alive at the activation peak beyond the
    sharded storage. Every unit is unsharded under zero2; under zero3 none once the root's forward ended.
    Inside the root's forward (`peak_inside_forward`; a pipeline stage's forward, `PipelinePeak` / `StageState`)
    `forward_peak_numel` adds what that forward holds. Multi-stage (interleaved) ranks: per local stage,
    `multi_stage_peak`."""
    p = spec.parallel
    managed = [q for q in params if not (q.is_expert and p.ep > 1)]  # ep experts are ignored_params
    units = fsdp_units(spec.model, managed)
    params_out = sum(unsharded_numel(u) for u in units.values()) if p.zero_stage == 2 else 0
    multi = multi_stage_peak(spec, stages)
    if multi is not None:
        n_stages = p.pp * p.virtual_stages
        stage = {q.name: stage_of(q.name, spec.model, n_stages) for q in managed}
        at = {name: multi[s] for name, s in stage.items()}
        if p.zero_stage != 2:
            params_out = sum(unsharded_numel(u) for u in units.values() if at[u[0].name].unsharded)
        for s, st in multi.items():
            if st.in_forward:
                mine = fsdp_units(spec.model, [q for q in managed if stage[q.name] == s])
                params_out += forward_peak_numel(mine, p.zero_stage, "block", st.gathered)
        return params_out, sum(unsharded_grad_numel(q, p.tp) for q in managed if at[q.name].grads)
    pipe = pipeline_peak(spec, stages)
    grads_out = sum(unsharded_grad_numel(q, p.tp) for q in managed) if pipe and pipe.after_backward else 0
    if pipe is not None:
        if pipe.where is not None:
            params_out += forward_peak_numel(units, p.zero_stage, pipe.where, pipe.gathered)
        return params_out, grads_out
    where = peak_inside_forward(spec)
    if where is not None:  # every microbatch's forward all-gathers: without pipelining each backward reshards
        params_out += forward_peak_numel(units, p.zero_stage, where, True)  # (reshard_after_backward defaults True)
    return params_out, grads_out
