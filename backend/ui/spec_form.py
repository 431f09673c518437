"""The New-experiment form as a flat dict of widget values, and its conversion to/from an ExperimentSpec."""

from __future__ import annotations

from typing import Any

from backend.spec import Framework, Offload  # issue 14
from backend.spec import (
    ExperimentSpec,
    Optimizer,
    Precision,
    Recompute,
    Schedule,
    Strategy,
    validate_spec,
)

# Shapes for the form. The CPU presets run here in seconds; the large ones are for prediction
# (the model is a GPT with a 4h GELU MLP, so "-like" shapes only approximate the named models).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny (runs in seconds on CPU)": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=0, ffn_hidden=0, seq_len=32, n_experts=0, top_k=2),
    "small (4 layers)": dict(vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=0, ffn_hidden=0, seq_len=64, n_experts=0, top_k=2),
    "tiny MoE (4 experts, top-2)": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=0, ffn_hidden=0, seq_len=32, n_experts=4, top_k=2),
    "GPT-2 124M-like": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, n_kv_heads=0, ffn_hidden=0, seq_len=1024, n_experts=0, top_k=2),
    "LLaMA-7B-like": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=0, ffn_hidden=11008, seq_len=4096, n_experts=0, top_k=2),
    "LLaMA-70B-like (GQA 8)": dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, seq_len=4096, n_experts=0, top_k=2),
}
DEFAULT_PRESET = next(iter(PRESETS))

MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "seq_len", "n_experts", "top_k")
TRAIN_KEYS = ("global_batch", "micro_batch", "microbatches", "steps", "warmup_steps", "precision", "optimizer", "lr", "recompute", "seed")
PARALLEL_KEYS = ("strategy", "world_size", "tp", "pp", "ep", "sequence_parallel", "pp_schedule", "virtual_stages")
# Widgets use 0 for "derive it": None in the spec.
ZERO_MEANS_NONE = {"n_kv_heads", "ffn_hidden", "microbatches"}

STRATEGIES = [s.value for s in Strategy]
SCHEDULES = [s.value for s in Schedule]
PRECISIONS = [p.value for p in Precision]
OPTIMIZERS = [o.value for o in Optimizer]
RECOMPUTES = [r.value for r in Recompute]

STRATEGY_HELP = {
    "ddp": "DDP: full replica per rank, gradients all-reduced",
    "zero1": "ZeRO-1: optimizer state sharded (ZeroRedundancyOptimizer)",
    "zero2": "ZeRO-2: optimizer state + gradients sharded",
    "zero3": "ZeRO-3: params + grads + optimizer sharded",
    "fsdp": "FSDP2 fully_shard (ZeRO-3 semantics)",
    "tp": "Tensor parallel (Megatron column/row split)",
    "pp": "Pipeline parallel (torch.distributed.pipelining schedules)",
    "ep": "Expert parallel (MoE experts split over ranks, all-to-all)",
}


# Issue 14: which framework runs the step, and what it offloads (backend/frameworks/capabilities.py says which
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
        name="", preset=DEFAULT_PRESET, strategy="ddp", world_size=2, tp=1, pp=1, ep=1,
        sequence_parallel=False, pp_schedule="1f1b", virtual_stages=1,
        global_batch=8, micro_batch=2, microbatches=0, steps=3, warmup_steps=1,
        precision="fp32", optimizer="adamw", lr=1e-3, recompute="none", seed=0,
        timeout_s=600.0, device_mem_gb=80.0, executor="local", nnodes=1,
    )
    v.update(framework="torch", offload="none")
    return v


def form_to_spec_dict(v: dict[str, Any]) -> dict[str, Any]:
    """Flat widget values -> nested spec dict (validate with validate_spec)."""

    def val(k: str) -> Any:
        x = v.get(k)
        return None if (k in ZERO_MEANS_NONE and not x) else x

    parallel = {k: val(k) for k in PARALLEL_KEYS if k in v}
    parallel["offload"] = v.get("offload") or "none"
    return {
        "framework": v.get("framework") or "torch",
        "name": v.get("name") or "",
        "model": {k: val(k) for k in MODEL_KEYS if k in v},
        "train": {k: val(k) for k in TRAIN_KEYS if k in v},
        "parallel": parallel,
        "runtime": {"timeout_s": float(v.get("timeout_s") or 600.0), "executor": v.get("executor") or "local",
                    "nnodes": int(v.get("nnodes") or 1) if v.get("executor") == "slurm" else 1},
    }


def form_to_spec(v: dict[str, Any]) -> tuple[ExperimentSpec | None, list[str]]:
    return validate_spec(form_to_spec_dict(v))


def spec_to_form(spec: ExperimentSpec) -> dict[str, Any]:
    """An existing spec back into widget values (re-run / clone into the form)."""
    v = default_form()
    m, t, p = spec.model, spec.train, spec.parallel
    v.update({k: getattr(m, k) for k in MODEL_KEYS})
    v.update({k: getattr(t, k) for k in TRAIN_KEYS})
    v.update({k: getattr(p, k) for k in PARALLEL_KEYS})
    for k in ZERO_MEANS_NONE:
        v[k] = v[k] or 0
    for k in ("precision", "optimizer", "recompute", "strategy", "pp_schedule"):
        v[k] = str(v[k])
    # A derived degree is re-derived from world_size for the pure strategies.
    if p.strategy in (Strategy.TP, Strategy.PP, Strategy.EP):
        v[p.strategy.value] = 1 if getattr(p, p.strategy.value) == p.world_size else getattr(p, p.strategy.value)
    v["microbatches"] = 0
    v["name"], v["timeout_s"], v["preset"] = spec.name, spec.runtime.timeout_s, preset_of(v)
    v["framework"], v["offload"] = str(spec.framework), str(p.offload)
    v["executor"], v["nnodes"] = str(spec.runtime.executor), spec.runtime.nnodes
    return v


def preset_of(v: dict[str, Any]) -> str:
    for name, shape in PRESETS.items():
        if all(v.get(k) == x for k, x in shape.items()):
            return name
    return "custom"


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
    return " · ".join(parts)


RUN_ON = {"local": "This machine (the worker's torchrun)", "slurm": "SLURM cluster (sbatch; shardlab.toml [slurm])"}


def placement(v: dict[str, Any]) -> str:
    """"2 node(s) x 2 rank(s) per node" for the form's caption."""
    nodes = int(v.get("nnodes") or 1) if v.get("executor") == "slurm" else 1
    world = int(v.get("world_size") or 1)
    return f"{nodes} node(s) x {world / nodes:g} rank(s) per node"
