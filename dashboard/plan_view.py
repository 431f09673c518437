"""Plan page logic: model from a preset or a config.json, the planner's results as a table, a Pareto plot of
memory vs step time coloured by strategy, a stacked time breakdown, and the seeds' scenarios' verdicts."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from backend.analytic.device import RuntimeOverhead
from backend.analytic.estimate import worst_rank_bytes
from backend.analytic.steptime.hardware import get_hardware, load_profiles
from backend.analytic.steptime.model import step_time
from backend.analytic.units import GiB
from backend.planner.capacity import NOTE_PREFIX as CAPACITY_NOTE
from backend.planner.capacity import Factor
from backend.planner.held import PRECISIONS as HELD_PRECISIONS
from backend.planner.held import HeldTraining
from backend.planner.search import STEP_ASSUMES, Plan, plan, planned_attention
from backend.planner.space import light_spec
from backend.planner.why import explain_first, why_text
from backend.spec import ExperimentSpec, ModelSpec, dims
from backend.spec.choices import AttentionImpl, MoeDispatcher
from dashboard.glossary import schedule_label
from dashboard.theme import LAYOUT, STRATEGY_COLOR

BREAKDOWN = (("compute_s", "compute"), ("exposed_comm_s", "exposed communication"), ("bubble_s", "pipeline bubble"),
             ("optimizer_s", "optimizer step"), ("other_s", "other"))
HF_KEYS = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "num_key_value_heads": "n_kv_heads", "intermediate_size": "ffn_hidden", "vocab_size": "vocab_size",
           "n_embd": "d_model", "n_layer": "n_layers", "n_head": "n_heads"}


def hardware_options(engine: Any = None) -> list[str]:
    """The shipped profiles, then the calibrated profiles of this store by name (`calibrate --name`, issue 25)."""
    names: list[str] = []
    if engine is not None:
        from backend.calibration.records import named_profiles

        names = [c["name"] for c in named_profiles(engine)]
    return list(load_profiles()) + [n for n in names if n not in load_profiles()]


def model_from_config(text: str | bytes, seq: int) -> ModelSpec:
    """A Hugging Face config.json's model. A real config (it names its `model_type`) goes through backend.hf.config,
    the one import the CLI and New experiment use (exact family, refused fields named); a bare dict of shape keys
    without a model_type gets a plain GPT block of that shape. Raises ValueError with the reason."""
    from backend.hf.config import from_hf_config, parse_hf_config

    cfg = parse_hf_config(text)
    if "model_type" in cfg:
        fields, _notes = from_hf_config(cfg, seq_len=seq)
        return ModelSpec(**{**fields, "seq_len": seq})
    data = {ours: cfg[theirs] for theirs, ours in HF_KEYS.items() if theirs in cfg}
    missing = {"d_model", "n_layers", "n_heads", "vocab_size"} - set(data)
    if missing:
        raise ValueError(f"config.json lacks {', '.join(sorted(missing))} (looked for {', '.join(HF_KEYS)})")
    bad = [f"{theirs}={cfg[theirs]!r}" for theirs, ours in HF_KEYS.items()
           if theirs in cfg and (isinstance(cfg[theirs], bool) or not isinstance(cfg[theirs], int))]
    if bad:
        raise ValueError(f"config.json: {', '.join(bad)} must be integers")
    from pydantic import ValidationError

    try:
        return ModelSpec(**data, seq_len=seq)
    except ValidationError as e:  # pydantic's bound errors, one line each
        raise ValueError("config.json: " + "; ".join(f"{x['loc'][0]}: {x['msg']}" for x in e.errors())) from None


DEFAULT_KERNEL = "default"
KERNEL_CHOICES = [DEFAULT_KERNEL, "flash", "math"]
"""The Plan page's attention choices: the default (planner.search.planned_attention: flash on a GPU profile) or one."""
PRECISIONS = list(HELD_PRECISIONS)
CP_NOT_SEARCHED = "context parallelism not searched"


def planned_kernel(model: ModelSpec | None, hardware: str, choice: str | None,
                   db_url: str | None = None) -> tuple[str, str]:
    """(kernel, why) the page plans with for its choice (DEFAULT_KERNEL: planned_attention's rule on that profile)."""
    from backend.calibration.records import resolve

    asked = None if choice in (None, DEFAULT_KERNEL) else choice
    try:
        hw, _, _ = resolve(hardware, None, db_url)
    except ValueError as e:
        return asked or "flash", str(e)
    return planned_attention(model if model is not None else ModelSpec(vocab_size=2, d_model=2, n_layers=1, n_heads=1),
                             hw, asked)


def held_training(precision: str, imported: tuple | None) -> HeldTraining:
    """What every layout trains with: the page's precision, and a loaded config's own recompute policy, optimizer and
    fp8 recipe (imported = the page's (model, framework, name, train) of "Plan this model")."""
    if imported is None:
        return HeldTraining(precision=precision)
    _, framework, name, train = imported
    return HeldTraining.of_train(train, precision=precision, source=f"the imported {framework} config")


def run_plan(model: ModelSpec, *, gpus: int, gpus_per_node: int, hardware: str, global_batch: int,
             memory_gb: float | None, top: int, db_url: str | None = None, include_predicted: bool = False,
             attention: str | None = None, held: HeldTraining | None = None, reserve_gb: float | None = None,
             fragmentation: float | None = None, capacity_factors: tuple[Factor, ...] | None = None) -> Plan:
    """The planner on a profile, or on a calibrated profile's name (its fitted parameters and interval); the plan
    carries `profile_used` (calibration/usage.calibration_used: profile, calibration, LOO error, extrapolation) and
    `attention_why`. `attention`: the kernel to plan with (None: planner.search.planned_attention's default, flash on a
    GPU profile); context parallelism is searched with flash only. `held`: the training settings (planner/held.py).
    reserve_gb / fragmentation: the fit rule's overrides (`plan --reserve-gb / --fragmentation`; check them first with
    allowance_check). capacity_factors: a MoE model's factors to search (capacity_choice; None: its own)."""
    from backend.calibration.records import resolve
    from backend.calibration.usage import calibration_used

    hw, band, cal = resolve(hardware, None, db_url)
    kernel, why = planned_attention(model, hw, attention)
    model = model.model_copy(update={"attention": AttentionImpl(kernel)})
    res = plan(model, gpus=gpus, gpus_per_node=gpus_per_node, hw=hw, global_batch=global_batch,
               memory_bytes=memory_gb * 1e9 if memory_gb else None, top=top, band=band,
               include_predicted=include_predicted, held=held, fragmentation=fragmentation,
               reserve_bytes=None if reserve_gb is None else reserve_gb * 1e9, capacity_factors=capacity_factors)
    res.profile_used = calibration_used(hw, cal, res.configs, gpus_per_node)
    res.attention_why = why
    res.why_first = explain_first(res.configs, hw, gpus_per_node, res.device_bytes, res.overhead)
    return res


DISPATCHERS = [d.value for d in MoeDispatcher]
"""A MoE model's token dispatcher choices (`plan --moe-dispatcher`): every layout of the search runs it."""


def with_dispatcher(model: ModelSpec, dispatcher: str | None) -> ModelSpec:
    """The model with the dispatcher the page picked (None: its own)."""
    return model if dispatcher is None else model.model_copy(update={"moe_dispatcher": MoeDispatcher(dispatcher)})


DEFAULT_SLACK = RuntimeOverhead().fragmentation_frac
RESERVE_LABEL = "Reserve per GPU, GB (empty = CUDA context + NCCL buffers)"
SLACK_LABEL = "Allocator slack, fraction of the fullest moment"
FIELD_NAMES = {"memory": "GPU memory", "reserve": "Reserve per GPU", "fragmentation": "Allocator slack"}
"""The page's fields as its messages name them (the CLI names its flags: planner/allowance.FLAGS)."""


def allowance_check(hardware: str, *, memory_gb: float | None, reserve_gb: float | None, fragmentation: float | None,
                    db_url: str | None = None) -> str | None:
    """Why the page's allowance fields cannot describe a device, or None: `plan`'s own checks (planner/allowance.py),
    on the device size the plan would use (the GB field, else the profile's)."""
    from backend.calibration.records import resolve
    from backend.planner.allowance import allowance_problem, device_bytes_of, reserve_problem

    problem = allowance_problem(memory_gb, reserve_gb, fragmentation, FIELD_NAMES)
    if problem or reserve_gb is None:
        return problem
    try:
        hw, _, _ = resolve(hardware, None, db_url)
    except ValueError:  # the Search says why the profile is unknown
        return None
    return reserve_problem(reserve_gb, device_bytes_of(hw, memory_gb * 1e9 if memory_gb else None), hardware,
                           bool(memory_gb), FIELD_NAMES)


def planned_line(p: Plan) -> str:
    """What the shown plan was searched with, in words: the attention kernel (and why) and the held settings."""
    held = next((n for n in p.notes if n.startswith("every layout trains with ")), "")
    why = getattr(p, "attention_why", "")
    return f"Planned with {p.attention} attention" + (f" ({why})" if why else "") + (f"; {held}." if held else ".")


def fit_rule_line(p: Plan) -> str:
    """How the page judged "fits", in words: estimate's and New experiment's one rule (analytic/device.fits_device),
    with the allowance the plan used (a reserve field's: planner/allowance.overhead_of, no NCCL term)."""
    o = p.overhead
    if p.device != "cuda":
        return ("A layout fits when its worst rank's memory at its fullest moment fits the "
                f"{p.device_bytes / GiB:.1f} GiB per GPU.")
    fixed = (f"the CUDA context ({o.cuda_context_bytes / 2**20:.0f} MiB) + NCCL buffers "
             f"({o.nccl_bytes_per_communicator() / 2**20:.0f} MiB per communicator)" if o.nccl_bytes_per_communicator()
             else f"a reserve of {o.cuda_context_bytes / 1e9:g} GB per GPU (in place of the CUDA context and NCCL "
                  "buffers)")
    return (f"A layout fits when its worst rank's memory at its fullest moment + {fixed} + allocator slack "
            f"({o.fragmentation_frac * 100:.3g}% of the fullest moment) fits the "
            f"{p.device_bytes / GiB:.1f} GiB per GPU (column 'needs GiB'): the rule of New experiment's fit check and "
            "`estimate --hardware`.")


def warning_notes(p: Plan) -> list[str]:
    """The notes a person must not miss: cp not searched (a long sequence without flash), failed internal checks and
    what the step times assume in place of what the layouts ask for."""
    return [n[0].upper() + n[1:] for n in p.notes
            if n.startswith((CP_NOT_SEARCHED, "internal check failed", STEP_ASSUMES))]


CAPACITY_OPTIONS: tuple[Factor, ...] = (None, 0.5, 0.75, 1.0, 1.1, 1.25, 1.5, 2.0)
"""The Plan page's capacity factors to pick from (None: dropless), with the model's own added."""


def capacity_options(model: ModelSpec) -> list[Factor]:
    """Dropless first, then ascending; the model's own factor among them."""
    chosen = set(CAPACITY_OPTIONS) | {model.capacity_factor}
    return [None] * (None in chosen) + sorted(f for f in chosen if f is not None)


def capacity_label(factor: Factor) -> str:
    return "none (dropless)" if factor is None else f"{factor:g}"


def capacity_choice(model: ModelSpec | None, picked: list[Factor] | None) -> tuple[Factor, ...] | None:
    """The factors to search for the page's pick: None (the model's own alone, the default plan) for a dense model,
    an empty pick or the model's own factor alone."""
    if model is None or not model.is_moe or not picked or list(picked) == [model.capacity_factor]:
        return None
    return tuple(picked)


def capacity_shown(p: Plan) -> bool:
    """The table shows the capacity factor where one was searched or a layout has one."""
    return len(getattr(p, "capacity_factors", [None])) > 1 or any(c.get("capacity_factor") is not None
                                                                   for c in p.configs)


def capacity_note(p: Plan) -> str | None:
    """The plan's note on ranked layouts that drop tokens (planner/capacity.drop_note), capitalised; None if none."""
    note = next((n for n in p.notes if n.startswith(CAPACITY_NOTE)), None)
    return None if note is None else note[0].upper() + note[1:]


def nothing_ranked(p: Plan) -> str:
    """Why a search ranks nothing when no layout was left out or untimed: no layout divides the model and batch
    (nothing was searched; before, the page said "no layout fits" as if memory were short), or none fits: the closest
    layout and how far off it is (Plan.none_fit, what `plan` prints)."""
    if p.searched == 0:
        return ("No layout to search: " + "; ".join(p.notes) + ". Change the GPU count, global batch or model so "
                "that its degrees divide them.")
    none_fit = getattr(p, "none_fit", None)  # planner/none_fit.py: the closest layout, the CLI's words
    return none_fit["text"] if none_fit else "No layout fits: more GPUs, a smaller batch per GPU, or more memory."


def other_notes(p: Plan) -> list[str]:
    shown = ("every layout trains with ", CP_NOT_SEARCHED, "internal check failed", CAPACITY_NOTE, STEP_ASSUMES)
    return [n for n in p.notes if not n.startswith(shown)]


def search_label(name: str, model: ModelSpec | None, *, gpus: int, hardware: str, global_batch: int,
                 memory_gb: float | None) -> str:
    """What a search was for, in words (shown when the results on screen no longer match the inputs)."""
    if model is None:
        return f"{name} (not loaded)"
    mem = f", {memory_gb:g} GB per GPU" if memory_gb else ""
    return f"{name}, seq {model.seq_len}, on {gpus} × {hardware}{mem}, global batch {global_batch}"


MOMENT_LABEL = {"activation_peak": "end of forward", "optimizer_step": "optimizer.step",
                "loss_backward": "loss's backward", "backward": "inside backward"}
"""RankEstimate.moments keys as the Plan table shows them (column "fullest at")."""


def results_frame(p: Plan) -> pd.DataFrame:
    """One row per layout; the column names are glossary.HELP keys (the page shows each as a tooltip)."""
    rows = []
    for i, c in enumerate(p.configs):
        s, t, par = c["spec"], c["step_time"], c["spec"]["parallel"]
        rows.append({"#": i + 1, "strategy": c["strategy"], **{d: par.get(d, 1) for d in dims.degree_names(dims.DIMS)},
                     "memory GiB": c["mem_bytes_max"] / GiB,
                     "fullest at": MOMENT_LABEL.get(c.get("fullest_moment"), "–"),
                     "needs GiB": c["need_bytes"] / GiB if "need_bytes" in c else None,
                     "step s": t["step_s"],
                     "step s (low)": t["low_s"], "step s (high)": t["high_s"], "MFU %": 100 * t["mfu"],
                     "runs": "yes" if c.get("runnable", True) else "prediction only",
                     "micro-batch": s["train"]["micro_batch"], "recompute": s["train"]["recompute"],
                     "schedule": schedule_label(par["pp_schedule"]) if par["pp"] > 1 else None,
                     "virtual stages": par["virtual_stages"] if par["pp"] > 1 else None,
                     "sequence parallel": ("yes" if par["sequence_parallel"] else "no") if par["tp"] > 1 else None,
                     "tokens/s": round(t["tokens_per_s"]), "TFLOP/s per GPU": t["tflops_per_gpu"],
                     "extrapolation": "; ".join(_flags(p, i)) or None})
        if capacity_shown(p):
            rows[-1].update(_capacity_columns(c))
    return pd.DataFrame(rows)


def _capacity_columns(c: dict[str, Any]) -> dict[str, Any]:
    factor, share = c.get("capacity_factor"), c.get("predicted_dropped_share")
    padded = " padded" if factor is not None and c["spec"]["model"].get("moe_pad_to_capacity") else ""
    return {"capacity factor": "dropless" if factor is None else f"{factor:g}{padded}",
            "dropped %": None if share is None else 100 * share}


def _flags(p: Plan, i: int) -> list[str]:
    used = getattr(p, "profile_used", None)
    return used["extrapolation"][i] if used else []


def why_fastest(p: Plan) -> str | None:
    """Why #1 wins (planner/why.py): its largest part, then #2's difference in layout terms and by part of the step,
    signed parts that add up to it (run_plan walks from #1 to #2 on the same profile)."""
    return why_text(p.configs, getattr(p, "why_first", None))


def prediction_only_notes(p: Plan) -> list[str]:
    """'#3, #7: <why>' per distinct reason among the shown layouts that this engine can only predict."""
    by_reason: dict[str, list[int]] = {}
    for i, c in enumerate(p.configs, 1):
        if not c.get("runnable", True):
            by_reason.setdefault(c["why_not"], []).append(i)
    return [f"{', '.join(f'#{i}' for i in rows)}: {why}" for why, rows in by_reason.items()]


def pareto_fig(p: Plan) -> go.Figure:
    """Worst-rank memory vs predicted step time, one colour per data-parallel flavour; the Pareto front drawn."""
    fig = go.Figure()
    for strat in sorted({c["strategy"] for c in p.configs}):
        cs = [c for c in p.configs if c["strategy"] == strat]
        fig.add_scatter(name=strat, mode="markers", x=[c["step_time"]["step_s"] for c in cs],
                        y=[c["mem_bytes_max"] / GiB for c in cs], marker=dict(color=STRATEGY_COLOR.get(strat), size=10),
                        text=[c["spec"]["name"] for c in cs],
                        hovertemplate="%{text}<br>%{x:.3f} s/step, %{y:.1f} GiB<extra></extra>")
    front, best = [], float("inf")
    for c in sorted(p.configs, key=lambda c: (c["step_time"]["step_s"], c["mem_bytes_max"])):
        if c["mem_bytes_max"] < best:
            best = c["mem_bytes_max"]
            front.append(c)
    if front:
        fig.add_scatter(name="Pareto front", mode="lines", x=[c["step_time"]["step_s"] for c in front],
                        y=[c["mem_bytes_max"] / GiB for c in front], line=dict(color="black", dash="dot"),
                        hoverinfo="skip")
    fig.update_layout(title="Memory vs predicted step time (layouts that fit)", xaxis_title="step time (s)",
                      yaxis_title="worst rank at its fullest moment (GiB)", **LAYOUT)
    return fig


def breakdown_fig(p: Plan) -> go.Figure:
    labels = [f"#{i + 1}"
              for i in range(len(p.configs))]  # the table's row numbers: short, never rotated into the legend
    names = [c["spec"]["name"][5:] for c in p.configs]
    fig = go.Figure()
    for key, name in BREAKDOWN:
        fig.add_bar(name=name, x=labels, y=[c["step_time"][key] for c in p.configs], customdata=names,
                    hovertemplate=f"%{{x}} %{{customdata}}<br>{name}: %{{y:.3f}} s<extra></extra>")
    fig.update_layout(barmode="stack", title="Predicted step time by component (slowest rank)",
                      xaxis_title="layout (# in the table)",
                      yaxis_title="seconds", **LAYOUT)
    fig.update_xaxes(type="category")
    return fig


def spec_for_form(p: Plan, index: int) -> ExperimentSpec:
    """The row's full spec for the New-experiment form (predict-only layouts are flagged there by the run checks)."""
    return ExperimentSpec.for_prediction(p.configs[index]["spec"])


# The seeds' scenarios (backend/analytic/textbook/seeds.py: SEED_003): Llama-70B on 4 nodes x 8 A100-80GB;
# GPT-3 175B on 64.
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
    """Each seed scenario: fits or not (its exact worst rank on the profile's ranks by the plan's and estimate's one
    rule, analytic/device.fits_device; "budget GiB": the largest fullest moment that fits it), predicted step time, and
    the planner's own best layout for the same model, GPUs and batch."""
    from backend.analytic.device import fits_device, fullest_budget_bytes, profile_device

    hw = get_hardware(hardware)
    device = profile_device(hw.kind)
    out, bests = [], {}
    for sc in SCENARIOS:
        par = {**sc["parallel"], "world_size": sc["gpus"], "pp_schedule": "1f1b", "virtual_stages": 1}
        data = {"name": sc["claim"], "model": sc["model"], "parallel": par,
                "train": {"global_batch": sc["global_batch"], "micro_batch": micro_batch, "precision": "bf16-mixed",
                          "recompute": recompute}, "runtime": {"device": device}}
        spec = ExperimentSpec.for_prediction(data)
        worst, _ = worst_rank_bytes(light_spec(spec.model_dump(mode="json")))
        st = step_time(spec, hw, gpus_per_node=gpus_per_node).summary
        budget = fullest_budget_bytes(spec.parallel, device, hw.memory_bytes)
        row = {"claim": sc["claim"], "fits": bool(fits_device(worst, spec.parallel, device, hw.memory_bytes)),
               "memory GiB": worst / GiB, "budget GiB": budget / GiB,
               "step s": st["step_s"], "MFU %": 100 * st["mfu"], "planner best": "", "best step s": None,
               "best memory GiB": None}
        if with_best:
            key = (json.dumps(sc["model"], sort_keys=True), sc["gpus"], sc["global_batch"])
            if key not in bests:
                bests[key] = plan(ModelSpec(**sc["model"]), gpus=sc["gpus"], gpus_per_node=gpus_per_node, hw=hw,
                                  global_batch=sc["global_batch"], top=1, enough=8)
            best = bests[key]
            if best.configs:
                c = best.configs[0]
                s = c["spec"]
                row.update({"planner best": f"{s['name'][5:]}, b={s['train']['micro_batch']}, "
                                            f"{s['train']['recompute']} recompute"
                            + (f", {s['parallel']['pp_schedule']}" if s["parallel"]["pp"] > 1 else ""),
                            "best step s": c["step_time"]["step_s"], "best memory GiB": c["mem_bytes_max"] / GiB})
        out.append(row)
    return out


# "Verify scaled-down": a scaled-down run of a planned layout, same parallel family, small enough to run here.
SCALED_DOWN_MODEL = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=64)


def scaled_down_spec(config: dict[str, Any]) -> tuple[ExperimentSpec | None, list[str]]:
    """The layout's family (dp flavour, tp/pp/ep > 1 or not, schedule, v, SP, recompute) on <= 4 CPU ranks and a
    small model: (spec, []) or (None, why it cannot run here, with the run checks' arithmetic). At most 4 ranks: a
    layout with tp, pp and dp > 1 keeps tp = pp = 2 and drops dp to 1, so its data-parallel sharding goes
    unexercised."""
    from backend.spec import validate_spec

    s, par = config["spec"], config["spec"]["parallel"]
    tp, pp, ep = min(par["tp"], 2), min(par["pp"], 2), min(par.get("ep", 1), 2)
    cp = min(par.get("cp", 1), max(1, 4 // (tp * pp * ep)))
    dp = max(1, ep // cp, min(par["dp"], 4 // (tp * pp * cp)))
    v = par["virtual_stages"]
    mb = pp * 2 if pp > 1 else 2
    data = {"name": f"verify {s['name'][5:]}", "model": {**SCALED_DOWN_MODEL, "n_layers": max(4, pp * v)},
            "train": {"global_batch": 2 * dp * mb, "micro_batch": 2, "recompute": s["train"]["recompute"], "steps": 5},
            "parallel": {"strategy": par["strategy"], "world_size": tp * pp * dp * cp, "dp": dp, "tp": tp, "pp": pp,
                         "ep": ep, "cp": cp, "sequence_parallel": par["sequence_parallel"] and tp > 1,
                         "pp_schedule": par["pp_schedule"], "virtual_stages": v}}
    if cp > 1:  # ring attention runs over flash attention
        data["model"]["attention"] = "flash"
    if ep > 1:  # the layout's capacity factor too (a drop at the scaled-down run's own T·k/E)
        data["model"].update(n_experts=4, top_k=2, capacity_factor=s["model"].get("capacity_factor"),
                             moe_pad_to_capacity=bool(s["model"].get("moe_pad_to_capacity")))
    return validate_spec(data)


def verify_tag(config: dict[str, Any]) -> str:
    import hashlib

    return "verify-" + hashlib.sha1(json.dumps(config["spec"], sort_keys=True).encode()).hexdigest()[:10]


def verify_frame(engine: Any, tag: str) -> pd.DataFrame:
    """The verification runs of one layout: status, measured vs predicted step time with the interval, and why a number
    is missing (still queued or running, failed, no 'cpu' profile yet)."""
    from dashboard.steptime_view import run_comparison
    from db import queries as q

    rows = []
    for r in q.list_experiments(engine, tag=[tag]):
        d = q.get_experiment(engine, r["id"])
        pred, why = run_comparison(d["result"], engine) if d["status"] == "ok" else (None, _pending(d))
        rows.append({"run": r["id"], "status": r["status"], "world": r["world_size"],
                     "measured s": pred["measured_s"] if pred else None,
                     "predicted s": pred["predicted_s"] if pred else None,
                     "error %": pred["error_pct"] if pred else None,
                     "interval s": f"{pred['low_s']:.3f} – {pred['high_s']:.3f}" if pred else "",
                     "inside": ("yes" if pred["inside"] else "no") if pred else "", "note": why or ""})
    return pd.DataFrame(rows, columns=VERIFY_COLUMNS)


VERIFY_COLUMNS = ["run", "status", "world", "measured s", "predicted s", "error %", "interval s", "inside", "note"]


def _pending(run: dict[str, Any]) -> str:
    if run["status"] in ("queued", "running"):
        return "waiting for a worker" if run["status"] == "queued" else "running"
    return f"{run['status']}: {run.get('error') or 'no error recorded'}"
