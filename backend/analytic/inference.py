"""Serving memory per rank: the weights a rank holds and its KV cache (pure Python).

A rank's weights depend on its pipeline rank, its ep index and its tp index's chunk sizes only (rank_classes.py):
they are computed once per such class and expanded per rank for the page that is printed.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING, Any

from backend.analytic.params import active_params, count_params, param_list
from backend.analytic.rank_classes import chunk_intervals
from backend.analytic.sharding import local_params, rank_layers, rank_stages
from backend.analytic.textbook.kv_cache import kv_cache_bytes
from backend.analytic.traffic import compute_bytes

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec, ModelSpec


def estimate_inference(spec: ExperimentSpec, *, batch: int, context: int, offset: int = 0,
                       max_ranks: int | None = None) -> dict[str, Any]:
    """Per-rank weights (pp/tp/ep split, replicated over dp) and KV cache (Pope 2022 Sec 2.1) for serving; every rank
    unless a page is asked for (max_ranks below the world size, or an offset: then "per_rank_page" says which)."""
    m, p = spec.model, spec.parallel
    cb = compute_bytes(spec.train.precision)
    tp_starts = chunk_intervals({d for q in param_list(m) for d in q.shape}, p.tp)
    classes: dict[tuple[int, int, int], tuple[list[int], int]] = {}

    def weights_of(rank: int) -> tuple[list[int], int]:
        c = p.coords(rank)
        key = (c["pp"], bisect_right(tp_starts, c["tp"]), c["ep"])  # the weights a rank holds depend on nothing else
        if key not in classes:
            classes[key] = (rank_layers(spec, rank_stages(spec, rank)),
                            sum(q.local_numel for q in local_params(spec, rank, dp_shard=False)))
        return classes[key]

    def row(rank: int) -> dict[str, Any]:
        layers, weights = weights_of(rank)
        kv = layers_kv_cache_bytes(m, layers, batch=batch, context=context, dtype_bytes=cb, tp=p.tp)
        return {"rank": rank, "coords": p.coords(rank), "params_count": weights, "weights_bytes": weights * cb,
                "kv_cache_bytes": kv, "total_bytes": weights * cb + kv}

    # one rank of every class: every pipeline rank, every tp interval, every ep index (dp index = ep index)
    distinct = [row((pp * p.dp_cp + ep) * p.tp + tp) for pp in range(p.pp) for tp in tp_starts for ep in range(p.ep)]
    paged = max_ranks is not None and (offset > 0 or p.world_size > max_ranks)
    stop = min(p.world_size, offset + max_ranks) if paged else p.world_size
    out = {"mode": "inference", "batch": batch, "context": context, "dtype_bytes": cb,
           "per_rank": [row(r) for r in range(offset if paged else 0, stop)],
           "params_total": count_params(m), "active_params": active_params(m),
           "weights_bytes": max(r["weights_bytes"] for r in distinct),
           "kv_cache_bytes": max(r["kv_cache_bytes"] for r in distinct)}
    if paged:
        out["per_rank_page"] = {"offset": offset, "ranks": len(out["per_rank"]), "world_size": p.world_size}
    return out


def layers_kv_cache_bytes(m: ModelSpec, layers: list[int], *, batch: int, context: int, dtype_bytes: float,
                          tp: int) -> float:
    """KV cache of the given blocks. A plain layer caches K and V per kv head (textbook/kv_cache.py, vLLM Sec 3);
    a windowed one (sliding or chunked) at most `window` positions (Mistral's rolling buffer, Jiang et al. 2023 Sec 2);
    MLA caches one compressed latent (kv_lora_rank) plus the shared rope key (qk_rope_head_dim) per token and layer,
    whole on every tp rank (DeepSeek-V2 Sec 2.1.2, Table 1: (d_c + d_h^R) * l elements per token). Sinks cache
    nothing (one logit per head, a parameter)."""
    total = 0.0
    for layer in layers:
        kept = context if m.layer_is_global(layer) else min(context, m.window)
        if m.is_mla:
            total += batch * kept * (m.kv_lora_rank + m.qk_rope_head_dim) * dtype_bytes
        else:
            total += kv_cache_bytes(batch=batch, context=kept, n_layers=1, n_kv_heads=m.kv_heads,
                                    head_dim=m.head_dim, dtype_bytes=dtype_bytes, tp=tp)
    return total
