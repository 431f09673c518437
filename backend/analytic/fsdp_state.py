"""FSDP2 / replicate state at the engine's activation peak beyond the sharded storage (pure Python): which
units are unsharded and which unsharded gradients have accumulated, depending on where the peak falls
(inside the root's forward, at a pipeline stage's forward or backward). Used by estimate._memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.analytic.sharding import LocalParam, fsdp_units, unsharded_grad_numel, unsharded_numel
from backend.analytic.traffic import compute_bytes


def peak_inside_forward(spec: Any) -> str | None:
    """Where the activation peak of a dp-mix without pipelining falls, when inside the FSDP2 root's forward:
    "block" = inside the last block (ep: the all_to_all dispatch buffers of the last MoE layer), "root" = in
    the root after the last block (tp, fp32 logits: lm_head's all-gather holds the local shard, the gathered
    buffer and the concatenated logits, at least what the loss adds after the root's post_forward), None =
    after the root's forward (the loss)."""
    m, p = spec.model, spec.parallel
    if p.pp > 1:
        return None
    if p.ep > 1 and m.is_moe:
        return "block"
    if p.tp > 1 and compute_bytes(spec.train.precision) == 4:
        return "root"
    return None


@dataclass(frozen=True)
class PipelinePeak:
    """FSDP2 state of one pipeline rank at its activation peak (gpipe / 1f1b, one stage per rank)."""

    in_root_forward: bool
    """The peak is the end of a forward that all-gathered its units, before the stage root's post_forward."""
    after_backward: bool
    """A backward of this step ran before: unsharded gradients accumulate (no sync until the last one)."""


def pipeline_peak(spec: Any, stages: list[int]) -> PipelinePeak | None:
    """Under pipelining (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`) every backward
    keeps its FSDP2 units unsharded (reshard_after_backward=False) and accumulates unsharded gradients
    (requires_gradient_sync=False) until `perform_reduce_grad` after the last one.
    Last stage: the peak is the start of a backward (loss seed made, every in-flight forward held): under
    1F1B each backward starts with one microbatch in flight and the last such moment (after m-1 backwards)
    is the one the engine keeps; under GPipe the first backward. Other stages: the end of the forward that
    reaches the warm-up's in-flight count (1F1B: min(m, p - stage), GPipe: m). zero3 reshards after every
    forward, so the last warm-up forward all-gathered its units (the root still unsharded, the last block's
    all-gather output still referenced); zero2 keeps them unsharded, and its steady-state forwards (after a
    backward, no all-gather) reach the same count: the last of them."""
    p, t = spec.parallel, spec.train
    sched, m = str(p.pp_schedule), t.microbatches
    if p.pp == 1 or p.zero_stage < 2 or sched not in ("gpipe", "1f1b") or len(stages) != 1:
        return None
    if stages[0] == p.pp - 1:
        return PipelinePeak(False, sched == "1f1b" and m > 1)
    warm = m if sched == "gpipe" else min(m, p.pp - stages[0])
    if p.zero_stage == 2:
        steady = sched == "1f1b" and m > warm
        return PipelinePeak(not steady and warm == 1, steady)  # zero2 gathers only in the first forward
    return PipelinePeak(True, False)


def fsdp_peak_extra(spec: Any, params: list[LocalParam], stages: list[int]) -> tuple[int, int]:
    """(unsharded parameter elements, unsharded gradient elements) alive at the activation peak beyond the
    sharded storage. Every unit is unsharded under zero2; under zero3 none once the root's forward ended.
    Inside the root's forward (`peak_inside_forward`, `PipelinePeak.in_root_forward`) the last block's flat
    all-gather output is still referenced (_fsdp_param_group.py wait_for_unshard keeps it in
    comm_ctx.all_gather_state; the root's _fsdp_state.py _post_forward frees it) and, under zero3, the root
    (and the last block, inside it) are not yet resharded (_fsdp_param_group.py post_forward)."""
    p = spec.parallel
    managed = [q for q in params if not (q.is_expert and p.ep > 1)]  # ep experts are ignored_params
    units = fsdp_units(spec.model, managed)
    params_out = sum(unsharded_numel(u) for u in units.values()) if p.zero_stage == 2 else 0
    pipe = pipeline_peak(spec, stages)
    where = peak_inside_forward(spec) or ("root" if pipe and pipe.in_root_forward else None)
    grads_out = sum(unsharded_grad_numel(q, p.tp) for q in managed) if pipe and pipe.after_backward else 0
    blocks = sorted((k for k in units if k != "root"), key=lambda k: int(k.split(".")[1]))
    if where is None:
        return params_out, grads_out
    last = unsharded_numel(units[blocks[-1]]) if blocks else 0
    params_out += last  # the all-gather output buffer
    if p.zero_stage != 2:
        params_out += unsharded_numel(units.get("root", [])) + (last if where == "block" else 0)
    return params_out, grads_out
