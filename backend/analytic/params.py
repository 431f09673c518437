"""Exact parameter counts of ShardLab's decoder family (`backend/models/gpt.py`: GPT, Llama/Mistral/Qwen2-style
dense, Mixtral-style MoE, MoE with shared experts; Qwen3 (q/k norms, own head width), Gemma 3 (sandwich norms, tied),
gpt-oss (sinks, biased router and experts), Llama 4 (interleaved MoE), DeepSeek-V2/V3 (MLA, dense prefix)), pure
Python. Blocks differ only by dense vs MoE MLP (`layer_is_moe`); everything else is the same in every block.

`param_list(model)` mirrors `GPT.named_parameters()` name for name, shape for shape, in the same
order, because per-rank sharding (ZeRO-1's greedy partition, FSDP2's per-parameter padding, TP
splits) works on individual parameters, not on a total.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from backend.analytic.model_shape import ModelShape
    from backend.spec import ModelSpec


@dataclass(frozen=True)
class ParamInfo:
    name: str
    """Name as `GPT.named_parameters()` reports it, e.g. "layers.0.attn.q.weight"."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def module(self) -> str:
        """Owning module path, e.g. "layers.0.attn.q"."""
        return self.name.rsplit(".", 1)[0]


def _dims(m: ModelShape) -> tuple[int, int, int, int, int, int]:
    """(V, h, s, kv_dim, ffn, n_experts) from a ModelSpec or its ModelKey."""
    kv_heads = m.n_kv_heads or m.n_heads
    kv_dim = kv_heads * head_dim(m)
    return m.vocab_size, m.d_model, m.seq_len, kv_dim, m.ffn_hidden or 4 * m.d_model, m.n_experts


def _fam(m: ModelShape, name: str, default: Any) -> Any:
    """A family field as a plain string/value (objects from before the family fields get GPT's defaults)."""
    v = getattr(m, name, default)
    return str(v) if hasattr(v, "value") else v


GATED = ("swiglu", "geglu", "swiglu_clamped")
"""MLP kinds with three matrices gate, up, down (Shazeer 2020 Eq. 6; the clamped gpt-oss variant has the same
shapes)."""


def is_gated(kind: str) -> bool:
    return str(getattr(kind, "value", kind)) in GATED


def is_mla(m: ModelShape) -> bool:
    return getattr(m, "kv_lora_rank", None) is not None


def head_dim(m: ModelShape) -> int:
    """Width of one q / k head: MLA nope + rope, else attn_head_dim or d_model / n_heads."""
    if is_mla(m):
        return m.qk_nope_head_dim + m.qk_rope_head_dim
    return getattr(m, "attn_head_dim", None) or m.d_model // m.n_heads


def v_head_dim(m: ModelSpec) -> int:
    """Width of one value head (MLA's v_head_dim, else head_dim)."""
    return m.v_head_dim if is_mla(m) else head_dim(m)


def layer_is_moe(m: ModelShape, layer: int) -> bool:
    """ModelSpec.layer_is_moe on any object with the fields: the dense prefix, then every moe_every-th block."""
    return bool(m.n_experts) and layer >= getattr(m, "first_dense_layers", 0) \
        and (layer + 1) % getattr(m, "moe_every", 1) == 0


def layer_attention_kind(m: ModelSpec, layer: int) -> tuple[bool, bool]:
    """(block `layer` applies rotary positions, block `layer` attends in a window): ModelSpec.layer_is_global and
    Llama 4's NoPE global layers, on any object with the fields."""
    window = getattr(m, "window", None)
    every = getattr(m, "global_every", 0)
    is_global = window is None or (every > 0 and (layer + 1) % every == 0)
    rope = _fam(m, "positions", "learned") == "rope" and not (window is not None and is_global
                                                                and getattr(m, "global_layers_nope", False))
    return rope, not is_global


def n_moe_layers(m: ModelSpec, layers: Iterable[int] | None = None) -> int:
    """MoE blocks among `layers` (default all)."""
    return sum(layer_is_moe(m, i) for i in (range(m.n_layers) if layers is None else layers))


def expert_ffn(m: ModelShape) -> int:
    return getattr(m, "expert_ffn_hidden", None) or m.ffn_hidden or 4 * m.d_model


def shared_ffn(m: ModelShape) -> int:
    """Hidden size of the fused shared-expert MLP (n_shared_experts x one shared expert's hidden)."""
    n = getattr(m, "n_shared_experts", 0)
    return n * (getattr(m, "shared_ffn_hidden", None) or expert_ffn(m)) if n else 0


def _linear(prefix: str, n_in: int, n_out: int, bias: bool = True) -> list[ParamInfo]:
    # torch.nn.Linear stores weight as (out_features, in_features)
    out = [ParamInfo(f"{prefix}.weight", (n_out, n_in))]
    return out + [ParamInfo(f"{prefix}.bias", (n_out,))] if bias else out


def _norm(prefix: str, h: int, kind: str = "layernorm") -> list[ParamInfo]:
    # nn.LayerNorm: weight + bias; nn.RMSNorm: weight only (Zhang & Sennrich 2019, Sec 3)
    out = [ParamInfo(f"{prefix}.weight", (h,))]
    return out + [ParamInfo(f"{prefix}.bias", (h,))] if kind == "layernorm" else out


def _mlp(prefix: str, h: int, f: int, kind: str = "gelu", bias: bool = True) -> list[ParamInfo]:
    if is_gated(kind):  # Shazeer 2020 Eq. 6 FFN_SwiGLU: down(silu(x W_gate) * x W_up)
        return (_linear(f"{prefix}.gate", h, f, bias) + _linear(f"{prefix}.up", h, f, bias)
                + _linear(f"{prefix}.down", f, h, bias))
    return _linear(f"{prefix}.fc_in", h, f, bias) + _linear(f"{prefix}.fc_out", f, h, bias)


def _mlp_numel(h: int, f: int, kind: str, bias: bool) -> int:
    return (3 * h * f + (2 * f + h) * bias) if is_gated(kind) else (2 * h * f + (f + h) * bias)


def attention_param_list(m: ModelShape, p: str) -> list[ParamInfo]:
    """One block's attention: q, k, v, o (+ per-head q/k norms, + sinks), or MLA's low-rank projections
    (DeepSeek-V2 Sec 2.1.2-2.1.3, as Hugging Face's DeepseekV3Attention holds them): q_a (h -> q_lora) + q_a_norm + q_b
    (q_lora -> a*(nope + rope)) or q (h -> a*(nope + rope)); kv_a (h -> kv_lora + rope: the latent and the shared rope
    key) + kv_a_norm + kv_b (kv_lora -> a*(nope + v)); o (a*v -> h)."""
    _, h, _, kv_dim, _, _ = _dims(m)
    bias = _fam(m, "bias", "all")
    qkv_b, all_b = bias in ("all", "qkv"), bias == "all"
    a = m.n_heads
    if is_mla(m):
        qk, rope, lora = head_dim(m), m.qk_rope_head_dim, m.kv_lora_rank
        q_lora = getattr(m, "q_lora_rank", None)
        out = (_linear(f"{p}.attn.q_a", h, q_lora, qkv_b) + _norm(f"{p}.attn.q_a_norm", q_lora, "rmsnorm")
               + _linear(f"{p}.attn.q_b", q_lora, a * qk, qkv_b)) if q_lora \
            else _linear(f"{p}.attn.q", h, a * qk, qkv_b)
        out += _linear(f"{p}.attn.kv_a", h, lora + rope, qkv_b) + _norm(f"{p}.attn.kv_a_norm", lora, "rmsnorm")
        out += _linear(f"{p}.attn.kv_b", lora, a * (m.qk_nope_head_dim + m.v_head_dim), False)
        return out + _linear(f"{p}.attn.o", a * m.v_head_dim, h, all_b)
    q_dim = a * head_dim(m)
    out = _linear(f"{p}.attn.q", h, q_dim, qkv_b) + _linear(f"{p}.attn.k", h, kv_dim, qkv_b)
    out += _linear(f"{p}.attn.v", h, kv_dim, qkv_b) + _linear(f"{p}.attn.o", q_dim, h, all_b)
    if getattr(m, "qk_norm", False):  # Qwen3 / Gemma 3: RMSNorm over each head's channels, one weight for all heads
        out += _norm(f"{p}.attn.q_norm", head_dim(m), "rmsnorm") + _norm(f"{p}.attn.k_norm", head_dim(m), "rmsnorm")
    if getattr(m, "attention_sinks", False):
        out.append(ParamInfo(f"{p}.attn.sinks.weight", (a,)))  # one logit per head (module attn.sinks)
    return out


def block_param_list(m: ModelShape, layer: int) -> list[ParamInfo]:
    """One transformer block: ln1, attn.*, [ln1_post], ln2, then mlp.{fc_in,fc_out | gate,up,down} or the MoE
    (mlp.router, mlp.experts.E.*, mlp.shared.*, mlp.shared_gate), [ln2_post]; `layer` picks dense or MoE and names the
    parameters, nothing else (param_tuple builds one block per MLP kind and renames it)."""
    _, h, _, _, f, n_experts = _dims(m)
    norm, kind, all_b = _fam(m, "norm", "layernorm"), _fam(m, "mlp", "gelu"), _fam(m, "bias", "all") == "all"
    sandwich = getattr(m, "sandwich_norm", False)
    p = f"layers.{layer}"
    out = _norm(f"{p}.ln1", h, norm) + attention_param_list(m, p)
    if sandwich:  # Gemma: post-attention norm before the residual add
        out += _norm(f"{p}.ln1_post", h, norm)
    out += _norm(f"{p}.ln2", h, norm)
    if layer_is_moe(m, layer):
        out += _linear(f"{p}.mlp.router", h, n_experts, bias=bool(getattr(m, "router_bias", False)))
        for e in range(n_experts):
            out += _mlp(f"{p}.mlp.experts.{e}", h, expert_ffn(m), kind, all_b)
        if shared_ffn(m):
            out += _mlp(f"{p}.mlp.shared", h, shared_ffn(m), kind, all_b)
            if getattr(m, "shared_expert_gate", False):
                out += _linear(f"{p}.mlp.shared_gate", h, 1, bias=False)
    else:
        out += _mlp(f"{p}.mlp", h, f, kind, all_b)
    if sandwich:
        out += _norm(f"{p}.ln2_post", h, norm)
    return out


class ModelKey(NamedTuple):
    """The ModelSpec fields the parameter list depends on (hashable, for caching per-parameter work)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None
    ffn_hidden: int | None
    seq_len: int
    n_experts: int
    norm: str = "layernorm"
    mlp: str = "gelu"
    positions: str = "learned"
    tie_embeddings: bool = False
    bias: str = "all"
    expert_ffn_hidden: int | None = None
    n_shared_experts: int = 0
    shared_ffn_hidden: int | None = None
    shared_expert_gate: bool = False
    attn_head_dim: int | None = None
    qk_norm: bool = False
    attention_sinks: bool = False
    sandwich_norm: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_dense_layers: int = 0
    moe_every: int = 1
    router_bias: bool = False


_KEY_FAMILY = ("attn_head_dim", "qk_norm", "attention_sinks", "sandwich_norm", "q_lora_rank", "kv_lora_rank",
               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_dense_layers", "moe_every", "router_bias")


def model_key(m: ModelSpec) -> ModelKey:
    defaults = ModelKey._field_defaults
    return ModelKey(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.seq_len, m.n_experts,
                    _fam(m, "norm", "layernorm"), _fam(m, "mlp", "gelu"), _fam(m, "positions", "learned"),
                    bool(getattr(m, "tie_embeddings", False)), _fam(m, "bias", "all"),
                    getattr(m, "expert_ffn_hidden", None), getattr(m, "n_shared_experts", 0),
                    getattr(m, "shared_ffn_hidden", None), bool(getattr(m, "shared_expert_gate", False)),
                    *(getattr(m, name, defaults[name]) for name in _KEY_FAMILY))


@lru_cache(maxsize=64)
def param_tuple(key: ModelKey) -> tuple[ParamInfo, ...]:
    """Cached `param_list` of a ModelKey (ParamInfo is frozen, so the tuple can be shared)."""
    V, h, s, _, _, _ = _dims(key)
    out = [ParamInfo("tok_emb.weight", (V, h))]
    if key.positions == "learned":
        out.append(ParamInfo("pos_emb.weight", (s, h)))
    # block_param_list reads the layer only for its name prefix and its MLP kind: one block per kind, renamed (a
    # DeepSeek-V3 has 47k block parameters; tests/unit/test_plan_usability.py checks this against the plain build)
    kinds: dict[bool, list[tuple[str, tuple[int, ...]]]] = {}
    for i in range(key.n_layers):
        moe = layer_is_moe(key, i)
        if moe not in kinds:
            cut = len(f"layers.{i}.")
            kinds[moe] = [(q.name[cut:], q.shape) for q in block_param_list(key, i)]
        prefix = f"layers.{i}."
        out += [ParamInfo(prefix + rest, shape) for rest, shape in kinds[moe]]
    out += _norm("norm", h, key.norm)
    # tied: lm_head.weight IS tok_emb.weight, which named_parameters() reports once, under tok_emb
    return tuple(out if key.tie_embeddings else out + _linear("lm_head", h, V, bias=False))


def param_list(m: ModelSpec) -> list[ParamInfo]:
    """Every parameter of `build_model(m)` in `named_parameters()` order."""
    return list(param_tuple(model_key(m)))


def block_params(m: ModelSpec, layer: int | None = None) -> int:
    """Parameters of one block: block `layer`, or (None) the first MoE block of a MoE model, else the dense one."""
    if layer is None:
        layer = next((i for i in range(m.n_layers) if layer_is_moe(m, i)), 0)
    return sum(q.numel for q in block_param_list(model_key(m), layer))


def count_params(m: ModelSpec) -> int:
    """Total parameters: embeddings V*h (+ s*h learned positions), every block, final norm, lm_head h*V unless tied."""
    return sum(q.numel for q in param_tuple(model_key(m)))


def active_params(m: ModelSpec) -> int:
    """Parameters one token touches (MoE: router + top_k routed experts + shared experts instead of all experts)."""
    _, h, _, kv, f, n_experts = _dims(m)
    if not n_experts:
        return count_params(m)
    per_expert = _mlp_numel(h, expert_ffn(m), _fam(m, "mlp", "gelu"), _fam(m, "bias", "all") == "all")
    inactive = (n_experts - m.top_k) * per_expert
    return count_params(m) - n_moe_layers(m) * inactive


def mtp_module_params(m: ModelSpec) -> tuple[int, int]:
    """(unique, stored) parameters of ONE DeepSeek-V3 multi-token-prediction module (num_nextn_predict_layers), which
    ShardLab does not build: enorm and hnorm (h each), eh_proj (2h -> h, no bias), one decoder block like the last
    main block, shared_head.norm (h); stored adds the checkpoint's copies of the embedding and the output head, which
    the module shares with the main model (DeepSeek-V3 README_WEIGHTS.md; vLLM's DeepSeekMultiTokenPredictorLayer)."""
    h = m.d_model
    unique = 3 * h + 2 * h * h + sum(q.numel for q in block_param_list(model_key(m), m.n_layers - 1))
    return unique, unique + 2 * m.vocab_size * h


def breakdown(m: ModelSpec) -> dict[str, int]:
    """Totals per component: embeddings, attention, norms, mlp (or router + experts), lm_head."""
    out: dict[str, int] = {}
    for p in param_list(m):
        parts = p.name.split(".")
        if parts[0] == "layers":
            key = "norms" if parts[2] in ("ln1", "ln2", "ln1_post", "ln2_post") else \
                parts[2] if parts[2] == "attn" else (
                "router" if parts[3] == "router" else "experts" if parts[3] == "experts" else
                "shared_experts" if parts[3] in ("shared", "shared_gate") else "mlp")
        else:
            key = {"tok_emb": "embeddings", "pos_emb": "embeddings", "norm": "norms"}.get(parts[0], parts[0])
        out[key] = out.get(key, 0) + p.numel
    return out


def matmul_params(m: ModelSpec, *, active: bool = False) -> int:
    """Weights that enter a matmul (Linear weights incl. lm_head; embeddings are lookups, biases adds)."""
    key = (model_key(m), getattr(m, "top_k", None), active)  # every field _matmul_params reads (memoised: per step)
    hit = _MATMUL.get(key)
    if hit is None:
        if len(_MATMUL) > 256:
            _MATMUL.clear()
        hit = _MATMUL[key] = _matmul_params(m, active=active)
    return hit


_MATMUL: dict[tuple, int] = {}


def _matmul_weights(m: ModelSpec) -> int:
    """Elements of the 2-D weights other than the embeddings' (a pass over every parameter: a DeepSeek-V3 has ~47k;
    the active and the total count share it)."""
    key = ("weights", model_key(m))
    hit = _MATMUL.get(key)
    if hit is None:
        hit = _MATMUL[key] = sum(q.numel for q in param_list(m) if len(q.shape) == 2
                                 and not q.name.startswith(("tok_emb", "pos_emb")))
    return hit


def _matmul_params(m: ModelSpec, *, active: bool) -> int:
    n = _matmul_weights(m)
    if getattr(m, "tie_embeddings", False):
        n += m.vocab_size * m.d_model  # lm_head multiplies by the tied tok_emb weight
    if active and m.is_moe:
        mats = 3 if is_gated(getattr(m, "mlp", "gelu")) else 2
        # top_k experts per token
        n -= n_moe_layers(m) * (m.n_experts - m.top_k) * mats * m.d_model * getattr(m, "expert_ffn", m.ffn)
    return n
