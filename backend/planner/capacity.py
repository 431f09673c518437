"""The capacity factors a plan searches for a MoE model (issue 35), and what each one drops.

A capacity factor is a model field (ModelSpec.capacity_factor, None = dropless), so each candidate is the model with
that factor, searched through the same core as `estimate` prices a spec with it: the padded dispatch buffers, the
all-to-all rows and the expert GEMM rows all come from analytic/moe_rows.py (memory/activations.py, traffic.py,
steptime/compute.py and the planner's step-time screen read it). The default is the model's own factor alone (one
search, the plan as before).

Dropped tokens change what the model learns, not only its speed. The prediction assumes uniform routing (every expert
gets T k / E of a rank's T tokens' k slots per microbatch; `model.moe_imbalance` scales the busiest experts' load), so
a factor >= 1 drops nothing in expectation there; real routers are uneven and drop at such factors too (a run counts
its drops: RunResult.tokens_dropped).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from backend.analytic.moe_capacity import drops, expert_capacity
from backend.analytic.moe_rows import expert_rows
from backend.spec import ModelSpec

DROPLESS_WORDS = ("none", "dropless")
NOTE_PREFIX = "capacity factor: "
"""How the plan's note on dropping layouts starts (the Plan page shows it as a caption under the table)."""
Factor = float | None


def parse_capacity_factors(text: str) -> tuple[tuple[Factor, ...], str | None]:
    """`--capacity-factors none,1.0,1.25` -> ((None, 1.0, 1.25), None), or ((), why not) naming the bad item."""
    out: list[Factor] = []
    for item in (x.strip() for x in text.split(",")):
        if item.lower() in DROPLESS_WORDS:
            out.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            return (), (f"--capacity-factors: {item!r} is neither a number nor none (dropless); give a comma list such "
                        "as none,1.0,1.25")
        if not 0 < value <= 1000:  # ModelSpec.capacity_factor's bounds
            return (), f"--capacity-factors: {item} is out of range: a capacity factor is > 0 and <= 1000"
        out.append(value)
    return tuple(dict.fromkeys(out)), None


def capacity_problem(model: ModelSpec, factors: Iterable[Factor] | None) -> str | None:
    """Why `factors` cannot be searched for `model` (a dense model has no experts to cap), or None."""
    if factors is None or getattr(model, "is_moe", False):
        return None
    return (f"capacity factors apply to mixture-of-experts models only: this model is dense (n_experts="
            f"{model.n_experts}); plan it without --capacity-factors")


def candidates(model: ModelSpec, factors: Iterable[Factor] | None) -> tuple[Factor, ...]:
    """The factors a plan searches, dropless first, then largest first (a tie in step time goes to the layout that
    drops less: the timing sort is stable); None: the model's own factor alone."""
    if factors is None:
        return (getattr(model, "capacity_factor", None),)
    chosen = set(factors)
    return ((None,) if None in chosen else ()) + tuple(sorted((f for f in chosen if f is not None), reverse=True))


def with_factor(model: ModelSpec, factor: Factor) -> ModelSpec:
    """The model at one candidate factor (itself at its own); dropless cannot pad, so padding goes with a factor."""
    if factor == getattr(model, "capacity_factor", None):
        return model
    return model.model_copy(update={"capacity_factor": factor,
                                    "moe_pad_to_capacity": model.moe_pad_to_capacity and factor is not None})


def factor_label(factor: Factor) -> str:
    return "dropless" if factor is None else f"cf {factor:g}"


def dropped_share(spec: dict[str, Any]) -> float | None:
    """Share of a rank's routed token-slots its capacity limit drops per MoE layer and microbatch under uniform routing
    (moe_rows.expert_rows' kept rows of T = micro-batch x seq / cp tokens); None for dropless or dense."""
    m = spec["model"]
    if m.get("capacity_factor") is None or not m.get("n_experts"):
        return None
    tokens = _tokens(spec)
    rows = tokens * m["top_k"]
    kept = expert_rows(tokens=tokens, top_k=m["top_k"], n_experts=m["n_experts"], factor=m["capacity_factor"],
                       pad=bool(m.get("moe_pad_to_capacity"))).kept
    return 1.0 - kept / rows


def busiest_share(spec: dict[str, Any]) -> float:
    """Share of the busiest experts' slots dropped when they get `moe_imbalance` x the uniform load: 1 - E C /
    (rho T k) where the limit applies (C <= T)."""
    m = spec["model"]
    tokens, rho = _tokens(spec), float(m.get("moe_imbalance") or 1.0)
    factor, k, e = m["capacity_factor"], m["top_k"], m["n_experts"]
    if factor is None or not drops(tokens, k, e, factor):
        return 0.0
    return max(0.0, 1.0 - e * expert_capacity(tokens, k, e, factor) / (rho * tokens * k))


def drop_note(configs: list[dict[str, Any]]) -> str | None:
    """The plan's note when it ranks a layout with a capacity factor: the trade-off, and what each one is predicted
    to drop under the model's assumption (uniform routing), said as such."""
    rows = [(i, c) for i, c in enumerate(configs, 1) if c.get("capacity_factor") is not None]
    if not rows:
        return None
    by_factor: dict[tuple[float, bool, float], list[int]] = {}
    for i, c in rows:
        m = c["spec"]["model"]
        key = (c["capacity_factor"], bool(m.get("moe_pad_to_capacity")), c["predicted_dropped_share"])
        by_factor.setdefault(key, []).append(i)
    parts = [f"{', '.join(f'#{i}' for i in ranks)} at {factor:g}{' padded' if pad else ''}: {share:.1%} predicted "
             "dropped" for (factor, pad, share), ranks in by_factor.items()]
    spec = rows[0][1]["spec"]
    rho = float(spec["model"].get("moe_imbalance") or 1.0)
    busiest = (f"; at the model's imbalance {rho:g}, the busiest experts of #{rows[0][0]} drop "
               f"{busiest_share(spec):.1%} of their slots" if rho > 1 else "")
    return (f"{NOTE_PREFIX}a layout with a capacity factor drops the routed token-slots above an expert's capacity "
            "(Megatron's per-rank limit): a change to what the model learns, not only to its speed. "
            + "; ".join(parts) + busiest + ". The prediction assumes uniform routing (every expert gets T·k/E of a "
            "rank's T tokens' k slots per microbatch), under which a factor >= 1 drops nothing in expectation; real "
            "routing is uneven and drops at such factors too: a run counts its drops (tokens_dropped).")


def _tokens(spec: dict[str, Any]) -> int:
    """T: a rank's tokens of one microbatch (micro-batch x seq / cp), which its router dispatches."""
    return spec["train"]["micro_batch"] * spec["model"]["seq_len"] // spec["parallel"].get("cp", 1)
