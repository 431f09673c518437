"""torch's AdamW and SGD(momentum=0.9) written out in JAX (no optax in the venv; the update is torch's formula
term for term, so losses match the torch reference). State leaves mirror the parameter dict."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

BETAS = (0.9, 0.999)  # torch.optim.AdamW defaults
EPS = 1e-8
WEIGHT_DECAY = 0.01
MOMENTUM = 0.9  # backend.strategies.base.optimizer_kwargs


def init_state(params: dict[str, jax.Array], optimizer: str) -> dict[str, Any]:
    zeros = {k: jnp.zeros_like(v) for k, v in params.items()}
    if optimizer == "adamw":
        return {"m": zeros, "v": {k: jnp.zeros_like(v) for k, v in params.items()}}
    return {"buf": zeros}


def update(params, grads, state, step: jax.Array, lr: float, optimizer: str):
    """One optimizer step; step is the 1-based step count (a traced scalar)."""
    if optimizer != "adamw":
        buf = {k: MOMENTUM * state["buf"][k] + g for k, g in grads.items()}
        return {k: params[k] - lr * buf[k] for k in params}, {"buf": buf}
    b1, b2 = BETAS
    m = {k: b1 * state["m"][k] + (1 - b1) * g for k, g in grads.items()}
    v = {k: b2 * state["v"][k] + (1 - b2) * g * g for k, g in grads.items()}
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    new = {}
    for k, q in params.items():
        q = q * (1 - lr * WEIGHT_DECAY)
        denom = jnp.sqrt(v[k]) / jnp.sqrt(bc2) + EPS
        new[k] = q - (lr / bc1) * m[k] / denom
    return new, {"m": m, "v": v}
