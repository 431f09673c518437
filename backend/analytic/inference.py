"""Serving memory per rank: the weights a rank holds and its KV cache (pure Python)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backend.analytic.textbook import kv_cache as KV
from backend.analytic.params import active_params, count_params
from backend.analytic.sharding import local_params, rank_layers, rank_stages
from backend.analytic.traffic import compute_bytes

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec


def estimate_inference(spec: ExperimentSpec, *, batch: int, context: int) -> dict[str, Any]:
    """Per-rank weights (pp/tp/ep split, replicated over dp) and KV cache (Pope 2022 Sec 2.1) for serving."""
    m, t, p = spec.model, spec.train, spec.parallel
    cb = compute_bytes(t.precision)
    per_rank, done = [], {}
    for rank in range(p.world_size):
        c = p.coords(rank)
        key = (c["pp"], c["tp"], c["ep"])  # the weights a rank holds depend on nothing else
        if key not in done:
            done[key] = (rank_layers(spec, rank_stages(spec, rank)),
                         sum(q.local_numel for q in local_params(spec, rank, dp_shard=False)))
        layers, weights = done[key]
        kv = KV.kv_cache_bytes(batch=batch, context=context, n_layers=len(layers), n_kv_heads=m.kv_heads,
                               head_dim=m.head_dim, dtype_bytes=cb, tp=p.tp)
        per_rank.append({"rank": rank, "coords": c, "params_count": weights, "weights_bytes": weights * cb,
                         "kv_cache_bytes": kv, "total_bytes": weights * cb + kv})
    return {"mode": "inference", "batch": batch, "context": context, "dtype_bytes": cb, "per_rank": per_rank,
            "params_total": count_params(m), "active_params": active_params(m),
            "weights_bytes": max(r["weights_bytes"] for r in per_rank),
            "kv_cache_bytes": max(r["kv_cache_bytes"] for r in per_rank)}
