"""Activation bytes of one transformer layer as published (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec 4 / Table 2): 16-bit activations, with dropout, GPT-style layer
with a 4h MLP. Symbols: s sequence, b microbatch, h hidden, a heads, t tensor-parallel degree, sp sequence parallel.
The exact count for this engine's model is backend/analytic/memory/activations.py."""

from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one transformer layer, Korthikanti 2022 Table 2."""
    recompute = str(recompute)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} not in {RECOMPUTE}")
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)  # Table 2 "full recompute": 2sbh input per layer (/t with SP)
    attn_scores = 0.0 if recompute == "selective" else 5 * a * s / h  # Sec 5: selective recompute drops the 5as/h term
    if sp:
        return sbh / t * (34 + attn_scores)  # Table 2: sbh/t (34 + 5as/h); selective sbh·34/t
    return sbh * (10 + 24 / t + attn_scores / t)  # Table 2: sbh(10 + 24/t + 5as/(ht)); selective sbh(10 + 24/t)
