"""NeMo's Megatron GPT YAML (examples/nlp/language_modeling/conf/megatron_gpt_config.yaml, NeMo 1.x/2024) -> a
ShardLab spec, through the Megatron table (importers/megatron_fields.py): NeMo's `model.*` keys are Megatron's
arguments with underscores (model.encoder_seq_length is --seq-length, model.num_moe_experts --num-experts,
model.activation swiglu / fast-swiglu is --swiglu, model.bias False is --disable-bias-linear,
model.optim.name distributed_fused_adam is the distributed optimizer). trainer.devices x trainer.num_nodes is the
GPU count, trainer.precision the precision.

Read with yaml.safe_load (no tags that build objects); OmegaConf interpolations of another key (${model.x},
${.x}) are resolved here, resolver calls (${multiply:...}) are left as text (they only appear in keys that change
nothing predicted).
"""

from __future__ import annotations

import re
from typing import Any

from backend.importers.assemble import to_spec
from backend.importers.bounded import parse_bounded
from backend.importers.fields import Flat, Ignore, To, Unmappable, apply_table, choice, flatten
from backend.importers.import_result import ConfigImportError, ImportedConfig, safe_name
from backend.importers.megatron_fields import TABLE as MEGATRON
from backend.importers.megatron_fields import as_flag, given_vocab, model_and_layout, opt_int, pos_int, training
from backend.spec.user_text import MAX_JSON_FILE_BYTES, over_limit

_REF = re.compile(r"^\$\{(\.?[A-Za-z_][A-Za-z0-9_.]*)\}$")
_IGNORED = "training numerics, data, logging, checkpointing or kernel fusion: no effect on memory or step time per step"
SAME_AS_MEGATRON = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "max_position_embeddings", "make_vocab_size_divisible_by", "micro_batch_size",
                    "global_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "context_parallel_size", "expert_model_parallel_size", "sequence_parallel", "moe_router_topk",
                    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "normalization",
                    "position_embedding_type", "expert_tensor_parallel_size", "moe_expert_capacity_factor",
                    "moe_pad_expert_input_to_capacity", "moe_token_dispatcher_type", "moe_grouped_gemm",
                    "moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_layer_freq",
                    "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                    "moe_router_group_topk", "mtp_num_layers", "multi_latent_attention", "q_lora_rank", "kv_lora_rank",
                    "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm")
FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_add_fusion", "masked_softmax_fusion",
           "apply_rope_fusion")
"""Megatron's fusions (on by default): the megatron stack's fused element-wise accounting assumes them; one turned off
is reported."""
RENAMED = {"encoder_seq_length": "--seq-length", "num_moe_experts": "--num-experts",
           "virtual_pipeline_model_parallel_size": "--virtual-pipeline-model-parallel-size",
           "activations_checkpoint_granularity": "--recompute-granularity",
           "activations_checkpoint_method": "--recompute-method",
           "activations_checkpoint_num_layers": "--recompute-num-layers", "use_flash_attention": "--use-flash-attn",
           "cpu_offloading": "--cpu-offloading"}
TABLE: dict[str, Any] = {
    **{f"model.{k}": MEGATRON["--" + k.replace("_", "-")] for k in SAME_AS_MEGATRON},
    **{f"model.{k}": MEGATRON[flag] for k, flag in RENAMED.items()},
    "model.normalization": To("norm", choice({"layernorm": "layernorm", "rmsnorm": "rmsnorm"})),
    "model.activation": To("mg_swiglu",
                           choice({"gelu": False, "fast-gelu": False, "swiglu": True, "fast-swiglu": True})),
    "model.bias": To("mg_bias", as_flag),
    "model.share_embeddings_and_output_weights": To("mg_untie", lambda v: not as_flag(v)),
    "model.fp8": To("nemo_fp8", as_flag), "model.fp8_hybrid": To("nemo_fp8_hybrid", as_flag),
    "model.fp8_e4m3": To("nemo_fp8_e4m3", as_flag),
    "model.optim.name": To("nemo_optim", str),
    "model.fsdp": To("mg_fsdp", as_flag), "model.transformer_engine": To("nemo_te", as_flag),
    "model.tokenizer.library": To("nemo_tokenizer_library", str), "model.tokenizer.type": To("nemo_tokenizer", str),
    "model.padded_vocab_size": To("mg_padded_vocab", opt_int), "model.vocab_size": To("mg_vocab", opt_int),
    "trainer.devices": To("nemo_devices", pos_int), "trainer.num_nodes": To("nemo_nodes", pos_int),
    "trainer.precision": To("nemo_precision", str),
    "model.activations_checkpoint_layers_per_pipeline": Unmappable("partial activation checkpointing per pipeline "
                                                                   "stage is not modelled"),
    "model.num_micro_batches_with_partial_activation_checkpoints": Unmappable("partial activation checkpointing is "
                                                                              "not modelled"),
    "model.attention_type": To("nemo_attention_type", choice({"multihead": "multihead"})),
    "model.transformer_block_type": To("nemo_block", choice({"pre_ln": "pre_ln"})),
    "model.headscale": To("nemo_headscale", lambda v: _off(v, "headscale adds per-head parameters")),
    "model.overlap_p2p_comm": To("pp_overlap", as_flag),
    "model.ub_tp_comm_overlap": To("tp_overlap", as_flag),
    "model.optim.overlap_grad_sync": To("grad_reduce_overlap", as_flag),
    "model.optim.overlap_param_sync": To("param_gather_overlap", as_flag),
    **{f"model.{k}": To(f"nemo_fusion.{k}", as_flag) for k in FUSIONS},
}
PREFIXES: dict[str, Any] = {
    **{p: Ignore(_IGNORED) for p in (
        "name", "restore_from_path", "defaults", "exp_manager", "s3_checkpointing", "hydra", "trainer", "model.data",
        "model.optim", "model.tokenizer", "model.nsys_profile", "model.megatron_timer_kwargs", "model.dist_ckpt",
        "model.restore_from", "model.resume_from_checkpoint", "model.skip_train", "model.rampup_batch_size",
        "model.init_method_std", "model.use_scaled_init_method", "model.hidden_dropout", "model.attention_dropout",
        "model.ffn_dropout", "model.apply_query_key_layer_scaling", "model.layernorm_epsilon",
        "model.do_layer_norm_weight_decay", "model.pre_process", "model.post_process", "model.persist_layer_norm",
        "model.openai_gelu", "model.normalize_attention_scores", "model.rotary_percentage",
        "model.batch_p2p_comm", "model.seq_len_interpolation_factor", "model.scale_positional_embedding",
        "model.reset_lr", "model.native_amp", "model.hysteresis", "model.fp32_residual_connection",
        "model.fp16_lm_cross_entropy", "model.megatron_amp_O2", "model.grad_allreduce_chunk_size_mb",
        "model.grad_div_ar_fusion", "model.get_attention_mask_from_fusion", "model.seed",
        "model.use_cpu_initialization", "model.onnx_safe", "model.apex_transformer_log_level",
        "model.gradient_as_bucket_view", "model.sync_batch_comm", "model.nccl_communicator_config_path",
        "model.validation_param_sync_overlap", "model.fsdp_", "model.mcore_gpt", "model.fp8_margin",
        "model.fp8_interval", "model.fp8_amax", "model.reduce_amax", "model.use_emha", "model.cpu_offloading_",
        "model.sharp", "model.enable_megatron_timers", "model.gc_interval", "model.drop_layers",
        "model.precision", "model.resume", "model.moe_z_loss_coeff",
        "model.moe_input_jitter_eps", "model.moe_token_dropping")},
}


def _off(value: Any, what: str) -> bool:
    if as_flag(value):
        raise ValueError(f"{what}: not modelled")
    return False


def parse(text: str | bytes) -> dict[str, Any]:
    import yaml

    size = len(text.encode() if isinstance(text, str) else text)
    if size > MAX_JSON_FILE_BYTES:
        raise ConfigImportError([over_limit("the YAML", size, MAX_JSON_FILE_BYTES) + " for a config"])
    try:
        data = parse_bounded(yaml.safe_load, text, "the NeMo YAML")
    except yaml.YAMLError as e:
        raise ConfigImportError([f"not a YAML file: {str(e).splitlines()[0]}"]) from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ConfigImportError(["not a NeMo Megatron config: no 'model:' section"])
    return data


def resolve(values: dict[str, Any]) -> dict[str, Any]:
    """${a.b} and ${.b} (a sibling) interpolations replaced by the value they name (chains of up to 8)."""
    out = dict(values)
    for _ in range(8):
        changed = False
        for key, value in out.items():
            m = _REF.match(value) if isinstance(value, str) else None
            if not m:
                continue
            ref = m.group(1)
            target = f"{key.rsplit('.', 1)[0]}.{ref[1:]}" if ref.startswith(".") else ref
            if target in out and out[target] != value:
                out[key], changed = out[target], True
        if not changed:
            break
    return out


def import_yaml(text: str | bytes, *, gpus: int | None = None, model_config: dict[str, Any] | None = None,
                file: str = "config.yaml", vocab_size: int | None = None) -> ImportedConfig:
    data = parse(text)
    flat = Flat(resolve(flatten(data)))
    apply_table(flat, TABLE, prefixes=PREFIXES)
    notes = _nemo(flat, model_config)
    if vocab_size is not None:
        given_vocab(flat, vocab_size)
    notes += model_and_layout(flat) + training(flat)
    flat.put("notes", notes, "nemo")
    if flat.problems:
        raise ConfigImportError(flat.problems, flat.needs)
    name = f"NeMo {safe_name(data.get('name') or 'megatron_gpt', 60)} ({safe_name(file, 60)})"
    return to_spec(flat, framework="megatron", source_format="nemo-yaml", name=name, gpus=gpus)


def _nemo(flat: Flat, model_config: dict[str, Any] | None) -> list[str]:
    notes: list[str] = []
    devices, nodes = flat.get("nemo_devices"), flat.get("nemo_nodes", 1)
    if devices is not None:
        flat.put("gpus", devices * nodes, "trainer.devices x trainer.num_nodes")
    flat.put("dp", -1, "data-parallel size (GPUs / (tp * pp * cp))")
    if flat.get("mg_query_groups") is not None:
        # NeMo has no group_query_attention key: MegatronBaseModel.build_transformer_config copies
        # model.num_query_groups into Megatron-Core's TransformerConfig as is (None there means num_attention_heads),
        # where Megatron-LM's core_transformer_config_from_args passes it only with --group-query-attention
        flat.put("mg_gqa", True, "model.num_query_groups")
    precision = str(flat.get("nemo_precision", "32"))
    flat.put("mg_bf16", precision.startswith("bf16"), "trainer.precision")
    flat.put("mg_fp16", precision in ("16", "16-mixed"), "trainer.precision")
    if flat.get("nemo_fp8"):
        flat.put("fp8", "e4m3" if flat.get("nemo_fp8_e4m3") else "hybrid", "model.fp8")
    optim = flat.get("nemo_optim", "fused_adam")
    flat.put("mg_dist_opt", optim.startswith("distributed_fused_adam"), "model.optim.name")
    flat.put("optimizer", "sgd" if optim == "sgd" else "adamw", "model.optim.name")
    flat.put("mg_transformer_impl", "transformer_engine" if flat.get("nemo_te", False) else "local",
             "model.transformer_engine")  # without TE: Megatron's local attention (unfused, or flash-attn)
    for k in FUSIONS:
        if flat.get(f"nemo_fusion.{k}") is False:
            flat.unmap(f"model.{k}", False, "a fusion turned off: the megatron stack's fused element-wise accounting "
                       "assumes Megatron's fusions on")
    if model_config is not None and isinstance(model_config.get("vocab_size"), int):
        flat.put("mg_vocab", model_config["vocab_size"], "--model-config vocab_size")
    elif flat.get("mg_vocab") is None and flat.get("mg_padded_vocab") is None:
        if (flat.get("nemo_tokenizer_library"), flat.get("nemo_tokenizer")) == ("megatron", "GPT2BPETokenizer"):
            flat.put("mg_vocab", 50257, "model.tokenizer.type")
            notes.append("vocabulary 50,257: NeMo's megatron GPT2BPETokenizer (GPT-2's BPE)")
    return notes
