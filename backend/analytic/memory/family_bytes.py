"""What the model families add to a block's saved bytes beyond the GPT block (backend/analytic/memory/activations.py
holds the block): the attention's own widths and the 2026 features' per-token tensors (`head_widths`,
`feature_elems`), the per-layer constants that differ between attention kinds (`attention_constant_bytes`), and the
norm / MLP / shared-expert terms (`family_extra_bytes`). Pure Python, each read off the ops the engine runs
(tests/unit/test_family_activations.py, tests/unit/test_family_terms.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from backend.analytic.device import CPU, rms_norm_saved_bytes
from backend.analytic.memory.moe_bytes import hidden_saved
from backend.analytic.params import head_dim, is_gated, v_head_dim

if TYPE_CHECKING:
    from backend.spec import ModelSpec

STAT_BYTES = 4  # LayerNorm mean/rstd are fp32


def mlp_elems(*, s, b, h, ffn, t, hidden: int = 2) -> float:
    # fc_in saves its input (ln2 output; counted in the block), GELU saves fc_in output (s·b·ffn),
    # fc_out saves GELU output (s·b·ffn). SwiGLU (Shazeer 2020 Eq. 6): silu saves gate's output, the product saves
    # silu's output and up's output, down saves the product: 4·s·b·ffn (measured op by op,
    # tests/unit/test_family_activations.py); gpt-oss's clamped SwiGLU 7 (moe_bytes.hidden_saved)
    return hidden * s * b * ffn / t


def head_widths(m: ModelSpec) -> dict[str, int]:
    """LayerShape's q_width / v_width / rope_width: the attention's own widths when they differ from d_model."""
    q, v = m.n_heads * head_dim(m), m.n_heads * v_head_dim(m)
    rope = m.qk_rope_head_dim if getattr(m, "kv_lora_rank", None) is not None else head_dim(m)
    return dict(q_width=0 if q == m.d_model else q, v_width=0 if v == q else v,
                rope_width=0 if rope == m.d_model // m.n_heads else rope, **feature_elems(m))


class NormShape(Protocol):
    """What `qk_norm_bytes` and `sandwich_norm_bytes` read of an activations.LayerShape (a Protocol, as
    AttentionShape)."""

    @property
    def qk_norm(self) -> bool: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def q_width(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def dtype_bytes(self) -> float: ...
    @property
    def device(self) -> str: ...
    @property
    def autocast(self) -> bool: ...
    @property
    def sandwich_norm(self) -> bool: ...
    @property
    def sequence_parallel(self) -> bool: ...


class LatentShape(NormShape, Protocol):
    """What `latent_norm_bytes` and `v_view_elems` read of an activations.LayerShape."""

    @property
    def q_lora(self) -> int: ...
    @property
    def kv_lora(self) -> int: ...
    @property
    def rope_width(self) -> int: ...
    @property
    def v_view_extra(self) -> int: ...
    @property
    def flash(self) -> bool: ...
    @property
    def v_width(self) -> int: ...


class AttentionShape(Protocol):
    """What `attention_constant_bytes` reads of an activations.LayerShape (a Protocol: activations.py imports this
    module, so naming LayerShape here would be an import cycle)."""

    @property
    def seq_len(self) -> int: ...
    @property
    def rope_width(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def dtype_bytes(self) -> float: ...
    @property
    def flash(self) -> bool: ...


def attention_constant_bytes(shape: AttentionShape, recompute: str, *, rope: bool, windowed: bool) -> float:
    """`shape`: an activations.LayerShape. A block's saved bytes that do not scale with tokens and differ between a
    model's attention kinds: the rotary (s, width) cos and sin tables the rotation's muls keep (in q's dtype; not
    under full recompute), and the (s, s) additive mask a windowed layer hands flash attention, which the kernel
    keeps for backward in q's dtype (no recompute: selective re-makes it inside the checkpoint). Read off the autograd
    graph (tests/unit/test_family_terms.py); the math path keeps an (s, s) bool mask on every layer alike."""
    if recompute == "full":
        return 0.0
    s = shape.seq_len
    out = 2 * s * (shape.rope_width or shape.d_model // shape.n_heads) * shape.dtype_bytes if rope else 0.0
    if windowed and shape.flash and recompute == "none":
        out += s * s * shape.dtype_bytes
    return out


def feature_elems(m: ModelSpec) -> dict[str, int]:
    """Per token saved elements of the 2026 features, by op: the sink column of a math softmax (a per row, counted with
    the probabilities' rows: a / s per token is below a byte, kept for the record as a per-query element). The rest
    are flags and widths whose bytes depend on the device, the dtype or the attention kernel: q / k RMSNorm (Qwen3,
    Gemma 3: `qk_norm_bytes`), sandwich norms (`sandwich_norm_bytes`), MLA's latents (`latent_norm_bytes`) and the
    nope part of kv_b's output behind MLA's v (`v_view_elems`)."""
    split = m.n_heads if getattr(m, "attention_sinks", False) and str(getattr(m, "attention", "math")) == "math" else 0
    mla = getattr(m, "kv_lora_rank", None) is not None
    return dict(split_elems=split, qk_norm=bool(getattr(m, "qk_norm", False)),
                sandwich_norm=bool(getattr(m, "sandwich_norm", False)),
                q_lora=(getattr(m, "q_lora_rank", None) or 0) if mla else 0, kv_lora=m.kv_lora_rank if mla else 0,
                v_view_extra=m.n_heads * m.qk_nope_head_dim if mla else 0)


def qk_norm_bytes(shape: NormShape) -> float:
    """What a block's q and k RMSNorms (Qwen3, Gemma 3: one F.rms_norm over each head's width, on the projections'
    outputs at the compute dtype) keep for backward: device.rms_norm_saved_bytes over the q + k widths with one rstd
    per head, each /tp. On CUDA with 16-bit weights (FSDP2's bf16 params) the fused kernel keeps its 16-bit input and
    an fp32 rstd; on the CPU, and under autocast anywhere, the composite runs (the CPU has no fused kernel; autocast
    hands a 16-bit input to an fp32 weight, and torch's rms_norm dispatches to the fused kernel only when their dtypes
    match: aten/src/ATen/native/layer_norm.cpp rms_norm_symint) and keeps the fp32 input, normalised x and rstd.
    Whether CUDA autocast upcasts rms_norm's input first (the fused kernel would keep it in fp32, 4 B less per
    element) is not measured: the composite's bytes are the upper bound. Measured on the CPU:
    tests/unit/test_extra_norm_bytes.py."""
    if not shape.qk_norm:
        return 0.0
    a, kv_heads, t = shape.n_heads, shape.kv_heads or shape.n_heads, shape.tp
    q = shape.q_width or shape.d_model
    rows = shape.seq_len * shape.micro_batch
    widths, heads = (q + kv_heads * (q // a)) / t, (a + kv_heads) / t
    return _extra_norm_bytes(shape, sbh=rows * widths, sb=rows * heads)


def sandwich_norm_bytes(shape: NormShape) -> float:
    """What a block's two sandwich norms (Gemma 3: an RMSNorm on the attention's and the MLP's output, each at the
    compute dtype, before the residual add) keep for backward: device.rms_norm_saved_bytes over h per token each, by
    the same rule as qk_norm_bytes (the composite on the CPU and under autocast; measured on the CPU:
    tests/unit/test_extra_norm_bytes.py). Every tp rank holds them whole; under sequence parallelism they run, as the
    block's own norms do, on the rank's s / tp tokens (tp_placement's SequenceParallel; measured on the fake process
    group: tests/unit/test_extra_norm_bytes.py)."""
    if not shape.sandwich_norm:
        return 0.0
    rows = shape.seq_len * shape.micro_batch / (shape.tp if shape.sequence_parallel else 1)
    return 2 * _extra_norm_bytes(shape, sbh=rows * shape.d_model, sb=rows)


def _extra_norm_bytes(shape: NormShape, *, sbh: float, sb: float) -> float:
    """device.rms_norm_saved_bytes of a norm whose input comes at the compute dtype (qk_norm_bytes' rule): the
    composite under autocast on any device."""
    return rms_norm_saved_bytes(sbh=sbh, sb=sb, input_bytes=shape.dtype_bytes, device=_extra_norm_device(shape))


def _extra_norm_device(shape: NormShape) -> str:
    """The kernel a 16-bit-input norm runs: the composite under autocast on any device, else its device's."""
    return CPU if shape.autocast else shape.device


def latent_norm_bytes(shape: LatentShape) -> float:
    """What MLA's two latent RMSNorms keep for backward with their outputs as q_b's and kv_b's inputs (every tp rank
    holds them whole): per norm device.rms_norm_saved_bytes over its latent width (`_extra_norm_bytes`' rule) plus
    the next Linear's input at the compute dtype (the composite's fp32 output is cast there, the fused kernel's comes
    at its input dtype). kv_a's output is [latent | rotary key]: a norm that keeps its input as it came (fp32 on the
    CPU, the fused CUDA kernel) keeps a view of that whole output, rope_width more per token; the composite's 16-bit
    input is upcast to an fp32 copy of the latent alone. Measured op by op on the CPU:
    tests/unit/test_mla_block_bytes.py."""
    if not shape.kv_lora:
        return 0.0
    rows, c = shape.seq_len * shape.micro_batch, shape.dtype_bytes
    kept_as_is = _extra_norm_device(shape) != CPU or (c == 4 and not shape.autocast)
    out = 0.0
    for width in (shape.q_lora, shape.kv_lora):
        if width:
            out += _extra_norm_bytes(shape, sbh=rows * width, sb=rows) + rows * width * c
    return out + (rows * rope_table_width(shape) * c if kept_as_is else 0.0)


def pads_v(shape: LatentShape) -> bool:
    """Whether this engine's flash attention runs over a zero-padded v: a v narrower than q (MLA) on the CPU, whose
    only flash kernel takes one head width (models/gpt.py _padded_flash_attention)."""
    return bool(shape.flash and shape.v_width and shape.device == CPU)


def rope_table_width(shape: LatentShape) -> int:
    """One head's rotary width (LayerShape.rope_width, whose 0 means d_model / n_heads)."""
    return shape.rope_width or shape.d_model // shape.n_heads


def v_view_elems(shape: LatentShape, *, recompute: str, padded: bool) -> float:
    """Per-token elements that MLA's v keeps beyond its own a x v_head_dim: v is a view of kv_b's whole (nope + v)
    output, so an op that saves v as given keeps that storage (a x qk_nope_head_dim more). Saved as given: by the
    selective checkpoint (its inputs), by SDPA when v is as wide as q, and by math attention's P·V bmm at micro-batch
    1 (the (1, a, s, d) view flattens to (a, s, d) without a copy). At a larger micro-batch the bmm's reshape copies
    v, and a padded flash v is a new tensor: neither keeps kv_b's output."""
    if not shape.v_view_extra:
        return 0.0
    if recompute == "selective":
        return shape.v_view_extra
    if shape.flash:
        return 0.0 if padded else shape.v_view_extra
    return shape.v_view_extra if shape.micro_batch == 1 else 0.0


def family_extra_bytes(*, s, b, h, a, ffn, t, norm_div, dtype_bytes, residual_bytes, autocast, norm, mlp, rope,
                       n_experts, shared_ffn, shared_gate, device) -> float:
    """What the architecture-family choices add to the GPT block's saved bytes (each measured op by op against
    MemTracker in tests/unit/test_family_activations.py):
    - rmsnorm: per norm what device.rms_norm_saved_bytes gives for its input (the residual stream, /t under SP)
      instead of LayerNorm's input + mean + rstd (2sb fp32): on the CPU the fp32 normalised x and rstd on top (and
      the input's fp32 copy under bf16 params), on CUDA (fused kernel) the rstd only;
    - autocast + swiglu, dense MLP: gate and up each save their own 16-bit cast of the ln2 output (one more than
      fc_in);
    - shared experts (MoE only): their hidden 2·N·f_s/t (gelu) or 4·N·f_s/t (swiglu) and, under autocast, one cast
      of the tokens per first Linear; the sigmoid gate keeps its (N, 1) output and the shared output (N, h), and under
      autocast its own cast of the tokens."""
    sb, sbh = s * b, s * b * h
    out = 0.0
    if norm == "rmsnorm":
        out += 2 * rms_norm_extra_bytes(sbh=sbh / norm_div, sb=sb / norm_div, input_bytes=residual_bytes, device=device)
    swiglu = is_gated(mlp)
    if autocast and swiglu and not n_experts:  # an MoE block's gated experts count their casts (moe_bytes)
        out += sbh * dtype_bytes
    if n_experts and shared_ffn:
        out += mlp_elems(s=s, b=b, h=h, ffn=shared_ffn, t=t, hidden=hidden_saved(mlp)) * dtype_bytes
        if autocast:
            out += (2 if swiglu else 1) * sbh * dtype_bytes
        if shared_gate:  # its sigmoid's (N, 1) output and the shared output mul saves (+ under autocast its own cast)
            out += (sbh + sb) * dtype_bytes + (sbh * dtype_bytes if autocast else 0.0)
    return out


def rms_norm_extra_bytes(*, sbh: float, sb: float, input_bytes: float, device: str) -> float:
    """What one RMSNorm saves beyond the LayerNorm terms the formulas count for every norm (its input in
    input_bytes and fp32 mean + rstd): device.rms_norm_saved_bytes minus those."""
    return rms_norm_saved_bytes(sbh=sbh, sb=sb, input_bytes=input_bytes, device=device) - sbh * input_bytes \
        - 2 * sb * STAT_BYTES
