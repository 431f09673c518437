"""Activation bytes of one rank as a non-default stack saves them (issue 34 part 2), one layout or arrays of them.

Per block (one microbatch; s = seq_len / cp, b micro-batch, h hidden, a heads, h_kv = kv heads x head width, f the
MLP width, g = 2 for a gated MLP, t = tp, t_sp = t under sequence parallelism, c = the 16-bit compute bytes):
- Transformer Engine (elementwise fused, dense blocks), research notes Sec 2.2-2.3 from TE d0067d0 and Megatron-LM
  d98e8a64 `get_gpt_layer_with_transformer_engine_submodules` (gpt_layer_specs.py 180-340):
  `_LayerNormLinear.forward` (module/layernorm_linear.py 526-536) saves the norm input (the residual stream, c B) and
  the norm output (c B; 1 B fp8 under fp8) of qkv and fc1, plus rsigma (fp32; LayerNorm also mu); `FusedAttnFunc`
  (attention/dot_product_attention/backends.py 1590-1664) Q, K, V, O and the fp32 softmax stats (4 B per head and
  token); `_Linear` (module/linear.py 594-621) nothing new for proj in bf16 (O is attention's), an fp8 copy of O
  (1 B) under fp8, and for fc2 its input, the activation output (c B; 1 B fp8); Megatron's `bias_swiglu_impl`
  (fusions/fused_bias_swiglu.py 221-237) keeps its input, the fc1 output (g f c B). Fused RoPE saves nothing new.
  bf16: s b [8h / t_sp + (4h + 4h_kv + 2g f + 2f) / t] + 4 s b a / t + 4 s b / t_sp x (1 RMSNorm | 2 LayerNorm) x 2.
  fp8: s b [6h / t_sp + (5h + 4h_kv + 2g f + f) / t] + the same stats (11h with SP, research notes Sec 2.3).
- Eager torch blocks (torchtitan, DeepSpeed: elementwise eager or compiled): this engine's own block model
  (activations.layer_activation_bytes), without autocast (FSDP2's MixedPrecisionPolicy / DeepSpeed's 16-bit module
  run the block in bf16) and with the stack's attention kernel. What Inductor saves in a compiled block, and
  torchao's float8 saved casts, are not modelled (research notes gaps 6 and Sec 4.1).
Recompute: full keeps each checkpoint unit's input (c s b h / t_sp); selective under TE keeps what no recompute
keeps (Q, K, V and O are saved anyway: research notes Sec 2.3); one block re-runs at a time in backward.

Head, on the stage with the logits (n = s b V / t_v logits, t_v = t under loss parallel, else 1):
- Megatron: the final norm's input and stats and the output layer's input (c s b h / t_sp each),
  `VocabParallelCrossEntropy` (tensor_parallel/cross_entropy.py 19-210): an fp32 copy of the logits worked in place,
  the fp32 softmax saved; forward peak (c + 4) n, backward peak 4 n + c n (the in-place grad, cast back).
- torch's loss (torchtitan's `cross_entropy(pred.float())`, loss_parallel's `_log_softmax`,
  torch/distributed/tensor/parallel/loss.py @3be1238): forward peak c + 4 + 4 + 4 B per logit (logits, fp32 copy,
  shifted, exp), the fp32 log-probs kept; backward peak 16 B per logit (research notes Sec 3.2); the output layer
  saves its all-gathered input (c s b h) and the final norm its input (c s b h / t_sp) and rstd.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from backend.analytic.layout import RECOMPUTE_NAMES, Layout
from backend.analytic.memory.activations import STAT_BYTES, LayerShape, layer_activation_bytes
from backend.analytic.memory.parts import RankParts
from backend.analytic.memory.pipeline_activations import in_flight
from backend.analytic.memory.rank_activations import checkpointing
from backend.analytic.params import head_dim, is_gated
from backend.analytic.scalar_or_array import as_int, logical_and, maximum, per_distinct, where
from backend.analytic.stack_memory import StackMemory

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

LSE_BYTES = 4  # fp32 softmax statistics per head and token (cuDNN softmaxStats, flash's lse)


@dataclass(frozen=True)
class TeLayer:
    """What one Transformer Engine block's saved bytes depend on."""
    s: int
    b: int
    h: int
    q: int
    """Heads x head width of q and O."""
    kv: int
    """kv heads x head width (h_kv)."""
    a: int
    f: int
    gated: bool
    t: int
    sp: bool
    norm_stats: int
    """fp32 statistics per token and norm: rsigma (RMSNorm) or mu + rsigma (LayerNorm)."""
    c: int
    fp8: bool


def te_layer_bytes(layer: TeLayer) -> float:
    """One TE block's saved bytes without recompute (module docstring)."""
    sb, t = layer.s * layer.b, layer.t
    t_sp = t if layer.sp else 1
    g = 2 if layer.gated else 1
    c = layer.c
    ln_out = 1 if layer.fp8 else c
    replicated = 2 * (c + ln_out) * layer.h  # qkv and fc1: norm input + norm output
    split = c * (2 * layer.q + 2 * layer.kv)  # Q, K, V, O
    split += (1 * layer.q if layer.fp8 else 0)  # proj's fp8 copy of O
    split += c * g * layer.f  # the SwiGLU / GeLU input (fc1 output)
    split += (1 if layer.fp8 else c) * layer.f  # fc2's input (the activation output)
    stats = 2 * layer.norm_stats * STAT_BYTES / t_sp + LSE_BYTES * layer.a / t
    return sb * (replicated / t_sp + split / t + stats)


def te_layer_of(model: ModelSpec, layout: Layout, s: int, b: int, t: int, sp: bool) -> TeLayer:
    hd = head_dim(model)
    return TeLayer(s=s, b=b, h=model.d_model, q=model.n_heads * hd, kv=model.kv_heads * hd, a=model.n_heads,
                   f=model.ffn, gated=is_gated(getattr(model, "mlp", "gelu")), t=t, sp=bool(sp),
                   norm_stats=1 if str(getattr(model, "norm", "layernorm")) == "rmsnorm" else 2,
                   c=layout.compute_bytes, fp8=bool(layout.stack.fp8))


def uses_te(model: ModelSpec, stack: StackMemory) -> bool:
    """TE's layer formula: fused element-wise work and fused attention on dense blocks (MoE blocks keep the eager
    block model)."""
    return stack.te_layer and stack.fused_attention and not model.is_moe


@lru_cache(maxsize=4096)
def _block_terms(shape: LayerShape, te: TeLayer | None, recompute: int) -> tuple[float, float, float]:
    """(a plain block's saved bytes under the policy, a checkpoint unit's, one block while re-run)."""
    kind = RECOMPUTE_NAMES[recompute]
    if te is not None:
        none = te_layer_bytes(te)
        unit = te.s * te.b * te.h * te.c / (te.t if te.sp else 1)
        return none, unit, none
    plain = layer_activation_bytes(shape, "selective" if kind == "selective" else "none")
    unit = layer_activation_bytes(shape, "op" if kind == "op" else "full")
    return plain, unit, layer_activation_bytes(shape, "none")


def block_terms(model: ModelSpec, layout: Layout) -> tuple[Any, Any, Any]:
    """`_block_terms` of every layout (once per distinct micro-batch, tp, SP, recompute, ep, cp)."""
    stack: StackMemory = layout.stack
    proto = LayerShape.prototype(model, dtype_bytes=layout.compute_bytes, device=layout.device, sac_ops=layout.sac_ops)
    proto = replace(proto, flash=stack.fused_attention)
    te = uses_te(model, stack)

    def terms(b: int, tp: int, sp: int, rc: int, ep: int, cp: int, etp: int) -> tuple[float, float, float]:
        shape = replace(proto, micro_batch=b, tp=tp, sequence_parallel=bool(sp), autocast=False,
                        ep=ep if proto.n_experts else 1, etp=etp if proto.n_experts and ep > 1 else 1,
                        seq_len=proto.seq_len // cp)
        layer = te_layer_of(model, layout, proto.seq_len // cp, b, tp, bool(sp)) if te else None
        return _block_terms(shape, layer, rc)

    out = per_distinct(terms, layout.micro_batch, layout.tp, layout.sequence_parallel, layout.recompute, layout.ep,
                       layout.cp, layout.etp)
    return out if isinstance(out, tuple) else tuple(out[..., i] for i in range(3))


@dataclass(frozen=True)
class HeadBytes:
    """The stage with the logits, one microbatch: what the final norm and output layer save, and per logit the
    loss's bytes at its forward peak, kept after it, and at its backward peak."""
    norm_and_output: Num
    logits: Num
    forward_peak_per_logit: float
    kept_per_logit: float
    backward_peak_per_logit: float


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
    return HeadBytes(norm + c * sbh, logits, c + copy + 8, 4, 16)


def stack_activation_bytes(model: ModelSpec, layout: Layout, pp_rank: Num, parts: RankParts) -> Num:
    """Activation bytes of one rank at its activation peak: the end of the last microbatch's forward with the loss's
    forward peak on the stage with the logits, or, under recompute, the first re-run block in backward (the head's
    tensors freed), whichever is larger. Pipelined ranks hold their in-flight microbatches' blocks
    (pipeline_activations.in_flight)."""
    plain_b, unit_b, rerun_b = block_terms(model, layout)
    st = parts.stages
    ck = checkpointing(model, layout, st.n_blocks)
    blocks = ck.units * unit_b + ck.plain * plain_b  # one microbatch of every local chunk
    units = where(layout.pipelined, in_flight(layout, pp_rank), 1)
    held = blocks * units / layout.virtual_stages
    head = head_bytes(model, layout)
    forward = held + where(st.last, head.norm_and_output + head.forward_peak_per_logit * head.logits, 0)
    checkpointed = logical_and(ck.units > 0, st.n_blocks > 0)
    rerun = held + maximum(0, ck.rerun_blocks * rerun_b - unit_b - ck.after * plain_b)
    return as_int(where(checkpointed, maximum(forward, rerun), forward))


def stack_loss_backward_extra(model: ModelSpec, layout: Layout) -> Num:
    """What the start of the loss's backward holds beyond the activation peak's forward moment on the stage with the
    logits: (backward peak - forward peak) bytes per logit, at least 0."""
    head = head_bytes(model, layout)
    return maximum(0, (head.backward_peak_per_logit - head.forward_peak_per_logit) * head.logits)
