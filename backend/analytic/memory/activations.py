"""Activation bytes autograd saves for backward in THIS engine's model (backend/models/gpt.py), per block and
for the embeddings / head, read off the ops it runs (no dropout, explicit softmax or SDPA attention). Pure Python,
one set of sizes at a time: the rank-level model (rank_activations.py) evaluates these once per distinct
(micro-batch, tp, SP, recompute, autocast) and spreads them over arrays of layouts.
Symbols inside the formulas: s sequence (this rank's share: seq_len / cp under context parallelism), b microbatch, h
hidden, a heads, t tensor-parallel degree, sp sequence parallel. The published per-layer formula is
textbook/korthikanti.py. """

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backend.analytic.device import softmax_saved_bytes_per_score
from backend.analytic.layout import Layout
from backend.analytic.memory.family_bytes import (
    STAT_BYTES,
    attention_constant_bytes,
    family_extra_bytes,
    head_widths,
    latent_norm_bytes,
    mlp_elems,
    pads_v,
    qk_norm_bytes,
    rms_norm_extra_bytes,
    rope_table_width,
    sandwich_norm_bytes,
    v_view_elems,
)
from backend.analytic.memory.moe_bytes import (
    INDEX_BYTES,
    ep_moe_layer_bytes,
    expert_input_copies,
    hidden_saved,
    row_bytes,
)
from backend.analytic.moe_rows import expert_rows
from backend.analytic.params import is_gated, layer_attention_kind, layer_is_moe
from backend.recompute_policy import DEFAULT_SAC_OPS

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec, ModelSpec

RECOMPUTE = ("none", "selective", "full", "op")
"""Per-block saved-tensor policies; layers:K, block:N and uniform:N mix `none` and `full` blocks (rank_activations)."""
LOSS_BYTES = 2 * 4  # fp32 scalars: nll_loss's saved total_weight and the loss itself
FUSED_LOSS_ROW_BYTES = 2 * 4
"""A fused cross-entropy's saved fp32 values per row: the max and the log-sum-exp (Inductor's partition of the
compiled loss, measured: tests/helpers/compiled_loss_memory.py; flash-attn's xentropy saves the LSE)."""
LSE_BYTES = 4  # flash / memory-efficient attention keep the softmax logsumexp in fp32


def _check_recompute(recompute: str) -> str:
    recompute = str(recompute)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} not in {RECOMPUTE}")
    return recompute


@dataclass(frozen=True)
class LayerShape:
    """What one block's saved activations depend on: the model's sizes and family, the micro-batch, the tensor /
    sequence / expert split and the dtypes."""
    seq_len: int
    micro_batch: int
    d_model: int
    n_heads: int
    ffn: int
    """The MLP's hidden size (an expert's for MoE)."""
    dtype_bytes: int
    tp: int = 1
    sequence_parallel: bool = False
    n_experts: int = 0
    top_k: int = 1
    ep: int = 1
    etp: int = 1
    """MoE under ep: the expert tensor-parallel degree; each local expert's (rows, ffn) tensors are split over it
    (Colwise fc_in / Rowwise fc_out over etp, strategies/tp.py)."""
    autocast: bool = False
    device: str = "cpu"
    """Where the ranks run ("cpu" or "cuda"): CUDA autocast's fp32 softmax, CUDA's fused RMSNorm."""
    norm: str = "layernorm"
    mlp: str = "gelu"
    rope: bool = False
    flash: bool = False
    shared_ffn: int = 0
    shared_gate: bool = False
    bias: str = "all"
    router_bias: bool = False
    """MoE: the router Linear has a bias (gpt-oss): aten.addmm, not a counted aten.mm."""
    expert_loop: bool = True
    """MoE: the experts run one aten.mm per Linear per expert (the engine's per-expert loop), outputs op-level SAC
    saves (`moe_linears_of`); False: grouped GEMMs (moe_grouped_gemm, the frameworks' experts)."""
    kv_heads: int = 0
    """0: n_heads (plain multi-head attention)."""
    sac_ops: tuple[str, ...] = ()
    """The ops op-level recompute saves (recompute_policy.DEFAULT_SAC_OPS unless the spec lists others)."""

    q_width: int = 0
    """a x head_dim of q and k when it differs from d_model (own head width, MLA's nope + rope); 0 = d_model."""
    v_width: int = 0
    """a x the value head width when it differs from d_model (MLA's v_head_dim); 0 = q_width."""
    qk_norm: bool = False
    """q / k RMSNorm over each head (Qwen3, Gemma 3): family_bytes.qk_norm_bytes."""
    sandwich_norm: bool = False
    """An RMSNorm on the attention's and the MLP's output (Gemma 3): family_bytes.sandwich_norm_bytes."""
    split_elems: int = 0
    """Per token, what the 2026 families' features save beyond the GPT block in head-split tensors (/t): the sink
    column (`feature_elems`)."""
    q_lora: int = 0
    """MLA: q's latent width (q_lora_rank; 0 = q straight from x): family_bytes.latent_norm_bytes."""
    kv_lora: int = 0
    """MLA: the key / value latent width (kv_lora_rank); 0 = not MLA."""
    v_view_extra: int = 0
    """MLA: a x qk_nope_head_dim, the rest of kv_b's output that v is a view of (family_bytes.v_view_elems)."""
    rope_width: int = 0
    """Width of the rotary cos / sin tables (one head's, MLA's qk_rope_head_dim) when it differs from d_model /
    heads."""
    nope: bool = False
    """This block kind applies no rotary position (Llama 4's NoPE global layers): no cos / sin tables."""
    windowed: bool = False
    """This block kind attends in a window: flash attention gets (and keeps) an (s, s) additive mask."""
    capacity_factor: float | None = None
    """MoE: the capacity factor (None: dropless) and padding to capacity (moe_rows.py)."""
    pad_to_capacity: bool = False
    moe_imbalance: float = 1.0
    """MoE: the busiest rank's expert load over uniform."""
    fused_loss: bool = False
    """The cross-entropy runs as one fused row kernel (torch.compile of the loss, `loss_compiled`): it saves the 16-bit
    logits and two fp32 values per row, no fp32 copy or log-probs (`FUSED_LOSS_ROW_BYTES`)."""
    compiled: bool = False
    """This engine's blocks run under torch.compile (Layout.blocks_compiled): a block that recomputes nothing keeps
    memory/compiled_block.py's bytes where measured (rank_activations.layer_terms)."""

    @classmethod
    def of(cls, model: ModelSpec, *, micro_batch: int, tp: int, sequence_parallel: bool, dtype_bytes: int,
           autocast: bool, ep: int, device: str, alt: bool = False, sac_ops: tuple[str, ...] = DEFAULT_SAC_OPS,
           cp: int = 1, etp: int = 1) -> LayerShape:
        """The shape of block 0's kind (alt: of the other MLP kind's blocks, mixed stacks); a cp rank's seq_len / cp."""
        moe = layer_is_moe(model, 0) != alt if model.is_moe else False
        family = family_kwargs(model)
        if not moe:
            family["shared_ffn"], family["shared_gate"] = 0, False
        rope, windowed = layer_attention_kind(model, 0)
        return cls(seq_len=model.seq_len // cp, micro_batch=micro_batch, d_model=model.d_model, n_heads=model.n_heads,
                   ffn=_fam(model, "expert_ffn", model.ffn) if moe else model.ffn, dtype_bytes=dtype_bytes,
                   tp=tp, sequence_parallel=sequence_parallel, n_experts=model.n_experts if moe else 0,
                   top_k=model.top_k, ep=ep if moe else 1, etp=etp if moe and ep > 1 else 1, autocast=autocast,
                   device="cuda" if device == "cuda" else "cpu", bias=_fam(model, "bias", "all"),
                   kv_heads=getattr(model, "kv_heads", model.n_heads), sac_ops=tuple(sac_ops), **family,
                   **head_widths(model), nope=family["rope"] and not rope, windowed=windowed,
                   router_bias=moe and bool(getattr(model, "router_bias", False)),
                   expert_loop=not getattr(model, "moe_grouped_gemm", False),
                   **(_capacity_kwargs(model) if moe else {}))

    @classmethod
    def prototype(cls, model: ModelSpec, *, dtype_bytes: int, device: str, alt: bool = False,
                  sac_ops: tuple[str, ...] = DEFAULT_SAC_OPS) -> LayerShape:
        """The model's shape at micro-batch 1 without any split (memoised per model object: callers `replace` the
        per-layout fields)."""
        key = (id(model), dtype_bytes, device, alt, tuple(sac_ops))
        hit = _PROTOTYPES.get(key)
        if hit is None or hit[0] is not model:
            if len(_PROTOTYPES) > 64:
                _PROTOTYPES.clear()
            shape = cls.of(model, micro_batch=1, tp=1, sequence_parallel=False, dtype_bytes=dtype_bytes, autocast=False,
                           ep=1, device=device, alt=alt, sac_ops=sac_ops)
            hit = _PROTOTYPES[key] = (model, shape)  # holds the model: its id cannot be reused while cached
        return hit[1]

    @classmethod
    def of_spec(cls, spec: ExperimentSpec, *, moe_block: bool = False) -> LayerShape:
        """The shape of a validated spec's block 0 (moe_block: of its MoE blocks, wherever a dense prefix or an
        interleave puts them)."""
        layout = Layout.of(spec)
        alt = moe_block and spec.model.is_moe and not layer_is_moe(spec.model, 0)
        return cls.of(spec.model, micro_batch=layout.micro_batch, tp=layout.tp,
                      sequence_parallel=layout.sequence_parallel, dtype_bytes=layout.compute_bytes,
                      autocast=layout.uses_autocast, ep=layout.ep, device=layout.device, alt=alt,
                      sac_ops=spec.train.sac_ops, cp=layout.cp, etp=int(layout.etp))

    def head_kwargs(self, vocab: int) -> dict[str, Any]:
        """The keywords of the embedding / head formulas below."""
        return dict(s=self.seq_len, b=self.micro_batch, h=self.d_model, vocab=vocab, dtype_bytes=self.dtype_bytes,
                    t=self.tp, autocast=self.autocast, norm=self.norm, learned_pos=not self.rope, device=self.device,
                    fused_loss=self.fused_loss)


_PROTOTYPES: dict[tuple, tuple[Any, LayerShape]] = {}


def _attn_core_elems(*, s, b, h, a, t) -> float:
    # matmul copies of q, k^T (GQA: repeat_interleave'd, so always a·d_head = h wide) saved by bmm: 2sbh/t;
    # softmax output probs (b, a, s, s) saved by softmax and probs@v: a·s²·b/t; v copy saved by bmm: sbh/t
    return (3 * s * b * h + a * s * s * b) / t


def dense_moe_layer_bytes(*, s, b, h, ffn, n_experts, top_k, dtype_bytes, t=1, hidden: int = 2,
                          autocast: bool = False, gated: bool = False) -> float:
    n = s * b  # tokens
    rows = n * top_k  # (token, expert) pairs; all tokens reach their k experts (no capacity drop)
    elems = n * n_experts  # router softmax output (N, E), saved by softmax
    elems += rows + n  # normalised top-k weights: div saves the topk values (N, k) and their sum (N, 1)
    # each expert's first Linears save its gathered input flat[tok] (under autocast: gate's and up's own casts)
    elems += expert_input_copies(autocast, gated) * rows * h
    # GELU input and fc_out input inside the experts; under TP each expert is Colwise fc_in / Rowwise fc_out
    # (backend/strategies/tp.py tp_plan), so its hidden is (rows, ffn/t) like the dense MLP's (Shoeybi 2019 Sec 3)
    elems += hidden * rows * ffn / t  # SwiGLU experts: gate out, silu out, up out, product (moe_bytes.hidden_saved)
    elems += rows * h + rows  # mul(expert_out, w) saves both operands
    index = rows + 2 * rows  # topk indices; nonzero (tok, slot) pairs per expert
    # index_add_(0, tok, weighted) keeps its source (expert_out · w) cast to the output's dtype (fp32 under autocast)
    return elems * dtype_bytes + rows * h * row_bytes(dtype_bytes, autocast) + index * INDEX_BYTES


def layer_activation_bytes(shape: LayerShape, recompute: str = "none") -> float:
    """Bytes autograd holds for backward for ONE block of backend.models.gpt (pre-LN, no dropout).

    Terms (elements, then · dtype_bytes):
      ln1 input x (sbh), ln1 stats mean+rstd (2sb fp32), ln1 output = q/k/v Linear input (sbh),
      attention core (q, k, v copies 3sbh + probs a s² b), causal mask (s² bool), o Linear input (sbh),
      ln2 input (sbh), ln2 stats (2sb fp32), ln2 output = fc_in input (sbh), MLP 2·s·b·ffn (or MoE).
    kv_heads does not change the bytes: GQA k/v are repeat_interleave'd to a heads before the matmuls
    and only the repeated copies are saved.
    TP (t > 1): head- and ffn-split tensors divide by t; the norms and their outputs stay replicated;
    with SP the norm inputs and stats divide by t but the all-gathered Linear inputs stay full.
    Selective recompute (checkpointed core attention) keeps q, k, v (3sbh/t) instead of the core.
    Full recompute keeps only the block input (sbh, /t with SP); one block is recomputed at a time.
    autocast (torch.autocast around fp32 weights, read off saved_tensors_hooks): the residual stream, the
    LayerNorm inputs and the block input stay fp32 (4 B); every Linear saves its own 16-bit cast of its input,
    so q, k and v hold three copies of the ln1 output (4 Linear-input copies per block instead of 2). The
    16-bit weight copies the matmuls save are counted by the caller (they are parameters' casts, not per token).
    device: CUDA autocast saves the softmax probabilities twice (device.softmax_saved_bytes_per_score); RMSNorm
    saves what its device's kernel keeps (device.rms_norm_saved_bytes).
    Family terms (`family_bytes.family_extra_bytes`): RMSNorm, SwiGLU, RoPE tables, flash attention, shared experts.
    """
    recompute = _check_recompute(recompute)
    s, b, h, a, ffn, dtype_bytes, t = (shape.seq_len, shape.micro_batch, shape.d_model, shape.n_heads, shape.ffn,
                                       shape.dtype_bytes, shape.tp)
    sp, autocast, flash, n_experts, top_k = (shape.sequence_parallel, shape.autocast, shape.flash, shape.n_experts,
                                             shape.top_k)
    sb, sbh = s * b, s * b * h
    qh, vh = sb * (shape.q_width or h), sb * (shape.v_width or shape.q_width or h)  # sbh of q / k and of v
    norm_div = t if sp else 1
    residual_bytes = 4 if autocast else dtype_bytes
    if recompute == "full":
        return sbh / norm_div * residual_bytes  # checkpoint(layer, h) saves the layer input only
    if recompute == "op":
        return sbh / norm_div * residual_bytes + op_sac_saved_bytes(shape)
    stat_bytes = 2 * 2 * sb / norm_div * STAT_BYTES  # mean and rstd for two LayerNorms
    stat_bytes += 2 * sbh / norm_div * residual_bytes  # ln1 and ln2 inputs (the residual stream)
    # ln1 / ln2 outputs as the Linear inputs (all-gathered to full size under SP); under autocast each Linear that
    # reads ln1's output keeps its own cast: q, k and v, or MLA's two down-projections (q_a or q, and kv_a)
    elems = (1 + (2 if shape.kv_lora else 3) if autocast else 2) * sbh
    elems += vh / t  # o Linear input (heads merged back, B, T, h/t)
    elems += sb * shape.split_elems / t  # feature_elems
    padded = recompute == "none" and pads_v(shape)
    elems += sb * v_view_elems(shape, recompute=recompute, padded=padded) / t
    mask_bytes = latent_norm_bytes(shape)
    if recompute == "selective":
        elems += (2 * qh + vh) / t  # checkpoint keeps q, k, v (linear outputs or GQA-repeated copies)
    elif padded:  # SDPA keeps q, k, the zero-padded v and its (b, a, s, d_qk) output; o's input is the sliced copy
        elems += 4 * qh / t
        mask_bytes += LSE_BYTES * a / t * s * b
    elif flash:
        elems += (2 * qh + vh) / t  # SDPA's fused kernel saves q, k, v; its output IS the o Linear input (same storage)
        mask_bytes += LSE_BYTES * a / t * s * b  # + the (b, a, s) fp32 logsumexp, no s x s (Dao et al. 2022, Alg. 2)
    else:
        elems += _attn_core_elems(s=s, b=b, h=h, a=a, t=t) + (2 * qh + vh - 3 * sbh) / t
        mask_bytes += s * s  # masked_fill saves the (s, s) bool mask
        # the core counts probs at dtype_bytes; CUDA autocast's fp32 softmax output comes on top
        per_score = softmax_saved_bytes_per_score(dtype_bytes, autocast=autocast, device=shape.device)
        if per_score != dtype_bytes:
            mask_bytes += a * s * s * b / t * (per_score - dtype_bytes)
    mask_bytes += family_extra_bytes(s=s, b=b, h=h, a=a, ffn=ffn, t=t, norm_div=norm_div, dtype_bytes=dtype_bytes,
                                      residual_bytes=residual_bytes, autocast=autocast, norm=shape.norm, mlp=shape.mlp,
                                      rope=shape.rope, n_experts=n_experts, shared_ffn=shape.shared_ffn,
                                      shared_gate=shape.shared_gate, device=shape.device)
    mask_bytes += attention_constant_bytes(shape, recompute, rope=shape.rope and not shape.nope,
                                           windowed=shape.windowed)
    mask_bytes += qk_norm_bytes(shape) + sandwich_norm_bytes(shape)  # outside the selectively checkpointed core
    hidden = hidden_saved(shape.mlp)
    if n_experts and shape.ep > 1:  # all-to-all dispatch (moe_dispatch.py): N·k rows per rank under uniform routing,
        # what the capacity limit keeps and pads, the busiest rank's share under an imbalance (moe_rows.py)
        rows = expert_rows(tokens=s * b, top_k=top_k, n_experts=n_experts, factor=shape.capacity_factor,
                           pad=shape.pad_to_capacity, imbalance=shape.moe_imbalance)
        moe = ep_moe_layer_bytes(tokens=s * b, received_rows=rows.received, h=h, ffn=ffn // shape.etp,
                                 n_experts=n_experts,
                                 top_k=top_k, dtype_bytes=dtype_bytes, autocast=autocast, hidden=hidden,
                                 kept_rows=None if shape.capacity_factor is None else rows.kept,
                                 padded=shape.pad_to_capacity, gated=is_gated(shape.mlp))
        return elems * dtype_bytes + stat_bytes + mask_bytes + moe
    if n_experts:
        moe = dense_moe_layer_bytes(s=s, b=b, h=h, ffn=ffn, n_experts=n_experts, top_k=top_k, dtype_bytes=dtype_bytes,
                                    t=t, hidden=hidden, autocast=autocast, gated=is_gated(shape.mlp))
        return elems * dtype_bytes + stat_bytes + mask_bytes + moe
    elems += mlp_elems(s=s, b=b, h=h, ffn=ffn, t=t, hidden=hidden)
    return elems * dtype_bytes + stat_bytes + mask_bytes


def op_sac_saved_bytes(shape: LayerShape) -> float:
    """What op-level selective checkpointing (models/checkpointing.op_policy, torchtitan's `_apply_op_sac`) keeps of
    one block beyond its input: the outputs of the listed ops, every second aten.mm excepted, in forward order.
    Linears without a bias run aten.mm on the flattened (s·b, in) input, with one aten.addmm; their local outputs are
    q (h/t), k and v (kv·d/t), o (h: Rowwise's partial sum), then fc_in (f/t), fc_out (h) or gate, up (f/t), down (h);
    MLA's are q_a (q_lora, replicated) and q_b (a·d_qk/t), or q, then kv_a (kv_lora + rope, replicated), kv_b
    (a·(nope + d_v)/t) and o. The flash kernels keep their output (b, a/t, s, d_v; d_qk for this engine's padded MLA v
    on the CPU) and the fp32 logsumexp (b, a/t, s); math attention's two bmm outputs are the (b·a/t, s, s) scores and
    (b·a/t, s, d_v). Under SP, TP's reduce-scatters after o and fc_out / down give (s/t · b, h) each. An MoE block's
    router and experts count on after the attention's linears (`moe_linears_of`)."""
    s, b, h, a, t, ops = shape.seq_len, shape.micro_batch, shape.d_model, shape.n_heads, shape.tp, set(shape.sac_ops)
    cb, sb = shape.dtype_bytes, shape.seq_len * shape.micro_batch
    q = shape.q_width or h
    v = shape.v_width or q
    linears = _block_linears(shape)
    kept = _op_sac_kept_linears([(width, biased) for width, biased, _ in linears], ops)
    saved = sum(sb * linears[i][2] * linears[i][0] * cb for i in kept)
    if shape.flash and ops & {"aten._scaled_dot_product_flash_attention_for_cpu.default",
                              "aten._scaled_dot_product_flash_attention.default",
                              "aten._scaled_dot_product_efficient_attention.default"}:
        out = q if pads_v(shape) else v
        saved += sb * out / t * cb + LSE_BYTES * a / t * sb
    elif not shape.flash and "aten.bmm.default" in ops:
        saved += (b * a / t * s * s + sb * v / t) * cb
    if shape.sequence_parallel and "_c10d_functional.reduce_scatter_tensor.default" in ops:
        saved += 2 * sb * h / t * cb
    return saved


def linears_of(shape: LayerShape) -> list[tuple[float, bool]]:
    """(local output width, biased) of one dense block's linears in forward order."""
    h, a, t = shape.d_model, shape.n_heads, shape.tp
    q = shape.q_width or h
    kv = (shape.kv_heads or a) * (q // a)
    qkv_bias, other_bias = shape.bias in ("all", "qkv"), shape.bias == "all"
    if shape.kv_lora:  # MLA (models/gpt.py LatentAttention): the latent projections are replicated over tp
        linears = [(shape.q_lora, qkv_bias), (q / t, qkv_bias)] if shape.q_lora else [(q / t, qkv_bias)]
        linears += [(shape.kv_lora + rope_table_width(shape), qkv_bias),
                    ((shape.v_view_extra + (shape.v_width or q)) / t, False), (h, other_bias)]
    else:
        linears = [(q / t, qkv_bias), (kv / t, qkv_bias), (kv / t, qkv_bias), (h, other_bias)]
    if not shape.n_experts:
        f = shape.ffn / t
        linears += ([(f, other_bias), (h, other_bias)] if not is_gated(shape.mlp)
                    else [(f, other_bias)] * 2 + [(h, other_bias)])
    return linears


def moe_linears_of(shape: LayerShape) -> list[tuple[float, bool, float]]:
    """(local output width, biased, rows per token) of an MoE block's linears in forward order (gpt.MoE under the
    dense dispatch's per-expert loop): the router (replicated), each expert on its N·k/E routed rows (uniform
    routing), the shared experts and their gate on every row. [] for a dense block, and where the rows are not the
    loop's: under ep (strategies/moe_dispatch.py), a capacity limit and grouped GEMMs (`expert_loop`)."""
    if not shape.n_experts or shape.ep > 1 or shape.capacity_factor is not None or not shape.expert_loop:
        return []
    h, t, biased = shape.d_model, shape.tp, shape.bias == "all"

    def mlp(ffn: int, rows: float) -> list[tuple[float, bool, float]]:
        widths = [ffn / t, ffn / t, h] if is_gated(shape.mlp) else [ffn / t, h]
        return [(w, biased, rows) for w in widths]

    out = [(float(shape.n_experts), shape.router_bias, 1.0)]
    for _ in range(shape.n_experts):
        out += mlp(shape.ffn, shape.top_k / shape.n_experts)
    if shape.shared_ffn:
        out += mlp(shape.shared_ffn, 1.0) + ([(1.0, False, 1.0)] if shape.shared_gate else [])
    return out


def _block_linears(shape: LayerShape) -> list[tuple[float, bool, float]]:
    """(local output width, biased, rows per token) of every linear of the block in forward order."""
    return [(width, biased, 1.0) for width, biased in linears_of(shape)] + moe_linears_of(shape)


def _op_sac_kept_linears(linears: list[tuple[float, bool]], ops: set[str]) -> list[int]:
    """Indices of the linears op-level SAC keeps: aten.addmm (biased) when listed, every odd aten.mm."""
    out, mm_count = [], 0
    for i, (_, biased) in enumerate(linears):
        if biased:
            if "aten.addmm.default" in ops:
                out.append(i)
            continue
        mm_count += 1
        if "aten.mm.default" in ops and mm_count % 2 == 1:
            out.append(i)
    return out


def op_sac_rerun_extra_bytes(shape: LayerShape) -> float:
    """While an op-SAC block is re-run in backward its cached outputs are handed back one by one as the re-run
    reaches them; the block's last linear (fc_out / down; an MoE block's last expert or shared-expert gate), when
    kept, is still cached when the re-run peaks."""
    linears = _block_linears(shape)
    last = len(linears) - 1
    kept_last = last in _op_sac_kept_linears([(width, biased) for width, biased, _ in linears], set(shape.sac_ops))
    width, _, rows = linears[last]
    return shape.seq_len * shape.micro_batch * rows * width * shape.dtype_bytes if kept_last else 0.0


def model_layer_activation_bytes(*, s: int, b: int, h: int, a: int, kv_heads: int, ffn: int, dtype_bytes: float,
                                 t: int = 1, sp: bool = False, recompute: str = "none", n_experts: int = 0,
                                 top_k: int = 1, autocast: bool = False, ep: int = 1, norm: str = "layernorm",
                                 mlp: str = "gelu", rope: bool = False, flash: bool = False, shared_ffn: int = 0,
                                 shared_gate: bool = False, device: str = "cpu") -> float:
    """`layer_activation_bytes` in the paper's symbols (the formula tests' form). kv_heads does not change the
    bytes: GQA k/v are repeat_interleave'd to a heads before the matmuls and only the repeated copies are saved."""
    del kv_heads
    return layer_activation_bytes(LayerShape(seq_len=s, micro_batch=b, d_model=h, n_heads=a, ffn=ffn,
                                             dtype_bytes=dtype_bytes, tp=t, sequence_parallel=sp, n_experts=n_experts,
                                             top_k=top_k, ep=ep, autocast=autocast, device=device, norm=norm, mlp=mlp,
                                             rope=rope, flash=flash, shared_ffn=shared_ffn, shared_gate=shared_gate),
                                  recompute)


def full_recompute_peak_extra_bytes(shape: LayerShape, head_freed_bytes: float = 0.0) -> float:
    """Bytes the full-recompute activation peak adds to the end-of-forward state: the last block's
    forward is re-run in backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
    Sec 3: one segment re-materialised at a time), its input being the checkpoint's already-saved input,
    so one block's activations minus that input. On the stage with the head this happens after the head's
    backward freed its saved tensors (`head_freed_bytes`); the peak is whichever moment is larger."""
    block = layer_activation_bytes(shape, "none")
    block_input = layer_activation_bytes(shape, "full")
    return max(0.0, block - block_input - head_freed_bytes)


def model_head_freed_in_backward_bytes(*, s: int, b: int, h: int, vocab: int, dtype_bytes: float, t: int = 1,
                                       sp: bool = False, loss_parallel: bool = False, autocast: bool = False,
                                       norm: str = "layernorm", learned_pos: bool = True, device: str = "cpu",
                                       fused_loss: bool = False) -> float:
    """The part of `model_embedding_head_activation_bytes` freed once the head's backward ran: everything
    except pos (embedding backward comes last), the caller-held logits and the loss scalars (a fused loss's saved
    logits are counted as the caller's: not freed, an upper bound where the loop lets them go)."""
    saved = model_embedding_head_activation_bytes(s=s, b=b, h=h, vocab=vocab, dtype_bytes=dtype_bytes, t=t, sp=sp,
                                                  logits_held=False, loss_parallel=loss_parallel, autocast=autocast,
                                                  norm=norm, learned_pos=learned_pos, device=device,
                                                  fused_loss=fused_loss)
    return saved - s * INDEX_BYTES * learned_pos - LOSS_BYTES


def model_loss_transient_bytes(*, s: int, b: int, vocab: int, dtype_bytes: float, t: int = 1,
                               loss_parallel: bool = False, fused_loss: bool = False) -> float:
    """16-bit logits: loss_fn's `.float()` copy (s·b·V fp32) is alive while log_softmax writes its output,
    the activation peak of forward + loss (none for fp32 logits, where `.float()` is the tensor itself, nor for a
    fused loss, which upcasts inside its row kernel)."""
    if dtype_bytes == 4 or fused_loss_applies(fused_loss, loss_parallel, t):
        return 0.0
    return s * b * vocab / (t if loss_parallel else 1) * 4


def fused_loss_applies(fused_loss: bool, loss_parallel: bool, t: int) -> bool:
    """The fused loss's terms apply: not over vocab-parallel logits, whose DTensor `_log_softmax` keeps the eager
    ones (stack_activations.py)."""
    return bool(fused_loss) and not (loss_parallel and t > 1)


def model_embedding_head_activation_bytes(*, s: int, b: int, h: int, vocab: int, dtype_bytes: float, t: int = 1,
                                          sp: bool = False, logits_held: bool = True,
                                          loss_parallel: bool = False, autocast: bool = False,
                                          norm: str = "layernorm", learned_pos: bool = True,
                                          device: str = "cpu", fused_loss: bool = False) -> float:
    """Bytes saved outside the blocks on the stages that own embedding / head, end of forward.

    Embedding: the token-embedding backward needs only the indices (the input batch); pos = arange(s)
    int64 is created in forward. Head: final LayerNorm input (sbh) + stats (2sb fp32), lm_head input
    (sbh), cross-entropy log_softmax output (s·b·V, fp32 because loss_fn calls .float()), plus the
    logits themselves while the caller holds them (s·b·V·dtype_bytes) and, for 16-bit logits, nothing
    more (the fp32 copy is only an input of log_softmax, which saves its output).
    With SP the final norm's input and stats are split over t (the lm_head input is all-gathered, full);
    with loss_parallel the vocab dimension of logits and log-probs is split over t.
    autocast: the final norm's input is the fp32 residual stream; lm_head saves a 16-bit cast of its input.
    RMSNorm: what its device's kernel keeps (rms_norm_extra_bytes); RoPE (learned_pos False): no arange.
    fused_loss: the loss saves the logits themselves and FUSED_LOSS_ROW_BYTES per row instead of the fp32 log-probs.
    """
    v_div = t if loss_parallel else 1
    emb = s * INDEX_BYTES * learned_pos  # pos = arange(s) (int64)
    loss = LOSS_BYTES  # nll_loss saves total_weight; the loss scalar itself
    norm_div = t if sp else 1
    norm_in_bytes = 4 if autocast else dtype_bytes
    # lm_head in, norm in, stats
    head = s * b * h * (dtype_bytes + norm_in_bytes / norm_div) + 2 * s * b / norm_div * STAT_BYTES
    if norm == "rmsnorm":  # see family_bytes.family_extra_bytes
        head += rms_norm_extra_bytes(sbh=s * b * h / norm_div, sb=s * b / norm_div, input_bytes=norm_in_bytes,
                                     device=device)
    if fused_loss_applies(fused_loss, loss_parallel, t):
        head += s * b * FUSED_LOSS_ROW_BYTES
    else:
        head += s * b * vocab / v_div * 4  # log_softmax output, fp32
    if logits_held:
        head += s * b * vocab / v_div * dtype_bytes
    return emb + head + loss


def head_beyond_blocks_bytes(*, s: int, b: int, h: int, vocab: int, dtype_bytes: float, t: int = 1, sp: bool = False,
                             autocast: bool = False, norm: str = "layernorm", learned_pos: bool = True,
                             device: str = "cpu", fused_loss: bool = False) -> float:
    """What the forward + loss moment of the stage with the logits holds beyond the end of its last block: the
    head's saved tensors, the held logits and the loss scalars (`model_embedding_head_activation_bytes` without
    pos), the TP logits shard, the 16-bit logits' fp32 copy (`model_loss_transient_bytes`) and, under autocast,
    lm_head's 16-bit weight cast (as `rank_activation_bytes` adds them). b may be an array."""
    head = model_embedding_head_activation_bytes(s=s, b=b, h=h, vocab=vocab, dtype_bytes=dtype_bytes, t=t, sp=sp,
                                                 autocast=autocast, norm=norm, learned_pos=learned_pos, device=device,
                                                 fused_loss=fused_loss)
    shard = tp_logits_shard_bytes(s=s, b=b, vocab=vocab, t=t, dtype_bytes=dtype_bytes)
    head = head - s * INDEX_BYTES * learned_pos + shard
    head = head + model_loss_transient_bytes(s=s, b=b, vocab=vocab, dtype_bytes=dtype_bytes, t=t,
                                             fused_loss=fused_loss)
    return head + (-(-vocab // t) * h * dtype_bytes if autocast else 0)


def ep_dispatch_peak_bytes(*, s: int, b: int, h: int, n_experts: int, top_k: int, dtype_bytes: float,
                           autocast: bool = False) -> float:
    """What the last MoE layer's all-to-all dispatch (strategies/moe_dispatch.py) holds at its peak beyond the
    saved tensors at the end of the blocks, under uniform routing (rows = N·k received = sent): three (rows, h)
    buffers in the row dtype (the received rows x, and y before and after the last local expert's index_add),
    the router's (N, E) probabilities and (N, k) top-k values, and under autocast the expert output's 16-bit
    (rows, h). Read off full-size traces (`python -m backend trace`, zero3 x ep2 at world 2, h 128/256, s 128/256,
    V 32/64, fp32 and bf16-mixed): within 1% of the traced excess."""
    rows = s * b * top_k
    rb = row_bytes(dtype_bytes, autocast)
    return 3 * rows * h * rb + s * b * (n_experts + top_k) * rb + (rows * h * dtype_bytes if autocast else 0)


def dispatch_outweighs_head(model: ModelSpec, shape: LayerShape) -> bool:
    """EP: the activation peak of the stage with the logits falls inside its last MoE block's dispatch (its
    buffers outweigh what the head and loss add after the blocks) rather than at the loss. Ties keep the loss
    (the tracker keeps the later moment)."""
    head = head_beyond_blocks_bytes(sp=shape.sequence_parallel, **shape.head_kwargs(model.vocab_size))
    return ep_dispatch_peak_bytes(s=shape.seq_len, b=shape.micro_batch, h=shape.d_model, n_experts=model.n_experts,
                                  top_k=model.top_k, dtype_bytes=shape.dtype_bytes, autocast=shape.autocast) > head


def ep_peaks_in_last_block(spec: ExperimentSpec) -> bool:
    """`dispatch_outweighs_head` for a validated spec."""
    return dispatch_outweighs_head(spec.model, LayerShape.of_spec(spec))


def model_backward_head_transient_bytes(*, s: int, b: int, vocab: int, dtype_bytes: float, t: int = 1,
                                        loss_parallel: bool = False) -> float:
    """Temporaries at the start of backward on the last stage, on top of the saved activations:
    the grad of the fp32 log-probs (s·b·V·4) and the grad of the logits (s·b·V·dtype_bytes; for 16-bit
    logits the fp32 grad of the .float() copy exists too). Dominates the backward peak when V >> h."""
    v_div = t if loss_parallel else 1
    extra = 0 if dtype_bytes == 4 else s * b * vocab / v_div * 4  # fp32 grad before the cast back
    return s * b * vocab / v_div * (4 + dtype_bytes) + extra


def loss_backward_extra_bytes(*, s: int, b: int, vocab: int, dtype_bytes: float, logits_held: bool,
                              fused_loss: bool = False) -> float:
    """What the start of the loss's backward holds beyond the forward + loss moment, on the rank with the loss:
    log_softmax's backward holds the fp32 grad of the log-probs and writes the fp32 grad of its input (2 · 4 B per
    logit; its own saved output is already counted), while loss_fn's fp32 copy of 16-bit logits is gone and so are
    the logits themselves unless the training loop still holds them (backend/models/gpt.loss_fn,
    strategies/step.LoopStyle: `logits_held_in_backward`). For a large vocabulary this is the step's fullest moment.
    An upper bound where the activation peak is elsewhere (inside the last MoE dispatch, a full-recompute re-run).
    Measured on the H200 (benchmarks/results/gpu/2026-11-26-h200-run2, Llama-3.2-1B shape, V = 128,256): the tracker's
    peak minus its activation-peak total is 0.979 GiB for zero3/zero2/zero3-full (2 B per logit: bf16 logits not
    held) and 1.957 GiB for ddp (4 B: held), what this gives.
    A fused loss (`fused_loss`) writes the logits' 16-bit gradient beside the logits it saved, nothing in fp32: the
    dtype's bytes per logit (measured for the compiled loss: tests/helpers/compiled_loss_memory.py, 2 -> 4 B)."""
    n = s * b * vocab
    if fused_loss:
        return n * dtype_bytes
    freed = (0 if dtype_bytes == 4 else 4 * n) + (0 if logits_held else n * dtype_bytes)
    return max(0.0, 2 * 4 * n - freed)


def logits_held_in_backward(layout: Layout) -> bool:
    """Whether the logits are still alive when the loss's backward starts (scalar layout): the training loop holds
    them in pure ddp / zero1 and the ep / dp mixes, a pipeline schedule keeps its last stage's output, the pure
    FSDP strategies and tp mixes let them go (backend/strategies/parallelize.loop_style)."""
    if layout.pipelined:
        return True
    if layout.tp > 1:
        return False
    return not (layout.fsdp and not layout.is_mix)


def tp_logits_shard_bytes(*, s: int, b: int, vocab: int, t: int, dtype_bytes: float) -> float:
    """ColwiseParallel lm_head: the local (b, s, V/t) logits shard stays alive next to the gathered logits."""
    return b * s * -(-vocab // t) * dtype_bytes if t > 1 else 0.0


def _fam(m: ModelSpec, name: str, default: Any) -> Any:
    v = getattr(m, name, default)
    return str(v) if hasattr(v, "value") else v


def _capacity_kwargs(m: ModelSpec) -> dict[str, Any]:
    return dict(capacity_factor=_fam(m, "capacity_factor", None),
                pad_to_capacity=bool(_fam(m, "moe_pad_to_capacity", False)),
                moe_imbalance=float(_fam(m, "moe_imbalance", 1.0)))


def family_kwargs(m: ModelSpec) -> dict[str, Any]:
    """The ModelSpec family fields as model_layer_activation_bytes keywords (GPT defaults for older objects)."""
    return dict(norm=_fam(m, "norm", "layernorm"), mlp=_fam(m, "mlp", "gelu"),
                rope=_fam(m, "positions", "learned") == "rope", flash=_fam(m, "attention", "math") == "flash",
                shared_ffn=_fam(m, "shared_ffn", 0), shared_gate=bool(_fam(m, "shared_expert_gate", False)))
