"""DeepSpeed's ds_config.json plus the model's Hugging Face config.json -> a ShardLab spec.

Keys and rules from DeepSpeed's own config (deepspeed/runtime/config.py, zero/config.py, 0.19.8):
train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel world, any one of
them derivable from the other two; "auto" values (the Hugging Face Trainer fills them in) need --gpus.
zero_optimization.stage 0-3 is ddp / zero1 / zero2 / zero3; offload_optimizer to cpu is offload=optimizer,
offload_param (stage 3) offload=params. The spec runs on ShardLab's DeepSpeed engine when the layout is one it
runs (backend/spec/framework_support.py), otherwise it is a torch spec of the same layout, for prediction.
"""

from __future__ import annotations

from typing import Any

from backend.importers.assemble import to_spec
from backend.importers.fields import Flat, Ignore, To, Unmappable, apply_table, choice, flag, flatten
from backend.importers.import_result import ConfigImportError, ImportedConfig, safe_name
from backend.spec.user_text import InputError, load_json_text

_IGNORED = "numerics, logging, monitoring or buffer sizing: no effect on the memory categories or step time predicted"


def _auto_or_int(value: Any) -> int:
    if value == "auto":
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError('expected an integer >= 1 or "auto"')
    return value


def _stage(value: Any) -> str:
    if value not in (0, 1, 2, 3):
        raise ValueError("expected a ZeRO stage 0, 1, 2 or 3")
    return ("ddp", "zero1", "zero2", "zero3")[value]


def _device(value: Any) -> str:
    if value not in ("cpu", "none", "nvme", None):
        raise ValueError("expected cpu, nvme or none")
    return str(value or "none")


TABLE: dict[str, Any] = {
    "train_batch_size": To("ds_global", _auto_or_int),
    "train_micro_batch_size_per_gpu": To("ds_micro", _auto_or_int),
    "gradient_accumulation_steps": To("ds_gas", _auto_or_int),
    "zero_optimization.stage": To("dp_flavour", _stage),
    "zero_optimization.offload_optimizer.device": To("ds_offload_optimizer", _device),
    "zero_optimization.offload_param.device": To("ds_offload_param", _device),
    "bf16.enabled": To("ds_bf16"), "fp16.enabled": To("ds_fp16"), "amp.enabled": To("ds_amp"),
    "optimizer.type": To("ds_optimizer"),
    "tensor_parallel.autotp_size": To("tp"),
    "sequence_parallel_size": Unmappable("DeepSpeed-Ulysses sequence parallelism is not modelled"),
    "zero_optimization.zero_hpz_partition_size": To("ds_hpz"),
    "zero_optimization.zero_quantized_weights": Unmappable("ZeRO++ quantized weights (qwZ) are not modelled"),
    "zero_optimization.zero_quantized_gradients": Unmappable("ZeRO++ quantized gradients (qgZ) are not modelled"),
    "zero_optimization.mics_shard_size": To("ds_mics"),
    "activation_checkpointing.partition_activations": Unmappable("partitioned activation checkpoints "
                                                                 "(Megatron-DeepSpeed models) are not modelled"),
    "activation_checkpointing.cpu_checkpointing": Unmappable("activation checkpoints on the CPU are not modelled"),
    "pipeline": Unmappable("DeepSpeed's pipeline engine needs the model's PipelineModule: not read"),
    "elasticity.enabled": Unmappable("elastic training changes the batch and world as it runs"),
    "data_types.grad_accum_dtype": To("grad_reduce_dtype", choice({"fp32": "fp32", "bf16": "bf16", "fp16": "fp16",
                                                                   "float32": "fp32", "bfloat16": "bf16"})),
    "zero_optimization.overlap_comm": To("grad_reduce_overlap", flag),
    **{f"zero_optimization.{k}": Unmappable(f"{k}: DeepSpeed's bucket / prefetch buffer bytes are not modelled "
                                            "(defaults assumed)") for k in (
        "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
        "stage3_max_reuse_distance", "stage3_param_persistence_threshold", "sub_group_size", "contiguous_gradients")},
    "communication_data_type": Unmappable("the gradient all-reduce dtype apart from the accumulation dtype: predicted "
                                          "as grad_accum_dtype"),
}
PREFIXES: dict[str, Any] = {
    **{p: Ignore(_IGNORED) for p in (
        "optimizer.params", "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
        "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "memory_breakdown",
        "dump_state", "prescale_gradients", "gradient_predivide_factor", "data_types",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "bf16", "fp16", "amp",
        "activation_checkpointing", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
        "seq_parallel_communication_data_type", "checkpoint", "load_universal_checkpoint", "use_node_local_storage",
        "torch_autocast", "timers", "aio", "sparse_gradients", "disable_allgather", "train_micro_batch_size",
        "zero_optimization")},
    "compression_training": Unmappable("compression training changes the model as it trains: not modelled"),
    "curriculum_learning": Unmappable("curriculum learning changes the sequence length as it trains: predicted at the "
                                      "given length"),
    "data_efficiency": Unmappable("data efficiency (curriculum / random-LTD) changes the work per step: not modelled"),
    "autotuning": Ignore("autotuning searches configs: the given one is imported"),
}


def parse(text: str | bytes) -> dict[str, Any]:
    try:
        data = load_json_text(text, "ds_config.json")
    except InputError as e:
        raise ConfigImportError([str(e)]) from None
    if not isinstance(data, dict):
        raise ConfigImportError(["ds_config.json is not a JSON object"])
    return data


def looks_like_ds_config(data: Any) -> bool:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization", "gradient_accumulation_steps")
    return isinstance(data, dict) and any(k in data for k in keys)


def import_ds_config(text: str | bytes, *, gpus: int | None = None, model_config: dict[str, Any] | None = None,
                     file: str = "ds_config.json", seq_len: int | None = None) -> ImportedConfig:
    data = parse(text)
    if model_config is None:
        raise ConfigImportError(["a ds_config.json describes no model: give the model's config.json with "
                                 "--model-config"])
    flat = Flat(flatten(data))
    apply_table(flat, TABLE, prefixes=PREFIXES)
    notes = _model(flat, model_config, seq_len) + _batch(flat, gpus) + _layout(flat)
    flat.put("notes", notes, "deepspeed")
    return to_spec(flat, framework="deepspeed", source_format="deepspeed-json",
                   name=safe_name(f"{model_config.get('model_type', 'model')} "
                                  f"ZeRO-{data.get('zero_optimization', {}).get('stage', 0)} ({file}, DeepSpeed)"),
                   gpus=gpus, spec_frameworks=("deepspeed", "torch"))


def _model(flat: Flat, cfg: dict[str, Any], seq_len: int | None) -> list[str]:
    from backend.hf.config import HFConfigError, from_hf_config

    try:
        model, notes = from_hf_config(cfg, seq_len=seq_len, file="config.json")
    except HFConfigError as e:
        raise ConfigImportError([f"--model-config: {e}"]) from None
    flat.put("model_base", model, "--model-config")
    return notes


def _batch(flat: Flat, gpus: int | None) -> list[str]:
    """DeepSpeed's batch rule: a gradient_accumulation_steps left out is train_batch_size / (micro x world) with a
    GPU count (the layout derives it), 1 without one."""
    glob, micro, gas = flat.get("ds_global"), flat.get("ds_micro"), flat.get("ds_gas", None if gpus else 1)
    given = {k: v for k, v in (("train_batch_size", glob), ("train_micro_batch_size_per_gpu", micro),
                               ("gradient_accumulation_steps", gas)) if v not in (None, -1)}
    if micro in (None, -1) and gas is None:
        gas = 1  # train_batch_size alone: DeepSpeed's micro batch is train_batch_size / world
    if micro in (None, -1) and glob not in (None, -1) and gas not in (None, -1) and gpus:
        micro = glob // (gas * gpus)
    if micro in (None, -1):
        raise ConfigImportError(["train_micro_batch_size_per_gpu is missing or auto: give it (or train_batch_size, "
                                 "gradient_accumulation_steps and --gpus)"])
    flat.put("micro_batch", micro, "train_micro_batch_size_per_gpu")
    if glob not in (None, -1) and gas not in (None, -1):
        if glob % (micro * gas):
            raise ConfigImportError([f"train_batch_size {glob} != train_micro_batch_size_per_gpu {micro} x "
                                     f"gradient_accumulation_steps {gas} x dp (not a whole multiple of {micro * gas})"])
        flat.put("dp", glob // (micro * gas), "train_batch_size / (micro x gas)")
        flat.put("global_batch", glob, "train_batch_size")
        return [f"dp = train_batch_size {glob} / (micro {micro} x gradient accumulation {gas}) = "
                f"{glob // (micro * gas)}"]
    flat.put("dp", -1, "data-parallel world (--gpus)")
    if glob not in (None, -1):
        flat.put("global_batch", glob, "train_batch_size")
    else:
        flat.put("grad_accum", 1 if gas in (None, -1) else gas, "gradient_accumulation_steps")
    return [f"batch from {', '.join(f'{k} {v}' for k, v in given.items())} and the GPU count"]


def _layout(flat: Flat) -> list[str]:
    notes = []
    flat.put("stack", "deepspeed", "ds_config.json")
    flat.put("dp_flavour", flat.get("dp_flavour", "ddp"), "zero_optimization.stage")
    bf16, fp16 = flat.get("ds_bf16") is True, flat.get("ds_fp16") is True
    if bf16 and fp16:
        flat.problems.append("bf16.enabled and fp16.enabled both true: DeepSpeed refuses the pair ('bfloat16 and fp16 "
                             "modes cannot be simultaneously enabled', runtime/config.py); enable one")
    precision = "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32"
    flat.put("precision", precision, "bf16.enabled / fp16.enabled")
    for key in ("ds_bf16", "ds_fp16"):
        if flat.get(key) == "auto":  # the Hugging Face Trainer decides at launch (its --bf16 / --fp16 flags)
            flat.unmap(flat.source_of(key), "auto", f"filled in by the Hugging Face Trainer at launch: predicted as "
                       f"{precision}; give the precision it runs with (e.g. estimate --spec S.json --precision "
                       "bf16-mixed)")
    if flat.get("ds_amp") is True:
        flat.unmap("amp.enabled", True, "NVIDIA Apex AMP is not modelled (predicted in fp32)")
    opt = str(flat.get("ds_optimizer", "AdamW")).lower()
    if opt in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        flat.put("optimizer", "adamw", "optimizer.type")
    elif opt == "sgd":
        flat.put("optimizer", "sgd", "optimizer.type")
    else:
        flat.unmap("optimizer.type", flat.get("ds_optimizer"), "only Adam/AdamW (2 states) and SGD (momentum) are "
                   "modelled: predicted as AdamW")
    off_opt, off_param = flat.get("ds_offload_optimizer", "none"), flat.get("ds_offload_param", "none")
    if "nvme" in (off_opt, off_param):
        flat.unmap("zero_optimization.offload_*.device", "nvme", "NVMe offload: predicted as CPU offload (the device "
                   "side is the same; host memory is not predicted)")
    if off_param != "none":
        flat.put("offload", "params", "zero_optimization.offload_param.device")
    elif off_opt != "none":
        flat.put("offload", "optimizer", "zero_optimization.offload_optimizer.device")
    for key, what in (("ds_hpz", "ZeRO++ hierarchical partitioning (hpZ)"), ("ds_mics", "MiCS sharding")):
        value = flat.get(key)
        if value not in (None, 0, 1, -1):
            flat.unmap(flat.source_of(key), value, f"{what} shards over a sub-group: predicted as sharding over all dp")
    tp = flat.get("tp")
    if tp is not None:
        flat.put("tp", int(tp), "tensor_parallel.autotp_size")
        if tp > 1:
            notes.append(f"AutoTP tp={tp}: predicted as ShardLab's Megatron-style tensor parallelism")
    return notes

