"""config.json -> ModelSpec fields for the 2026 families (backend/hf/config.py holds the older ones and the common
checks): deepseek_v3, deepseek_v2 (MLA, dense prefix, shared experts, sigmoid / group-limited routing), qwen3,
qwen3_moe (q/k norms, own head width, mlp_only_layers / decoder_sparse_step), gpt_oss (sinks, alternating
sliding / full layers, biased router and clamped SwiGLU experts), gemma3_text (sandwich norms, 5:1 local / global,
sqrt(h)-scaled tied embeddings, GeGLU) and llama4_text (interleaved MoE with a shared expert, chunked attention on
the rotary layers, NoPE global layers). Each mapping reads the keys the matching transformers 5.x config class
reads; keys that change nothing ShardLab predicts become notes, keys that would change counts or memory that
ShardLab does not model are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backend.hf.reads import HFConfigError, read_flag, read_int, read_int_list, read_num, read_seq, read_str

_BASE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "intermediate_size")
_BASE_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layers",
                "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
                "max_position_embeddings": "seq_len", "rms_norm_eps": "norm_eps", "head_dim": "attn_head_dim"}
QUANTIZED_RELEASES = ("fp8", "mxfp4")
"""Checkpoint formats of the published releases (DeepSeek-V3's block fp8, gpt-oss's MXFP4 experts): the stored
bytes differ, the parameters trained in fp32 / bf16 do not."""


@dataclass(frozen=True)
class NewFamily:
    keys: tuple[str, ...]
    """Keys this family reads beyond hf_config's metadata and numerics lists."""
    field_names: dict[str, str]
    """config key -> ModelSpec field (errors are named by the config's key)."""
    mapper: Callable[[dict[str, Any], int | None], tuple[dict[str, Any], list[str]]]


def new_family_model(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    return NEW_FAMILIES[cfg["model_type"]].mapper(cfg, seq_len)


def _base(cfg: dict[str, Any], seq_len: int | None, notes: list[str]) -> dict[str, Any]:
    """The fields every new family shares: sizes, RMSNorm, RoPE, no biases, own head width when it differs."""
    h, heads = read_int(cfg, "hidden_size"), read_int(cfg, "num_attention_heads")
    head_dim = read_int(cfg, "head_dim", None)
    kv = read_int(cfg, "num_key_value_heads", None)
    model = dict(vocab_size=read_int(cfg, "vocab_size"), d_model=h, n_layers=read_int(cfg, "num_hidden_layers"),
                 n_heads=heads, n_kv_heads=None if kv == heads else kv, ffn_hidden=read_int(cfg, "intermediate_size"),
                 seq_len=read_seq(cfg, seq_len, "max_position_embeddings", notes), norm="rmsnorm", mlp="swiglu",
                 positions="rope", bias="none", tie_embeddings=read_flag(cfg, "tie_word_embeddings", False),
                 norm_eps=read_num(cfg, "rms_norm_eps", 1e-6))
    if head_dim is not None and (h % heads or head_dim != h // heads):
        model["attn_head_dim"] = head_dim
    elif head_dim is None and h % heads:
        raise HFConfigError(f"num_attention_heads={heads} does not divide hidden_size={h} and head_dim is not given")
    if read_flag(cfg, "attention_bias", False) and cfg.get("model_type") != "gpt_oss":
        raise HFConfigError("attention_bias=true: attention biases without MLP biases are not modelled for "
                            f"model_type {cfg['model_type']}")
    return model


def _quantized(cfg: dict[str, Any], notes: list[str]) -> None:
    q = cfg.get("quantization_config")
    if q in (None, {}):
        return
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in QUANTIZED_RELEASES:
        raise HFConfigError(f"quantization_config={q!r}: only the published fp8 / mxfp4 release formats are accepted "
                            "(ShardLab counts the fp32 / bf16 parameters training holds)")
    notes.append(f"quantization_config (quant_method {method}): the checkpoint's storage format, not modelled; "
                 "training holds the same parameters in fp32 / bf16")


def _pattern(types: list[Any], global_name: str, key: str) -> int:
    """global_every of a per-layer type list (global when (i + 1) % global_every == 0), refused when the list is not
    that periodic pattern."""
    globals_ = [i for i, t in enumerate(types) if t == global_name]
    every = globals_[0] + 1 if globals_ else 0
    expect = [every > 0 and (i + 1) % every == 0 for i in range(len(types))]
    if [t == global_name for t in types] != expect:
        raise HFConfigError(f"{key}={types!r}: only a periodic pattern (every k-th layer {global_name}) is modelled")
    return every


def _layer_types(cfg: dict[str, Any], n_layers: int, windowed: str) -> int | None:
    """global_every from layer_types (None when absent)."""
    types = cfg.get("layer_types")
    if types in (None, []):
        return None
    if not isinstance(types, list) or len(types) != n_layers or any(t not in (windowed, "full_attention")
                                                                    for t in types):
        raise HFConfigError(f"layer_types={types!r}: expected {n_layers} entries of {windowed} / full_attention")
    return _pattern(types, "full_attention", "layer_types")


def _qwen3(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    read_str(cfg, "hidden_act", ("silu",))
    model = _base(cfg, seq_len, notes)
    model["qk_norm"] = True  # Qwen3Attention: q_norm / k_norm RMSNorm(head_dim)
    if read_flag(cfg, "use_sliding_window", False):
        raise HFConfigError("use_sliding_window=true: Qwen3's windowed upper layers (from max_window_layers) are not "
                            "modelled")
    if _layer_types(cfg, model["n_layers"], "sliding_attention") not in (None, model["n_layers"] + 1) and \
            any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise HFConfigError("layer_types with sliding_attention layers: not modelled for qwen3")
    if cfg["model_type"] == "qwen3_moe":
        step = read_int(cfg, "decoder_sparse_step", 1)
        dense = read_int_list(cfg, "mlp_only_layers")
        if dense != list(range(len(dense))):
            raise HFConfigError(f"mlp_only_layers={dense!r}: only a dense prefix (0, 1, ..., k-1) is modelled")
        model.update(n_experts=read_int(cfg, "num_experts"), top_k=read_int(cfg, "num_experts_per_tok"),
                     expert_ffn_hidden=read_int(cfg, "moe_intermediate_size"), first_dense_layers=len(dense),
                     moe_every=step)
    return model, notes


def _gpt_oss(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    read_str(cfg, "hidden_act", ("silu",))
    _quantized(cfg, notes)
    model = _base(cfg, seq_len, notes)
    if not read_flag(cfg, "attention_bias", True):
        raise HFConfigError("attention_bias=false: gpt-oss experts always carry biases; biased experts without "
                            "attention biases are not modelled")
    experts = read_int(cfg, "num_local_experts")
    model.update(bias="all", attention_sinks=True, mlp="swiglu_clamped", n_experts=experts,
                 top_k=read_int(cfg, "num_experts_per_tok"), expert_ffn_hidden=model["ffn_hidden"], router_bias=True)
    if read_num(cfg, "swiglu_limit", 7.0) != 7.0:
        notes.append(f"swiglu_limit={cfg['swiglu_limit']}: the clamp value is numerics (the engine clamps at 7)")
    window = read_int(cfg, "sliding_window", None)
    every = _layer_types(cfg, model["n_layers"], "sliding_attention")
    if window is not None and every != model["n_layers"] + 1:
        model.update(window=window, global_every=every if every is not None else 2)
    notes.append("router: softmax over the top-k logits = the renormalised top-k of the full softmax (same weights)")
    return model, notes


def _gemma3(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    read_str(cfg, "hidden_activation", ("gelu_pytorch_tanh",))
    read_str(cfg, "hidden_act", ("gelu_pytorch_tanh",))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise HFConfigError(f"{key}={cfg[key]!r}: tanh soft-capping keeps extra tensors, not modelled")
    if read_flag(cfg, "use_bidirectional_attention", False):
        raise HFConfigError("use_bidirectional_attention=true: ShardLab trains causal decoders")
    cfg = {"tie_word_embeddings": True} | cfg  # Gemma3TextConfig's default
    model = _base(cfg, seq_len, notes)
    model.update(mlp="geglu", qk_norm=True, sandwich_norm=True, scale_embeddings=True)
    window = read_int(cfg, "sliding_window", None)
    every = _layer_types(cfg, model["n_layers"], "sliding_attention")
    if every is None:
        every = read_int(cfg, "sliding_window_pattern", 6)
    if window is not None:
        model.update(window=window, global_every=every)
    notes.append("Gemma's RMSNorm scales by (1 + w): same parameters, numerics only")
    return model, notes


def _llama4(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    read_str(cfg, "hidden_act", ("silu",))
    model = _base(cfg, seq_len, notes)
    layers = model["n_layers"]
    step = read_int(cfg, "interleave_moe_layer_step", 1)
    moe_layers = read_int_list(cfg, "moe_layers")
    expected = list(range(step - 1, layers, step))
    if moe_layers and moe_layers != expected:
        raise HFConfigError(f"moe_layers={moe_layers!r}: only every interleave_moe_layer_step-th layer "
                            f"({expected[:4]}...) is modelled")
    expert_ffn = read_int(cfg, "intermediate_size")
    model.update(ffn_hidden=read_int(cfg, "intermediate_size_mlp", expert_ffn),
                 n_experts=read_int(cfg, "num_local_experts"), top_k=read_int(cfg, "num_experts_per_tok"),
                 expert_ffn_hidden=expert_ffn, n_shared_experts=1, shared_ffn_hidden=expert_ffn, moe_every=step,
                 router_score="sigmoid")
    interval = read_int(cfg, "no_rope_layer_interval", 4)
    rope_flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(rope_flags, list) or len(rope_flags) != layers or any(f not in (0, 1) for f in rope_flags):
        raise HFConfigError(f"no_rope_layers={cfg.get('no_rope_layers')!r}: expected {layers} flags of 0 / 1")
    every = _pattern([1 - f for f in rope_flags], 1, "no_rope_layers")
    chunk = read_int(cfg, "attention_chunk_size", None)
    if chunk is not None:
        model.update(window=chunk, window_kind="chunked", global_every=every, global_layers_nope=every > 0)
    elif every:
        raise HFConfigError("no_rope_layers without attention_chunk_size: NoPE layers with full attention everywhere "
                            "are not modelled")
    if read_flag(cfg, "use_qk_norm", False):
        notes.append("use_qk_norm: Llama 4's weightless L2 norm of q and k (no parameters; its saved tensors are "
                     "not modelled)")
    notes.append("router: sigmoid of the top-1 logit scales the expert's input in Llama 4; modelled as sigmoid scores")
    return model, notes


def _deepseek(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    family = cfg["model_type"]
    read_str(cfg, "hidden_act", ("silu",))
    _quantized(cfg, notes)
    model = _base(cfg, seq_len, notes)
    model.pop("attn_head_dim", None)
    model["n_kv_heads"] = None  # MLA expands the latent into every head's key and value
    model.update(q_lora_rank=read_int(cfg, "q_lora_rank", None), kv_lora_rank=read_int(cfg, "kv_lora_rank"),
                 qk_nope_head_dim=read_int(cfg, "qk_nope_head_dim"), qk_rope_head_dim=read_int(cfg, "qk_rope_head_dim"),
                 v_head_dim=read_int(cfg, "v_head_dim"))
    experts = read_int(cfg, "n_routed_experts", None)
    if read_int(cfg, "moe_layer_freq", 1) != 1:
        raise HFConfigError(f"moe_layer_freq={cfg['moe_layer_freq']}: DeepSeek's i % freq == 0 interleave is not "
                            "modelled (only every layer after first_k_dense_replace)")
    if experts:
        method = read_str(cfg, "topk_method", ("greedy", "group_limited_greedy", "noaux_tc"),
                          "noaux_tc" if family == "deepseek_v3" else "greedy")
        grouped = method != "greedy"
        shared = read_int(cfg, "n_shared_experts", 0, minimum=0)
        moe_ffn = read_int(cfg, "moe_intermediate_size")
        model.update(n_experts=experts, top_k=read_int(cfg, "num_experts_per_tok"), expert_ffn_hidden=moe_ffn,
                     first_dense_layers=read_int(cfg, "first_k_dense_replace", 0, minimum=0),
                     router_score=read_str(cfg, "scoring_func", ("softmax", "sigmoid"),
                                           "sigmoid" if family == "deepseek_v3" else "softmax"),
                     router_balance_bias=family == "deepseek_v3",
                     expert_groups=read_int(cfg, "n_group", 1) if grouped else 1,
                     topk_groups=read_int(cfg, "topk_group", 1) if grouped else 1)
        if shared:
            model.update(n_shared_experts=shared, shared_ffn_hidden=moe_ffn)
    mtp = read_int(cfg, "num_nextn_predict_layers", 0, minimum=0)
    if mtp:
        notes.append(mtp_note(model, mtp))
    return model, notes


def mtp_note(model: dict[str, Any], modules: int) -> str:
    """The multi-token-prediction module(s), refused by name and counted apart (params.mtp_module_params)."""
    from backend.analytic.params import mtp_module_params
    from backend.spec import ModelSpec

    try:
        unique, stored = mtp_module_params(ModelSpec(**{k: v for k, v in model.items() if k != "source"}))
    except ValueError:  # an invalid shape: from_hf_config's own check names the key
        return f"num_nextn_predict_layers={modules}: the multi-token-prediction module is not modelled"
    return (f"num_nextn_predict_layers={modules}: the multi-token-prediction module (model.layers.{model['n_layers']} "
            "in the checkpoint) is not modelled: ShardLab trains the next-token objective only, as transformers builds "
            f"the model; counted apart: {modules} x {unique:,} parameters (enorm, hnorm, eh_proj, one MoE block, "
            f"shared_head.norm), {modules} x {stored:,} stored with its embedding and head copies (DeepSeek-V3 "
            "README_WEIGHTS.md: 11.5B unique + 0.9B + 0.9B)")


_QWEN3_KEYS = _BASE + ("head_dim", "use_sliding_window", "max_window_layers", "layer_types", "attention_bias")
_MOE_FIELDS = {"num_experts_per_tok": "top_k", "moe_intermediate_size": "expert_ffn_hidden"}
NEW_FAMILIES: dict[str, NewFamily] = {
    "qwen3": NewFamily(_QWEN3_KEYS, _BASE_FIELDS | {"intermediate_size": "ffn_hidden"}, _qwen3),
    "qwen3_moe": NewFamily(_QWEN3_KEYS + ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                          "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"),
                           _BASE_FIELDS | _MOE_FIELDS | {"num_experts": "n_experts",
                                                         "decoder_sparse_step": "moe_every"},
                           _qwen3),
    "gpt_oss": NewFamily(_BASE + ("head_dim", "num_local_experts", "num_experts_per_tok", "experts_per_token",
                                  "sliding_window", "layer_types", "swiglu_limit", "initial_context_length",
                                  "quantization_config", "attention_bias"),
                         _BASE_FIELDS | {"num_local_experts": "n_experts", "num_experts_per_tok": "top_k",
                                         "intermediate_size": "expert_ffn_hidden"}, _gpt_oss),
    "gemma3_text": NewFamily(_BASE + ("head_dim", "hidden_activation", "query_pre_attn_scalar", "sliding_window",
                                      "sliding_window_pattern", "layer_types", "rope_local_base_freq",
                                      "attn_logit_softcapping", "final_logit_softcapping", "cache_implementation",
                                      "use_bidirectional_attention", "attention_bias"),
                             _BASE_FIELDS | {"intermediate_size": "ffn_hidden", "sliding_window": "window"}, _gemma3),
    "llama4_text": NewFamily(_BASE + ("head_dim", "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok",
                                      "interleave_moe_layer_step", "moe_layers", "no_rope_layers",
                                      "no_rope_layer_interval", "attention_chunk_size", "use_qk_norm",
                                      "attn_temperature_tuning", "floor_scale", "attn_scale", "for_llm_compressor",
                                      "attention_bias"),
                             _BASE_FIELDS | {"num_local_experts": "n_experts", "num_experts_per_tok": "top_k",
                                             "intermediate_size": "expert_ffn_hidden",
                                             "intermediate_size_mlp": "ffn_hidden", "attention_chunk_size": "window"},
                             _llama4),
}
_DEEPSEEK_KEYS = _BASE + ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                          "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "first_k_dense_replace", "moe_layer_freq", "topk_method", "scoring_func", "n_group",
                          "topk_group", "routed_scaling_factor", "num_nextn_predict_layers", "aux_loss_alpha",
                          "seq_aux", "ep_size", "rope_interleave", "quantization_config", "attention_bias")
_DEEPSEEK_FIELDS = _BASE_FIELDS | _MOE_FIELDS | {
    "intermediate_size": "ffn_hidden", "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "n_routed_experts": "n_experts", "first_k_dense_replace": "first_dense_layers", "n_group": "expert_groups",
    "topk_group": "topk_groups", "n_shared_experts": "n_shared_experts"}
NEW_FAMILIES["deepseek_v3"] = NewFamily(_DEEPSEEK_KEYS, _DEEPSEEK_FIELDS, _deepseek)
NEW_FAMILIES["deepseek_v2"] = NewFamily(_DEEPSEEK_KEYS, _DEEPSEEK_FIELDS, _deepseek)
