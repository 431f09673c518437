"""The New-experiment form as a flat dict of widget values, and its conversion to/from an ExperimentSpec."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from backend.hf.config import from_hf_config
from backend.presets import PRESETS as PUBLISHED
from backend.presets import scaled_for_cpu
from backend.recompute_policy import KINDS, spelled
from backend.recompute_policy import parse as parse_recompute
from backend.spec import (  # issue 14
    AttentionImpl,
    Bias,
    ExperimentSpec,
    Framework,
    Mlp,
    MoeDispatcher,
    Norm,
    Offload,
    Optimizer,
    Positions,
    Precision,
    RouterScore,
    Strategy,
    WindowKind,
    dims,
    validate_spec,
)
from dashboard import kept_fields, stack_form

_GPT = dict(n_kv_heads=0, ffn_hidden=0, n_experts=0, top_k=2, norm="layernorm", mlp="gelu", positions="learned",
            tie_embeddings=False, bias="all", attention="math", expert_ffn_hidden=0, n_shared_experts=0,
            shared_ffn_hidden=0, shared_expert_gate=False)
FAMILY_2026 = dict(attn_head_dim=0, qk_norm=False, attention_sinks=False, sandwich_norm=False, scale_embeddings=False,
                   q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
                   first_dense_layers=0, moe_every=1, router_score="softmax", router_bias=False,
                   router_balance_bias=False, expert_groups=1, topk_groups=1, window=0, window_kind="sliding",
                   global_every=0, global_layers_nope=False)
"""The 2026 families' fields (issue 24) with GPT's values, 0 for None where a widget shows 0."""
MOE_RUN = dict(capacity_factor=0.0, moe_pad_to_capacity=False, moe_aux_loss_coeff=0.0, moe_dispatcher="alltoall",
               moe_grouped_gemm=False, moe_imbalance=1.0)
"""How a MoE model's tokens reach its experts (capacity, padding, aux loss, dispatcher, grouped GEMMs, the routing
imbalance the prediction assumes), with the spec's defaults (capacity 0 = dropless): kept through clone and re-run."""
_GPT.update(FAMILY_2026)
_GPT.update(MOE_RUN)


def _published(name: str) -> dict[str, Any]:
    """A backend.presets shape as flat form values (0 for the None fields the widgets show as 0)."""
    fields = dict(_GPT)
    fields.update({k: v for k, v in PUBLISHED[name].model.items()})
    return {k: (0 if fields.get(k) is None and k in ZERO_MEANS_NONE else fields.get(k)) for k in MODEL_KEYS}


def preset_label(name: str) -> str:
    n = PUBLISHED[name].published_params
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    return f"{name} ({size} params{', rounded' if PUBLISHED[name].approx else ''}, published shape)"


# Shapes for the form. The CPU shapes run here in seconds; the published ones (backend/presets.py, parameter
# counts equal to the published counts) are for prediction, or run scaled down with "run it here".
PRESETS: dict[str, dict[str, Any]] = {
    "tiny (runs in seconds on CPU)": dict(_GPT, vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=32),
    "small (4 layers)": dict(_GPT, vocab_size=512, d_model=128, n_layers=4, n_heads=4, seq_len=64),
    "tiny MoE (4 experts, top-2)": dict(_GPT, vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=32,
                                        n_experts=4),
}
PRESET_SOURCES: dict[str, str] = {}  # form label -> backend.presets name
DEFAULT_PRESET = next(iter(PRESETS))

MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "seq_len", "n_experts",
              "top_k", "norm", "mlp", "positions", "tie_embeddings", "bias", "attention", "expert_ffn_hidden",
              "n_shared_experts", "shared_ffn_hidden", "shared_expert_gate") + tuple(FAMILY_2026) + tuple(MOE_RUN)
TRAIN_KEYS = ("global_batch", "micro_batch", "microbatches", "steps", "warmup_steps", "precision", "fp8_recipe",
              "optimizer", "lr", "recompute", "seed")
PARALLEL_FIELDS = dims.form_fields(dims.DIMS)
"""The parallel dimensions' fields the form shows (backend/spec/dims.py: degrees, then their options)."""
PARALLEL_KEYS = ("strategy", "world_size", *(f.name for f in PARALLEL_FIELDS))
# Widgets use 0 for "derive it": None in the spec.
ZERO_MEANS_NONE = {"n_kv_heads", "ffn_hidden", "microbatches", "expert_ffn_hidden", "shared_ffn_hidden",
                   "attn_head_dim", "q_lora_rank", "kv_lora_rank", "window", "capacity_factor"}
FAMILY_CHOICES = {"norm": [v.value for v in Norm], "mlp": [v.value for v in Mlp],
                  "positions": [v.value for v in Positions],
                  "bias": [v.value for v in Bias], "attention": [v.value for v in AttentionImpl],
                  "router_score": [v.value for v in RouterScore], "window_kind": [v.value for v in WindowKind],
                  "moe_dispatcher": [v.value for v in MoeDispatcher]}

for _name in PUBLISHED:
    PRESETS[preset_label(_name)] = _published(_name)
    PRESET_SOURCES[preset_label(_name)] = _name

STRATEGIES = [s.value for s in Strategy]
PRECISIONS = [p.value for p in Precision]
OPTIMIZERS = [o.value for o in Optimizer]
RECOMPUTES = list(KINDS)
"""Recompute policies (backend/recompute_policy.py); layers / block / uniform take the form's `recompute_layers`."""

STRATEGY_HELP = {
    "ddp": "DDP: full replica per rank, gradients all-reduced",
    "zero1": "ZeRO-1: optimizer state sharded (ZeroRedundancyOptimizer; with TP/PP Megatron's distributed optimizer)",
    "zero2": "ZeRO-2: optimizer state + gradients sharded",
    "zero3": "ZeRO-3: params + grads + optimizer sharded",
    "fsdp": "FSDP2 fully_shard (ZeRO-3 semantics)",
    "tp": "Tensor parallel (Megatron column/row split)",
    "pp": "Pipeline parallel (torch.distributed.pipelining schedules)",
    "ep": "Expert parallel (MoE experts split over ranks, all-to-all)",
}


# Issue 14: which framework runs the step, and what it offloads (backend/spec/framework_support.py says which
# framework runs which strategy; the form shows the refusal with its reason before anything is submitted).
FRAMEWORKS = [f.value for f in Framework]
OFFLOADS = [o.value for o in Offload]
FRAMEWORK_HELP = {
    "torch": "torch-native (DDP, FSDP2, DTensor TP, pipelining)",
    "deepspeed": "DeepSpeed ZeRO engine (stages 0-3, CPU offload)",
    "jax": "JAX/XLA GSPMD on virtual CPU devices (dp, fsdp, tp, dp×tp)",
}
OFFLOAD_HELP = {
    "none": "no offload",
    "optimizer": "optimizer state + fp32 master on CPU (DeepSpeed offload_optimizer)",
    "params": "params too (DeepSpeed offload_param, torch FSDP2 CPUOffloadPolicy)",
}


def default_form() -> dict[str, Any]:
    v: dict[str, Any] = dict(PRESETS[DEFAULT_PRESET])
    v.update(
        name="", preset=DEFAULT_PRESET, strategy="ddp", world_size=2,
        **{f.name: str(f.default) if isinstance(f.default, StrEnum) else f.default for f in PARALLEL_FIELDS},
        global_batch=8, micro_batch=2, microbatches=0, steps=3, warmup_steps=1,
        precision="fp32", fp8_recipe="tensorwise", optimizer="adamw", lr=1e-3, recompute="none", recompute_layers=2,
        seed=0, timeout_s=600.0, device_mem_gb=80.0, executor="local", nnodes=1, run_here=False, source=None,
        source_model=None, kept={},
    )
    v.update(framework="torch", offload="none")
    v.update(stack_form.defaults())  # issue 34: the stack and its settings (dashboard/stack_form.py)
    return v


def apply_preset(label: str) -> dict[str, Any]:
    """Form values a preset sets: its shape, and its source when it is a published one."""
    out = dict(PRESETS[label])
    name = PRESET_SOURCES.get(label)
    out["source"] = {"preset": name} if name else None
    out["source_model"] = dict(PRESETS[label]) if name else None
    return out


def apply_hf_config(cfg: dict[str, Any], *, file: str, seq_len: int | None = None) -> tuple[dict[str, Any], list[str]]:
    """Form values from an uploaded Hugging Face config.json (raises HFConfigError naming a refused field)."""
    model, notes = from_hf_config(cfg, seq_len=seq_len, file=file)
    source, kept = model.pop("source"), kept_fields.of_model(model)  # the config's norm epsilon: no widget shows it
    out = dict(_GPT) | model
    out = {k: (0 if out.get(k) is None and k in ZERO_MEANS_NONE else out.get(k)) for k in MODEL_KEYS}
    return out | {"source": source, "source_model": dict(out), "preset": "custom", "kept": kept}, notes


def model_source(v: dict[str, Any]) -> dict[str, Any] | None:
    """The model's source, marked edited when a shape field no longer matches what the preset / config gave."""
    src, shape = v.get("source"), v.get("source_model")
    if not src:
        return None
    if shape and any(v.get(k) != x for k, x in shape.items()):
        return dict(src, edited=True)
    return src


def form_to_spec_dict(v: dict[str, Any]) -> dict[str, Any]:
    """Flat widget values -> nested spec dict (validate with validate_spec)."""

    def val(k: str) -> Any:
        x = v.get(k)
        return None if (k in ZERO_MEANS_NONE and not x) else x

    parallel = {k: val(k) for k in PARALLEL_KEYS if k in v}
    parallel["offload"] = v.get("offload") or "none"
    model = {k: val(k) for k in MODEL_KEYS if k in v} | {"source": model_source(v)}
    name = v.get("name") or ""
    if v.get("run_here"):  # "run it here": the same family, scaled down for the CPU ranks
        full, model = model, scaled_for_cpu(model)
        name = name or scaled_name(full, model)
    out = {
        "framework": v.get("framework") or "torch",
        "name": name,
        "model": model,
        "train": {k: val(k) for k in TRAIN_KEYS if k in v} | (
            {"recompute": spelled(str(v["recompute"]), int(v.get("recompute_layers") or 1))} if "recompute" in v
            else {})
        | (stack_form.to_spec(v) if "stack" in v else {}),
        "parallel": parallel,
        "runtime": {"timeout_s": float(v.get("timeout_s") or 600.0), "executor": v.get("executor") or "local",
                    "nnodes": int(v.get("nnodes") or 1) if v.get("executor") == "slurm" else 1},
    }
    kept_fields.merge_into(out, v.get("kept"), bool(v.get("run_here")))  # the loaded spec's fields no widget shows
    return out


SHAPE_ROWS = (("d_model", "hidden size h"), ("n_layers", "layers L"), ("n_heads", "attention heads"),
              ("n_kv_heads", "KV heads"), ("ffn_hidden", "MLP hidden"), ("seq_len", "sequence length"),
              ("vocab_size", "vocabulary"), ("n_experts", "MoE experts"), ("top_k", "experts per token"),
              ("expert_ffn_hidden", "expert hidden"), ("shared_ffn_hidden", "shared expert hidden"))


def run_here_rows(v: dict[str, Any]) -> list[dict[str, str]]:
    """What "Run it here" runs instead of the form's full shape: one row per shape field (full, runs here, parameters),
    so the scaled shape (and a GQA group that no longer fits) is never silent."""
    from backend.analytic.params import count_params
    from backend.spec import ModelSpec

    full = form_to_spec_dict(v | {"run_here": False})["model"]
    small = form_to_spec_dict(v | {"run_here": True})["model"]
    moe_only = ("n_experts", "top_k", "expert_ffn_hidden", "shared_ffn_hidden")
    rows = [{"field": label, "full size": _shape_value(full, k), "runs here": _shape_value(small, k)}
            for k, label in SHAPE_ROWS if (full.get(k) or small.get(k))
            and (full.get("n_experts") or k not in moe_only)]
    try:
        counts = [f"{count_params(ModelSpec(**{k: x for k, x in m.items() if k != 'source'})):,}"
                  for m in (full, small)]
    except ValueError:
        counts = ["–", "–"]
    return rows + [{"field": "parameters", "full size": counts[0], "runs here": counts[1]}]


def gqa_note(v: dict[str, Any]) -> str | None:
    """Why the scaled model has no GQA when the full one has it (its group of query heads per KV head does not fit)."""
    full = form_to_spec_dict(v | {"run_here": False})["model"]
    small = form_to_spec_dict(v | {"run_here": True})["model"]
    heads, kv = full.get("n_heads") or 1, full.get("n_kv_heads")
    if kv and kv != heads and not small.get("n_kv_heads"):
        return (f"GQA: the full model's {heads // kv} query heads per KV head do not divide the {small['n_heads']} "
                "heads that run here, so the scaled model uses plain multi-head attention.")
    return None


def _shape_value(model: dict[str, Any], key: str) -> str:
    value = model.get(key)
    if key == "n_kv_heads" and not value:
        return f"{model.get('n_heads')} (no GQA)"
    if key == "ffn_hidden" and not value:
        return f"{4 * model.get('d_model', 0)} (4h)"
    return "–" if value is None else f"{value:,}"


def scaled_name(full: dict[str, Any], small: dict[str, Any]) -> str:
    """'llama-3-70b scaled for CPU: h64 L2 a4 kv1' (the run's default name when "Run it here" is on)."""
    src = full.get("source") or {}
    base = src.get("preset") or src.get("file") or f"h{full.get('d_model')} L{full.get('n_layers')}"
    kv = f" kv{small['n_kv_heads']}" if small.get("n_kv_heads") else ""
    moe = f" e{small['n_experts']}" if small.get("n_experts") else ""
    return f"{base} scaled for CPU: h{small['d_model']} L{small['n_layers']} a{small['n_heads']}{kv}{moe}"


def form_to_spec(v: dict[str, Any], *, predict_only: bool = False) -> tuple[ExperimentSpec | None, list[str]]:
    """predict_only: also accept layouts this engine can only predict (backend.spec.checks.run_blockers says why)."""
    return validate_spec(form_to_spec_dict(v), predict_only=predict_only)


def spec_to_form(spec: ExperimentSpec) -> dict[str, Any]:
    """An existing spec back into widget values (re-run / clone into the form)."""
    v = default_form()
    m, t, p = spec.model, spec.train, spec.parallel
    v.update({k: (str(x) if hasattr(x, "value") else x) for k in MODEL_KEYS for x in [getattr(m, k)]})
    v["source"] = m.source
    v.update({k: getattr(t, k) for k in TRAIN_KEYS})
    v.update({k: getattr(p, k) for k in PARALLEL_KEYS})
    for k in ZERO_MEANS_NONE:
        v[k] = v[k] or 0
    for k, default in MOE_RUN.items():  # float widgets take floats only (0, not None, for dropless)
        v[k] = float(v[k]) if isinstance(default, float) else v[k]
    for k in ("precision", "fp8_recipe", "optimizer", "recompute", "strategy", "router_score", "window_kind",
              "moe_dispatcher",
              *(f.name for f in PARALLEL_FIELDS if issubclass(f.kind, StrEnum))):
        v[k] = str(v[k])
    v["recompute"], layers = parse_recompute(v["recompute"])
    v["recompute_layers"] = layers or 2
    # A derived degree is re-derived from world_size for the pure strategies.
    if p.strategy in dims.pure_strategies(dims.DIMS):
        v[p.strategy.value] = 1 if getattr(p, p.strategy.value) == p.world_size else getattr(p, p.strategy.value)
    v["microbatches"] = 0
    v["name"], v["timeout_s"], v["preset"] = spec.name, spec.runtime.timeout_s, preset_of(v)
    v["framework"], v["offload"] = str(spec.framework), str(p.offload)
    v["executor"], v["nnodes"] = str(spec.runtime.executor), spec.runtime.nnodes
    v.update(stack_form.to_form(t))
    v["kept"] = kept_fields.of_spec(spec)
    # The shape the source gave, so an edit is stored as {"edited": true} (before, a re-run's edited shape kept the
    # preset's or config's name as if unchanged).
    v["source_model"] = {k: v[k] for k in MODEL_KEYS} if m.source and not m.source.get("edited") else None
    return v


def preset_of(v: dict[str, Any]) -> str:
    for name, shape in PRESETS.items():
        if all(v.get(k) == x for k, x in shape.items()):
            return name
    return "custom"


def attention_comparison(spec: ExperimentSpec) -> dict[str, int] | None:
    """Largest per-rank predicted activation bytes with math vs flash attention for this spec (None when the
    other variant does not validate): what the attention kernel choice changes. A stack other than shardlab keeps
    what its attention kernel saves (memory/stack_activations.py), so its kernel follows: eager vs flash2."""
    from backend.analytic.estimate import estimate

    out = {}
    for impl in ("math", "flash"):
        data = spec.model_dump()
        data["model"]["attention"] = impl
        if str(spec.train.stack) != "shardlab":
            data["train"]["attention_kernel"] = "eager" if impl == "math" else "flash2"
        other, problems = validate_spec(data, predict_only=True)
        if other is None:
            return None
        out[impl] = estimate(other).worst(key=lambda r: r.activations_bytes).activations_bytes
    return out


def describe(spec: ExperimentSpec) -> str:
    """One-line label: strategy, degrees, world."""
    p = spec.parallel
    parts = [str(p.strategy), f"world {p.world_size}", f"dp{p.dp}"]
    if str(spec.framework) != "torch":
        parts.insert(0, str(spec.framework))
    if str(p.offload) != "none":
        parts.append(f"offload {p.offload}")
    if p.tp > 1:
        parts.append(f"tp{p.tp}" + ("+sp" if p.sequence_parallel else ""))
    if p.pp > 1:
        parts.append(f"pp{p.pp} {p.pp_schedule}" + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else ""))
    if p.ep > 1:
        parts.append(f"ep{p.ep}")
    if p.cp > 1:
        parts.append(f"cp{p.cp} {p.cp_rotate}" + ("" if p.cp_load_balance else " contiguous"))
    return " · ".join(parts + dims.unnamed_parts(dims.DIMS, p.degrees(), ("dp", "tp", "pp", "ep", "cp")))


MAX_TIMEOUT_S = float(7 * 24 * 3600)
"""The spec's longest runtime.timeout_s (backend/spec/runtime_spec.py)."""
RUN_ON = {"local": "This machine (the worker's torchrun)", "slurm": "SLURM cluster (sbatch; shardlab.toml [slurm])"}


def placement(v: dict[str, Any]) -> str:
    """"2 node(s) x 2 rank(s) per node" for the form's caption."""
    nodes = int(v.get("nnodes") or 1) if v.get("executor") == "slurm" else 1
    world = int(v.get("world_size") or 1)
    return f"{nodes} node(s) x {world / nodes:g} rank(s) per node"
