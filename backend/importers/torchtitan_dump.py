"""The `Trainer.Config` dump of torchtitan releases that configure the trainer in Python -> a ShardLab spec.

Those releases build their config by running Python (config_registry.py); ShardLab never runs it. It reads what
the trainer itself logs: `Trainer.Config.to_dict()` as JSON, printed as "Running with configs: {...}" with
`--debug.print_config`, written by `--debug.save_config_file`, and sent to W&B / TensorBoard as the run config
(torchtitan/trainer.py `maybe_log`). Give the JSON file, or the training log that holds the printed block.
Field names from torchtitan/config/configs.py: the first Trainer.Config (Feb 2026: training.local_batch_size /
global_batch_size / seq_len, parallelism.pipeline_parallel_microbatch_size, activation_checkpoint.mode) and the
later token-based one (training.num_tokens_per_microbatch_per_dp_rank / num_tokens_per_train_step /
max_context_length, parallelism.num_pp_microbatches, an activation-checkpointing policy object).
"""

from __future__ import annotations

import json
from typing import Any

from backend.importers.assemble import to_spec
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
from backend.importers.torchtitan_models import dumped_model
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
from backend.spec.user_text import InputError, check_depth, load_json_text

MARKER = "Running with configs:"
_IGNORED = "bookkeeping, data, numerics or logging: no effect on memory or step time per step"

TABLE: dict[str, Any] = {
    "model_spec.name": To("tt_model_name", str), "model_spec.flavor": To("tt_flavor", str),
    "model_spec.model": To("tt_model"),
    "training.local_batch_size": To("local_batch", positive_int),
    "training.global_batch_size": To("tt_global_batch", int), "training.seq_len": To("seq_len", positive_int),
    "training.num_tokens_per_microbatch_per_dp_rank": To("tt_micro_tokens", positive_int),
    "training.num_tokens_per_train_step": To("tt_step_tokens", int),
    "training.max_context_length": To("seq_len", positive_int),
    "training.mixed_precision_param": To("tt_param_dtype", choice({"bfloat16": "bf16-mixed", "float32": "fp32"})),
    "training.mixed_precision_reduce": To("grad_reduce_dtype", choice({"float32": "fp32", "bfloat16": "bf16"})),
    "training.dtype": To("tt_dtype", str),
    "training.enable_cpu_offload": To("tt_cpu_offload", flag),
    "parallelism.data_parallel_replicate_degree": To("dp_replicate", degree),
    "parallelism.data_parallel_shard_degree": To("dp_shard", degree),
    "parallelism.fsdp_reshard_after_forward": To("tt_reshard", choice({"default": "default", "always": "always",
                                                                         "never": "never"})),
    "parallelism.tensor_parallel_degree": To("tp", positive_int),
    "parallelism.enable_sequence_parallel": To("sequence_parallel", flag),
    "parallelism.disable_loss_parallel": To("tt_no_loss_parallel", flag),
    "parallelism.pipeline_parallel_degree": To("pp", positive_int),
    "parallelism.pipeline_parallel_schedule": To("pp_schedule", schedule),
    "parallelism.pipeline_parallel_microbatch_size": To("tt_pp_micro", positive_int),
    "parallelism.num_pp_microbatches": To("tt_pp_microbatches", positive_int),
    "parallelism.pipeline_parallel_layers_per_stage": To("tt_layers_per_stage"),
    "parallelism.context_parallel_degree": To("cp", positive_int),
    "parallelism.context_parallel_rotate_method": To("cp_rotate",
                                                     choice({"allgather": "allgather", "alltoall": "alltoall"})),
    "activation_checkpoint": To("tt_ac"),
    "compile.enable": To("tt_compile", flag),
    "compile.components": To("tt_compile_components"),
    "compile.backend": To("tt_compile_backend", str),
    "parallelism.enable_async_tensor_parallel": To("tp_overlap", flag),
}
PREFIXES: dict[str, Any] = {
    **{p: Ignore(_IGNORED) for p in ("hf_assets_path", "dump_folder", "profiler", "metrics", "tokenizer", "dataloader",
                                     "optimizer", "lr_scheduler", "checkpoint", "comm", "validator", "debug",
                                     "override", "loss", "training.max_norm", "training.steps", "training.gc_freq",
                                     "training.gc_debug", "compile.components", "compile.backend",
                                     "training.disable_cuda_graphs")},
    "parallelism": Ignore("placement detail (split points, load balancer, backend): predicted with ShardLab's even "
                          "split"),
    "compile": Ignore("compile options (compile itself is compile.enable)"),
    "fault_tolerance": Unmappable("torchft fault tolerance replicas are not modelled"),
}


def config_from_log_text(text: str) -> dict[str, Any]:
    """The JSON object printed after "Running with configs:" (logger prefixes and rank prefixes stripped)."""
    at = text.find(MARKER)
    if at < 0:
        raise ConfigImportError([f"no {MARKER!r} block: torchtitan prints it with --debug.print_config (or give the "
                                 "file written by --debug.save_config_file)"])
    rest = text[at + len(MARKER):].lstrip()
    lines = [line.split("]:", 1)[1] if line.startswith("[") and "]:" in line[:16] else line
             for line in rest.splitlines()]
    try:
        obj, _ = json.JSONDecoder().raw_decode("\n".join(lines))
        check_depth(obj, f"the {MARKER!r} block")
    except json.JSONDecodeError as e:
        raise ConfigImportError([f"the {MARKER!r} block is not complete JSON (a truncated log?): {e}"]) from None
    except RecursionError:
        raise ConfigImportError([f"the {MARKER!r} block nests too deep to be a config"]) from None
    except InputError as e:
        raise ConfigImportError([str(e)]) from None
    return obj


def parse(text: str | bytes) -> dict[str, Any]:
    raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    if raw.lstrip().startswith("{"):
        try:
            data = load_json_text(raw, "the Trainer.Config dump")
        except InputError as e:
            raise ConfigImportError([str(e)]) from None
    else:
        data = config_from_log_text(raw)
    if not isinstance(data, dict) or "parallelism" not in data or "training" not in data:
        raise ConfigImportError(["not a torchtitan Trainer.Config dump (no 'training' and 'parallelism' sections)"])
    return data


def import_dump(text: str | bytes, *, gpus: int | None = None, model_config: dict[str, Any] | None = None,
                file: str = "config.json") -> ImportedConfig:
    data = parse(text)
    flat = Flat(flatten(data, keep=("model_spec.model", "activation_checkpoint")))
    apply_table(flat, {**TABLE, **MOE_TABLE}, prefixes=PREFIXES)
    notes = _model(flat, model_config) + _batch(flat)
    data_parallel(flat)
    notes += _ac(flat) + precision(flat)
    notes += experts(flat)
    notes += compile_and_early_step(flat)
    flat.put("notes", notes, "torchtitan")
    name = f"{flat.get('tt_model_name', 'model')} {flat.get('tt_flavor', '')} (torchtitan)"
    return accumulated_schedules(to_spec(flat, framework="torchtitan", source_format="torchtitan-config-dump",
                                         name=safe_name(name), gpus=gpus), flat)


def _model(flat: Flat, model_config: dict[str, Any] | None) -> list[str]:
    seq = flat.get("seq_len", 2048)
    if model_config is not None:
        from backend.hf.config import HFConfigError, from_hf_config

        try:
            model, notes = from_hf_config(model_config, seq_len=seq, file="config.json")
        except HFConfigError as e:
            raise ConfigImportError([f"--model-config: {e}"]) from None
        model["attention"] = "flash"
    elif isinstance(flat.get("tt_model"), dict):
        model, notes = dumped_model(flat.get("tt_model"), name=str(flat.get("tt_model_name", "model")),
                                    flavor=str(flat.get("tt_flavor", "")), seq_len=seq)
    else:
        raise ConfigImportError(["the dump has no model_spec.model: give the model's config.json with --model-config"])
    flat.put("model_base", model, "model_spec.model")
    return notes


def _batch(flat: Flat) -> list[str]:
    seq = flat.get("seq_len", 2048)
    notes: list[str] = []
    if flat.get("tt_micro_tokens") is not None:  # token-based TrainingConfig
        tokens = flat.get("tt_micro_tokens")
        if tokens % seq:
            raise ConfigImportError([f"training.num_tokens_per_microbatch_per_dp_rank={tokens} is not a whole number "
                                     f"of sequences of max_context_length {seq}"])
        micro, count = tokens // seq, flat.get("tt_pp_microbatches", 1)
        notes.append(f"micro batch = {tokens} tokens / context {seq} = {micro} sequences (packed)")
        local = micro * count
        step_tokens = flat.get("tt_step_tokens", -1)
        if step_tokens not in (-1, None):
            flat.put("global_batch", step_tokens // seq, "training.num_tokens_per_train_step")
    else:
        local = flat.get("local_batch", 8)
        micro = flat.get("tt_pp_micro", 1) if flat.get("pp", 1) > 1 else local
        glob = flat.get("tt_global_batch", -1)
        if glob not in (-1, None):
            flat.put("global_batch", glob, "training.global_batch_size")
    flat.put("local_batch", local, flat.source_of("local_batch"))
    if flat.get("pp", 1) > 1:
        return notes + pipeline(flat, local, micro)
    flat.put("micro_batch", micro, "training")
    return notes


def _ac(flat: Flat) -> list[str]:
    """Feb 2026: {"mode": ..., "selective_ac_option": ...}; later: the policy's fields (null = none;
    force_recompute_mm_shapes_by_fqns = SelectiveAC's op policy; memory_budget = MemoryBudgetAC; else FullAC)."""
    ac = flat.get("tt_ac")
    source = "activation_checkpoint"
    if ac is None and "tt_ac" in flat.canonical:
        flat.put("tt_ac_mode", "none", source)
    elif isinstance(ac, dict) and "mode" in ac:
        flat.put("tt_ac_mode", ac["mode"], source + ".mode")
        flat.put("tt_ac_option", ac.get("selective_ac_option", "2"), source + ".selective_ac_option")
    elif isinstance(ac, dict) and "memory_budget" in ac:
        flat.unmap(source, ac, "memory-budget activation checkpointing (compiler-chosen recompute) is not modelled")
        flat.put("tt_ac_mode", "none", source)
    elif isinstance(ac, dict):
        selective = "force_recompute_mm_shapes_by_fqns" in ac
        flat.put("tt_ac_mode", "selective" if selective else "full", source)
        flat.put("tt_ac_option", "op", source)
    return activation_checkpoint(flat)
