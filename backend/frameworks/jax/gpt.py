"""ShardLab's dense GPT (backend/models/gpt.py) written in JAX, parameter for parameter.

Parameters are a flat dict keyed by the torch names ("layers.0.attn.q.weight") with torch's shapes (Linear
weight (out, in)), so weights transfer by name from the seeded torch model and per-parameter sharding rules
match ShardLab's torch plans. Every op matches torch's: LayerNorm eps 1e-5, exact (erf) GELU, explicit masked
softmax attention, fp32 cross-entropy.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, jax.Array]
LN_EPS = 1e-5  # torch.nn.LayerNorm default


def torch_params(spec: Any) -> dict[str, Any]:
    """The seeded torch model's weights as numpy arrays by name (the same init every torch strategy uses)."""
    from backend.models.gpt import build_model

    model = build_model(spec.model, seed=spec.train.seed)
    return {k: v.detach().numpy().copy() for k, v in model.named_parameters()}


def _linear(p: Params, name: str, x: jax.Array, bias: bool = True) -> jax.Array:
    y = x @ p[f"{name}.weight"].T
    return y + p[f"{name}.bias"] if bias else y


def _layer_norm(p: Params, name: str, x: jax.Array) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + LN_EPS) * p[f"{name}.weight"] + p[f"{name}.bias"]


def _attention(p: Params, pre: str, x: jax.Array, n_heads: int, kv_heads: int) -> jax.Array:
    B, T, C = x.shape
    d = C // n_heads
    q = _linear(p, f"{pre}.q", x).reshape(B, T, n_heads, d).transpose(0, 2, 1, 3)  # (B, a, T, d)
    k = _linear(p, f"{pre}.k", x).reshape(B, T, kv_heads, d).transpose(0, 2, 1, 3)  # (B, kv, T, d)
    v = _linear(p, f"{pre}.v", x).reshape(B, T, kv_heads, d).transpose(0, 2, 1, 3)
    if kv_heads != n_heads:
        k, v = jnp.repeat(k, n_heads // kv_heads, axis=1), jnp.repeat(v, n_heads // kv_heads, axis=1)
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(d))  # (B, a, T, T)
    mask = jnp.triu(jnp.ones((T, T), dtype=bool), 1)
    probs = jax.nn.softmax(jnp.where(mask, -jnp.inf, scores), axis=-1)
    y = (probs @ v).transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
    return _linear(p, f"{pre}.o", y)


def forward(p: Params, tokens: jax.Array, m: Any) -> jax.Array:
    """tokens (B, T) int32 -> logits (B, T, V)."""
    T = tokens.shape[1]
    h = p["tok_emb.weight"][tokens] + p["pos_emb.weight"][jnp.arange(T)]  # (B, T, C)
    kv = m.n_kv_heads or m.n_heads
    for i in range(m.n_layers):
        pre = f"layers.{i}"
        h = h + _attention(p, f"{pre}.attn", _layer_norm(p, f"{pre}.ln1", h), m.n_heads, kv)
        x = _layer_norm(p, f"{pre}.ln2", h)
        h = h + _linear(p, f"{pre}.mlp.fc_out", jax.nn.gelu(_linear(p, f"{pre}.mlp.fc_in", x), approximate=False))
    h = _layer_norm(p, "norm", h)
    return _linear(p, "lm_head", h, bias=False)


def loss_fn(p: Params, tokens: jax.Array, targets: jax.Array, m: Any) -> jax.Array:
    logits = forward(p, tokens, m)  # (B, T, V)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()
