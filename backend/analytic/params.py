"""Exact parameter counts of ShardLab's GPT/MoE family (`backend/models/gpt.py`), pure Python.

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


def _linear(prefix: str, n_in: int, n_out: int, bias: bool = True) -> list[ParamInfo]:
    # torch.nn.Linear stores weight as (out_features, in_features)
    out = [ParamInfo(f"{prefix}.weight", (n_out, n_in))]
    return out + [ParamInfo(f"{prefix}.bias", (n_out,))] if bias else out


def _norm(prefix: str, h: int) -> list[ParamInfo]:
    return [ParamInfo(f"{prefix}.weight", (h,)), ParamInfo(f"{prefix}.bias", (h,))]


def _mlp(prefix: str, h: int, f: int) -> list[ParamInfo]:
    return _linear(f"{prefix}.fc_in", h, f) + _linear(f"{prefix}.fc_out", f, h)


def block_param_list(m: Any, layer: int) -> list[ParamInfo]:
    """One transformer block: ln1, attn.{q,k,v,o}, ln2, then mlp.{fc_in,fc_out} or the MoE."""
    _, h, _, kv_dim, f, n_experts = _dims(m)
    p = f"layers.{layer}"
    out = _norm(f"{p}.ln1", h)
    out += _linear(f"{p}.attn.q", h, h) + _linear(f"{p}.attn.k", h, kv_dim)
    out += _linear(f"{p}.attn.v", h, kv_dim) + _linear(f"{p}.attn.o", h, h)
    out += _norm(f"{p}.ln2", h)
    if n_experts:
        out += _linear(f"{p}.mlp.router", h, n_experts, bias=False)
        for e in range(n_experts):
            out += _mlp(f"{p}.mlp.experts.{e}", h, f)
    else:
        out += _mlp(f"{p}.mlp", h, f)
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


def model_key(m: Any) -> ModelKey:
    return ModelKey(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.seq_len, m.n_experts)


@lru_cache(maxsize=64)
def param_tuple(key: ModelKey) -> tuple[ParamInfo, ...]:
    """Cached `param_list` of a ModelKey (ParamInfo is frozen, so the tuple can be shared)."""
    V, h, s, _, _, _ = _dims(key)
    out = [ParamInfo("tok_emb.weight", (V, h)), ParamInfo("pos_emb.weight", (s, h))]
    for i in range(key.n_layers):
        out += block_param_list(key, i)
    out += _norm("norm", h)
    return tuple(out + _linear("lm_head", h, V, bias=False))


def param_list(m: Any) -> list[ParamInfo]:
    """Every parameter of `build_model(m)` in `named_parameters()` order."""
    return list(param_tuple(model_key(m)))


def block_params(m: Any) -> int:
    """Parameters of one block in closed form: 4h (norms) + 2h^2 + 2h*kv + 2h + 2kv (attn) + MLP/MoE."""
    _, h, _, kv, f, n_experts = _dims(m)
    attn = 2 * h * h + 2 * h * kv + 2 * h + 2 * kv
    mlp = 2 * h * f + f + h
    return 4 * h + attn + (h * n_experts + n_experts * mlp if n_experts else mlp)


def count_params(m: Any) -> int:
    """Total parameters Ψ: untied embeddings V*h + s*h, L blocks, final norm 2h, lm_head h*V (no bias)."""
    V, h, s, _, _, _ = _dims(m)
    return V * h + s * h + m.n_layers * block_params(m) + 2 * h + h * V


def active_params(m: Any) -> int:
    """Parameters one token touches (MoE: router + top_k experts instead of all experts)."""
    _, h, _, kv, f, n_experts = _dims(m)
    if not n_experts:
        return count_params(m)
    per_expert = 2 * h * f + f + h
    inactive = (n_experts - m.top_k) * per_expert
    return count_params(m) - m.n_layers * inactive


def breakdown(m: Any) -> dict[str, int]:
    """Totals per component: embeddings, attention, norms, mlp (or router + experts), lm_head."""
    out: dict[str, int] = {}
    for p in param_list(m):
        parts = p.name.split(".")
        if parts[0] == "layers":
            key = "norms" if parts[2] in ("ln1", "ln2") else parts[2] if parts[2] == "attn" else (
                "router" if parts[3] == "router" else "experts" if parts[3] == "experts" else "mlp")
        else:
            key = {"tok_emb": "embeddings", "pos_emb": "embeddings", "norm": "norms"}.get(parts[0], parts[0])
        out[key] = out.get(key, 0) + p.numel
    return out
