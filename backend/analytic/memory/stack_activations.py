"""Activation bytes of one rank as a non-default stack saves them (issue 34 part 2), one layout or arrays of them.

Per block (one microbatch; s = seq_len / cp, b micro-batch, h hidden, a heads, h_kv = kv heads x head width, f the
MLP width, g = 2 for a gated MLP, t = tp, t_sp = t under sequence parallelism, c = the 16-bit compute bytes):
- Megatron-Core + Transformer Engine (elementwise fused; fused or Megatron's unfused attention): memory/te_block.py,
  read from Megatron-LM d98e8a64 and TE d0067d0 (research notes Sec 2.2-2.3): standard and multi-latent attention,
  dense and MoE MLPs (N = s b / t_sp tokens routed per rank), each with what Megatron's --recompute-modules frees
  under selective recompute.
- Eager torch blocks (torchtitan, DeepSpeed: elementwise eager or compiled): this engine's own block model
  (activations.layer_activation_bytes), without autocast (FSDP2's MixedPrecisionPolicy / DeepSpeed's 16-bit module
  run the block in bf16) and with the stack's attention kernel. A compiled block (elementwise compiled) keeps what
  memory/compiled_block.py measured Inductor keeping (its families; the eager terms elsewhere), and under op-level
  SAC not its last linear's output, which only the residual add reads (`_block_terms`); torchao's float8 saved casts
  are not modelled (research notes Sec 4.1).
Recompute: full keeps each checkpoint unit's input (c s b h / t_sp); selective under TE checkpoints the stack's
recompute modules (core_attn by default: Q, K, V and O are saved anyway, research notes Sec 2.3); one block re-runs at a
time in backward. Blocks of two MLP kinds (a dense prefix before MoE blocks) are priced per kind.

Head, on the stage with the logits (n = s b V / t_v logits, t_v = t under loss parallel, else 1):
- Megatron: the final norm's input and stats and the output layer's input (c s b h / t_sp each),
  `VocabParallelCrossEntropy` (tensor_parallel/cross_entropy.py 19-210): an fp32 copy of the logits worked in place,
  the fp32 softmax saved; forward peak (c + 4) n, backward peak 4 n + c n (the in-place grad, cast back).
- torch's loss: under loss parallel, `_log_softmax` (torch/distributed/tensor/parallel/loss.py @3be1238): forward
  peak c + 4 + 4 + 4 B per logit (logits, fp32 copy, shifted, exp), backward peak 16 (research notes Sec 3.2);
  otherwise torchtitan's `cross_entropy(pred.float())` with `del pred` before backward (aten's log_softmax + nll_loss,
  measured: tests/unit/test_stack_memory.py): forward peak c + 4 + 4 (logits, fp32 copy, log-probs), backward peak 12
  (log-probs, nll's and log_softmax's gradients); the fp32 log-probs kept; the output layer saves its all-gathered
  input (c s b h) and the final norm its input (c s b h / t_sp) and rstd.
- torch's loss under torch.compile (train.loss_compiled, torchtitan's default with compile; not under loss parallel,
  whose DTensor `_log_softmax` path keeps the eager terms above): Inductor saves the 16-bit logits and two fp32
  values per row (the max and the log-sum-exp) and fuses the upcast, log-softmax and gradient into row kernels, so
  the forward peaks at the logits (c), the logits stay (c), and the backward peaks at them and their 16-bit gradient
  (2c) (measured with torch 2.13's Inductor on the CPU: tests/unit/test_stack_memory.py; the partition is the same
  FX graph on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from backend.analytic import moe_rows
from backend.analytic.layout import RECOMPUTE_NAMES, Layout
from backend.analytic.memory.activations import (
    STAT_BYTES,
    LayerShape,
    layer_activation_bytes,
    op_sac_rerun_extra_bytes,
)
from backend.analytic.memory.compiled_block import compiled_block_bytes
from backend.analytic.memory.parts import RankParts, is_mixed
from backend.analytic.memory.pipeline_activations import in_flight
from backend.analytic.memory.policy_blocks import Checkpointing, checkpointing
from backend.analytic.memory.te_block import MlaWidths, MoeWidths, TeLayer, te_layer_bytes
from backend.analytic.params import head_dim, is_gated
from backend.analytic.scalar_or_array import as_int, logical_and, maximum, minimum, per_distinct, where
from backend.analytic.stack_memory import StackMemory

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

def te_layer_of(model: ModelSpec, layout: Layout, shape: LayerShape) -> TeLayer:
    """The TE block of `shape` (a LayerShape of this layout: its tokens, split and kind) under the stack's recompute
    modules (applied by `_block_terms` to selective recompute only)."""
    hd = head_dim(model)
    t_sp = shape.tp if shape.sequence_parallel else 1
    moe = None
    if shape.n_experts:
        tokens = max(shape.seq_len * shape.micro_batch // t_sp, 1)  # N: routing runs on the sequence shard
        rows = moe_rows.of_model(model, tokens).received
        moe = MoeWidths(experts=shape.n_experts, top_k=shape.top_k, expert_ffn=shape.ffn // shape.etp,
                        shared_ffn=shape.shared_ffn, rows_per_token=shape.etp * rows / tokens,
                        sigmoid=str(getattr(model, "router_score", "softmax")) == "sigmoid")
    mla = None
    if model.is_mla:
        mla = MlaWidths(q_lora=model.q_lora_rank or 0, kv_lora=model.kv_lora_rank, rope=model.qk_rope_head_dim,
                        nope=model.qk_nope_head_dim, v_head=model.v_head_dim)
    return TeLayer(s=shape.seq_len, b=shape.micro_batch, h=model.d_model, q=model.n_heads * hd,
                   kv=model.kv_heads * hd, a=model.n_heads, f=model.ffn, gated=is_gated(getattr(model, "mlp", "gelu")),
                   t=shape.tp, sp=shape.sequence_parallel,
                   norm_stats=1 if str(getattr(model, "norm", "layernorm")) == "rmsnorm" else 2,
                   c=layout.compute_bytes, fp8=bool(layout.stack.fp8), mla=mla, moe=moe,
                   modules=layout.stack.recompute_modules, fused_attention=layout.stack.fused_attention)


def uses_te(model: ModelSpec, stack: StackMemory) -> bool:
    """Megatron's block formula (memory/te_block.py): fused element-wise work, with fused or unfused (Megatron's
    own) core attention."""
    return stack.te_layer


@lru_cache(maxsize=4096)
def _block_terms(shape: LayerShape, te: TeLayer | None, recompute: int, compiled: bool = False
                 ) -> tuple[float, float, float]:
    """(a plain block's saved bytes under the policy, a checkpoint unit's, one block while re-run). `compiled`: the
    block runs under torch.compile: a plain or re-run block keeps what memory/compiled_block.py measured (eager terms
    outside its families), and op-level SAC keeps only the must-save outputs backward reads: the block's last linear
    (fc_out / down), kept by the every-second-mm rule, feeds the residual add alone and is not saved (measured with
    torch 2.13's Inductor on the CPU: tests/unit/test_stack_memory.py; dense blocks, as measured)."""
    kind = RECOMPUTE_NAMES[recompute]
    if te is not None:  # selective: the stack's recompute modules (Megatron's --recompute-modules)
        none = te_layer_bytes(replace(te, modules=frozenset()))
        plain = te_layer_bytes(te) if kind == "selective" else none
        unit = te.s * te.b * te.h * te.c / (te.t if te.sp else 1)
        return plain, unit, none
    plain = layer_activation_bytes(shape, "selective" if kind == "selective" else "none")
    unit = layer_activation_bytes(shape, "op" if kind == "op" else "full")
    rerun = layer_activation_bytes(shape, "none")
    if compiled and (block := compiled_block_bytes(shape)) is not None:
        plain, rerun = (block if kind != "selective" else plain), block
    if compiled and kind == "op" and not shape.n_experts:
        unit -= op_sac_rerun_extra_bytes(shape)  # the last linear's output, when the rule keeps it
    return plain, unit, rerun


def block_terms(model: ModelSpec, layout: Layout, alt: bool = False) -> tuple[Num, Num, Num]:
    """`_block_terms` of every layout (once per distinct micro-batch, tp, SP, recompute, ep, cp); alt: of the blocks
    whose MLP kind differs from block 0's (a dense prefix before MoE blocks, or an interleave)."""
    stack: StackMemory = layout.stack
    proto = LayerShape.prototype(model, dtype_bytes=layout.compute_bytes, device=layout.device, alt=alt,
                                 sac_ops=layout.sac_ops)
    # the frameworks run their experts as grouped GEMMs, an op the op-level save list does not name
    proto = replace(proto, flash=stack.fused_attention, expert_loop=False)
    te = uses_te(model, stack)

    def terms(b: int, tp: int, sp: int, rc: int, ep: int, cp: int, etp: int) -> tuple[float, float, float]:
        shape = replace(proto, micro_batch=b, tp=tp, sequence_parallel=bool(sp), autocast=False,
                        ep=ep if proto.n_experts else 1, etp=etp if proto.n_experts and ep > 1 else 1,
                        seq_len=proto.seq_len // cp)
        return _block_terms(shape, te_layer_of(model, layout, shape) if te else None, rc,
                            stack.compiled_blocks and not te)

    out = per_distinct(terms, layout.micro_batch, layout.tp, layout.sequence_parallel, layout.recompute, layout.ep,
                       layout.cp, layout.etp)
    return out if isinstance(out, tuple) else tuple(out[..., i] for i in range(3))


@dataclass(frozen=True)
class HeadBytes:
    """The stage with the logits, one microbatch: what the final norm and output layer save, and per logit the
    loss's bytes at its forward peak, kept after it, and at its backward peak."""
    norm_and_output: Num
    logits: Num
    forward_peak_per_logit: Num
    kept_per_logit: Num
    backward_peak_per_logit: Num


def head_bytes(model: ModelSpec, layout: Layout) -> HeadBytes:
    stack: StackMemory = layout.stack
    c = layout.compute_bytes
    s, b, h, t = layout.seq_local(model), layout.micro_batch, model.d_model, layout.tp
    t_sp = where(layout.sequence_parallel, t, 1)
    sbh = s * b * h
    stats = 2 if str(getattr(model, "norm", "layernorm")) == "layernorm" else 1
    norm = c * sbh / t_sp + stats * STAT_BYTES * s * b / t_sp
    t_v = t if stack.loss_parallel else 1
    logits = s * b * model.vocab_size / t_v
    copy = 0 if c == 4 else 4  # the loss's fp32 copy of 16-bit logits
    if stack.mechanism == "megatron":  # ColumnParallelLinear saves its (sequence-sharded) input
        return HeadBytes(norm + c * sbh / t_sp, logits, c + copy, 4, 4 + c)
    # loss parallel's DTensor `_log_softmax` keeps the shifted logits and their exp beside the fp32 copy; the plain
    # loss (aten's fused log_softmax + nll_loss, the 16-bit logits deleted before backward as torchtitan's train step
    # does) peaks at the fp32 copy and log-probs forward, and at the log-probs, nll's gradient and log_softmax's
    # gradient backward (measured: tests/unit/test_stack_memory.py)
    vocab_parallel = logical_and(stack.loss_parallel, t > 1)
    eager = HeadBytes(norm + c * sbh, logits, c + copy + where(vocab_parallel, 8, 4), 4, where(vocab_parallel, 16, 12))
    if not stack.loss_compiled:
        return eager
    return HeadBytes(eager.norm_and_output, logits, where(vocab_parallel, eager.forward_peak_per_logit, c),
                     where(vocab_parallel, 4, c), where(vocab_parallel, eager.backward_peak_per_logit, 2 * c))


@dataclass(frozen=True)
class StackBlocks:
    """A stack rank's blocks (scalars or arrays of layouts): what they hold when its first backward starts (every
    in-flight microbatch's saved tensors), one plain block's, one checkpoint unit's and one re-run block's saved
    bytes, and the recompute policy's counts."""
    held: Num
    plain: Num
    unit: Num
    rerun: Num
    ck: Checkpointing


def stack_blocks(model: ModelSpec, layout: Layout, pp_rank: Num, parts: RankParts) -> StackBlocks:
    plain_b, unit_b, rerun_b = block_terms(model, layout)
    st = parts.stages
    ck = checkpointing(model, layout, st.n_blocks)
    blocks = ck.units * unit_b + ck.plain * plain_b  # one microbatch of every local chunk
    if is_mixed(model):  # per block kind, the policy's units and plain blocks spread over both kinds in proportion
        alt_plain, alt_unit, alt_rerun = block_terms(model, layout, alt=True)
        alt_share = st.n_alt / maximum(st.n_blocks, 1)
        blocks = blocks + alt_share * (ck.units * (alt_unit - unit_b) + ck.plain * (alt_plain - plain_b))
        rerun_b = where(st.n_alt > 0, maximum(rerun_b, alt_rerun), rerun_b)
    extra = layout.ep_overlap  # the combined 1F1B's one more warmup forward (pipelined: with virtual stages)
    units = where(layout.pipelined, minimum(in_flight(layout, pp_rank) + extra, layout.microbatches
                                            * layout.virtual_stages), 1)
    return StackBlocks(blocks * units / layout.virtual_stages, plain_b, unit_b, rerun_b, ck)


def stack_activation_bytes(model: ModelSpec, layout: Layout, blocks: StackBlocks, parts: RankParts) -> Num:
    """Activation bytes of one rank at its activation peak: the end of the last microbatch's forward with the loss's
    forward peak on the stage with the logits, or, under recompute, the first re-run block in backward (the head's
    tensors freed), whichever is larger. Pipelined ranks hold their in-flight microbatches' blocks
    (pipeline_activations.in_flight)."""
    st, ck, held = parts.stages, blocks.ck, blocks.held
    head = head_bytes(model, layout)
    forward = held + where(st.last, head.norm_and_output + head.forward_peak_per_logit * head.logits, 0)
    checkpointed = logical_and(ck.units > 0, st.n_blocks > 0)
    rerun = held + maximum(0, ck.rerun_blocks * blocks.rerun - blocks.unit - ck.after * blocks.plain)
    return as_int(where(checkpointed, maximum(forward, rerun), forward))


def stack_loss_backward_extra(model: ModelSpec, layout: Layout) -> Num:
    """What the start of the loss's backward holds beyond the activation peak's forward moment on the stage with the
    logits: (backward peak - forward peak) bytes per logit, at least 0."""
    head = head_bytes(model, layout)
    return maximum(0, (head.backward_peak_per_logit - head.forward_peak_per_logit) * head.logits)
