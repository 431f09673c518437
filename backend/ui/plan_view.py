"""Plan page logic: model from a preset or a config.json, the planner's results as a table, a Pareto plot of
memory vs step time coloured by strategy, a stacked time breakdown, and the seeds' scenarios' verdicts."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from backend.analytic.estimate import worst_rank_bytes
from backend.analytic.steptime.hardware import get_hardware, load_profiles
from backend.analytic.steptime.model import step_time
from backend.planner.search import Plan, budget_bytes, plan
from backend.planner.space import light_spec
from backend.spec import ExperimentSpec, ModelSpec
from backend.ui.theme import LAYOUT, STRATEGY_COLOR

BREAKDOWN = (("compute_s", "compute"), ("exposed_comm_s", "exposed comm"), ("bubble_s", "bubble"),
             ("optimizer_s", "optimizer"), ("other_s", "other"))
HF_KEYS = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "num_key_value_heads": "n_kv_heads", "intermediate_size": "ffn_hidden", "vocab_size": "vocab_size",
           "n_embd": "d_model", "n_layer": "n_layers", "n_head": "n_heads"}


def hardware_options() -> list[str]:
    return list(load_profiles())


def model_from_config(text: str, seq: int) -> ModelSpec:
    """A Hugging Face config.json's model. A real config (it names its `model_type`) goes through backend.hf_config,
    the one import the CLI and New experiment use (exact family, refused fields named); a bare dict of shape keys
    without a model_type gets a plain GPT block of that shape. Raises ValueError with the reason."""
    cfg = json.loads(text)
    if "model_type" in cfg:
        from backend.hf_config import from_hf_config

        fields, _notes = from_hf_config(cfg, seq_len=seq)
        return ModelSpec(**{**fields, "seq_len": seq})
    data = {ours: cfg[theirs] for theirs, ours in HF_KEYS.items() if theirs in cfg}
    missing = {"d_model", "n_layers", "n_heads", "vocab_size"} - set(data)
    if missing:
        raise ValueError(f"config.json lacks {', '.join(sorted(missing))} (looked for {', '.join(HF_KEYS)})")
    return ModelSpec(**data, seq_len=seq)


def run_plan(model: ModelSpec, *, gpus: int, gpus_per_node: int, hardware: str, global_batch: int,
             memory_gb: float | None, top: int) -> Plan:
    hw = get_hardware(hardware)
    return plan(model, gpus=gpus, gpus_per_node=gpus_per_node, hw=hw, global_batch=global_batch,
                memory_bytes=memory_gb * 1e9 if memory_gb else None, top=top)


def results_frame(p: Plan) -> pd.DataFrame:
    rows = []
    for i, c in enumerate(p.configs):
        s, t, par = c["spec"], c["step_time"], c["spec"]["parallel"]
        rows.append({"#": i + 1, "strategy": c["strategy"], "dp": par["dp"], "tp": par["tp"], "pp": par["pp"], "ep": par["ep"],
                     "micro-batch": s["train"]["micro_batch"], "recompute": s["train"]["recompute"],
                     "schedule": par["pp_schedule"] if par["pp"] > 1 else "-", "v": par["virtual_stages"],
                     "SP": par["sequence_parallel"], "memory GB": c["mem_bytes_max"] / 1e9, "step s": t["step_s"],
                     "low s": t["low_s"], "high s": t["high_s"], "tokens/s": t["tokens_per_s"],
                     "TFLOP/s/GPU": t["tflops_per_gpu"], "MFU %": 100 * t["mfu"]})
    return pd.DataFrame(rows)


def pareto_fig(p: Plan) -> go.Figure:
    """Worst-rank memory vs predicted step time, one colour per data-parallel flavour; the Pareto front drawn."""
    fig = go.Figure()
    for strat in sorted({c["strategy"] for c in p.configs}):
        cs = [c for c in p.configs if c["strategy"] == strat]
        fig.add_scatter(name=strat, mode="markers", x=[c["step_time"]["step_s"] for c in cs],
                        y=[c["mem_bytes_max"] / 1e9 for c in cs], marker=dict(color=STRATEGY_COLOR.get(strat), size=10),
                        text=[c["spec"]["name"] for c in cs], hovertemplate="%{text}<br>%{x:.3f} s/step, %{y:.1f} GB<extra></extra>")
    front, best = [], float("inf")
    for c in sorted(p.configs, key=lambda c: (c["step_time"]["step_s"], c["mem_bytes_max"])):
        if c["mem_bytes_max"] < best:
            best = c["mem_bytes_max"]
            front.append(c)
    if front:
        fig.add_scatter(name="Pareto front", mode="lines", x=[c["step_time"]["step_s"] for c in front],
                        y=[c["mem_bytes_max"] / 1e9 for c in front], line=dict(color="black", dash="dot"), hoverinfo="skip")
    fig.update_layout(title="Memory vs predicted step time (layouts that fit)", xaxis_title="step time (s)",
                      yaxis_title="worst-rank memory (GB)", **LAYOUT)
    return fig


def breakdown_fig(p: Plan) -> go.Figure:
    labels = [f"#{i + 1} {c['spec']['name'][5:]}" for i, c in enumerate(p.configs)]
    fig = go.Figure()
    for key, name in BREAKDOWN:
        fig.add_bar(name=name, x=labels, y=[c["step_time"][key] for c in p.configs],
                    hovertemplate=f"{name}: %{{y:.3f}} s<extra></extra>")
    fig.update_layout(barmode="stack", title="Predicted step time by component (slowest rank)", yaxis_title="seconds", **LAYOUT)
    return fig


def spec_for_form(p: Plan, index: int) -> ExperimentSpec:
    """The row's full spec for the New-experiment form (predict-only layouts are flagged there by the run checks)."""
    return ExperimentSpec.for_prediction(p.configs[index]["spec"])


# The seeds' scenarios (backend/analytic/textbook/seeds.py: SEED_003): Llama-70B on 4 nodes x 8 A100-80GB; GPT-3 175B on 64.
LLAMA70B = dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, seq_len=4096)
GPT3 = dict(vocab_size=51200, d_model=12288, n_layers=96, n_heads=96, seq_len=2048)
SCENARIOS = [
    {"claim": "Llama 70B on 4 nodes x 8 GPUs: TP8 · DP4", "model": LLAMA70B, "gpus": 32, "global_batch": 64,
     "parallel": {"strategy": "ddp", "tp": 8, "pp": 1, "dp": 4}},
    {"claim": "Llama 70B on 4 nodes x 8 GPUs: TP8 · PP4", "model": LLAMA70B, "gpus": 32, "global_batch": 64,
     "parallel": {"strategy": "ddp", "tp": 8, "pp": 4, "dp": 1}},
    {"claim": "GPT-3 175B on 64 GPUs: DP8 · PP4 · TP2 + ZeRO-2", "model": GPT3, "gpus": 64, "global_batch": 512,
     "parallel": {"strategy": "zero2", "tp": 2, "pp": 4, "dp": 8}},
]


def scenario_verdicts(hardware: str = "a100-80gb-sxm", gpus_per_node: int = 8, micro_batch: int = 1,
                      recompute: str = "full", with_best: bool = True) -> list[dict[str, Any]]:
    """Each seed scenario: fits or not (exact worst-rank memory vs the device minus the reserve), predicted step time,
    and the planner's own best layout for the same model, GPUs and batch."""
    hw = get_hardware(hardware)
    budget = budget_bytes(hw.memory_bytes)
    out, bests = [], {}
    for sc in SCENARIOS:
        par = {**sc["parallel"], "world_size": sc["gpus"], "pp_schedule": "1f1b", "virtual_stages": 1}
        data = {"name": sc["claim"], "model": sc["model"], "parallel": par,
                "train": {"global_batch": sc["global_batch"], "micro_batch": micro_batch, "precision": "bf16-mixed",
                          "recompute": recompute}}
        spec = ExperimentSpec.for_prediction(data)
        worst, _ = worst_rank_bytes(light_spec(spec.model_dump(mode="json")))
        st = step_time(spec, hw, gpus_per_node=gpus_per_node).summary
        row = {"claim": sc["claim"], "fits": worst <= budget, "memory GB": worst / 1e9, "budget GB": budget / 1e9,
               "step s": st["step_s"], "MFU %": 100 * st["mfu"], "planner best": "", "best step s": None, "best memory GB": None}
        if with_best:
            key = (json.dumps(sc["model"], sort_keys=True), sc["gpus"], sc["global_batch"])
            if key not in bests:
                bests[key] = plan(ModelSpec(**sc["model"]), gpus=sc["gpus"], gpus_per_node=gpus_per_node, hw=hw,
                                  global_batch=sc["global_batch"], top=1, enough=8)
            best = bests[key]
            if best.configs:
                c = best.configs[0]
                s = c["spec"]
                row.update({"planner best": f"{s['name'][5:]}, b={s['train']['micro_batch']}, {s['train']['recompute']} recompute"
                            + (f", {s['parallel']['pp_schedule']}" if s["parallel"]["pp"] > 1 else ""),
                            "best step s": c["step_time"]["step_s"], "best memory GB": c["mem_bytes_max"] / 1e9})
        out.append(row)
    return out


def run_step_prediction(res: Any, engine: Any) -> dict[str, Any] | None:
    """Predicted step time and interval of a finished run on its hardware, with the newest calibration for that
    hardware (None when the run has no timing or its device has no profile). CPU runs use the "cpu" profile."""
    from backend.calibration.fit import extrapolation
    from backend.calibration.store import latest_for, measured_step_s

    if res is None or not res.per_rank or not any(r.step_s for r in res.per_rank):
        return None
    device = str((res.env or {}).get("device", "cpu")).lower()
    key = "cpu" if "cpu" in device or str(res.spec.runtime.device) == "cpu" else None
    if key is None or key not in load_profiles():
        return None
    hw = get_hardware(key)
    cal = latest_for(engine, key)
    band = tuple(cal["band"]) if cal else None
    if cal:
        hw = hw.with_tunables(**cal["params"])
    st = step_time(res.spec, hw, band=band).summary
    measured = measured_step_s(res)
    return {"hardware": key, "calibration": cal["id"] if cal else None, "predicted_s": st["step_s"], "low_s": st["low_s"],
            "high_s": st["high_s"], "measured_s": measured, "error_pct": (st["step_s"] - measured) / measured * 100,
            "inside": st["low_s"] <= measured <= st["high_s"],
            "extrapolation": extrapolation(res.spec, cal["ranges"], hw.gpus_per_node) if cal else []}


# "Verify scaled-down": a CPU proxy of a planned layout, same parallel family, small enough to run here.
PROXY_MODEL = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=64)


def scaled_down_spec(config: dict[str, Any]) -> tuple[ExperimentSpec | None, list[str]]:
    """The layout's family (dp flavour, tp/pp/ep > 1 or not, schedule, v, SP, recompute) on <= 4 CPU ranks and a
    small model: (spec, []) or (None, why it cannot run here, with the run checks' arithmetic). At most 4 ranks: a
    layout with tp, pp and dp > 1 keeps tp = pp = 2 and drops dp to 1, so its data-parallel sharding goes unexercised."""
    from backend.spec import validate_spec

    s, par = config["spec"], config["spec"]["parallel"]
    tp, pp, ep = min(par["tp"], 2), min(par["pp"], 2), min(par.get("ep", 1), 2)
    dp = max(ep, min(par["dp"], 4 // (tp * pp)))
    v = par["virtual_stages"]
    mb = pp * 2 if pp > 1 else 2
    data = {"name": f"verify {s['name'][5:]}", "model": {**PROXY_MODEL, "n_layers": max(4, pp * v)},
            "train": {"global_batch": 2 * dp * mb, "micro_batch": 2, "recompute": s["train"]["recompute"], "steps": 5},
            "parallel": {"strategy": par["strategy"], "world_size": tp * pp * dp, "dp": dp, "tp": tp, "pp": pp, "ep": ep,
                         "sequence_parallel": par["sequence_parallel"] and tp > 1, "pp_schedule": par["pp_schedule"],
                         "virtual_stages": v}}
    if ep > 1:
        data["model"].update(n_experts=4, top_k=2)
    return validate_spec(data)


def verify_tag(config: dict[str, Any]) -> str:
    import hashlib

    return "verify-" + hashlib.sha1(json.dumps(config["spec"], sort_keys=True).encode()).hexdigest()[:10]


def verify_frame(engine: Any, tag: str) -> pd.DataFrame:
    """The proxy runs of one layout: status, measured vs predicted step time with the interval."""
    from db import queries as q

    rows = []
    for r in q.list_experiments(engine, tag=[tag]):
        d = q.get_experiment(engine, r["id"])
        pred = run_step_prediction(d["result"], engine) if d["status"] == "ok" else None
        rows.append({"run": r["id"], "status": r["status"], "world": r["world_size"],
                     "measured s": pred["measured_s"] if pred else None, "predicted s": pred["predicted_s"] if pred else None,
                     "error %": pred["error_pct"] if pred else None,
                     "interval": f"{pred['low_s']:.3f}–{pred['high_s']:.3f}" if pred else "",
                     "inside": pred["inside"] if pred else None})
    return pd.DataFrame(rows)
