"""The fullest moment inside a rank's backward (one layout or arrays of them): `backward_moment_bytes`.

The activation peak (rank_memory.py) is the end of forward. Backward then frees each block's saved tensors as it
goes, but holds what the forward never did: the block being back-propagated re-materialised (recompute) with its
backward's own tensors (block_backward.py), FSDP2's parameters of the current block and the prefetched one, the
unsharded gradients before their reduce-scatter and the reduce-scatter's fp32 input of the block before
(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py `pre_backward` / `_backward_prefetch` / `post_backward`:
one reduce-scatter input kept, `reduce_scatter_max_input_buffers` = 1), and the root's gradients, which FSDP2
reduces only once the whole backward is done. Candidates, each the sum of the rank's model state, FSDP2's buffers,
the held activations and the working block:
- the first block back-propagated (the stage's last), and the second (the first's reduce-scatter input alive; under
  zero2 the first resharded);
- under pipelining the stage's first block too: FSDP2 keeps every unit unsharded after its backward
  (reshard_after_backward=False) and accumulates unsharded gradients (no sync until the last microbatch), so the
  end of a stage's backward holds every block's parameters; in the first backward with every in-flight microbatch,
  in a later one with the accumulated gradients; under layers:K the stage's lowest checkpoint, re-run above the K - 1
  plain blocks' saved tensors; a later 1F1B backward of a stage past the first also holds the previous backward's
  stage-input gradient (both in pipelined_backward.py); GPipe's later loss backwards on the last stage, and what
  GPipe's finished microbatches and the looped schedules' one-chunk backwards hold otherwise (schedule_backward.py);
- the embeddings' backward (the stage with them): their dense gradient, then the root's post-backward
  reduce-scatter input (its fp32 unsharded size).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from backend.analytic.device import CUDA, rms_norm_saved_bytes
from backend.analytic.layout import Layout, RecomputeMode, ZeroStage
from backend.analytic.memory.activations import LayerShape
from backend.analytic.memory.block_backward import block_backward_extra, weight_grads
from backend.analytic.memory.parts import RankParts
from backend.analytic.memory.pipelined_backward import (
    PipeTerms,
    lowest_checkpoint,
    pipeline_backward,
    sent_grad_bytes,
    stage_grad_bytes,
)
from backend.analytic.memory.schedule_backward import (
    chunk_blocks,
    finished_microbatch_bytes,
    kept_stage_input,
    later_loss_bytes,
    later_units_bytes,
    overlapped_loss_graph,
    stale_logits_shards,
)
from backend.analytic.scalar_or_array import logical_and, logical_not, logical_or, maximum, minimum, per_distinct, where
from backend.analytic.traffic import MASTER_BYTES

if TYPE_CHECKING:
    from backend.analytic.memory.rank_activations import ActivationMoments
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

RMS_CPU_TEMPS = 3
"""The CPU's composite RMSNorm backward: fp32 (tokens, h) intermediates alive at once (measured op by op,
tests/unit/test_block_backward.py)."""


def block_extra(shape: LayerShape, held: bool) -> tuple[float, float]:
    """block_backward.block_backward_extra of one block of `shape` (its micro-batch, split, dtype and device; seq_len is
    this rank's share): (a plain or re-run block's, a selective plain block's), the weight grads held (FSDP2,
    `replicate`) or added in place. MoE blocks: the dense ledger at top_k x the expert's hidden (each token's rows), an
    approximation (not read off the engine op by op)."""
    s, h, b, tp, cb = shape.seq_len, shape.d_model, shape.micro_batch, shape.tp, shape.dtype_bytes
    norm = s * b * h / (tp if shape.sequence_parallel else 1)
    rb = 4 if shape.autocast else cb
    rms = shape.norm == "rmsnorm"
    kw = dict(s=s, b=b, h=h, a=shape.n_heads, ffn=shape.ffn * (shape.top_k if shape.n_experts else 1), t=tp,
              sp=shape.sequence_parallel, dtype_bytes=cb, autocast=shape.autocast, flash=shape.flash, mlp=shape.mlp,
              q_width=shape.q_width, v_width=shape.v_width,
              kv_heads=shape.kv_heads if shape.kv_heads != shape.n_heads else 0,
              wg=weight_grads(dtype_bytes=cb, autocast=shape.autocast, held=held),
              norm_saved=rms_norm_saved_bytes(sbh=norm, sb=norm / h, input_bytes=rb,
                                              device=shape.device) if rms else None,
              norm_temp=RMS_CPU_TEMPS * norm * 4 if rms and shape.device != CUDA else 0.0)
    return block_backward_extra(**kw), block_backward_extra(selective=True, **kw)


_EXTRA: dict[LayerShape, dict[tuple[int, ...], tuple[float, float]]] = {}


def _extra_at(proto: LayerShape, layout: Layout) -> Any:
    """`block_extra` of every layout, once per distinct (micro-batch, tp, SP, autocast, cp, dtype, held weight grads)
    and model (memoised across calls: the planner asks once per group of layouts, the groups share most rows)."""
    memo = _EXTRA.get(proto)
    if memo is None:
        if len(_EXTRA) > 64:
            _EXTRA.clear()
        memo = _EXTRA[proto] = {}

    def extra(*row: int) -> tuple[float, float]:
        hit = memo.get(row)
        if hit is None:
            b, tp, sp, ac, cp, cb, held = row
            shape = replace(proto, micro_batch=b, tp=tp, sequence_parallel=bool(sp), autocast=bool(ac), dtype_bytes=cb,
                            seq_len=proto.seq_len // cp)
            hit = memo[row] = block_extra(shape, bool(held))
        return hit

    held = logical_or(layout.fsdp, layout.uses_replicate)
    out = per_distinct(extra, layout.micro_batch, layout.tp, layout.sequence_parallel, layout.uses_autocast, layout.cp,
                       layout.compute_bytes, held)
    return out if isinstance(out, tuple) else (out[..., 0], out[..., 1])


def backward_moment_bytes(model: ModelSpec, layout: Layout, pp_rank: Num, parts: RankParts, acts: ActivationMoments,
                          state: Num, other: Num) -> Num:
    """Total bytes of the rank's fullest moment inside backward. `acts`: rank_activations.ActivationMoments; `state`:
    (params, grads, optimizer) bytes without FSDP2's unsharded state (model_state with nothing unsharded); `other`:
    the inputs."""
    proto = LayerShape.prototype(model, dtype_bytes=layout.compute_bytes, device=layout.device, sac_ops=layout.sac_ops)
    e_plain_none, e_selective = _extra_at(proto, layout)
    kind, ck, stages = layout.recompute, acts.ck, parts.stages
    n = stages.n_blocks
    one = acts.one_block_casts
    e_plain = where(kind == RecomputeMode.SELECTIVE, e_selective, e_plain_none)
    w_ckpt = acts.none + one + e_plain_none  # a re-run block while its backward runs
    w_plain = acts.plain + one + e_plain
    top_ckpt = logical_and(ck.units > 0, ck.after == 0)
    uniform = kind == RecomputeMode.UNIFORM
    top_saved = where(top_ckpt, acts.unit, acts.plain + one)
    top_w = where(top_ckpt, ck.rerun_blocks * (acts.none + one) + e_plain_none, w_plain)
    k = maximum(layout.recompute_layers, 1)
    per_block = logical_or(kind == RecomputeMode.FULL, kind == RecomputeMode.OP, kind == RecomputeMode.BLOCK,
                           logical_and(kind == RecomputeMode.LAYERS, k == 1))
    second_ckpt = logical_and(ck.units > 0, logical_or(ck.after == 1, logical_and(ck.after == 0, per_block)))
    second_saved = where(second_ckpt, acts.unit, acts.plain + one)
    second_w = where(second_ckpt, w_ckpt, w_plain)
    pb, fsdp, zero3 = layout.fsdp_param_bytes, layout.fsdp, layout.zero_stage == ZeroStage.ZERO3
    blk = parts.last_block.fsdp_unsharded_numel
    root = stages.first * parts.embeddings.fsdp_unsharded_numel + stages.last * parts.head.fsdp_unsharded_numel
    units = parts.total("fsdp_unsharded_numel")
    grad_bytes = where(layout.uses_autocast, MASTER_BYTES, layout.compute_bytes)  # what FSDP2's unsharded grads hold
    all_grads = parts.total("fsdp_unsharded_grad_numel")
    head_grads = stages.last * parts.head.fsdp_unsharded_grad_numel
    replicate = layout.uses_replicate
    # the head's backward freed its saved tensors, and the logits unless the loop holds them
    logits = layout.seq_local(model) * layout.micro_batch * model.vocab_size * layout.compute_bytes
    base = state + other + acts.held - acts.head_freed - stale_logits_shards(model, layout, parts) - where(
        logical_and(stages.last, logical_not(logits_held(layout))), logits, 0)

    # --- without pipelining: the first blocks back-propagated ---
    head_wg = where(logical_or(fsdp, replicate), grad_bytes * head_grads, 0)  # the root's grads wait for the end
    rs_prev = where(logical_or(fsdp, replicate), MASTER_BYTES * blk, 0)  # the reduce-scatter input of the block before

    def alone(removed: Num, work: Num, gathered: Num, done: Num, below: Num, rs: Num) -> Num:
        """Blocks' saved bytes `removed` from what the backward started with, the working set `work`; zero3 holds the
        root, the `gathered` blocks and the prefetched next one (`below`: whether that one is not gathered yet),
        zero2 every unit but the `done` ones; `rs`: the reduce-scatter input of the block before."""
        params = where(zero3, root + gathered * blk + where(below, blk, 0), units - done * blk)
        return base - removed + work + where(fsdp, pb * params, 0) + head_wg + where(rs, rs_prev, 0)

    r = ck.rerun_blocks
    per_top = alone(top_saved, top_w, 1, 0, n > 1, False)
    per_second = where(n > 1, alone(top_saved + second_saved, second_w, 1, 1, n > 2, True), 0)
    # uniform: the last group's r blocks re-run (and gather) at once, so the prefetch of the block after the working
    # one finds it gathered until the group's last block; then its second block; then the group before
    group = acts.none + one
    earlier = minimum(k, n - r)
    uni_top = alone(acts.unit, r * group + e_plain_none, r, 0, logical_and(r == 1, n > 1), False)
    uni_second = where(r > 1, alone(acts.unit, (r - 1) * group + e_plain_none, r - 1, 1,
                                    logical_and(r == 2, n > r), True), 0)
    uni_earlier = where(n > r, alone(2 * acts.unit, earlier * group + e_plain_none, earlier, r,
                                     logical_and(earlier == 1, n > r + 1), True), 0)
    # the first block's post-backward: it resharded, the reduce-scatter's fp32 input made while its unsharded grads
    # are still alive (_fsdp_collectives.foreach_reduce: copied in, then cleared), its input's grad flowing
    flow = stage_grad_bytes(model, layout)
    reduce_now = where(logical_or(fsdp, replicate), grad_bytes * parts.last_block.fsdp_unsharded_grad_numel
                       + rs_prev, 0)
    post_top = alone(top_saved, flow + reduce_now, 0, 1, n > 1, False)
    uni_post = alone(acts.unit, (r - 1) * group + flow + reduce_now, r - 1, 1, logical_and(r <= 2, n > r), False)
    unaligned = maximum(maximum(per_top, per_second), post_top)
    alone_best = where(uniform, maximum(maximum(uni_top, uni_second), maximum(uni_earlier, uni_post)), unaligned)
    # the forward's last unshard (every microbatch's forward re-gathers: the units were resharded by the backward
    # before): the last block's parameters copied out of its all-gather buffer while the previous one's buffer is
    # still referenced (freed when the next unshard waits), the earlier blocks' saved tensors held
    gathering = where(zero3, root + blk, units) + where(n > 1, 2, 1) * blk
    learned = str(getattr(model, "positions", "learned")) == "learned"
    pos = stages.first * layout.seq_local(model) * 8 * learned  # int64 arange of the learned positions
    last_unshard = state + other + acts.blocks - top_saved + pos + pb * gathering
    alone_best = maximum(alone_best, where(fsdp, last_unshard, 0))

    # --- pipelining: FSDP2 units stay unsharded after their backward, grads accumulate unsharded (no sync until the
    # last microbatch); the schedule runs inside one autocast region, so autocast's cache keeps every block's weight
    # casts (and the head's), shared by every microbatch's graph ---
    pipe = pipeline_backward(layout, pp_rank)
    pipe_base = base + acts.cached_casts + acts.head_casts  # the head's copy is cached too
    gathered_top = where(zero3, root + blk + where(n > 1, blk, 0), units)
    all_unsharded = where(fsdp, pb * units, 0)
    grads_all = where(fsdp, grad_bytes * all_grads, 0)
    # a re-run block's weight casts come out of the autocast cache (pipe_base holds them), and a plain block's are in
    # what the stage holds: the working blocks add their activations and backward tensors only
    pipe_top_w = where(top_ckpt, ck.rerun_blocks * acts.none + e_plain_none, w_plain)
    reruns = where(uniform, minimum(k, n), 1)  # blocks re-run at the last group's start (uniform) or working alone
    bottom_w = reruns * acts.none + e_plain_none
    # a later backward's 16-bit weight grads wait for the shared cast's node (made by the first microbatch's forward,
    # so the autograd engine runs it last): one block's casts' worth per block back-propagated before the working ones
    # (tests/multiprocess/test_fullest_moment.py's pipelined grid, read op by op: they are copied out after the
    # embeddings' backward)
    held_all = chunk_blocks(layout, parts) * one + acts.head_casts  # looped: the working chunk's only
    # the first backward: every in-flight microbatch, gradients made as it goes
    emb_grads = where(fsdp, grad_bytes * stages.first * parts.embeddings.fsdp_unsharded_grad_numel, 0)
    first_top = pipe_base - top_saved + pipe_top_w + where(fsdp, pb * gathered_top, 0)
    first_bottom = pipe_base - acts.blocks + bottom_w + all_unsharded + grads_all - emb_grads  # embeddings' come last
    # a later one: a steady-state backward follows a forward (which resharded every zero3 unit) with as many in
    # flight; a cool-down one follows the previous backward with one fewer, every unit still unsharded
    steady = pipe_base + grads_all + overlapped_loss_graph(parts, layout, acts)
    cool = pipe_base - finished_microbatch_bytes(model, layout, parts, acts) + grads_all
    kept_input = kept_stage_input(model, layout, parts)  # GPipe: the working microbatch's stays too
    sent_grad = sent_grad_bytes(model, layout, parts)
    later_top = acts.head_casts + sent_grad + maximum(
        where(pipe.steady, steady - top_saved + pipe_top_w + where(fsdp, pb * gathered_top, 0), 0),
        cool - top_saved + pipe_top_w + all_unsharded)

    def later_bottom_at(working: Num) -> Num:
        """A later backward at the stage's first block, `working` blocks re-run at once: the grads of the n - working
        blocks back-propagated before it held (the head's 16-bit grad waits the same way)."""
        work = working * acts.none + e_plain_none
        held_wgrads = (chunk_blocks(layout, parts) - working) * one + acts.head_casts + sent_grad
        freed = acts.blocks - kept_input
        return maximum(where(pipe.steady, steady, cool) - freed + work + held_wgrads + all_unsharded,
                       cool - freed + work + held_wgrads + all_unsharded)

    # uniform: the last group's blocks re-run at once, then the stage's first block back-propagated alone (the
    # group's other blocks' grads held)
    later_bottom = maximum(later_bottom_at(reruns), where(uniform, later_bottom_at(1), 0))
    piped = maximum(maximum(first_top, first_bottom), where(pipe.has_later, maximum(later_top, later_bottom), 0))
    terms = PipeTerms(base=pipe_base, steady=steady, cool=cool, grads=grads_all - emb_grads, unsharded=all_unsharded,
                      sent_grad=sent_grad, pipe=pipe, n_blocks=n, rerun_extra=e_plain_none, grad_bytes=grad_bytes)
    piped = maximum(piped, lowest_checkpoint(layout, acts, parts, terms))
    piped = maximum(piped, later_loss_bytes(model, layout, parts, cool, all_unsharded, pipe, acts))
    # the first stage's embeddings: their dense gradient is made (the first backward: it becomes the root's
    # unsharded gradient; a later one: added into it)
    dense = embedding_grad_bytes(layout, parts)
    first_emb = pipe_base - acts.blocks + dense + all_unsharded + grads_all - emb_grads
    later_emb = (where(pipe.steady, steady, cool) - acts.blocks + dense + held_all
                 + later_units_bytes(layout, parts, all_unsharded))
    piped = maximum(piped, where(stages.first, maximum(first_emb, where(pipe.has_later, later_emb, 0)), 0))

    blocks_moment = where(n > 0, where(layout.pipelined, piped, alone_best), 0)
    return maximum(blocks_moment,
                   where(layout.pipelined, 0, embedding_moment(layout, parts, base, acts, grad_bytes, pb)))


def logits_held(layout: Layout) -> Num:
    """activations.logits_held_in_backward on layouts: the training loop (or a pipeline schedule) still holds the
    logits in backward, except under the pure FSDP strategies and tp mixes."""
    return logical_or(layout.pipelined, logical_and(layout.tp == 1, logical_not(logical_and(layout.fsdp,
                                                                                           logical_not(layout.is_mix)))))


def embedding_grad_bytes(layout: Layout, parts: RankParts) -> Num:
    """The embeddings' dense gradient their backward makes (fp32 under autocast: the lookup runs in fp32), on the stage
    with them: the full (V, h) under a vocab-parallel split (sharding.unsharded_grad_numel)."""
    elems = where(logical_or(layout.fsdp, layout.uses_replicate), parts.embeddings.fsdp_unsharded_grad_numel,
                  parts.embeddings.local_numel)
    return parts.stages.first * elems * where(layout.uses_autocast, MASTER_BYTES, layout.compute_bytes)


def embedding_moment(layout: Layout, parts: RankParts, base: Num, acts: ActivationMoments, grad_bytes: Num,
                     pb: Num) -> Num:
    """Without pipelining, the stage with the embeddings at the end of its backward: their dense gradient made, then
    (FSDP2) the root's post-backward: its unsharded parameters freed, its gradients copied into the reduce-scatter's
    fp32 input. Every block's saved tensors are gone; the root's head gradients were held since the head's backward."""
    stages = parts.stages
    fsdp, zero3 = layout.fsdp, layout.zero_stage == ZeroStage.ZERO3
    emb_grad = stages.first * parts.embeddings.fsdp_unsharded_grad_numel
    head_grad = stages.last * parts.head.fsdp_unsharded_grad_numel
    root = stages.first * parts.embeddings.fsdp_unsharded_numel + stages.last * parts.head.fsdp_unsharded_numel
    units = parts.total("fsdp_unsharded_numel")
    held = base - acts.blocks
    made = held + embedding_grad_bytes(layout, parts) + where(fsdp,
                                                              pb * where(zero3, root, units) + grad_bytes * head_grad
                                                              + MASTER_BYTES * parts.last_block.fsdp_unsharded_numel, 0)
    post = held + grad_bytes * (emb_grad + head_grad) + MASTER_BYTES * root + where(zero3, 0, pb * (units - root))
    return where(stages.first, maximum(made, where(fsdp, post, 0)), 0)
