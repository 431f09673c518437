"""Compute time of one microbatch on one pipeline stage, by operation class (pure Python + numpy).

- GEMMs: one per local 2-D weight (Linear; tok/pos embeddings are lookups), M = tokens that pass through it,
  FLOPs = 2·M·K·N (Narayanan 2021 Sec 5.1). Forward (M, K, N), backward its dgrad (M, N, K) and wgrad (K, M, N),
  each timed at its own shape's efficiency (ops.gemm_time: the profile's GEMM table, else gemm_efficiency_max x a
  size curve), never faster than the bytes it moves (the roofline, Williams et al. 2009, CACM, Sec 2).
- attention core: fused kernels (flash, efficient, cudnn, flash1, flash-triton) at the profile's attention table
  efficiency for the kernel, (seq, head_dim), causal (ops.attention_time: FlashAttention-2's FLOP count, masked blocks
  skipped); eager = two batched GEMMs (QKᵀ, P·V: 2·2·b·(a/t)·s²·d_head FLOPs, PaLM App. B) plus the softmax on the
  (b, a/t, s, s) scores as memory traffic.
- element-wise: elementwise.py, kernel by kernel, per implementation: "torch" (eager PyTorch, ShardLab's engine:
  norms, casts, RoPE, GQA repeat, residual adds, activations, and under autocast the per-microbatch casts of every
  weight and the accumulation of every gradient) or "fused" (Megatron's fused kernels: 2x the Korthikanti 2022
  Table 2 bytes per layer forward, backward twice that); each kernel at its class's measured bandwidth.
- loss: cross-entropy over fp32 logits, 8 B per logit forward and 12 backward, at the cross-entropy bandwidth.
- recompute: full re-runs the block's forward (and under autocast its weight casts), selective the attention core
  (Korthikanti 2022 Sec 5).
- context parallelism: a rank's GEMMs, element-wise passes and head see its seq_len / cp tokens (smaller M); its
  attention is its queries against every key, 1/cp of the layer's; without load balancing the cp ranks do unequal
  causal work and the ring waits for the busiest, rank cp-1: (2cp-1)/cp of the average (cp_imbalance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.layout import Layout, RecomputeMode
from backend.analytic.moe_rows import is_uniform_dropless, moe_rows_key
from backend.analytic.moe_rows import of_model as expert_rows_of
from backend.analytic.params import head_dim, layer_attention_kind, model_key, v_head_dim
from backend.analytic.recompute_cost import rerun_share
from backend.analytic.scalar_or_array import maximum, per_distinct, where
from backend.analytic.sharding import LocalParam, derived, stage_layers
from backend.analytic.steptime.elementwise import (
    CE_BWD_BYTES_PER_LOGIT,
    CE_FWD_BYTES_PER_LOGIT,
    IMPLEMENTATIONS,
    Widths,
    compiled_layer_passes,
    fused_layer_passes,
    layer_passes,
    param_passes,
)
from backend.analytic.steptime.float8_casts import cast_roles, casts_context, float8_casts_cost
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.ops import (
    FLASH_BWD_FACTOR,
    attention_time,
    curve_fraction,
    float8_gemm_time,
    gemm_time,
    passes_time,
)
from backend.analytic.steptime.ring_compute import ring_blocks_time, ring_merge
from backend.analytic.steptime.stack_kernels import TORCHAO_ROWWISE, te_float8_gemm_time
from backend.analytic.steptime.torchao_rowwise import TORCHAO_ROWWISE_LINEAR, rowwise_linear_s
from backend.analytic.textbook.korthikanti import korthikanti_layer_bytes
from backend.analytic.traffic import compute_bytes, is_float8_weight

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ExperimentSpec, ModelSpec

ATTENTION = ("eager", "flash", "efficient", "cudnn", "flash1", "flash-triton", "flash3")
"""eager: explicit softmax(QKᵀ)V; the fused SDPA kernels by name (flash = FlashAttention-2); flash1 =
FlashAttention v1 (Dao 2022, CUDA) and flash-triton = its Triton port (flash_attn/flash_attn_triton.py, MosaicML's
`attn_impl: triton`): the kernels of 2022-2023 runs, timed from the FlashAttention-2 paper's figures (op_tables.json);
flash3 = FlashAttention-3 (Shah et al. 2024, Hopper), from that paper's figures (op_tables.json fa3-paper-h100)."""
PARAM_PASS_IMPLEMENTATIONS = ("torch", "compiled")
"""Implementations whose autocast casts and gradient accumulation run as kernels of their own (param_passes)."""
__all__ = ["ATTENTION", "FLASH_BWD_FACTOR", "IMPLEMENTATIONS", "PassCost", "curve_fraction", "gemm_s", "memory_s",
           "attention_pass", "elementwise_pass", "head_pass", "stage_cost", "default_implementation"]


@dataclass
class PassCost:
    """Seconds and FLOPs of one microbatch through one stage."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    recompute_s: float = 0.0
    fwd_flops: float = 0.0

    def add(self, other: PassCost) -> None:
        self.fwd_s += other.fwd_s
        self.bwd_s += other.bwd_s
        self.recompute_s += other.recompute_s
        self.fwd_flops += other.fwd_flops


def gemm_s(hw: Hardware, peak: float, m: Num, k: Num, n: Num, dtype_bytes: float, precision: str | None = None) -> Num:
    """One (m, k) x (k, n) GEMM (module docstring); sizes may be arrays (one GEMM per entry). With `precision` the
    matmul dtype's peak and table; without, `peak` and the profile's size curve (its table is per dtype)."""
    if precision is not None:
        return gemm_time(hw, precision, m, k, n, dtype_bytes)
    t = hw.tune
    flops = 2 * m * k * n  # Narayanan 2021 Sec 5.1
    if hw.gemm_curve:
        fraction = np.vectorize(lambda f: curve_fraction(hw.gemm_curve, f))(flops) if isinstance(flops, np.ndarray) \
            else curve_fraction(hw.gemm_curve, flops)
    else:
        fraction = flops / (flops + t.gemm_half_flops)
    eff = t.gemm_efficiency_max * fraction * t.gemm_scale
    moved = (m * k + k * n + m * n) * dtype_bytes
    return maximum(flops / (peak * eff),
                   moved / (hw.hbm_bytes_per_s * hw.elementwise_fraction("copy"))) + t.kernel_launch_s


def memory_s(hw: Hardware, n_bytes: float, kernels: int = 1, cls: str = "copy") -> float:
    """A memory-bound pass over n_bytes at the class's bandwidth (roofline's bandwidth roof, Williams 2009 Sec 2),
    plus `kernels` kernel floors."""
    return n_bytes / (hw.hbm_bytes_per_s * hw.elementwise_fraction(cls)) + kernels * hw.tune.kernel_launch_s


def default_implementation(hw: Hardware) -> str:
    """Element-wise accounting of a profile's ranks: eager PyTorch on GPUs (what ShardLab's engine runs); CPU ranks
    keep the fused accounting their probe-fitted tunables were calibrated with."""
    return "fused" if hw.kind == "cpu" else "torch"


def linear_gemms_s(hw: Hardware, precision: str, rows: Num, k: Num, n_out: Num, cb: float,
                   float8: bool = False, fp8_gemms: str = "torchao") -> tuple[Num, Num, Num]:
    """(forward, dgrad, wgrad) seconds of one Linear weight (n_out, k) over `rows` tokens (module docstring);
    float8: a float8 linear under fp8, torchao's (ops.float8_gemm_time; fp8_gemms TORCHAO_ROWWISE: its rowwise
    recipe; TORCHAO_ROWWISE_LINEAR: the compiled rowwise linear timed whole, torchao_rowwise.py) or Transformer
    Engine's (fp8_gemms "transformer_engine": stack_kernels.te_float8_gemm_time)."""
    if float8 and fp8_gemms == TORCHAO_ROWWISE_LINEAR:
        return rowwise_linear_s(hw, rows, k, n_out)
    if float8 and fp8_gemms == "transformer_engine":
        return (te_float8_gemm_time(hw, "fprop", rows, k, n_out), te_float8_gemm_time(hw, "dgrad", rows, n_out, k),
                te_float8_gemm_time(hw, "wgrad", k, rows, n_out))
    if float8:
        rowwise = fp8_gemms == TORCHAO_ROWWISE
        return (float8_gemm_time(hw, rows, k, n_out, rowwise), float8_gemm_time(hw, rows, n_out, k, rowwise),
                float8_gemm_time(hw, k, rows, n_out, rowwise))
    return (gemm_s(hw, 0.0, rows, k, n_out, cb, precision), gemm_s(hw, 0.0, rows, n_out, k, cb, precision),
            gemm_s(hw, 0.0, k, rows, n_out, cb, precision))


def weight_gemms_s(hw: Hardware, precision: str, rows: Num, k: Num, n_out: Num, cb: float,
                   float8: bool = False, fp8_gemms: str = "torchao") -> tuple[Num, Num]:
    """(forward, dgrad + wgrad) seconds of one Linear weight: linear_gemms_s with backward's two GEMMs summed."""
    fwd, dgrad, wgrad = linear_gemms_s(hw, precision, rows, k, n_out, cb, float8, fp8_gemms)
    return fwd, dgrad + wgrad


def weights_cost(spec: ExperimentSpec, hw: Hardware, params: Sequence[LocalParam], tokens: int,
                 fp8_gemms: str = "torchao") -> PassCost:
    """Forward and backward seconds and FLOPs of the given Linear weights' GEMMs (forward, dgrad, wgrad at their own
    shapes) for `tokens` tokens (experts see tokens·top_k·ep/E each under uniform routing, GShard Sec 3.1);
    benchmarks/published_gpu.py prints it per layer."""
    return weight_kinds_cost(spec, hw, weight_kinds(params, str(spec.train.precision) == "fp8"), tokens, fp8_gemms)


def weight_kinds(params: Sequence[LocalParam], fp8: bool) -> tuple[tuple[tuple, ...], tuple[int, ...]]:
    """(the distinct (local shape, expert or not, float8 or not, float8 cast role) of the GEMM weights among `params`,
    each GEMM weight's index into them, in order): what weights_cost and float8_casts_cost read of the parameters,
    whatever the tokens (stage_cost memoises it per stage, every micro-batch reuses it)."""
    kinds: dict[tuple, int] = {}
    ids: list[int] = []
    float8 = [q.name for q in params if fp8 and is_float8_weight(q)]
    roles = cast_roles(float8) if float8 else {}
    for q in params:
        shape = q.local_shape
        if len(shape) != 2 or q.name.startswith(("tok_emb", "pos_emb")):
            continue
        # float8 linears: the fp8 peak, 1-byte operands, and where torchao casts their inputs (float8_casts.py)
        kind = (shape, q.is_expert, q.name in roles, roles.get(q.name))
        ids.append(kinds.setdefault(kind, len(kinds)))
    return tuple(kinds), tuple(ids)


def weight_kinds_cost(spec: ExperimentSpec, hw: Hardware, weights: tuple[tuple[tuple, ...], tuple[int, ...]],
                      tokens: int, fp8_gemms: str = "torchao") -> PassCost:
    """weights_cost of weight_kinds(params): each kind timed once, the sums adding every weight's seconds one by one,
    in order."""
    cb, precision = compute_bytes(spec.train.precision), str(spec.train.precision)
    m, p = spec.model, spec.parallel
    routed = tokens * m.top_k * p.ep / m.n_experts if m.n_experts else tokens  # _gemm_rows of an expert's weight
    if m.n_experts and p.ep > 1 and not is_uniform_dropless(m):  # capacity / imbalance: the busiest rank (moe_rows.py)
        routed = expert_rows_of(m, tokens).received * p.ep / m.n_experts
    # a model's blocks repeat the same weight shapes (a MoE block its experts'): same inputs, same seconds, timed once
    timed_kinds = []
    for (n_out, k), is_expert, float8, _ in weights[0]:  # nn.Linear weight (out, in)
        rows = routed if is_expert else tokens
        # same on every layout
        key = ("weight gemms", precision, rows, k, n_out, cb, float8) + ((fp8_gemms,) if float8 and fp8_gemms !=
                                                                           "torchao" else ())
        timed = hw.memo.get(key)
        if timed is None:
            timed = hw.memo[key] = weight_gemms_s(hw, precision, rows, k, n_out, cb, float8, fp8_gemms)
        timed_kinds.append((*timed, 2 * rows * k * n_out))
    fwd = bwd = flops = 0.0  # plain += in order (not sum(): Python 3.12's sum compensates, other floats)
    for i in weights[1]:
        f = timed_kinds[i]
        fwd += f[0]
        bwd += f[1]
        flops += f[2]
    out = PassCost()
    out.fwd_s, out.bwd_s, out.fwd_flops = fwd, bwd, flops
    return out


def cp_imbalance(layout: Layout) -> Num:
    """The busiest cp rank's causal attention work over the average: 1 with head-tail chunks (each rank's two chunks
    cost the same in sum, torch's load-balance note); contiguous chunks give rank r r + 1/2 blocks of cp/2 on
    average, so the last rank does (cp - 1/2) / (cp / 2) = (2cp - 1) / cp of it."""
    return 1.0 if layout.cp_load_balance else (2 * layout.cp - 1) / layout.cp


def attention_pass(model: ModelSpec, layout: Layout, hw: Hardware, attention: str, *,
                   windowed: bool = False) -> PassCost:
    """QKᵀ and P·V of one layer and microbatch on one tp rank (+ eager: softmax/dropout traffic), with the block's
    own widths (d_qk: MLA's nope + rope; d_v: its v_head_dim; on the CPU this engine's flash kernel runs a narrower v
    padded to d_qk); fwd_flops is the PaLM count (no causal saving), as
    MFU counts it. A windowed block (model_flops.kv_lengths) scores min(window, s) keys per query: its FLOPs, and a
    fused kernel's time (FlashAttention-2's window_size and FlexAttention's block masks skip the blocks outside the
    window: of the causal triangle s²/2 the band (2sw - w²)/2 is left); the eager path materialises and masks the
    whole (s, s) scores, as the engine's math attention does, so its time stays s². Under context parallelism the
    rank's s/cp queries against all keys: 1/cp of the layer's work, at the busiest cp rank's share (cp_imbalance)."""
    cb, peak = layout.compute_bytes, hw.peak(layout.precision)
    b, s, a = layout.micro_batch, model.seq_len, model.n_heads // layout.tp
    d_qk, d_v = head_dim(model), v_head_dim(model)
    s_kv = min(model.window, s) if windowed else s
    rows, skew = s // layout.cp, cp_imbalance(layout)
    # PaLM (Chowdhery 2022) App. B: QKᵀ + P·V (4·b·a·s²·d when d_qk = d_v)
    flops = 2 * b * a * rows * s_kv * (d_qk + d_v)
    if attention != "eager":
        # this engine pads a narrower v to d_qk for the CPU's flash kernel (models/gpt.py _padded_flash_attention)
        padded = layout.stack is None and hw.kind == "cpu" and d_v < d_qk
        kernel_d = d_qk if padded else (d_qk + d_v) / 2
        if not windowed:
            fwd, bwd = ring_blocks_time(hw, layout, attention, b, a, rows, kernel_d)
            merge = ring_merge(model, layout)
            return PassCost(fwd_s=fwd + memory_s(hw, merge.fwd_bytes, merge.fwd_kernels),
                            bwd_s=bwd + memory_s(hw, merge.bwd_bytes, merge.bwd_kernels), fwd_flops=flops)
        fwd, bwd = attention_time(hw, layout.precision, attention, b, a, s, kernel_d, causal=True)
        band = (2 * s * s_kv - s_kv * s_kv) / (s * s)  # 1 for a global block
        share = band * skew / layout.cp
        return PassCost(fwd_s=fwd * share, bwd_s=bwd * share, fwd_flops=flops)
    # one batched GEMM each: b·a problems of (s/cp, d_qk) x (d_qk, s) and (s/cp, s) x (s, d_v)
    bmm = gemm_s(hw, peak, b * a * rows, d_qk, s, cb) + gemm_s(hw, peak, b * a * rows, s, d_v, cb)
    scores = 5 * a * rows * s * b * cb / 2  # Korthikanti 2022 Eq. 1 5as²b (16-bit scores/probs + 1-byte mask)
    soft = memory_s(hw, 2 * scores, kernels=3)  # written once, read once
    return PassCost(fwd_s=skew * (bmm + soft), bwd_s=2 * skew * (bmm + soft), fwd_flops=flops)


def elementwise_pass(model: ModelSpec, layout: Layout, hw: Hardware, implementation: str = "fused") -> PassCost:
    """The memory-bound kernels of one layer and microbatch (elementwise.py): "fused": 2x Korthikanti Table 2
    bytes without the attention-score term (counted in attention_pass); "torch": eager PyTorch's kernels, timed
    once per distinct (micro-batch, tp, sequence parallel, autocast, cp) and profile; a cp rank's seq_len / cp
    tokens."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation {implementation!r} not in {IMPLEMENTATIONS}")
    if implementation in ("torch", "compiled"):
        return _torch_elementwise(model, layout, hw, implementation)
    if implementation == "fused":
        kb = per_distinct(lambda b, tp, sp, cp: korthikanti_layer_bytes(  # selective: without 5as²b
            s=model.seq_len // cp, b=b, h=model.d_model, a=model.n_heads, t=tp, sp=bool(sp), recompute="selective"),
            layout.micro_batch, layout.tp, layout.sequence_parallel, layout.cp)
        fwd, bwd = fused_layer_passes(kb, layout.compute_bytes)
        return PassCost(fwd_s=memory_s(hw, fwd.bytes, kernels=fwd.count),
                        bwd_s=memory_s(hw, bwd.bytes, kernels=bwd.count))
    raise AssertionError(implementation)


def _torch_elementwise(model: ModelSpec, layout: Layout, hw: Hardware, implementation: str = "torch") -> PassCost:
    """elementwise.layer_passes (compiled_layer_passes under "compiled") timed once per distinct (micro-batch, tp,
    sequence parallel, autocast, cp) and profile (hw.memo); the combinations not seen before are timed together on
    arrays."""
    passes = compiled_layer_passes if implementation == "compiled" else layer_passes
    tag = ("elementwise", model_key(model), layout.precision) + (("compiled",) if implementation == "compiled" else ())
    missing: list[tuple[int, int, int, int, int]] = []

    def one(*row: int) -> tuple[float, float]:
        hit = hw.memo.get((tag, *row))
        if hit is None:
            missing.append(row)
            return (0.0, 0.0)
        return hit

    columns = (layout.micro_batch, layout.tp, layout.sequence_parallel, layout.uses_autocast, layout.cp)
    both = per_distinct(one, *columns)
    if missing:
        b, tp, sp, ac, cp = (np.asarray(c) for c in zip(*missing, strict=False))
        fwd, bwd = passes(model, layer_widths(model, Layout(tp=tp, micro_batch=b, sequence_parallel=sp.astype(bool),
                                                           precision=layout.precision, cp=cp),
                                              autocast=ac.astype(bool)))
        f, bk = (np.broadcast_to(passes_time(hw, x), b.shape).tolist() for x in (fwd, bwd))
        hw.memo.update(((tag, *row), (x, y)) for row, x, y in zip(missing, f, bk, strict=False))
        both = per_distinct(one, *columns)
    if isinstance(both, tuple):
        return PassCost(fwd_s=both[0], bwd_s=both[1])
    return PassCost(fwd_s=both[..., 0], bwd_s=both[..., 1])


def layer_widths(model: ModelSpec, layout: Layout, autocast: Num | None = None) -> Widths:
    """Per-rank sizes of one layer and microbatch (elementwise.Widths): heads and the MLP split by tp, norm and
    residual tokens by tp under sequence parallelism; MoE MLP activations over top_k experts' rows per token; a cp
    rank's seq_len / cp tokens."""
    tokens = layout.micro_batch * layout.seq_local(model)
    tp, act = layout.tp, layout.compute_bytes
    mlp = model.top_k * model.expert_ffn + model.shared_ffn if model.is_moe else model.ffn
    return Widths(tokens=tokens, norm_tokens=where(layout.sequence_parallel, tokens / tp, tokens), h=model.d_model,
                  q=model.n_heads // tp * model.head_dim, kv=maximum(model.kv_heads // tp, 1) * model.head_dim,
                  ffn=mlp / tp, act=act, residual=where(layout.uses_autocast if autocast is None else autocast, 4, act))


def head_pass(model: ModelSpec, layout: Layout, hw: Hardware, *, kernel_launches: bool = True,
              vocab_shards: Num | None = None) -> PassCost:
    """Cross-entropy over the (b·s, V/vocab_shards) fp32 logits, 4 kernels each way (the lm_head GEMM is a weight);
    vocab_shards: tp under loss parallel, 1 over gathered logits; None: tp (what this model always counted for
    ShardLab's engine, which gathers the logits: kept for the shardlab stack's unchanged predictions);
    kernel_launches=False: the memory traffic alone (the planner's step-time screen)."""
    shards = layout.tp if vocab_shards is None else vocab_shards
    logits = layout.micro_batch * layout.seq_local(model) * model.vocab_size / shards
    kernels = 4 if kernel_launches else 0
    return PassCost(fwd_s=memory_s(hw, CE_FWD_BYTES_PER_LOGIT * logits, kernels, cls="cross_entropy"),
                    bwd_s=memory_s(hw, CE_BWD_BYTES_PER_LOGIT * logits, kernels, cls="cross_entropy"))


def param_pass(hw: Hardware, layout: Layout, sizes: tuple[Num, Num, Num, Num], implementation: str,
               autocast: Num | None = None) -> PassCost:
    """Per-microbatch passes over a group of parameters under autocast ("torch" only, elementwise.param_passes):
    weight casts forward (again in a full recompute), gradient casts and accumulation backward. `sizes`: (GEMM
    weight elements, other elements, GEMM weights, other tensors) of the group (part_param_sizes); `autocast`:
    the layout's unless given."""
    autocast = layout.uses_autocast if autocast is None else autocast
    if implementation not in PARAM_PASS_IMPLEMENTATIONS or autocast is False:
        return PassCost()
    fwd, bwd = param_passes(*sizes, autocast=autocast)
    f = passes_time(hw, fwd)
    return PassCost(fwd_s=f, bwd_s=passes_time(hw, bwd),
                    recompute_s=where(layout.recompute == RecomputeMode.FULL, f, 0.0))


def part_param_sizes(params: Sequence[LocalParam], gemm_names: Callable[[LocalParam], bool]) -> tuple[int, int, int,
                     int]:
    """(GEMM weight elements, other elements, GEMM weights, other tensors) of a group of local parameters;
    gemm_names(q) says which are GEMM weights."""
    gemm = [q for q in params if gemm_names(q)]
    g = sum(q.local_numel for q in gemm)
    return g, sum(q.local_numel for q in params) - g, len(gemm), len(params) - len(gemm)


def stage_param_pass(spec: ExperimentSpec, hw: Hardware, layout: Layout, params: list[LocalParam], stage: int,
                     implementation: str, tied_head: bool) -> PassCost:
    """param_pass of one stage, part by part (the planner's step-time screen sums the same parts): its blocks (each
    the same), the embeddings on the first stage (tok_emb is the head's GEMM weight when tied on one stage), norm and
    lm_head on the last."""
    m, p = spec.model, spec.parallel
    n_stages = p.pp * p.virtual_stages
    layers = stage_layers(m.n_layers, n_stages, stage)
    if (implementation not in PARAM_PASS_IMPLEMENTATIONS or layout.uses_autocast is False
            or not layers and stage not in (0, n_stages - 1)):
        return PassCost()
    is_gemm = lambda q: len(q.local_shape) == 2  # noqa: E731
    out = PassCost()
    if layers:  # blocks of one kind have the same sizes: one pass per kind (mixed stacks: a dense prefix, alternation)
        kinds = derived(params, ("block param sizes", tuple(layers)), lambda ps: _block_kinds(ps, layers, is_gemm))
        for sizes, count in kinds.items():
            one = param_pass(hw, layout, sizes, implementation)
            out.add(PassCost(fwd_s=count * one.fwd_s, bwd_s=count * one.bwd_s, recompute_s=count * one.recompute_s))
    if stage == 0:
        emb = derived(params, ("embedding param sizes", tied_head), lambda ps: part_param_sizes(
            [q for q in ps if q.name.startswith(("tok_emb", "pos_emb"))],
            lambda q: tied_head and q.name.startswith("tok_emb")))
        out.add(_no_recompute(param_pass(hw, layout, emb, implementation)))
    if stage == n_stages - 1:
        head = derived(params, "head param sizes", lambda ps: part_param_sizes(
            [q for q in ps if q.name.startswith(("norm.", "lm_head"))], lambda q: q.name.startswith("lm_head")))
        out.add(_no_recompute(param_pass(hw, layout, head, implementation)))
    return out


def _block_kinds(params: Sequence[LocalParam], layers: Sequence[int],
                 is_gemm: Callable[[LocalParam], bool]) -> dict[tuple[int, int, int, int], int]:
    """part_param_sizes of each layer, counted by distinct sizes."""
    by_layer: dict[int, list[LocalParam]] = {}
    wanted = set(layers)
    for q in params:
        if q.name.startswith("layers."):
            i = int(q.name.split(".", 2)[1])
            if i in wanted:
                by_layer.setdefault(i, []).append(q)
    kinds: dict[tuple[int, int, int, int], int] = {}
    for i in layers:
        sizes = part_param_sizes(by_layer.get(i, []), is_gemm)
        kinds[sizes] = kinds.get(sizes, 0) + 1
    return kinds


def _no_recompute(c: PassCost) -> PassCost:
    """Embeddings and the head are outside the checkpointed blocks: a full recompute does not re-cast them."""
    return replace(c, recompute_s=0.0)


def stage_cost(spec: ExperimentSpec, hw: Hardware, stage: int, params: list[LocalParam], attention: str, layout: Layout,
               implementation: str = "fused", *, fp8_gemms: str = "torchao",
               vocab_shards: Num | None = None) -> PassCost:
    """One microbatch through one stage of this rank: its layers' weights, attention, element-wise, head, and the
    per-microbatch passes over its parameters (`layout` = Layout.of(spec)); fp8_gemms: whose float8 GEMMs
    (weight_gemms_s), vocab_shards: the loss's logits split (head_pass)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r} not in {ATTENTION}")
    m, t, p = spec.model, spec.train, spec.parallel
    n_stages = p.pp * p.virtual_stages
    layers = stage_layers(m.n_layers, n_stages, stage)
    names = tuple(f"layers.{i}." for i in layers)
    last = stage == n_stages - 1
    tokens = t.micro_batch * m.seq_len // p.cp  # this rank's share of each sequence

    fp8 = str(t.precision) == "fp8"
    # the stage's GEMM weights by kind, once per shared params tuple and stage (every micro-batch reads the same)
    kinds = derived(params, ("weight kinds", stage, n_stages, fp8), lambda ps: weight_kinds(
        [q for q in ps if q.name.startswith(names) or (last and q.name.startswith("lm_head"))], fp8))
    # memoised per shared params tuple on every input weights_cost reads (the expert rows: moe_rows.of_model's fields)
    cost = replace(derived(params, ("weights", stage, n_stages, tokens, str(t.precision), id(hw), m.top_k, p.ep,
                                    m.n_experts, *moe_rows_key(m)) + ((fp8_gemms,) if fp8_gemms != "torchao" else ()),
                           lambda ps: weight_kinds_cost(spec, hw, kinds, tokens, fp8_gemms), keep=hw))
    if fp8:  # memoised like the weights: every micro-batch and call on these params casts the same
        compiled = implementation == "compiled"
        casts_fwd, casts_bwd = derived(params, ("float8 casts", stage, n_stages, tokens, id(hw),
                                                *casts_context(spec, fp8_gemms, compiled)),
                                       lambda ps: float8_casts_cost(hw, spec, kinds, tokens, fp8_gemms, compiled),
                                       keep=hw)
        cost.fwd_s += casts_fwd
        cost.bwd_s += casts_bwd
    elem = elementwise_pass(m, layout, hw, implementation)
    n_windowed = sum(layer_attention_kind(m, i)[1] for i in layers)  # the rest attend globally
    n = len(layers) - n_windowed
    attn = attention_pass(m, layout, hw, attention)
    win = attention_pass(m, layout, hw, attention, windowed=True) if n_windowed else attn
    cost.fwd_s += n * (attn.fwd_s + elem.fwd_s) + n_windowed * (win.fwd_s + elem.fwd_s)
    cost.bwd_s += n * (attn.bwd_s + elem.bwd_s) + n_windowed * (win.bwd_s + elem.bwd_s)
    cost.fwd_flops += n * attn.fwd_flops + n_windowed * win.fwd_flops
    rc = str(t.recompute)
    if rc == "full":
        cost.recompute_s = cost.fwd_s  # Korthikanti 2022 Sec 5 / Narayanan Eq. 3: one extra forward
    elif rc == "selective" and (layout.stack is None or layout.stack.textbook_selective):
        cost.recompute_s = n * attn.fwd_s + n_windowed * win.fwd_s  # Korthikanti 2022 Sec 5: only the attention core
    elif rc != "none":  # the shares of recompute_cost.py (the head's GEMM is never re-run)
        share = rerun_share(m, layout, flash=attention != "eager")  # every fused kernel saves no (s x s) scores
        attention_fwd_s = n * attn.fwd_s + n_windowed * win.fwd_s
        elementwise_fwd_s = (n + n_windowed) * elem.fwd_s
        gemm_fwd = cost.fwd_s - attention_fwd_s - elementwise_fwd_s
        cost.recompute_s = (float(share.gemm) * gemm_fwd + float(share.attention) * attention_fwd_s
                            + float(share.elementwise) * elementwise_fwd_s)
    tied_head = last and not any(q.name.startswith("lm_head") for q in params)
    if tied_head:  # a tied lm_head is tok_emb's weight: the head GEMM still runs (the lookup alone is free)
        f, b = weight_gemms_s(hw, str(t.precision), tokens, m.d_model, m.vocab_size / p.tp, compute_bytes(t.precision))
        cost.fwd_s += f
        cost.bwd_s += b
        cost.fwd_flops += 2 * tokens * m.d_model * m.vocab_size / p.tp
    cost.add(stage_param_pass(spec, hw, layout, params, stage, implementation, tied_head))
    if last:
        cost.add(head_pass(m, layout, hw, vocab_shards=vocab_shards))
    return cost
