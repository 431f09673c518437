"""Formula explorer figures (no run needed): ZeRO memory vs N, activations vs s, bubble vs m, seed claims."""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

from backend.analytic.units import GB, GiB
from backend.number_format import fmt_bytes
from dashboard.theme import LAYOUT, STRATEGY_COLOR

ZERO_CURVES = (("ddp", 0, "DDP (ZeRO-0)"), ("zero1", 1, "ZeRO-1 (P_os)"), ("zero2", 2, "ZeRO-2 (P_os+g)"),
               ("zero3", 3, "ZeRO-3 / FSDP (P_os+g+p)"))


def worlds(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 2
    return out


def zero_memory_fig(psi: float, *, precision: str, optimizer: str, ns: list[int], device_gb: float | None) -> go.Figure:
    """Per-GPU model-state memory (params + grads + optimizer) vs data-parallel size, one curve per stage."""
    from backend.analytic.textbook.zero import precision_bytes, zero_model_state_bytes

    pb, gb, k = precision_bytes(precision, optimizer)
    fig = go.Figure()
    for key, stage, label in ZERO_CURVES:
        ys = [zero_model_state_bytes(psi, n=n, stage=stage, k=k, param_bytes=pb, grad_bytes=gb)["total_bytes"] / GiB
              for n in ns]
        fig.add_scatter(name=label, x=ns, y=ys, mode="lines+markers", line_color=STRATEGY_COLOR[key],
                        hovertemplate=f"{label}<br>N=%{{x}} GPUs: %{{y:,.2f}} GiB per GPU<extra></extra>")
    if device_gb:
        # A trace, not add_hline: shapes on a log axis take log10 coordinates.
        dev = device_gb * GB / GiB
        fig.add_scatter(name=f"{device_gb:g} GB device ({dev:.3g} GiB)", x=[ns[0], ns[-1]], y=[dev, dev], mode="lines",
                        line=dict(color="black", dash="dash"),
                        hovertemplate=f"device memory {device_gb:g} GB = {dev:.3g} GiB<extra></extra>")
    per_param = pb + gb + k
    fig.update_layout(title=f"Model-state memory per GPU, Ψ = {psi / 1e9:g}B params, {precision}/{optimizer}: "
                            f"{pb:g} + {gb:g} + K = {per_param:g} bytes per parameter (K = {k:g} optimizer bytes)",
                      xaxis_title="data-parallel GPUs N (log)",
                      yaxis_title="params + grads + optimizer per GPU (GiB, log)", **LAYOUT)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig


def activation_fig(*, seqs: list[int], b: int, h: int, a: int, layers: int, t: int, sp: bool) -> go.Figure:
    """Korthikanti et al. 2022 activation memory for the whole model vs sequence length, per recompute mode."""
    from backend.analytic.textbook.korthikanti import korthikanti_layer_bytes

    fig = go.Figure()
    for mode in ("none", "selective", "full"):
        ys = [korthikanti_layer_bytes(s=s, b=b, h=h, a=a, t=t, sp=sp, recompute=mode) * layers / GiB for s in seqs]
        fig.add_scatter(name=f"recompute={mode}", x=seqs, y=ys, mode="lines+markers",
                        hovertemplate=f"recompute={mode}<br>s=%{{x}}: %{{y:,.3f}} GiB<extra></extra>")
    fig.update_layout(title=f"Activation memory per GPU (Korthikanti 2022), b={b}, h={h}, a={a}, L={layers}, "
                            f"t={t}" + (", SP" if sp else ""),
                      xaxis_title="sequence length s (tokens, log)", yaxis_title="activations per GPU (GiB, log)",
                      **LAYOUT)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig


def bubble_fig(*, p: int, ms: list[int], v: int) -> go.Figure:
    from backend.analytic.textbook.pipeline import bubble_fraction

    fig = go.Figure()
    for sched in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"):
        vv = 2 if sched == "zbv" else (v if sched in ("interleaved_1f1b", "zero_bubble") else 1)
        xs, ys = [], []
        for m in ms:
            try:
                ys.append(bubble_fraction(sched, p=p, m=m, v=vv) * 100)
                xs.append(m)
            except (ValueError, ZeroDivisionError):
                continue
        if xs:
            fig.add_scatter(name=f"{sched}" + (f" (v={vv})" if vv > 1 else ""), x=xs, y=ys, mode="lines+markers",
                            hovertemplate=f"{sched}<br>m=%{{x}} microbatches: bubble %{{y:.1f}} %<extra></extra>")
    fig.update_layout(title=f"Pipeline bubble fraction vs microbatches, p = {p} stages",
                      xaxis_title="microbatches per step m", yaxis_title="idle fraction of the step (%)", **LAYOUT)
    return fig


def _claim_get(c: Any, k: str) -> Any:
    return c.get(k) if isinstance(c, dict) else getattr(c, k, None)


def claims_frame(claims: list[Any]) -> pd.DataFrame:
    rows = []
    for c in claims:
        holds = _claim_get(c, "holds")
        unit = _claim_get(c, "unit") or ""
        rows.append({
            "verdict": "holds" if holds else ("does NOT hold" if holds is not None else "–"),
            "claim": _claim_get(c, "text"),
            "source": _claim_get(c, "source"),
            "claimed": _num(_claim_get(c, "claimed_value"), unit),
            "formula gives": _num(_claim_get(c, "formula_value"), unit),
            "formula": _claim_get(c, "formula"),
            "tolerance": _claim_get(c, "tolerance"),
            "why": _claim_get(c, "explanation"),
            "id": _claim_get(c, "id"),
        })
    return pd.DataFrame(rows)


def claim_styles(df: pd.DataFrame) -> pd.DataFrame:
    """Green verdict for a claim that holds, red for one that does not."""
    css = pd.DataFrame("", index=df.index, columns=df.columns)
    css.loc[df["verdict"] == "holds", "verdict"] = "background-color: #d8f0d2; font-weight: 600"
    css.loc[df["verdict"] == "does NOT hold", "verdict"] = "background-color: #f8d4d4; font-weight: 600"
    return css


def _num(v: Any, unit: str) -> str:
    if v is None:
        return "–"
    if isinstance(v, (int, float)):
        return f"{v:,.4g} {unit}".strip()
    return f"{v} {unit}".strip()


def measured_checks(runs: list[tuple[int, Any]]) -> pd.DataFrame:
    """Textbook claims checked on stored (id, RunResult) pairs: ZeRO model-state savings vs DDP, pipeline bubbles."""
    rows = []
    ddp = {}
    ids = {id(r): i for i, r in runs}
    results = [r for _, r in runs if r.memory_measured]  # an imported run's categories are unknown, not 0 B
    for r in results:
        if r.spec.parallel.strategy == "ddp" and r.per_rank:
            ddp[_shape_key(r)] = r
    for r in results:
        if not r.per_rank:
            continue
        st = str(r.spec.parallel.strategy)
        if st in ("zero1", "zero2", "zero3", "fsdp") and _shape_key(r) in ddp:
            base = _model_state(ddp[_shape_key(r)])
            cur, pred_cur, pred_base = (_model_state(r), _model_state(r, "predicted"),
                                        _model_state(ddp[_shape_key(r)], "predicted"))
            rows.append({"check": f"{st} saves model-state memory vs DDP (world {r.spec.parallel.world_size})",
                         "measured": f"{base / cur:.2f}× ({fmt_bytes(base)} → {fmt_bytes(cur)})" if cur else "–",
                         "formula": f"{pred_base / pred_cur:.2f}×" if pred_cur else "–", "run": ids[id(r)]})
        if r.bubble_measured is not None and r.bubble_predicted is not None:
            rows.append({"check": f"pipeline bubble, {r.spec.parallel.pp_schedule} p={r.spec.parallel.pp} "
                                  f"m={r.spec.train.microbatches}",
                         "measured": f"{r.bubble_measured * 100:.1f} %", "formula": f"{r.bubble_predicted * 100:.1f} %",
                         "run": ids[id(r)], "caveat": bubble_caveat(r)})
    return pd.DataFrame(rows, columns=["check", "measured", "formula", "run", "caveat"])


def bubble_caveat(r: Any) -> str:
    """The run's own note on CPU time-sharing (strategies/pp.py: ranks without a core each cannot overlap stages)."""
    return next((n for n in r.notes if n.startswith("Bubble:")), "")


def _shape_key(r: Any) -> tuple:
    """Runs compared with one DDP baseline: same model, precision, optimizer, world and framework (DeepSpeed's ZeRO
    keeps a reduce bucket and fp32 partitions that torch's DDP baseline does not)."""
    s = r.spec
    return (s.model.model_dump_json(), s.train.precision, s.train.optimizer, s.parallel.world_size, str(s.framework))


def _model_state(r: Any, which: str = "measured") -> float:
    return max(sum(getattr(getattr(x, which), c) for c in ("params_bytes", "grads_bytes", "optimizer_bytes"))
               for x in r.per_rank)
