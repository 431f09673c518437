"""Hugging Face `config.json` -> ModelSpec fields, offline (the user gives the file).

Families: llama, mistral, mixtral, qwen2, qwen2_moe, gpt2, gpt_neox. Every key of the config is either
mapped to a ModelSpec field, checked to hold the one value ShardLab models, listed as not changing the
shapes, memory or FLOPs ShardLab predicts (token ids, init, numerics such as rope_theta), or refused with
its name. Nothing is silently ignored: accepted-but-unmodelled numerics are returned as notes.

Refused: MLA (kv_lora_rank / q_lora_rank), parallel attention + MLP blocks (GPT-NeoX use_parallel_residual),
a sliding window shorter than the sequence, partial MoE layouts (decoder_sparse_step != 1, mlp_only_layers),
quantized checkpoints, head_dim != hidden / heads, unknown keys and unknown model types.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gpt2", "gpt_neox")
DEFAULT_SEQ_CAP = 8192

# Keys that change nothing ShardLab predicts (ids, init, caching, dtype of the checkpoint, framework metadata).
_METADATA = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
             "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "_name_or_path", "auto_map",
             "tokenizer_class", "vocab_file", "task_specific_params", "id2label", "label2id", "return_dict",
             "output_hidden_states", "output_attentions", "is_decoder", "max_length", "sep_token_id"}
# Numerics that change values, not shapes/memory/FLOPs: accepted, reported as a note.
_NUMERICS = {"rope_theta", "rope_scaling", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "pretraining_tp",
             "router_aux_loss_coef", "output_router_logits", "router_jitter_noise", "norm_topk_prob", "rotary_emb_base",
             "rotary_pct", "scale_attn_weights", "reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx",
             "use_sliding_window", "max_window_layers", "router_z_loss_coef", "classifier_dropout", "summary_type",
             "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
             "n_ctx", "max_position_embeddings", "sliding_window", "head_dim", "hidden_act", "activation_function",
             "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "use_parallel_residual",
             "mlp_bias", "attention_bias", "tie_word_embeddings", "bos_token", "eos_token", "rope_parameters"}
_DROPOUT = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")
_REFUSED = {"kv_lora_rank": "MLA (multi-head latent attention) is not modelled",
            "q_lora_rank": "MLA (multi-head latent attention) is not modelled",
            "quantization_config": "quantized weights are not modelled (ShardLab counts fp32/bf16 weights)",
            "first_k_dense_replace": "mixed dense/MoE layer stacks are not modelled",
            "layer_types": "per-layer attention types are not modelled"}


class HFConfigError(ValueError):
    """A config ShardLab cannot model; the message names the field."""


def load_hf_config(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        raise HFConfigError(f"cannot read HF config {path}: {e}") from e
    return parse_hf_config(text, name=str(path))


def parse_hf_config(text: str | bytes, *, name: str = "config.json") -> dict[str, Any]:
    """The JSON object of a config.json's text (an upload or a file); HFConfigError when it is not one."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HFConfigError(f"cannot read HF config {name}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise HFConfigError(f"{name} is not a JSON object (got a {type(data).__name__})")
    return data


def from_hf_config(cfg: dict[str, Any], *, seq_len: int | None = None, file: str | None = None
                   ) -> tuple[dict[str, Any], list[str]]:
    """(ModelSpec fields with `source` = the config, notes). Raises HFConfigError naming the field it refuses, lacks
    or cannot read; no other exception."""
    if not isinstance(cfg, dict):
        raise HFConfigError(f"a config.json must be a JSON object (got a {type(cfg).__name__})")
    family = cfg.get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        raise HFConfigError(f"model_type={family!r} is not supported (supported: {', '.join(FAMILIES)})")
    for key, why in _REFUSED.items():
        if cfg.get(key) not in (None, [], {}):
            raise HFConfigError(f"{key}={cfg[key]!r}: {why}")
    known = _METADATA | _NUMERICS | set(_FAMILY_KEYS[family])
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
        raise HFConfigError(f"unknown config key(s) {', '.join(unknown)} for model_type {family}: ShardLab cannot tell "
                            "whether they change the architecture, so it refuses rather than ignore them")
    model, notes = (_gpt2 if family == "gpt2" else _neox if family == "gpt_neox" else _llama_like)(cfg, seq_len)
    notes += [f"{k}={cfg[k]!r}: dropout is not modelled (ShardLab trains without dropout)"
              for k in _DROPOUT if cfg.get(k)]
    numerics = sorted(k for k in cfg if k in ("rope_theta", "rope_scaling", "norm_topk_prob", "rotary_pct",
                                             "scale_attn_by_inverse_layer_idx") and cfg[k] not in (None, False))
    if numerics:
        notes.append("accepted as numerics only (no effect on shapes, memory or FLOPs): " + ", ".join(numerics))
    _check_fields(model, family)
    model["source"] = {"hf_config": cfg, **({"file": file} if file else {})}
    return model, notes


def _check_fields(model: dict[str, Any], family: str) -> None:
    """The mapped fields against ModelSpec's own bounds, each error named by the config key it came from."""
    from pydantic import ValidationError

    from backend.spec import ModelSpec

    try:
        ModelSpec(**model)
    except ValidationError as e:
        origin = {ours: theirs for theirs, ours in _FIELD_NAMES[family].items()}
        err = e.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else "model"
        key = origin.get(field, field)
        raise HFConfigError(f"{key}={err.get('input')!r}: {err.get('msg', 'invalid')} (ShardLab's {field})") from None


_REQUIRED = object()


def _family(cfg: dict[str, Any]) -> str:
    return str(cfg.get("model_type"))


def _int(cfg: dict[str, Any], key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
    """cfg[key] as an integer >= minimum; `default` when absent or null (HFConfigError naming the key otherwise)."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise HFConfigError(f"config.json lacks {key}, which model_type {_family(cfg)} needs")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise HFConfigError(f"{key}={value!r} must be an integer >= {minimum}")
    return value


def _num(cfg: dict[str, Any], key: str, default: float) -> float:
    """cfg[key] as a positive finite number, `default` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise HFConfigError(f"{key}={value!r} must be a positive number")
    return float(value)


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """cfg[key] as true/false, `default` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HFConfigError(f"{key}={value!r} must be true or false")
    return value


def _seq(cfg: dict[str, Any], seq_len: int | None, max_key: str, notes: list[str]) -> int:
    max_pos = _int(cfg, max_key, None)
    if seq_len is None:
        seq_len = min(max_pos or DEFAULT_SEQ_CAP, DEFAULT_SEQ_CAP)
        notes.append(f"seq_len={seq_len} (from {max_key}={max_pos}, capped at {DEFAULT_SEQ_CAP}); set --seq to change")
    elif max_pos and seq_len > max_pos:
        raise HFConfigError(f"seq_len={seq_len} exceeds {max_key}={max_pos}")
    return seq_len


def _heads(cfg: dict[str, Any], h: int, heads: int) -> None:
    hd = _int(cfg, "head_dim", None)
    if h % heads:
        raise HFConfigError(f"num_attention_heads={heads} does not divide hidden_size={h}")
    if hd is not None and hd != h // heads:
        raise HFConfigError(f"head_dim={hd} != hidden_size / num_attention_heads = {h} / {heads} = {h // heads}: "
                            "decoupled head sizes are not modelled")


def _act(cfg: dict[str, Any], key: str, allowed: tuple[str, ...]) -> None:
    if cfg.get(key) is not None and cfg[key] not in allowed:
        raise HFConfigError(f"{key}={cfg[key]!r} is not modelled (expected one of {', '.join(allowed)})")


def _llama_like(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    family, notes = cfg["model_type"], []
    h, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    _heads(cfg, h, heads)
    _act(cfg, "hidden_act", ("silu",))
    window = _int(cfg, "sliding_window", None)
    windowed = window is not None and (family in ("mistral", "mixtral") or _flag(cfg, "use_sliding_window", False))
    if seq_len is None and windowed and window < min(_int(cfg, "max_position_embeddings", None) or DEFAULT_SEQ_CAP, DEFAULT_SEQ_CAP):
        seq_len = window
        notes.append(f"seq_len={window}: the sliding window (every key inside it, so full causal attention); set --seq to change")
    seq = _seq(cfg, seq_len, "max_position_embeddings", notes)
    if windowed and window < seq:
        raise HFConfigError(f"sliding_window={window} < seq_len={seq}: windowed attention is not modelled "
                            f"(use --seq {window} or less)")
    bias = "qkv" if family.startswith("qwen2") else "none"
    attn_b, mlp_b = _flag(cfg, "attention_bias", False), _flag(cfg, "mlp_bias", False)
    if family == "llama" and (attn_b or mlp_b):
        if not (attn_b and mlp_b):
            raise HFConfigError(f"attention_bias={attn_b}, mlp_bias={mlp_b}: q/k/v/o biases without MLP biases "
                                "(or the reverse) are not modelled; only none, all, or q/k/v only")
        bias = "all"
    model = dict(vocab_size=_int(cfg, "vocab_size"), d_model=h, n_layers=_int(cfg, "num_hidden_layers"), n_heads=heads,
                 n_kv_heads=_int(cfg, "num_key_value_heads", None), ffn_hidden=_int(cfg, "intermediate_size"),
                 seq_len=seq, norm="rmsnorm", mlp="swiglu", positions="rope", bias=bias,
                 tie_embeddings=_flag(cfg, "tie_word_embeddings", False), norm_eps=_num(cfg, "rms_norm_eps", 1e-6))
    if model["n_kv_heads"] == heads:
        model["n_kv_heads"] = None
    if family == "mixtral":
        model.update(n_experts=_int(cfg, "num_local_experts"), top_k=_int(cfg, "num_experts_per_tok"))
    if family == "qwen2_moe":
        if _int(cfg, "decoder_sparse_step", 1) != 1:
            raise HFConfigError(f"decoder_sparse_step={cfg['decoder_sparse_step']}: only every layer MoE (1) is modelled")
        if cfg.get("mlp_only_layers"):
            raise HFConfigError(f"mlp_only_layers={cfg['mlp_only_layers']!r}: mixed dense/MoE stacks are not modelled")
        shared = _int(cfg, "shared_expert_intermediate_size", 0, minimum=0)
        model.update(n_experts=_int(cfg, "num_experts"), top_k=_int(cfg, "num_experts_per_tok"),
                     expert_ffn_hidden=_int(cfg, "moe_intermediate_size"))
        if shared:  # Qwen2MoeSparseMoeBlock: one shared expert MLP plus a sigmoid gate Linear(h, 1, bias=False)
            model.update(n_shared_experts=1, shared_ffn_hidden=shared, shared_expert_gate=True)
    return model, notes


def _gpt2(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    h, heads = _int(cfg, "n_embd"), _int(cfg, "n_head")
    _heads(cfg, h, heads)
    _act(cfg, "activation_function", ("gelu_new", "gelu", "gelu_pytorch_tanh"))
    n_pos = _int(cfg, "n_positions")
    if seq_len is not None and seq_len != n_pos:
        notes.append(f"seq_len={seq_len}: learned positions get {seq_len} rows (the checkpoint has n_positions={n_pos})")
    model = dict(vocab_size=_int(cfg, "vocab_size"), d_model=h, n_layers=_int(cfg, "n_layer"), n_heads=heads,
                 ffn_hidden=_int(cfg, "n_inner", 4 * h), seq_len=seq_len or n_pos, norm="layernorm", mlp="gelu",
                 positions="learned", bias="all", tie_embeddings=_flag(cfg, "tie_word_embeddings", True),
                 norm_eps=_num(cfg, "layer_norm_epsilon", 1e-5))
    return model, notes


def _neox(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    if _flag(cfg, "use_parallel_residual", True):
        raise HFConfigError("use_parallel_residual=true: parallel attention + MLP blocks (x + attn(ln1 x) + mlp(ln2 x)) "
                            "are not modelled; ShardLab's blocks are sequential")
    h, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    _heads(cfg, h, heads)
    _act(cfg, "hidden_act", ("gelu", "gelu_new", "gelu_fast"))
    if not _flag(cfg, "attention_bias", True):
        raise HFConfigError("attention_bias=false with MLP biases is not modelled")
    seq = _seq(cfg, seq_len, "max_position_embeddings", notes)
    if _num(cfg, "rotary_pct", 1.0) != 1.0:
        notes.append(f"rotary_pct={cfg['rotary_pct']}: RoPE on part of each head changes no parameter or saved tensor")
    model = dict(vocab_size=_int(cfg, "vocab_size"), d_model=h, n_layers=_int(cfg, "num_hidden_layers"), n_heads=heads,
                 ffn_hidden=_int(cfg, "intermediate_size"), seq_len=seq, norm="layernorm", mlp="gelu", positions="rope",
                 bias="all", tie_embeddings=_flag(cfg, "tie_word_embeddings", False),
                 norm_eps=_num(cfg, "layer_norm_eps", 1e-5))
    return model, notes


_LLAMA_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layers",
                 "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "intermediate_size": "ffn_hidden",
                 "max_position_embeddings": "seq_len", "rms_norm_eps": "norm_eps"}
_FIELD_NAMES: dict[str, dict[str, str]] = {  # config key -> ModelSpec field, to name errors by the config's key
    **{f: _LLAMA_FIELDS for f in ("llama", "mistral", "qwen2")},
    "mixtral": _LLAMA_FIELDS | {"num_local_experts": "n_experts", "num_experts_per_tok": "top_k"},
    "qwen2_moe": _LLAMA_FIELDS | {"num_experts": "n_experts", "num_experts_per_tok": "top_k",
                                  "moe_intermediate_size": "expert_ffn_hidden",
                                  "shared_expert_intermediate_size": "shared_ffn_hidden"},
    "gpt2": {"vocab_size": "vocab_size", "n_embd": "d_model", "n_layer": "n_layers", "n_head": "n_heads",
             "n_inner": "ffn_hidden", "n_positions": "seq_len", "layer_norm_epsilon": "norm_eps"},
    "gpt_neox": _LLAMA_FIELDS | {"layer_norm_eps": "norm_eps"},
}
_LLAMA_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size")
_FAMILY_KEYS: dict[str, tuple[str, ...]] = {
    "llama": _LLAMA_KEYS,
    "mistral": _LLAMA_KEYS,
    "qwen2": _LLAMA_KEYS,
    "mixtral": _LLAMA_KEYS + ("num_local_experts", "num_experts_per_tok"),
    "qwen2_moe": _LLAMA_KEYS + ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers"),
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner"),
    "gpt_neox": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"),
}
