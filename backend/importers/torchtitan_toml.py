"""torchtitan's job TOML (the releases up to mid-2025) -> a ShardLab spec. The file is parsed as data (tomllib);
nothing in it is executed or imported (`experimental.custom_import` is reported, never loaded).

Both layouts are read: autumn 2024 ([training] batch_size and data_parallel_*/tensor_parallel_degree, [experimental]
pipeline_parallel_degree / _microbatches / context_parallel_degree) and v0.1.0, June 2025 ([training]
local_batch_size / global_batch_size, [parallelism] *_degree, pipeline_parallel_microbatch_size); field names and
defaults from torchtitan/config_manager.py of those releases. torchtitan rules applied as its code does:
- mixed_precision_param applies only under FSDP (dp_shard > 1); DDP / TP-only training runs in fp32;
- fsdp_reshard_after_forward "default" reshards after forward except under pipelining (= ZeRO-2 there);
- a multi-stage pipeline schedule runs 2 stages per rank unless pipeline_parallel_layers_per_stage says otherwise;
- pipeline microbatches per schedule = local_batch_size / pipeline_parallel_microbatch_size, one schedule per
  gradient-accumulation step (global_batch_size / (local_batch_size x dp)).
"""

from __future__ import annotations

import tomllib
from typing import Any

from backend.importers.assemble import to_spec
from backend.importers.bounded import parse_bounded
from backend.importers.fields import (
    Flat,
    Ignore,
    To,
    Unmappable,
    apply_table,
    choice,
    degree,
    flag,
    flatten,
    positive_int,
)
from backend.importers.import_result import ConfigImportError, ImportedConfig, safe_name
from backend.importers.torchtitan_models import flavor_model
from backend.importers.torchtitan_moe import TABLE as MOE_TABLE
from backend.importers.torchtitan_moe import experts
from backend.importers.torchtitan_rules import (
    accumulated_schedules,
    activation_checkpoint,
    compile_and_early_step,
    data_parallel,
    pipeline,
    precision,
    schedule,
)
from backend.spec.user_text import MAX_JSON_FILE_BYTES, over_limit

_BOOKKEEPING = ("job bookkeeping, profiling, metrics, checkpointing or communication timeouts: no effect on memory or "
                "step time")
_NUMERICS = "optimizer / schedule / data numerics: no effect on memory or step time per step"

TABLE: dict[str, Any] = {
    "model.name": To("tt_model_name"), "model.flavor": To("tt_flavor", str),
    "model.tokenizer_path": Ignore("the vocabulary comes with the flavor (or --model-config)"),
    "model.hf_assets_path": Ignore("the vocabulary comes with the flavor (or --model-config)"),
    "model.norm_type": To("tt_norm_type"), "model.converters": To("tt_converters"),
    "model.print_after_conversion": Ignore(_BOOKKEEPING),
    "optimizer.name": To("optimizer", choice({"adamw": "adamw", "adam": "adamw"})),
    "optimizer.early_step_in_backward": To("tt_early_step", flag),
    "optimizer.fused": Ignore("kernel choice of the optimizer step: same memory"),
    "optimizer.implementation": Ignore("kernel choice of the optimizer step (for-loop, foreach, fused): same state"),
    "training.batch_size": To("local_batch", positive_int),
    "training.local_batch_size": To("local_batch", positive_int),
    "training.global_batch_size": To("tt_global_batch", int), "training.seq_len": To("seq_len", positive_int),
    "training.data_parallel_replicate_degree": To("dp_replicate", degree),
    "training.data_parallel_shard_degree": To("dp_shard", degree),
    "training.data_parallel_degree": To("dp_shard", degree), "training.tensor_parallel_degree": To("tp", positive_int),
    "training.enable_loss_parallel": To("tt_loss_parallel", flag),
    "training.mixed_precision_param": To("tt_param_dtype", choice({"bfloat16": "bf16-mixed", "float32": "fp32"})),
    "training.mixed_precision_reduce": To("grad_reduce_dtype", choice({"float32": "fp32", "bfloat16": "bf16"})),
    "training.enable_cpu_offload": To("tt_cpu_offload", flag),
    "training.compile": To("tt_compile", flag),
    "compile.enable": To("tt_compile", flag),
    "compile.components": To("tt_compile_components"),
    "compile.backend": To("tt_compile_backend", str),
    "parallelism.enable_async_tensor_parallel": To("tp_overlap", flag),
    "experimental.enable_async_tensor_parallel": To("tp_overlap", flag),
    "quantize.linear.float8.enable_fsdp_float8_all_gather": To("tt_fp8_all_gather", flag),
    "quantize.linear.float8.recipe_name": To("tt_fp8_recipe"),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": Ignore(
        "one amax all-reduce for all float8 weights after the optimizer step instead of one per weight: a few floats"),
    "quantize.linear.float8.force_recompute_fp8_weight_in_bwd": Unmappable(
        "the fp8 weight recast in backward instead of kept: its bytes and time are not modelled"),
    "quantize.linear.float8.filter_fqns": Unmappable("float8 linears filtered by name: ShardLab keeps every block "
                                                     "linear in float8 and lm_head in bf16"),
    "parallelism.data_parallel_replicate_degree": To("dp_replicate", degree),
    "parallelism.data_parallel_shard_degree": To("dp_shard", degree),
    "parallelism.fsdp_reshard_after_forward": To("tt_reshard", choice({"default": "default", "always": "always",
                                                                         "never": "never"})),
    "parallelism.tensor_parallel_degree": To("tp", positive_int),
    "parallelism.disable_loss_parallel": To("tt_no_loss_parallel", flag),
    "parallelism.pipeline_parallel_degree": To("pp", positive_int),
    "experimental.pipeline_parallel_degree": To("pp", positive_int),
    "parallelism.pipeline_parallel_schedule": To("pp_schedule", schedule),
    "experimental.pipeline_parallel_schedule": To("pp_schedule", schedule),
    "parallelism.pipeline_parallel_microbatch_size": To("tt_pp_micro", positive_int),
    "experimental.pipeline_parallel_microbatches": To("tt_pp_microbatches", positive_int),
    "parallelism.pipeline_parallel_layers_per_stage": To("tt_layers_per_stage"),
    "parallelism.context_parallel_degree": To("cp", positive_int),
    "experimental.context_parallel_degree": To("cp", positive_int),
    "parallelism.context_parallel_rotate_method": To("cp_rotate",
                                                     choice({"allgather": "allgather", "alltoall": "alltoall"})),
    "activation_checkpoint.mode": To("tt_ac_mode", choice({"none": "none", "selective": "selective", "full": "full"})),
    "activation_checkpoint.selective_ac_option": To("tt_ac_option", str),
    "float8.enable_float8_linear": To("fp8", flag),
    "float8.recipe_name": To("tt_fp8_recipe"),
    "float8.enable_fsdp_float8_all_gather": To("tt_fp8_all_gather", flag),
}
PREFIXES: dict[str, Any] = {
    **{p: Ignore(_BOOKKEEPING) for p in ("job", "profiling", "metrics", "checkpoint", "comm", "memory_estimation",
                                         "validation")},
    **{p: Ignore(_NUMERICS) for p in ("optimizer", "lr_scheduler", "training.dataset", "training.dataset_path",
                                      "training.max_norm", "training.steps", "training.warmup_steps",
                                      "training.gc_freq", "training.gc_debug", "training.seed",
                                      "training.deterministic")},
    "float8": Ignore("details of the float8 recipe (fp8 itself is model.converters / enable_float8_linear)"),
    "quantize": Ignore("details of the quantization recipe (fp8 itself is model.converters)"),
    "mx": Ignore("details of the MX recipe (MX itself is model.converters)"),
    "fault_tolerance": Unmappable("torchft fault tolerance replicas are not modelled"),
}
WHEN_ON = {  # booleans reported only when switched on
    "parallelism.enable_compiled_autograd": "compiled autograd: not modelled",
    "experimental.enable_compiled_autograd": "compiled autograd: not modelled",
    "experimental.custom_import": "custom code: ShardLab never imports a config's module; its effect is unknown",
    "experimental.custom_args_module": "custom code: ShardLab never imports a config's module; its effect is unknown",
    "parallelism.pipeline_parallel_split_points": "hand-placed pipeline split points: ShardLab splits layers evenly",
    "experimental.pipeline_parallel_split_points": "hand-placed pipeline split points: ShardLab splits layers evenly",
    "parallelism.pipeline_parallel_schedule_csv": "a pipeline schedule from a CSV file: not modelled",
}


def parse(text: str | bytes) -> dict[str, Any]:
    size = len(text.encode() if isinstance(text, str) else text)
    if size > MAX_JSON_FILE_BYTES:
        raise ConfigImportError([over_limit("the TOML", size, MAX_JSON_FILE_BYTES) + " for a config"])
    try:
        return parse_bounded(tomllib.loads, text.decode("utf-8") if isinstance(text, bytes) else text, "the TOML")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigImportError([f"not a TOML file: {e}"]) from None


def import_toml(text: str | bytes, *, gpus: int | None = None, model_config: dict[str, Any] | None = None,
                file: str = "job.toml") -> ImportedConfig:
    data = parse(text)
    values = flatten(data)
    flat = Flat({k: v for k, v in values.items() if k not in WHEN_ON})
    for key in WHEN_ON.keys() & values.keys():
        (flat.unmap if values[key] not in (False, None, "", []) else flat.ignore)(
            key, values[key], WHEN_ON[key] if values[key] not in (False, None, "", []) else "off")
    apply_table(flat, {**TABLE, **MOE_TABLE}, prefixes=PREFIXES)
    notes = _model(flat, model_config) + _batch(flat)
    data_parallel(flat)
    notes += activation_checkpoint(flat) + _numerics(flat) + precision(flat)
    notes += experts(flat)
    notes += compile_and_early_step(flat)
    flat.put("notes", notes, "torchtitan")
    description = (data.get("job") or {}).get("description") or (f"{flat.get('tt_model_name', 'model')} "
                                                                 f"{flat.get('tt_flavor', '')}")
    return accumulated_schedules(to_spec(flat, framework="torchtitan", source_format="torchtitan-toml",
                                         name=safe_name(f"{description} (torchtitan)"), gpus=gpus), flat)


def _model(flat: Flat, model_config: dict[str, Any] | None) -> list[str]:
    seq = flat.get("seq_len", 2048)  # torchtitan's default training.seq_len
    if model_config is not None:
        from backend.hf.config import HFConfigError, from_hf_config

        try:
            model, notes = from_hf_config(model_config, seq_len=seq, file="config.json")
        except HFConfigError as e:
            raise ConfigImportError([f"--model-config: {e}"]) from None
        model["attention"] = "flash"
    else:
        model, notes = flavor_model(str(flat.get("tt_model_name", "llama3")), str(flat.get("tt_flavor", "debugmodel")),
                                    seq)
    norm = flat.get("tt_norm_type")
    if norm is not None and norm not in ("rmsnorm", "fused_rmsnorm"):
        flat.unmap(flat.source_of("tt_norm_type"), norm, "ShardLab's Llama blocks use RMSNorm (layernorm / "
                   "np_layernorm change the norm's parameters slightly: predicted as RMSNorm)")
    flat.put("model_base", model, "model")
    return notes


def _batch(flat: Flat) -> list[str]:
    local = flat.get("local_batch", 8)  # torchtitan's default local batch size
    flat.put("local_batch", local, flat.source_of("local_batch"))
    glob = flat.get("tt_global_batch", -1)
    if glob not in (-1, None):
        flat.put("global_batch", glob, flat.source_of("tt_global_batch"))
    if flat.get("pp", 1) == 1:
        flat.put("micro_batch", local, flat.source_of("local_batch"))
        return []
    micro = flat.get("tt_pp_micro")
    if micro is None and flat.get("tt_pp_microbatches"):  # autumn 2024: a count of microbatches
        count = flat.get("tt_pp_microbatches")
        if local % count:
            raise ConfigImportError([f"local batch {local} is not divisible by pipeline_parallel_microbatches {count}"])
        micro = local // count
    return pipeline(flat, local, micro or 1)


def _numerics(flat: Flat) -> list[str]:
    converters = flat.get("tt_converters") or []
    float8 = ("float8", "quantize.linear.float8")
    if any(c in float8 for c in converters):
        flat.put("fp8", True, "model.converters")
    if other := [c for c in converters if c not in float8]:
        flat.unmap("model.converters", converters,
                   f"model converters {other} (MX, other quantization) are not modelled")
    return []
