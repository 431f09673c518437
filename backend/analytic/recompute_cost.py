"""How much of a block's forward each recompute policy (backend/recompute_policy.py) runs again in backward, as
shares of its weight GEMMs, its attention core and its element-wise work (scalars or arrays of layouts).

- none: nothing; selective: the attention core (Korthikanti et al. 2022 Sec 5); full and uniform:N: the whole
  forward (Chen et al. 2016; Narayanan et al. 2021 Eq. 3).
- layers:K, block:N: the whole forward of the checkpointed blocks: their share of all blocks (stages of q or q+1
  layers, the extra ones on the earliest stages, as sharding.layer_split).
- op: the weight GEMMs whose outputs the policy does not keep (every second aten.mm, aten.addmm unless listed:
  their FLOPs share over the block's linears), the attention core unless its kernel is listed, every element-wise op.
- selective with Megatron's --recompute-modules (Layout.stack.recompute_modules; core_attn alone is Korthikanti's
  selective): the attention core if core_attn is listed, and the FLOPs share of the linears the listed modules re-run
  over every block's linears (mla_up_proj: q_b and kv_b; mlp: the dense blocks' MLP; moe: the MoE blocks' router,
  experts (k of E per token) and shared experts; shared_experts: those alone). Their element-wise work is taken in
  the same share (layernorm and moe_act re-run element-wise work only: counted as none).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from backend.analytic.layout import Layout, RecomputeMode
from backend.analytic.params import (
    ModelKey,
    block_param_list,
    head_dim,
    is_gated,
    is_mla,
    layer_is_moe,
    model_key,
    v_head_dim,
)
from backend.analytic.scalar_or_array import maximum, minimum, where
from backend.analytic.stack_memory import CORE_ATTN_ONLY

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ExperimentSpec, ModelSpec

FLASH_OPS = {"aten._scaled_dot_product_flash_attention_for_cpu.default",
             "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default"}


class RerunShare(NamedTuple):
    gemm: Num
    attention: Num
    elementwise: Num


def _linears(model: ModelSpec) -> list[tuple[float, bool]]:
    """(in x out, biased) of one block's linears in forward order (FLOPs are proportional to the weight's size): q, k,
    v, o, or MLA's q_a and q_b (or q), kv_a, kv_b and o (models/gpt.py LatentAttention), then the MLP's."""
    h, a = model.d_model, model.n_heads
    q = a * head_dim(model)
    bias = str(getattr(model, "bias", "all"))
    qkv, other = bias in ("all", "qkv"), bias == "all"
    ffn = model.expert_ffn if model.is_moe else model.ffn
    mlp = [(h * ffn, other)] * (3 if is_gated(getattr(model, "mlp", "gelu")) else 2)  # fc_out / down: ffn x h too
    if is_mla(model):
        q_lora, kv_lora = model.q_lora_rank or 0, model.kv_lora_rank
        attn = [(h * q_lora, qkv), (q_lora * q, qkv)] if q_lora else [(h * q, qkv)]
        v = a * v_head_dim(model)
        attn += [(h * (kv_lora + model.qk_rope_head_dim), qkv), (kv_lora * (a * model.qk_nope_head_dim + v), False),
                 (v * h, other)]
        return attn + mlp
    kv = getattr(model, "kv_heads", a) * head_dim(model)
    return [(h * q, qkv), (h * kv, qkv), (h * kv, qkv), (q * h, other)] + mlp


def op_gemm_share(model: ModelSpec, ops: tuple[str, ...]) -> float:
    """The FLOPs share of a block's linears that op-level SAC re-runs."""
    ops_set, count, rerun = set(ops), 0, 0.0
    linears = _linears(model)
    for width, biased in linears:
        if biased:
            rerun += 0 if "aten.addmm.default" in ops_set else width
            continue
        count += 1
        rerun += 0 if "aten.mm.default" in ops_set and count % 2 == 1 else width
    return rerun / sum(width for width, _ in linears)


def checkpointed_share(model: ModelSpec, kind: Num, layers: Num, n_stages: Num) -> Num:
    """Share of all blocks whose forward is re-run by layers:K / block:N / uniform:N (per stage module)."""
    q, extra = model.n_layers // n_stages, model.n_layers % n_stages
    k = maximum(layers, 1)
    per_stage = {RecomputeMode.LAYERS: (lambda c: c // k), RecomputeMode.BLOCK: (lambda c: minimum(k, c)),
                 RecomputeMode.UNIFORM: (lambda c: c)}
    share = 0.0
    for code, units in per_stage.items():
        share = where(kind == code, (extra * units(q + 1) + (n_stages - extra) * units(q)) / model.n_layers, share)
    return share


def _module_of(name: str, moe_block: bool) -> str | None:
    """The recompute module that re-runs a block parameter's linear (None: no module does)."""
    if ".attn.q_b." in name or ".attn.kv_b." in name:
        return "mla_up_proj"
    if ".mlp." not in name:
        return None
    if not moe_block:
        return "mlp"
    return "shared_experts" if ".mlp.shared." in name else "moe"


@lru_cache(maxsize=256)
def module_gemm_share(key: ModelKey, top_k: int, modules: frozenset[str]) -> float:
    """The FLOPs share of all blocks' linears that selective recompute of `modules` re-runs (module docstring)."""
    n_moe = sum(layer_is_moe(key, i) for i in range(key.n_layers))
    total = rerun = 0.0
    for moe, count in ((False, key.n_layers - n_moe), (True, n_moe)):
        if not count:
            continue
        layer = next(i for i in range(key.n_layers) if layer_is_moe(key, i) == moe)
        for p in block_param_list(key, layer):
            if len(p.shape) != 2:
                continue
            macs = count * p.numel * (top_k / key.n_experts if ".mlp.experts." in p.name else 1)
            total += macs
            module = _module_of(p.name, moe)
            if module in modules or (module == "shared_experts" and "moe" in modules):
                rerun += macs
    return rerun / total if total else 0.0


def rerun_share(model: ModelSpec, layout: Layout, *, flash: bool) -> RerunShare:
    """Per layout: the shares of the block forward re-run in backward (layout.recompute, recompute_layers)."""
    kind = layout.recompute
    whole = where((kind == RecomputeMode.FULL) | (kind == RecomputeMode.UNIFORM), 1.0,
                  checkpointed_share(model, kind, layout.recompute_layers, layout.n_stages))
    op = kind == RecomputeMode.OP
    attention_kept = flash and bool(FLASH_OPS & set(layout.sac_ops))
    modules = layout.stack.recompute_modules if layout.stack is not None else CORE_ATTN_ONLY
    selective = kind == RecomputeMode.SELECTIVE
    modules_share = (0.0 if modules == CORE_ATTN_ONLY
                     else module_gemm_share(model_key(model), int(getattr(model, "top_k", 1)), modules))
    gemm = where(op, op_gemm_share(model, layout.sac_ops), where(selective, modules_share, whole))
    attention = where(op, 0.0 if attention_kept else 1.0,
                      where(selective, 1.0 if "core_attn" in modules else 0.0, whole))
    return RerunShare(gemm=gemm, attention=attention,
                      elementwise=where(op, 1.0, where(selective, modules_share, whole)))


def rerun_share_of(spec: ExperimentSpec) -> RerunShare:
    """rerun_share of a validated spec's own layout and attention kernel."""
    return rerun_share(spec.model, Layout.of(spec), flash=str(getattr(spec.model, "attention", "math")) == "flash")


def flops_rerun(spec: ExperimentSpec) -> tuple[float, float] | None:
    """training_flops_per_step's `rerun` for a spec: None for none / selective (core_attn) / full (the textbook's own
    cases)."""
    stack = Layout.of(spec).stack
    textbook_selective = stack is None or stack.textbook_selective
    if str(spec.train.recompute) in ("none", "full") or (str(spec.train.recompute) == "selective"
                                                          and textbook_selective):
        return None
    share = rerun_share_of(spec)
    return float(share.gemm), float(share.attention)
