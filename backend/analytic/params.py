"""Exact parameter counts of ShardLab's decoder family (`backend/models/gpt.py`: GPT, Llama/Mistral/Qwen2-style
dense, Mixtral-style MoE, MoE with shared experts), pure Python.

`param_list(model)` mirrors `GPT.named_parameters()` name for name, shape for shape, in the same
order, because per-rank sharding (ZeRO-1's greedy partition, FSDP2's per-parameter padding, TP
splits) works on individual parameters, not on a total.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Any, NamedTuple


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


def _dims(m: Any) -> tuple[int, int, int, int, int, int]:
    """(V, h, s, kv_dim, ffn, n_experts) from a ModelSpec (or any object with the same fields)."""
    kv_heads = m.n_kv_heads or m.n_heads
    kv_dim = kv_heads * (m.d_model // m.n_heads)
    return m.vocab_size, m.d_model, m.seq_len, kv_dim, m.ffn_hidden or 4 * m.d_model, m.n_experts


def _fam(m: Any, name: str, default: Any) -> Any:
    """A family field as a plain string/value (objects from before the family fields get GPT's defaults)."""
    v = getattr(m, name, default)
    return str(v) if hasattr(v, "value") else v


def expert_ffn(m: Any) -> int:
    return getattr(m, "expert_ffn_hidden", None) or m.ffn_hidden or 4 * m.d_model


def shared_ffn(m: Any) -> int:
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
    if kind == "swiglu":  # Shazeer 2020 Eq. 6 FFN_SwiGLU: down(silu(x W_gate) * x W_up)
        return _linear(f"{prefix}.gate", h, f, bias) + _linear(f"{prefix}.up", h, f, bias) + _linear(f"{prefix}.down", f, h, bias)
    return _linear(f"{prefix}.fc_in", h, f, bias) + _linear(f"{prefix}.fc_out", f, h, bias)


def _mlp_numel(h: int, f: int, kind: str, bias: bool) -> int:
    return (3 * h * f + (2 * f + h) * bias) if kind == "swiglu" else (2 * h * f + (f + h) * bias)


def block_param_list(m: Any, layer: int) -> list[ParamInfo]:
    """One transformer block: ln1, attn.{q,k,v,o}, ln2, then mlp.{fc_in,fc_out | gate,up,down} or the MoE
    (mlp.router, mlp.experts.E.*, mlp.shared.*, mlp.shared_gate)."""
    _, h, _, kv_dim, f, n_experts = _dims(m)
    norm, kind, bias = _fam(m, "norm", "layernorm"), _fam(m, "mlp", "gelu"), _fam(m, "bias", "all")
    qkv_b, all_b = bias in ("all", "qkv"), bias == "all"
    p = f"layers.{layer}"
    out = _norm(f"{p}.ln1", h, norm)
    out += _linear(f"{p}.attn.q", h, h, qkv_b) + _linear(f"{p}.attn.k", h, kv_dim, qkv_b)
    out += _linear(f"{p}.attn.v", h, kv_dim, qkv_b) + _linear(f"{p}.attn.o", h, h, all_b)
    out += _norm(f"{p}.ln2", h, norm)
    if n_experts:
        out += _linear(f"{p}.mlp.router", h, n_experts, bias=False)
        for e in range(n_experts):
            out += _mlp(f"{p}.mlp.experts.{e}", h, expert_ffn(m), kind, all_b)
        if shared_ffn(m):
            out += _mlp(f"{p}.mlp.shared", h, shared_ffn(m), kind, all_b)
            if getattr(m, "shared_expert_gate", False):
                out += _linear(f"{p}.mlp.shared_gate", h, 1, bias=False)
    else:
        out += _mlp(f"{p}.mlp", h, f, kind, all_b)
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


def model_key(m: Any) -> ModelKey:
    return ModelKey(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.seq_len, m.n_experts,
                    _fam(m, "norm", "layernorm"), _fam(m, "mlp", "gelu"), _fam(m, "positions", "learned"),
                    bool(getattr(m, "tie_embeddings", False)), _fam(m, "bias", "all"),
                    getattr(m, "expert_ffn_hidden", None), getattr(m, "n_shared_experts", 0),
                    getattr(m, "shared_ffn_hidden", None), bool(getattr(m, "shared_expert_gate", False)))


@lru_cache(maxsize=64)
def param_tuple(key: ModelKey) -> tuple[ParamInfo, ...]:
    """Cached `param_list` of a ModelKey (ParamInfo is frozen, so the tuple can be shared)."""
    V, h, s, _, _, _ = _dims(key)
    out = [ParamInfo("tok_emb.weight", (V, h))]
    if key.positions == "learned":
        out.append(ParamInfo("pos_emb.weight", (s, h)))
    for i in range(key.n_layers):
        out += block_param_list(key, i)
    out += _norm("norm", h, key.norm)
    # tied: lm_head.weight IS tok_emb.weight, which named_parameters() reports once, under tok_emb
    return tuple(out if key.tie_embeddings else out + _linear("lm_head", h, V, bias=False))


def param_list(m: Any) -> list[ParamInfo]:
    """Every parameter of `build_model(m)` in `named_parameters()` order."""
    return list(param_tuple(model_key(m)))


def block_params(m: Any) -> int:
    """Parameters of one block in closed form. GPT (layernorm, gelu, bias all): 4h (norms) + 2h^2 + 2h*kv + 2h + 2kv
    (attn) + MLP/MoE; rmsnorm drops the norm biases, swiglu has 3 matrices, bias none/qkv drop biases."""
    _, h, _, kv, f, n_experts = _dims(m)
    norm, kind, bias = _fam(m, "norm", "layernorm"), _fam(m, "mlp", "gelu"), _fam(m, "bias", "all")
    qkv_b, all_b = bias in ("all", "qkv"), bias == "all"
    norms = (4 if norm == "layernorm" else 2) * h
    attn = 2 * h * h + 2 * h * kv + (h + 2 * kv) * qkv_b + h * all_b
    if not n_experts:
        return norms + attn + _mlp_numel(h, f, kind, all_b)
    moe = h * n_experts + n_experts * _mlp_numel(h, expert_ffn(m), kind, all_b)
    if shared_ffn(m):
        moe += _mlp_numel(h, shared_ffn(m), kind, all_b) + h * bool(getattr(m, "shared_expert_gate", False))
    return norms + attn + moe


def count_params(m: Any) -> int:
    """Total parameters Ψ: embeddings V*h (+ s*h learned positions), L blocks, final norm, lm_head h*V unless tied."""
    V, h, s, _, _, _ = _dims(m)
    pos = s * h if _fam(m, "positions", "learned") == "learned" else 0
    head = 0 if getattr(m, "tie_embeddings", False) else h * V
    final_norm = (2 if _fam(m, "norm", "layernorm") == "layernorm" else 1) * h
    return V * h + pos + m.n_layers * block_params(m) + final_norm + head


def active_params(m: Any) -> int:
    """Parameters one token touches (MoE: router + top_k routed experts + shared experts instead of all experts)."""
    _, h, _, kv, f, n_experts = _dims(m)
    if not n_experts:
        return count_params(m)
    per_expert = _mlp_numel(h, expert_ffn(m), _fam(m, "mlp", "gelu"), _fam(m, "bias", "all") == "all")
    inactive = (n_experts - m.top_k) * per_expert
    return count_params(m) - m.n_layers * inactive


def breakdown(m: Any) -> dict[str, int]:
    """Totals per component: embeddings, attention, norms, mlp (or router + experts), lm_head."""
    out: dict[str, int] = {}
    for p in param_list(m):
        parts = p.name.split(".")
        if parts[0] == "layers":
            key = "norms" if parts[2] in ("ln1", "ln2") else parts[2] if parts[2] == "attn" else (
                "router" if parts[3] == "router" else "experts" if parts[3] == "experts" else
                "shared_experts" if parts[3] in ("shared", "shared_gate") else "mlp")
        else:
            key = {"tok_emb": "embeddings", "pos_emb": "embeddings", "norm": "norms"}.get(parts[0], parts[0])
        out[key] = out.get(key, 0) + p.numel
    return out


def matmul_params(m: Any, *, active: bool = False) -> int:
    """Weights that enter a matmul (Linear weights incl. lm_head; embeddings are lookups, biases adds)."""
    key = (model_key(m), getattr(m, "top_k", None), active)  # every field _matmul_params reads (memoised: per step)
    hit = _MATMUL.get(key)
    if hit is None:
        if len(_MATMUL) > 256:
            _MATMUL.clear()
        hit = _MATMUL[key] = _matmul_params(m, active=active)
    return hit


_MATMUL: dict[tuple, int] = {}


def _matmul_params(m: Any, *, active: bool) -> int:
    n = sum(q.numel for q in param_list(m) if len(q.shape) == 2 and not q.name.startswith(("tok_emb", "pos_emb")))
    if getattr(m, "tie_embeddings", False):
        n += m.vocab_size * m.d_model  # lm_head multiplies by the tied tok_emb weight
    if active and m.is_moe:
        mats = 3 if str(getattr(m, "mlp", "gelu")) == "swiglu" else 2
        n -= m.n_layers * (m.n_experts - m.top_k) * mats * m.d_model * getattr(m, "expert_ffn", m.ffn)  # top_k experts per token
    return n
