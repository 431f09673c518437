"""Activation bytes of one rank at the engine's activation peak, for one layout or arrays of them.

The peak is the largest of: the end of the last microbatch's forward + loss (16-bit logits: + loss_fn's fp32
copy); under torch.autocast the 16-bit weight copies the matmuls save and the end of forward inside autocast
(every weight and bias cast cached); under full recompute the last block re-run in backward after the head's
backward freed its tensors. Under pipelining a rank holds its in-flight microbatches' saved tensors, every
non-first stage's input buffers, the sent stage outputs (pipelining.py) and, on the last stage, each in-flight
microbatch's loss graph. The per-block and head terms come from activations.py, once per distinct sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from backend.analytic.layout import RECOMPUTE_NAMES, Layout, RecomputeMode
from backend.analytic.memory.activations import (
    FUSED_LOSS_ROW_BYTES,
    LOSS_BYTES,
    LayerShape,
    layer_activation_bytes,
    model_embedding_head_activation_bytes,
    model_head_freed_in_backward_bytes,
    op_sac_rerun_extra_bytes,
    tp_logits_shard_bytes,
)
from backend.analytic.memory.compiled_block import compiled_block_bytes
from backend.analytic.memory.expert_casts import (
    grouped_excess_bytes,
    grouped_expert_elems,
    inside_grouped_block,
    previous_logits_bytes,
)
from backend.analytic.memory.family_bytes import attention_constant_bytes
from backend.analytic.memory.parts import RankParts, attention_kind_counts, is_mixed, moe_blocks
from backend.analytic.memory.pipeline_activations import pipeline_saved, split_backward
from backend.analytic.memory.policy_blocks import Checkpointing, KindBytes, checkpointing, kind_bytes, policy_blocks
from backend.analytic.params import layer_is_moe
from backend.analytic.scalar_or_array import (
    as_int,
    logical_and,
    logical_not,
    logical_or,
    maximum,
    per_distinct,
    per_value,
    take_rows,
    where,
)

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

TERMS = 6
COMPILED = "compiled:"
"""_block_bytes' prefix of a policy ("none" or "selective") for a block under torch.compile."""


def layer_terms(shape: LayerShape, recompute: int, vocab: int, block: Callable[[str], float] | None = None,
                head: tuple[float, float, float] | None = None) -> tuple[float, ...]:
    """(a non-checkpointed block's saved bytes (selective: its own), a checkpoint unit's saved bytes (its input; op:
    + the saved op outputs), one block while it is re-run (no recompute's bytes; op: + what is still cached), the
    embedding + head bytes at the end of forward, the head's share freed by its backward, the TP logits shard).
    block, head: _block_bytes of this shape by policy name and its _head_terms (a caller's memo of them)."""
    kind = RECOMPUTE_NAMES[recompute]
    block = block or (lambda policy: _block_bytes(shape, policy))
    # a compiled block outside any checkpoint keeps what Inductor saves; the re-run of a checkpointed compiled block
    # is not measured and keeps the eager terms (an upper bound)
    plain_policy = "selective" if kind == "selective" else "none"
    plain = block(COMPILED + plain_policy if shape.compiled else plain_policy)
    unit = block("op" if kind == "op" else "full")
    rerun_block = block("none") + (op_sac_rerun_extra_bytes(shape) if kind == "op" else 0.0)
    return (plain, unit, rerun_block, *(head or _head_terms(shape, vocab)))


@lru_cache(maxsize=1 << 14)
def _block_bytes(shape: LayerShape, recompute: str) -> float:
    """layer_activation_bytes, once per shape and policy (the recompute kinds of one shape share most of them);
    COMPILED + policy: what a compiled block keeps, where measured (memory/compiled_block.py), else the eager
    policy's bytes."""
    if recompute.startswith(COMPILED):
        policy = recompute[len(COMPILED):]
        compiled = compiled_block_bytes(shape, selective=policy == "selective")
        return layer_activation_bytes(shape, policy) if compiled is None else compiled
    return layer_activation_bytes(shape, recompute)


@lru_cache(maxsize=1 << 14)
def _head_terms(shape: LayerShape, vocab: int) -> tuple[float, float, float]:
    """layer_terms' embedding + head bytes, the head's share its backward frees, the TP logits shard: the same for
    every recompute kind."""
    head = shape.head_kwargs(vocab)
    return (model_embedding_head_activation_bytes(**head), model_head_freed_in_backward_bytes(**head),
            tp_logits_shard_bytes(s=shape.seq_len, b=shape.micro_batch, vocab=vocab, t=shape.tp,
                                  dtype_bytes=shape.dtype_bytes))


_TERMS: dict[tuple[LayerShape, int], dict[tuple[int, ...], tuple[float, ...]]] = {}


def _layer_terms_at(proto: LayerShape, vocab: int) -> Any:
    """A memoised `row -> layer_terms` for one model and dtype: row = (micro-batch, tp, SP, recompute kind, autocast,
    ep, cp); the prototype holds the whole sequence, a cp rank seq_len / cp of it."""
    memo = _TERMS.get((proto, vocab))
    if memo is None:
        if len(_TERMS) > 64:
            _TERMS.clear()
        memo = _TERMS[(proto, vocab)] = {}

    # the recompute kinds of a row share its shape, and its block bytes by policy (a dict on the policy name: the
    # lru caches hash every field of the shape on each call)
    shapes: dict[tuple[int, ...], tuple[LayerShape, Callable[[str], float], tuple[float, float, float]]] = {}

    def terms(*row: int) -> tuple[float, ...]:
        hit = memo.get(row)
        if hit is None:
            b, tp, sp, rc, ac, ep, cp, etp = row
            entry = shapes.get((b, tp, sp, ac, ep, cp, etp))
            if entry is None:
                shape = replace(proto, micro_batch=b, tp=tp, sequence_parallel=bool(sp), autocast=bool(ac),
                                ep=ep if proto.n_experts else 1, etp=etp, seq_len=proto.seq_len // cp)
                entry = shapes[(b, tp, sp, ac, ep, cp, etp)] = (shape, _policy_memo(shape), _head_terms(shape, vocab))
            hit = memo[row] = layer_terms(*entry[:1], rc, vocab, *entry[1:])
        return hit

    return terms


def _policy_memo(shape: LayerShape) -> Callable[[str], float]:
    """_block_bytes(shape, policy), memoised on the policy name."""
    saved: dict[str, float] = {}

    def block(policy: str) -> float:
        hit = saved.get(policy)
        if hit is None:
            hit = saved[policy] = _block_bytes(shape, policy)
        return hit

    return block


def autocast_casts(model: ModelSpec, layout: Layout, parts: RankParts) -> tuple[Num, Num, Num]:
    """(block Linear weights, lm_head weight, block Linear biases) as autocast's 16-bit casts: every Linear runs on
    cast copies of its fp32 weight and bias; the matmul saves the weight copy for backward, the bias copy lives in
    autocast's cache until the autocast region exits. A tied model without pipeline stages runs lm_head on
    tok_emb's weight. fp8: the block Linears are torchao Float8Linear (strategies/float8.py), whose matmul saves the
    fp32 weight itself and its input as it comes (measured op by op: the same input bytes as autocast's copies, no
    weight or bias cast); lm_head stays an autocast Linear."""
    cb = layout.compute_bytes
    tied_alone = logical_and(bool(getattr(model, "tie_embeddings", False)), layout.n_stages == 1)
    head = parts.total("head_weight_numel") + where(tied_alone, parts.embeddings.token_embedding_numel, 0)
    if layout.precision == "fp8":  # torchao's float8 linears keep their fp32 weight (no cast) and add a transient bias
        return (0, cb * head, 0)
    grouped_w, grouped_b = (moe_blocks(model, parts.stages) * x for x in grouped_expert_elems(model, layout))
    return (cb * (parts.total("linear_weight_numel") - grouped_w), cb * head,
            cb * (parts.total("linear_bias_numel") - grouped_b))


def rank_activation_terms(model: ModelSpec, layout: Layout, alt: bool = False) -> tuple:
    """`layer_terms` of every layout (once per distinct micro-batch, tp, SP, recompute, autocast, ep and cp; memoised
    on the table of layouts); alt: of the other MLP kind's blocks (parts.ALT_PART, mixed stacks)."""
    proto = LayerShape.prototype(model, dtype_bytes=layout.compute_bytes, device=layout.device, alt=alt,
                                 sac_ops=layout.sac_ops)
    if layout.loss_compiled:
        proto = replace(proto, fused_loss=True)
    if layout.blocks_compiled:
        proto = replace(proto, compiled=True)

    def compute() -> Any:
        ep = layout.ep if proto.n_experts else 1  # a dense block's shape does not read ep (_layer_terms_at)
        etp = where(ep > 1, layout.etp, 1)  # nor etp, which splits the experts only under ep
        return per_distinct(_layer_terms_at(proto, model.vocab_size), layout.micro_batch, layout.tp,
                            layout.sequence_parallel, layout.recompute, layout.uses_autocast, ep, layout.cp, etp)

    values = layout.memoised(("layer terms", proto, model.vocab_size), compute)
    return values if isinstance(values, tuple) else tuple(values[..., i] for i in range(TERMS))


@dataclass(frozen=True)
class ActivationMoments:
    """A rank's activation bytes at the moments the memory model compares (scalars or arrays): `peak` the activation
    peak (the categories' moment), `forward` the end of the last forward + loss (what the loss's backward starts
    from), and the terms the moments inside backward are built from (memory/backward_moment.py)."""
    peak: Num
    forward: Num
    forward_loss: Num
    """The end of forward once the loss is computed (autocast's cache freed, except inside a pipeline schedule's one
    autocast region): what the loss's backward starts from."""
    held: Num
    """Saved tensors held when a backward of the rank's stage starts: every in-flight microbatch, the stage buffers,
    under autocast the plain blocks' 16-bit weight copies (the head's tensors included: its backward frees them)."""
    blocks: Num
    """One microbatch's saved bytes of all the rank's blocks under the policy."""
    head_freed: Num
    """What the head's backward frees (the stage with the logits; 0 elsewhere)."""
    plain: Num
    unit: Num
    none: Num
    """Saved bytes of one plain block, one checkpoint unit (its input), one block with nothing recomputed."""
    one_block_casts: Num
    """autocast: one block's 16-bit weight and bias copies (a re-run block makes them again)."""
    cached_casts: Num
    """autocast: every block's 16-bit weight and bias copies beyond the plain blocks' (what autocast's cache holds while
    its region lasts: through the backwards too under pipelining, whose schedule runs inside one autocast region)."""
    head_casts: Num
    """autocast: the lm_head weight's 16-bit copy on the stage with the head (0 elsewhere)."""
    ck: Checkpointing
    weight_pass_rerun: Num = 0.0
    """Checkpointed blocks: what a split backward's weight pass re-materialises above the held bytes (one block re-run
    with its 16-bit weight copies; memory/split_backward.py); 0 otherwise."""


def rank_activation_bytes(model: ModelSpec, layout: Layout, pp_rank: Num, parts: RankParts) -> Num:
    """Activation bytes of one rank at its activation peak (module docstring); layout fields and pp_rank broadcast
    together."""
    return rank_activation_moments(model, layout, pp_rank, parts).peak


def rank_activation_moments(model: ModelSpec, layout: Layout, pp_rank: Num, parts: RankParts) -> ActivationMoments:
    """`ActivationMoments` of one rank; layout fields and pp_rank broadcast together."""
    cb, autocast = layout.compute_bytes, layout.uses_autocast
    terms = rank_activation_terms(model, layout)
    plain_b, unit_b, _, emb_head, head_freed_bytes, shard = terms
    stages = parts.stages
    ck = checkpointing(model, layout, stages.n_blocks)
    pb = policy_blocks(model, layout, pp_rank, parts, ck, _kinds(model, layout, parts, terms))
    blocks = pb.blocks + attention_kind_correction(model, layout, pp_rank, stages.n_blocks, ck.plain)
    pipelined = layout.pipelined

    def saved(lay: Layout, rank: _Rows, prt: RankParts, rows_terms: _Rows, ac: _Rows, pipe: bool) -> Num:
        if pipe:
            return pipeline_saved(model, lay, rank.values, prt, rows_terms.values, ac.values)
        blocks_, emb_head_, shard_ = rows_terms.values
        return blocks_ + emb_head_ + shard_

    n = len(layout)
    total = per_value(pipelined, saved, layout, _Rows(pp_rank, n), parts, _Rows((blocks, emb_head, shard), n),
                      _Rows(autocast, n))
    not_last_stage = logical_and(pipelined, logical_not(stages.last))
    head_freed = where(not_last_stage, 0.0, head_freed_bytes)
    # the last block's MLP output, alive next to the residual sum that ends a non-last stage's forward
    seq = layout.seq_local(model)
    mlp_out = layout.micro_batch * seq * model.d_model / where(layout.sequence_parallel, layout.tp, 1) * cb
    forward_transient = where(not_last_stage, mlp_out, 0.0)
    w_blocks, w_head, b_blocks = (where(autocast, x, 0) for x in autocast_casts(model, layout, parts))
    checkpointed = logical_and(ck.units > 0, stages.n_blocks > 0)
    # a checkpointed block saves no 16-bit weight copy: only the plain blocks' casts stay
    kept_casts = where(stages.n_blocks > 0, w_blocks * pb.kept_weight_share, 0)
    sbv = seq * layout.micro_batch * model.vocab_size
    # loss_fn's fp32 copy of 16-bit logits (model_loss_transient_bytes); a compiled loss upcasts inside its kernel
    loss_copy = 0.0 if cb == 4 or layout.loss_compiled else sbv * 4
    # what the loss saves beyond the logits: the fp32 log-probs, or the compiled loss's two fp32 values per row
    loss_saved = seq * layout.micro_batch * FUSED_LOSS_ROW_BYTES if layout.loss_compiled else sbv * 4
    forward_last = total + w_head + kept_casts + loss_copy
    # a pipeline schedule computes the loss inside its one autocast region: the checkpointed blocks' casts stay cached
    forward_loss = forward_last + where(pipelined, w_blocks + b_blocks - kept_casts, 0)
    # end of forward, inside autocast: every weight and bias cast still cached, no loss yet, and the previous
    # microbatch's logits still bound in the training loop
    inside_autocast = (total - loss_saved - LOSS_BYTES + w_head + w_blocks + b_blocks
                       + where(layout.microbatches > 1, sbv * cb, 0))
    forward_last = where(autocast, maximum(forward_last, inside_autocast), forward_last)
    # what the end of the blocks holds besides their saved tensors: the cached casts, the previous logits still bound
    held_at_blocks_end = where(autocast, w_blocks + b_blocks, 0) + previous_logits_bytes(model, layout)
    forward = where(stages.last, forward_last, total + w_blocks + b_blocks + forward_transient)
    # split-backward schedules are measured hook-free (bench/memory.py): the re-run block counts as Temp
    split = split_backward(layout)
    # one block's casts again, of the first re-run span's kind
    one_block = pb.rerun_casts / maximum(ck.rerun_blocks, 1)
    # the first re-run in backward: the last checkpoint unit, once the plain blocks after it and the head freed theirs;
    # uniform: also the last full group of N blocks, once the (smaller) last group freed its input
    rerun = pb.rerun_none - pb.rerun_unit + pb.rerun_transient
    # under autocast one more fp32 (b, s, h) while a block or group re-runs (measured on the CPU: uniform:2 /
    # uniform:3 and, without pipelining, layers:2, GPT and Llama blocks; tests/unit/test_recompute_policies.py); a
    # pipelined per-block policy is unmeasured at its re-run peak and keeps without
    residual_copy = where(logical_and(autocast, logical_or(layout.recompute == RecomputeMode.UNIFORM,
                                                           logical_not(pipelined))),
                          layout.micro_batch * seq * model.d_model * 4 / where(layout.sequence_parallel, layout.tp, 1),
                          0)
    # the plain blocks before the re-run one still hold their 16-bit weight copies (those after it freed theirs);
    # a pipeline schedule's casts are counted by pipeline_saved
    held_casts = where(pipelined, 0.0, maximum(0.0, kept_casts - pb.after_casts))
    rerun_peak = (total + maximum(0.0, rerun - head_freed - pb.after_plain) + pb.rerun_casts + residual_copy
                  + held_casts)
    k = maximum(layout.recompute_layers, 1)
    earlier_group = logical_and(layout.recompute == RecomputeMode.UNIFORM, ck.rerun_blocks < k, ck.units > 1)
    group_peak = total + maximum(0.0, pb.group_none - 2 * unit_b - head_freed) + pb.group_casts + residual_copy
    rerun_peak = where(earlier_group, maximum(rerun_peak, group_peak), rerun_peak)
    peak = where(logical_and(checkpointed, logical_not(split)), maximum(forward, rerun_peak), forward)
    # the blocks' saved bytes at the end of the last forward: one microbatch's head not made yet
    head_one = where(logical_or(logical_not(pipelined), stages.last), emb_head + shard, 0.0)
    in_block = inside_grouped_block(model, layout, ck, total - head_one, held_at_blocks_end)
    peak = as_int(maximum(peak, in_block))
    # a weight pass runs its blocks in forward order: layers:K's first checkpoint (a chunk's K-th block) re-runs once
    # the K - 1 plain blocks before it have freed their saved tensors and 16-bit weight copies
    ahead = where(layout.recompute == RecomputeMode.LAYERS, k - 1, 0)
    weight_pass_rerun = where(checkpointed, maximum(0.0, rerun) + pb.rerun_casts - ahead * (plain_b + one_block), 0.0)
    return ActivationMoments(peak=peak, forward=forward, forward_loss=forward_loss, held=total + kept_casts,
                             weight_pass_rerun=weight_pass_rerun,
                             blocks=blocks, head_freed=head_freed, plain=plain_b, unit=pb.rerun_unit,
                             none=pb.rerun_none / maximum(ck.rerun_blocks, 1),
                             one_block_casts=one_block, cached_casts=w_blocks + b_blocks - kept_casts,
                             head_casts=w_head, ck=ck)


def _kinds(model: ModelSpec, layout: Layout, parts: RankParts, terms: tuple) -> tuple[KindBytes, KindBytes]:
    """Block 0's kind's bytes and, in a mixed stack, the other kind's (mixed_blocks.KindBytes): the saved-bytes terms
    and one block's 16-bit weight and bias copies under autocast."""
    on = where(layout.uses_autocast, layout.compute_bytes, 0)
    # the dense dispatch's accumulator, in the residual stream's dtype (fp32 under autocast); the expert-parallel
    # dispatch's buffers at its re-run are not measured
    accumulator = where(layout.ep > 1, 0, layout.micro_batch * layout.seq_local(model) * model.d_model
                        * where(layout.uses_autocast, 4, layout.compute_bytes))
    accumulator = maximum(accumulator, grouped_excess_bytes(model, layout))
    moe0 = layer_is_moe(model, 0)
    grouped_w, grouped_b = grouped_expert_elems(model, layout)
    base = kind_bytes(terms, (on * (parts.block.linear_weight_numel - (grouped_w if moe0 else 0)),
                              on * (parts.block.linear_bias_numel - (grouped_b if moe0 else 0))),
                      accumulator if moe0 else 0.0)
    if not is_mixed(model):
        return base, base
    alt = kind_bytes(rank_activation_terms(model, layout, alt=True),
                     (on * (parts.alt_block.linear_weight_numel - (0 if moe0 else grouped_w)),
                      on * (parts.alt_block.linear_bias_numel - (0 if moe0 else grouped_b))),
                     0.0 if moe0 else accumulator)
    return base, alt


def attention_kind_correction(model: ModelSpec, layout: Layout, pp_rank: Num, n_blocks: Num,
                              plain_blocks: Num | None = None) -> Num:
    """The rank's blocks' per-layer constants (family_bytes.attention_constant_bytes: rotary tables, a windowed flash
    layer's mask) where its blocks differ from block 0's attention kind, which the block term counts for every
    block: sum over the rank's blocks minus n_blocks x block 0's. Checkpointed blocks (full, op, and the units of
    layers:K / block:N / uniform:N) keep no constant; plain blocks keep their policy's (none or selective). With a
    policy that mixes both, the kinds are taken spread over plain and checkpointed blocks in proportion."""
    counts = attention_kind_counts(model, layout, pp_rank)
    if counts is None:
        return 0.0
    n_rope, n_windowed = counts
    proto = LayerShape.prototype(model, dtype_bytes=layout.compute_bytes, device=layout.device)
    rope0, windowed0 = proto.rope and not proto.nope, proto.windowed

    def constants(recompute: int) -> tuple[float, float]:
        kind = RECOMPUTE_NAMES[recompute]
        rc = kind if kind in ("none", "selective") else "none"  # of the plain blocks
        return (attention_constant_bytes(proto, rc, rope=True, windowed=False),
                attention_constant_bytes(proto, rc, rope=False, windowed=True))

    per = per_distinct(constants, layout.recompute)
    rope_bytes, window_bytes = per if isinstance(per, tuple) else (per[..., 0], per[..., 1])
    plain_share = 1.0 if plain_blocks is None else plain_blocks / maximum(n_blocks, 1)
    return plain_share * ((n_rope - n_blocks * rope0) * rope_bytes + (n_windowed - n_blocks * windowed0) * window_bytes)


class _Rows:
    """Per-layout values carried through scalar_or_array.per_value (restricted with the table's rows)."""

    def __init__(self, values: Any, n: int):
        self.values, self.n = values, n

    def take(self, rows: Any) -> _Rows:
        if isinstance(self.values, tuple):
            return _Rows(tuple(take_rows(v, rows, self.n) for v in self.values), len(rows))
        return _Rows(take_rows(self.values, rows, self.n), len(rows))
