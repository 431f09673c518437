"""Activation bytes saved for backward (pure Python).

Two models:
- `korthikanti_layer_bytes`: the published per-layer formulas (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", Sec 4 / Table 2): 16-bit activations, with
  dropout, GPT-style layer with 4h MLP.
- `model_layer_activation_bytes` / `model_embedding_head_activation_bytes`: what autograd saves for
  OUR model (backend/models/gpt.py), read off the ops it runs (no dropout, explicit softmax attention).
- `rank_activation_bytes`: one rank of a spec at the engine's activation peak (the moments it can fall in).
Symbols: s sequence, b microbatch, h hidden, a heads, t tensor-parallel degree, sp sequence parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backend.analytic import device as D
from backend.analytic import moe_routing as MR
from backend.analytic.textbook import pipeline as PL
from backend.analytic.pipelining import held_stage_inputs, held_stage_outputs
from backend.analytic.traffic import compute_bytes, is_mix

if TYPE_CHECKING:
    from backend.analytic.sharding import LocalParam

RECOMPUTE = ("none", "selective", "full")
INDEX_BYTES = 8  # int64 indices (topk, nonzero) that autograd saves for index ops
STAT_BYTES = 4  # LayerNorm mean/rstd are fp32
LOSS_BYTES = 2 * 4  # fp32 scalars: nll_loss's saved total_weight and the loss itself
LSE_BYTES = 4  # flash / memory-efficient attention keep the softmax logsumexp in fp32


def _check_recompute(recompute: str) -> str:
    recompute = str(recompute)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} not in {RECOMPUTE}")
    return recompute


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one transformer layer, Korthikanti 2022 Table 2."""
    recompute = _check_recompute(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)  # Table 2 "full recompute": 2sbh input per layer (/t with SP)
    attn_scores = 0.0 if recompute == "selective" else 5 * a * s / h  # Sec 5: selective recompute drops the 5as/h term
    if sp:
        return sbh / t * (34 + attn_scores)  # Table 2: sbh/t (34 + 5as/h); selective sbh·34/t
    return sbh * (10 + 24 / t + attn_scores / t)  # Table 2: sbh(10 + 24/t + 5as/(ht)); selective sbh(10 + 24/t)


def _attn_core_elems(*, s, b, h, a, t) -> float:
    # matmul copies of q, k^T (GQA: repeat_interleave'd, so always a·d_head = h wide) saved by bmm: 2sbh/t;
    # softmax output probs (b, a, s, s) saved by softmax and probs@v: a·s²·b/t; v copy saved by bmm: sbh/t
    return (3 * s * b * h + a * s * s * b) / t


def _mlp_elems(*, s, b, h, ffn, t, swiglu: bool = False) -> float:
    # fc_in saves its input (ln2 output; counted in the block), GELU saves fc_in output (s·b·ffn),
    # fc_out saves GELU output (s·b·ffn). SwiGLU (Shazeer 2020 Eq. 6): silu saves gate's output, the product saves
    # silu's output and up's output, down saves the product: 4·s·b·ffn (measured op by op, tests/test_family_activations.py)
    return (4 if swiglu else 2) * s * b * ffn / t


def _moe_bytes(*, s, b, h, ffn, n_experts, top_k, dtype_bytes, t=1, swiglu: bool = False) -> float:
    n = s * b  # tokens
    rows = n * top_k  # (token, expert) pairs; all tokens reach their k experts (no capacity drop)
    elems = n * n_experts  # router softmax output (N, E), saved by softmax
    elems += rows + n  # normalised top-k weights: div saves the topk values (N, k) and their sum (N, 1)
    elems += rows * h  # each expert's fc_in saves its gathered input flat[tok]
    # GELU input and fc_out input inside the experts; under TP each expert is Colwise fc_in / Rowwise fc_out
    # (backend/strategies/tp.py tp_plan), so its hidden is (rows, ffn/t) like the dense MLP's (Shoeybi 2019 Sec 3)
    elems += (4 if swiglu else 2) * rows * ffn / t  # SwiGLU experts: gate out, silu out, up out, product
    elems += rows * h + rows  # mul(expert_out, w) saves both operands
    elems += rows * h  # index_add_(0, tok, weighted) keeps its source (expert_out · w)
    index = rows + 2 * rows  # topk indices; nonzero (tok, slot) pairs per expert
    return elems * dtype_bytes + index * INDEX_BYTES


def model_layer_activation_bytes(*, s: int, b: int, h: int, a: int, kv_heads: int, ffn: int, dtype_bytes: float,
                                 t: int = 1, sp: bool = False, recompute: str = "none", n_experts: int = 0,
                                 top_k: int = 1, autocast: bool = False, ep: int = 1, norm: str = "layernorm",
                                 mlp: str = "gelu", rope: bool = False, flash: bool = False, shared_ffn: int = 0,
                                 shared_gate: bool = False, autocast_device: str = "cpu") -> float:
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
    autocast_device: CUDA autocast saves the softmax probabilities twice (device.softmax_saved_bytes_per_score).
    Family terms (`_family_extra_bytes`): RMSNorm, SwiGLU, RoPE tables, flash attention, shared experts.
    """
    recompute = _check_recompute(recompute)
    del kv_heads  # see docstring: saved k/v are always a·d_head wide
    sb, sbh = s * b, s * b * h
    norm_div = t if sp else 1
    residual_bytes = 4 if autocast else dtype_bytes
    if recompute == "full":
        return sbh / norm_div * residual_bytes  # checkpoint(layer, h) saves the layer input only
    stat_bytes = 2 * 2 * sb / norm_div * STAT_BYTES  # mean and rstd for two LayerNorms
    stat_bytes += 2 * sbh / norm_div * residual_bytes  # ln1 and ln2 inputs (the residual stream)
    elems = (4 if autocast else 2) * sbh  # ln1 / ln2 outputs as the Linear inputs (all-gathered to full size under SP)
    elems += sbh / t  # o Linear input (heads merged back, B, T, h/t)
    mask_bytes = 0.0
    if recompute == "selective":
        elems += 3 * sbh / t  # checkpoint keeps q, k, v (linear outputs or GQA-repeated copies)
    elif flash:
        elems += 3 * sbh / t  # SDPA's fused kernel saves q, k, v; its output IS the o Linear input (same storage)
        mask_bytes = LSE_BYTES * a / t * s * b  # + the (b, a, s) fp32 logsumexp, no s x s (Dao et al. 2022, Alg. 2)
    else:
        elems += _attn_core_elems(s=s, b=b, h=h, a=a, t=t)
        mask_bytes = s * s  # masked_fill saves the (s, s) bool mask
        # the core counts probs at dtype_bytes; CUDA autocast's fp32 softmax output comes on top
        per_score = D.softmax_saved_bytes_per_score(dtype_bytes, autocast=autocast, device=autocast_device)
        if per_score != dtype_bytes:
            mask_bytes += a * s * s * b / t * (per_score - dtype_bytes)
    mask_bytes += _family_extra_bytes(s=s, b=b, h=h, a=a, ffn=ffn, t=t, norm_div=norm_div, dtype_bytes=dtype_bytes,
                                      residual_bytes=residual_bytes, autocast=autocast, norm=norm, mlp=mlp, rope=rope,
                                      n_experts=n_experts, shared_ffn=shared_ffn, shared_gate=shared_gate)
    swiglu = mlp == "swiglu"
    if n_experts and ep > 1:  # all-to-all dispatch (moe_dispatch.py) under uniform routing: N·k rows per rank
        moe = MR.ep_moe_layer_bytes(tokens=s * b, received_rows=s * b * top_k, h=h, ffn=ffn, n_experts=n_experts,
                                    top_k=top_k, dtype_bytes=dtype_bytes, autocast=autocast, swiglu=swiglu)
        return elems * dtype_bytes + stat_bytes + mask_bytes + moe
    if n_experts:
        moe = _moe_bytes(s=s, b=b, h=h, ffn=ffn, n_experts=n_experts, top_k=top_k, dtype_bytes=dtype_bytes, t=t,
                         swiglu=swiglu)
        return elems * dtype_bytes + stat_bytes + mask_bytes + moe
    elems += _mlp_elems(s=s, b=b, h=h, ffn=ffn, t=t, swiglu=swiglu)
    return elems * dtype_bytes + stat_bytes + mask_bytes


def _family_extra_bytes(*, s, b, h, a, ffn, t, norm_div, dtype_bytes, residual_bytes, autocast, norm, mlp, rope,
                        n_experts, shared_ffn, shared_gate) -> float:
    """What the architecture-family choices add to the GPT block's saved bytes (each measured op by op against
    MemTracker in tests/test_family_activations.py):
    - rmsnorm (composite x * rsqrt(mean(x^2) + eps) * w): per norm the normalised x (sbh) and rstd (sb) instead of
      LayerNorm's mean + rstd (2sb fp32); in the residual dtype, /t under SP;
    - rope: the (s, d_head) cos and sin tables the two muls keep, in q's dtype, per layer (not per token);
    - autocast + swiglu: gate and up each save their own 16-bit cast of the ln2 output (one more than fc_in);
    - shared experts (MoE only): their hidden 2·N·f_s/t (gelu) or 4·N·f_s/t (swiglu) and, under autocast, one cast
      of the tokens per first Linear; the sigmoid gate keeps its (N, 1) output and the shared output (N, h)."""
    sb, sbh = s * b, s * b * h
    out = 0.0
    if norm == "rmsnorm":
        out += 2 * (sbh + sb) / norm_div * residual_bytes - 2 * 2 * sb / norm_div * STAT_BYTES
    if rope:
        out += 2 * s * (h // a) * dtype_bytes
    swiglu = mlp == "swiglu"
    if autocast and swiglu:
        out += sbh * dtype_bytes
    if n_experts and shared_ffn:
        out += _mlp_elems(s=s, b=b, h=h, ffn=shared_ffn, t=t, swiglu=swiglu) * dtype_bytes
        if autocast:
            out += (2 if swiglu else 1) * sbh * dtype_bytes
        if shared_gate:
            out += (sbh + sb) * (4 if autocast else dtype_bytes)
    return out


def model_full_recompute_peak_extra_bytes(*, head_freed_bytes: float = 0.0, **layer_kwargs) -> float:
    """Bytes the full-recompute activation peak adds to the end-of-forward state: the last block's
    forward is re-run in backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
    Sec 3: one segment re-materialised at a time), its input being the checkpoint's already-saved input,
    so one block's activations minus that input. On the stage with the head this happens after the head's
    backward freed its saved tensors (`head_freed_bytes`); the peak is whichever moment is larger."""
    block = model_layer_activation_bytes(**dict(layer_kwargs, recompute="none"))
    block_input = model_layer_activation_bytes(**dict(layer_kwargs, recompute="full"))
    return max(0.0, block - block_input - head_freed_bytes)


def model_head_freed_in_backward_bytes(*, s: int, b: int, h: int, vocab: int, dtype_bytes: float, t: int = 1,
                                       sp: bool = False, loss_parallel: bool = False, autocast: bool = False,
                                       norm: str = "layernorm", learned_pos: bool = True) -> float:
    """The part of `model_embedding_head_activation_bytes` freed once the head's backward ran: everything
    except pos (embedding backward comes last), the caller-held logits and the loss scalars."""
    saved = model_embedding_head_activation_bytes(s=s, b=b, h=h, vocab=vocab, dtype_bytes=dtype_bytes, t=t, sp=sp,
                                                  logits_held=False, loss_parallel=loss_parallel, autocast=autocast,
                                                  norm=norm, learned_pos=learned_pos)
    return saved - s * INDEX_BYTES * learned_pos - LOSS_BYTES


def model_loss_transient_bytes(*, s: int, b: int, vocab: int, dtype_bytes: float, t: int = 1,
                               loss_parallel: bool = False) -> float:
    """16-bit logits: loss_fn's `.float()` copy (s·b·V fp32) is alive while log_softmax writes its output,
    the activation peak of forward + loss (none for fp32 logits, where `.float()` is the tensor itself)."""
    return 0.0 if dtype_bytes == 4 else s * b * vocab / (t if loss_parallel else 1) * 4


def model_embedding_head_activation_bytes(*, s: int, b: int, h: int, vocab: int, dtype_bytes: float, t: int = 1,
                                          sp: bool = False, logits_held: bool = True,
                                          loss_parallel: bool = False, autocast: bool = False,
                                          norm: str = "layernorm", learned_pos: bool = True) -> float:
    """Bytes saved outside the blocks on the stages that own embedding / head, end of forward.

    Embedding: the token-embedding backward needs only the indices (the input batch); pos = arange(s)
    int64 is created in forward. Head: final LayerNorm input (sbh) + stats (2sb fp32), lm_head input
    (sbh), cross-entropy log_softmax output (s·b·V, fp32 because loss_fn calls .float()), plus the
    logits themselves while the caller holds them (s·b·V·dtype_bytes) and, for 16-bit logits, nothing
    more (the fp32 copy is only an input of log_softmax, which saves its output).
    With SP the final norm's input and stats are split over t (the lm_head input is all-gathered, full);
    with loss_parallel the vocab dimension of logits and log-probs is split over t.
    autocast: the final norm's input is the fp32 residual stream; lm_head saves a 16-bit cast of its input.
    RMSNorm: the normalised x (sbh) and rstd (sb) instead of mean + rstd; RoPE (learned_pos False): no arange.
    """
    v_div = t if loss_parallel else 1
    emb = s * INDEX_BYTES * learned_pos  # pos = arange(s) (int64)
    loss = LOSS_BYTES  # nll_loss saves total_weight; the loss scalar itself
    norm_div = t if sp else 1
    norm_in_bytes = 4 if autocast else dtype_bytes
    head = s * b * h * (dtype_bytes + norm_in_bytes / norm_div) + 2 * s * b / norm_div * STAT_BYTES  # lm_head in, norm in, stats
    if norm == "rmsnorm":  # see _family_extra_bytes
        head += (s * b * h + s * b) / norm_div * norm_in_bytes - 2 * s * b / norm_div * STAT_BYTES
    head += s * b * vocab / v_div * 4  # log_softmax output, fp32
    if logits_held:
        head += s * b * vocab / v_div * dtype_bytes
    return emb + head + loss


def head_beyond_blocks_bytes(*, s: int, b: int, h: int, vocab: int, dtype_bytes: float, t: int = 1, sp: bool = False,
                             autocast: bool = False, norm: str = "layernorm", learned_pos: bool = True) -> float:
    """What the forward + loss moment of the stage with the logits holds beyond the end of its last block: the
    head's saved tensors, the held logits and the loss scalars (`model_embedding_head_activation_bytes` without
    pos), the TP logits shard, the 16-bit logits' fp32 copy (`model_loss_transient_bytes`) and, under autocast,
    lm_head's 16-bit weight cast (as `rank_activation_bytes` adds them). b may be an array."""
    head = model_embedding_head_activation_bytes(s=s, b=b, h=h, vocab=vocab, dtype_bytes=dtype_bytes, t=t, sp=sp,
                                                 autocast=autocast, norm=norm, learned_pos=learned_pos)
    shard = tp_logits_shard_bytes(s=s, b=b, vocab=vocab, t=t, dtype_bytes=dtype_bytes)
    head = head - s * INDEX_BYTES * learned_pos + shard
    head = head + model_loss_transient_bytes(s=s, b=b, vocab=vocab, dtype_bytes=dtype_bytes, t=t)
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
    rb = MR.row_bytes(dtype_bytes, autocast)
    return 3 * rows * h * rb + s * b * (n_experts + top_k) * rb + (rows * h * dtype_bytes if autocast else 0)


def ep_peaks_in_last_block(spec: Any) -> bool:
    """EP: the activation peak of the stage with the logits falls inside its last MoE block's dispatch (its
    buffers outweigh what the head and loss add after the blocks) rather than at the loss. Ties keep the loss
    (the tracker keeps the later moment)."""
    m, t, p = spec.model, spec.train, spec.parallel
    kw = _layer_kwargs(spec)
    head = head_beyond_blocks_bytes(s=m.seq_len, b=t.micro_batch, h=m.d_model, vocab=m.vocab_size,
                                    dtype_bytes=kw["dtype_bytes"], t=p.tp, sp=p.sequence_parallel,
                                    autocast=kw["autocast"], norm=kw["norm"], learned_pos=not kw["rope"])
    return ep_dispatch_peak_bytes(s=m.seq_len, b=t.micro_batch, h=m.d_model, n_experts=m.n_experts, top_k=m.top_k,
                                  dtype_bytes=kw["dtype_bytes"], autocast=kw["autocast"]) > head


def model_backward_head_transient_bytes(*, s: int, b: int, vocab: int, dtype_bytes: float, t: int = 1,
                                        loss_parallel: bool = False) -> float:
    """Temporaries at the start of backward on the last stage, on top of the saved activations:
    the grad of the fp32 log-probs (s·b·V·4) and the grad of the logits (s·b·V·dtype_bytes; for 16-bit
    logits the fp32 grad of the .float() copy exists too). Dominates the backward peak when V >> h."""
    v_div = t if loss_parallel else 1
    extra = 0 if dtype_bytes == 4 else s * b * vocab / v_div * 4  # fp32 grad before the cast back
    return s * b * vocab / v_div * (4 + dtype_bytes) + extra


def _layer_kwargs(spec: Any) -> dict[str, Any]:
    m, t, p = spec.model, spec.train, spec.parallel
    return dict(s=m.seq_len, b=t.micro_batch, h=m.d_model, a=m.n_heads, kv_heads=m.kv_heads,
                ffn=_fam(m, "expert_ffn", m.ffn) if m.is_moe else m.ffn,
                dtype_bytes=compute_bytes(t.precision), t=p.tp, sp=p.sequence_parallel, n_experts=m.n_experts,
                top_k=m.top_k, autocast=uses_autocast(spec), ep=p.ep if m.is_moe else 1, 
                autocast_device="cuda" if str(spec.runtime.device) == "cuda" else "cpu", **family_kwargs(m))


def _fam(m: Any, name: str, default: Any) -> Any:
    v = getattr(m, name, default)
    return str(v) if hasattr(v, "value") else v


def family_kwargs(m: Any) -> dict[str, Any]:
    """The ModelSpec family fields as model_layer_activation_bytes keywords (GPT defaults for older objects)."""
    return dict(norm=_fam(m, "norm", "layernorm"), mlp=_fam(m, "mlp", "gelu"), rope=_fam(m, "positions", "learned") == "rope",
                flash=_fam(m, "attention", "math") == "flash", shared_ffn=_fam(m, "shared_ffn", 0),
                shared_gate=bool(_fam(m, "shared_expert_gate", False)))


def _saved_end_of_forward(spec: Any, rank: int, layers: list[int], stages: list[int]) -> tuple[float, float, float]:
    """(bytes autograd holds at the end of the last microbatch's forward + loss, the head's share of them
    freed by the head's backward, a transient alive only at the end of a stage's forward without the loss)."""
    m, t, p = spec.model, spec.train, spec.parallel
    kw = _layer_kwargs(spec)
    per_mb = len(layers) * model_layer_activation_bytes(recompute=str(t.recompute), **kw)
    hkw = dict(s=m.seq_len, b=t.micro_batch, h=m.d_model, vocab=m.vocab_size, dtype_bytes=kw["dtype_bytes"], t=p.tp,
               autocast=kw["autocast"], norm=kw["norm"], learned_pos=not kw["rope"])
    if p.pp > 1:
        if p.pp * p.virtual_stages - 1 in stages:
            return _pipeline_saved(spec, rank, stages, per_mb, hkw), model_head_freed_in_backward_bytes(**hkw), 0.0
        # the last block's MLP output, alive next to the residual sum that ends the stage's forward
        mlp_out = t.micro_batch * m.seq_len * m.d_model / (p.tp if p.sequence_parallel else 1) * hkw["dtype_bytes"]
        return _pipeline_saved(spec, rank, stages, per_mb, hkw), 0.0, mlp_out
    total = per_mb + model_embedding_head_activation_bytes(**hkw)
    total += _tp_logits_shard_bytes(spec, kw["dtype_bytes"])
    return total, model_head_freed_in_backward_bytes(**hkw), 0.0


def _tp_logits_shard_bytes(spec: Any, dtype_bytes: float) -> float:
    m, t, p = spec.model, spec.train, spec.parallel
    return tp_logits_shard_bytes(s=m.seq_len, b=t.micro_batch, vocab=m.vocab_size, t=p.tp, dtype_bytes=dtype_bytes)


def tp_logits_shard_bytes(*, s: int, b: int, vocab: int, t: int, dtype_bytes: float) -> float:
    """ColwiseParallel lm_head: the local (b, s, V/t) logits shard stays alive next to the gathered logits."""
    return b * s * -(-vocab // t) * dtype_bytes if t > 1 else 0.0


def _pipeline_saved(spec: Any, rank: int, stages: list[int], per_mb: float, hkw: dict[str, Any]) -> float:
    """One pipeline rank when its activations peak: after its last forward (stages without the loss) or at the
    start of the last stage's last backward (the loss seed just made). torch.distributed.pipelining holds,
    besides each in-flight chunk's saved tensors: every non-first stage's m input buffers, the sent stage
    outputs (pipeline.held_stage_outputs), and on the last stage each in-flight microbatch's loss graph."""
    m, t, p = spec.model, spec.train, spec.parallel
    sched, v, mb = str(p.pp_schedule), p.virtual_stages, t.microbatches
    n_stages = p.pp * v
    units = PL.in_flight_microbatches(sched, p=p.pp, m=mb, stage=p.coords(rank)["pp"], v=v)
    # one stage input / output: the residual stream (fp32 under autocast), sequence-split under SP
    buf = t.micro_batch * m.seq_len * m.d_model / (p.tp if p.sequence_parallel else 1) * (
        4 if hkw["autocast"] else hkw["dtype_bytes"])
    total = per_mb * units / v  # in-flight chunks (per_mb covers all v chunks), each chunk's input included
    total -= units * buf * sum(s != 0 for s in stages) / len(stages)  # non-first inputs: counted as held inputs
    total += buf * (held_stage_inputs(m=mb, stages=stages)
                    + held_stage_outputs(sched, m=mb, in_flight=units, stages=stages, n_stages=n_stages))
    if 0 in stages and hkw["learned_pos"]:  # pos = arange(s) int64 per in-flight microbatch of the first stage
        total += units / v * m.seq_len * INDEX_BYTES
    if n_stages - 1 not in stages:
        return total
    head = model_embedding_head_activation_bytes(**hkw) - m.seq_len * INDEX_BYTES * hkw["learned_pos"] - LOSS_BYTES
    head += _tp_logits_shard_bytes(spec, hkw["dtype_bytes"])
    k = PL.last_stage_in_flight(sched, m=mb)
    # fp32 scalars: every microbatch's loss (schedules.py `_internal_losses`, kept to the step's end), nll_loss's
    # total_weight per in-flight loss graph, the ones_like loss seed of the backward (_backward.py stage_backward)
    return total + k * head + 4 * (mb + k + 1)


def rank_activation_bytes(spec: Any, rank: int, layers: list[int], stages: list[int], params: list[LocalParam]) -> int:
    """Activation bytes of one rank at the engine's activation peak (see backend/analytic/estimate.py): the
    largest of end of forward + loss, end of forward inside autocast, and the full-recompute re-run."""
    m, t, p = spec.model, spec.train, spec.parallel
    kw = _layer_kwargs(spec)
    cb, ac = kw["dtype_bytes"], kw["autocast"]
    total, head_freed, fwd_transient = _saved_end_of_forward(spec, rank, layers, stages)
    last = p.pp * p.virtual_stages - 1 in stages
    w_blocks, w_head, b_blocks = autocast_copy_bytes(spec, params) if ac else (0, 0, 0)
    # forward + loss: the 16-bit copies of every local Linear weight (saved by the matmuls, kept by the
    # checkpoint only for lm_head); loss_fn's fp32 logits copy; stages without the loss peak at the end of
    # forward, with autocast's cached bias casts still alive
    full = str(t.recompute) == "full" and bool(layers)
    if last:
        sbv = m.seq_len * t.micro_batch * m.vocab_size
        fwd = total + w_head + (0 if full else w_blocks) + model_loss_transient_bytes(
            s=m.seq_len, b=t.micro_batch, vocab=m.vocab_size, dtype_bytes=cb, t=p.tp)
        if ac:  # end of forward, inside autocast: every weight and bias cast still cached, no loss yet, and
            # the previous microbatch's logits still bound in the training loop
            fwd = max(fwd, total - sbv * 4 - LOSS_BYTES + w_head + w_blocks + b_blocks
                      + (sbv * cb if t.microbatches > 1 else 0))
    else:
        fwd = total + w_blocks + b_blocks + fwd_transient
    if not full or (p.pp > 1 and str(p.pp_schedule) in ("zero_bubble", "zbv")):
        # split-backward schedules are measured hook-free (backend/bench/memory.py): the re-run block counts as Temp
        return int(round(fwd))
    # the last block re-run in backward after the head's backward freed its saved tensors: one block's
    # activations (minus the checkpointed input) and, under autocast, its weight and bias casts again
    one_block = (w_blocks + b_blocks) / len(layers)
    rec = total + model_full_recompute_peak_extra_bytes(head_freed_bytes=head_freed, **kw) + one_block
    return int(round(max(fwd, rec)))


def uses_autocast(spec: Any) -> bool:
    """16-bit precision through torch.autocast: ddp / zero1 and every tp/pp/ep mix; the pure FSDP strategies
    cast through MixedPrecisionPolicy instead (the saved weight is the unsharded parameter itself)."""
    p = spec.parallel
    return str(spec.train.precision) != "fp32" and not (p.zero_stage >= 2 and not is_mix(spec))


def autocast_copy_bytes(spec: Any, params: list[LocalParam]) -> tuple[int, int, int]:
    """(block Linear weights, lm_head weight, block Linear biases) as autocast's 16-bit casts, local elements
    x 2 B: every Linear runs on cast copies of its fp32 weight and bias; the matmul saves the weight copy for
    backward, the bias copy lives in autocast's cache until the autocast region exits."""
    cb = compute_bytes(spec.train.precision)
    w = sum(q.local_numel for q in params if len(q.shape) == 2 and q.name.startswith("layers."))
    head = sum(q.local_numel for q in params if q.name.startswith("lm_head."))
    if getattr(spec.model, "tie_embeddings", False) and not head and any(q.name.startswith("norm.") for q in params):
        head = sum(q.local_numel for q in params if q.name == "tok_emb.weight")  # lm_head runs on the tied weight
    bias = sum(q.local_numel for q in params if q.name.startswith("layers.") and q.name.endswith(".bias")
               and ".ln" not in q.name)
    return cb * w, cb * head, cb * bias
