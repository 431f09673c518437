"""Hugging Face `config.json` -> ModelSpec fields, offline (the user gives the file).

Families: llama, mistral, mixtral, qwen2, qwen2_moe, gpt2, gpt_neox here; deepseek_v3, deepseek_v2, qwen3, qwen3_moe,
gpt_oss, gemma3_text and llama4_text (and llama4's text_config) in backend/hf/families.py. Every key of the config is
either mapped to a ModelSpec field, checked to hold the one value ShardLab models, listed as not changing the
shapes, memory or FLOPs ShardLab predicts (token ids, init, numerics such as rope_theta), or refused with
its name. Nothing is silently ignored: accepted-but-unmodelled numerics are returned as notes.

Refused: MLA (kv_lora_rank / q_lora_rank), parallel attention + MLP blocks (GPT-NeoX use_parallel_residual),
a sliding window shorter than the sequence, partial MoE layouts (decoder_sparse_step != 1, mlp_only_layers),
quantized checkpoints, head_dim != hidden / heads, unknown keys and unknown model types.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backend.hf.families import NEW_FAMILIES, new_family_model
from backend.hf.reads import DEFAULT_SEQ_CAP, HFConfigError
from backend.hf.reads import read_flag as _flag
from backend.hf.reads import read_int as _int
from backend.hf.reads import read_num as _num
from backend.hf.reads import read_seq as _seq
from backend.spec.user_text import InputError, check_depth, load_json_file, load_json_text

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gpt2", "gpt_neox") + tuple(NEW_FAMILIES)

# Keys that change nothing ShardLab predicts (ids, init, caching, dtype of the checkpoint, framework metadata).
_METADATA = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
             "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "_name_or_path", "auto_map",
             "tokenizer_class", "vocab_file", "task_specific_params", "id2label", "label2id", "return_dict",
             "output_hidden_states", "output_attentions", "is_decoder", "max_length", "sep_token_id",
             "_attn_implementation_autoset"}
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


def load_hf_config(path: str | Path) -> dict[str, Any]:
    try:
        data = load_json_file(path, "HF config")
    except InputError as e:
        raise HFConfigError(str(e)) from None
    if not isinstance(data, dict):
        raise HFConfigError(f"HF config {path} is not a JSON object (got a {type(data).__name__})")
    return data


def parse_hf_config(text: str | bytes, *, name: str = "config.json") -> dict[str, Any]:
    """The JSON object of a config.json's text (an upload or a file); HFConfigError when it is not one (or is too
    big or nested too deep: backend/spec/user_text.py limits)."""
    try:
        data = load_json_text(text, name)
    except InputError as e:
        raise HFConfigError(str(e)) from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{name} is not a JSON object (got a {type(data).__name__})")
    return data


def from_hf_config(cfg: dict[str, Any], *, seq_len: int | None = None, file: str | None = None
                   ) -> tuple[dict[str, Any], list[str]]:
    """(ModelSpec fields with `source` = the config's parsed fields, notes). Raises HFConfigError naming the field
    it refuses, lacks or cannot read; no other exception. `source` keeps every key the mapping reads or reports
    (not ids, labels or other metadata), so a run stores what shaped its model, never a whole uploaded file."""
    if not isinstance(cfg, dict):
        raise HFConfigError(f"a config.json must be a JSON object (got a {type(cfg).__name__})")
    try:
        check_depth(cfg, "the HF config")
    except InputError as e:
        raise HFConfigError(str(e)) from None
    wrapper_notes: list[str] = []
    if isinstance(cfg.get("model_type"), str) and cfg["model_type"] in MULTIMODAL_WRAPPERS:
        cfg, wrapper_notes = text_model_config(cfg)
    family = cfg.get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        raise HFConfigError(f"model_type={family!r} is not supported (supported: {', '.join(FAMILIES)})")
    new = NEW_FAMILIES.get(family)
    for key, why in _REFUSED.items():
        if cfg.get(key) not in (None, [], {}) and not (new and key in new.keys):
            raise HFConfigError(f"{key}={cfg[key]!r}: {why}")
    known = _METADATA | _NUMERICS | set(new.keys if new else _FAMILY_KEYS[family])
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
        raise HFConfigError(f"unknown config key(s) {', '.join(unknown)} for model_type {family}: ShardLab cannot tell "
                            "whether they change the architecture, so it refuses rather than ignore them")
    try:
        if new:
            model, notes = new_family_model(cfg, seq_len)
        else:
            model, notes = (_gpt2 if family == "gpt2" else _neox if family == "gpt_neox" else _llama_like)(cfg, seq_len)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        if isinstance(e, HFConfigError):
            raise
        raise HFConfigError(f"model_type {family}: a field has a value ShardLab cannot use "
                            f"({type(e).__name__}: {e})") from None
    notes += [f"{k}={cfg[k]!r}: dropout is not modelled (ShardLab trains without dropout)"
              for k in _DROPOUT if cfg.get(k)]
    numerics = sorted(k for k in cfg if k in ("rope_theta", "rope_scaling", "norm_topk_prob", "rotary_pct",
                                             "scale_attn_by_inverse_layer_idx") and cfg[k] not in (None, False))
    if numerics:
        notes.append("accepted as numerics only (no effect on shapes, memory or FLOPs): " + ", ".join(numerics))
    notes = wrapper_notes + notes
    _check_fields(model, family)
    model["source"] = {"hf_config": parsed_fields(cfg), **({"file": file} if file else {})}
    return model, notes


MULTIMODAL_WRAPPERS = {"llama4": ("llama4_text", {"boi_token_index", "eoi_token_index", "image_token_index",
                                                   "vision_config", "text_config"})}
"""Published config.json files of image-text models whose text model ShardLab builds: model_type -> (text
model_type, top-level keys besides the metadata)."""


def text_model_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The text_config of a multimodal release (Llama 4's Llama4ForConditionalGeneration), with a note that the vision
    encoder and projector are not built: text-only training and transformers' Llama4ForCausalLM use the text model."""
    text_type, keys = MULTIMODAL_WRAPPERS[cfg["model_type"]]
    unknown = sorted(k for k in cfg if k not in keys | _METADATA)
    if unknown:
        raise HFConfigError(f"unknown config key(s) {', '.join(unknown)} for model_type {cfg['model_type']}")
    text = cfg.get("text_config")
    if not isinstance(text, dict) or text.get("model_type", text_type) != text_type:
        raise HFConfigError(f"text_config must be a JSON object of model_type {text_type} (got {text!r:.80})")
    note = (f"model_type {cfg['model_type']}: the text model (text_config, {text_type}) is built; the vision encoder "
            "and projector (vision_config) are not modelled: text training does not run them")
    return {"model_type": text_type} | text, [note]


def _check_fields(model: dict[str, Any], family: str) -> None:
    """The mapped fields against ModelSpec's own bounds, each error named by the config key it came from."""
    from pydantic import ValidationError

    from backend.spec import ModelSpec

    try:
        ModelSpec(**model)
    except ValidationError as e:
        names = NEW_FAMILIES[family].field_names if family in NEW_FAMILIES else _FIELD_NAMES[family]
        origin = {ours: theirs for theirs, ours in names.items()}
        err = e.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else "model"
        key = origin.get(field, field)
        raise HFConfigError(f"{key}={err.get('input')!r}: {err.get('msg', 'invalid')} (ShardLab's {field})") from None


def parsed_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The part of a config.json a run keeps: model_type and every key the mapping reads or reports, without
    ids, labels, tokenizer and framework metadata."""
    return {k: v for k, v in cfg.items() if k == "model_type" or k not in _METADATA}


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
    if seq_len is None and windowed and window < min(_int(cfg, "max_position_embeddings", None) or DEFAULT_SEQ_CAP,
                                                     DEFAULT_SEQ_CAP):
        seq_len = window
        notes.append(f"seq_len={window}: the sliding window (every key inside it, so full causal attention); set --seq "
                     "to change")
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
            raise HFConfigError(f"decoder_sparse_step={cfg['decoder_sparse_step']}: only every layer MoE (1) is "
                                "modelled")
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
        notes.append(f"seq_len={seq_len}: learned positions get {seq_len} rows (the checkpoint has "
                     f"n_positions={n_pos})")
    model = dict(vocab_size=_int(cfg, "vocab_size"), d_model=h, n_layers=_int(cfg, "n_layer"), n_heads=heads,
                 ffn_hidden=_int(cfg, "n_inner", 4 * h), seq_len=seq_len or n_pos, norm="layernorm", mlp="gelu",
                 positions="learned", bias="all", tie_embeddings=_flag(cfg, "tie_word_embeddings", True),
                 norm_eps=_num(cfg, "layer_norm_epsilon", 1e-5))
    return model, notes


def _neox(cfg: dict[str, Any], seq_len: int | None) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    if _flag(cfg, "use_parallel_residual", True):
        raise HFConfigError("use_parallel_residual=true: parallel attention + MLP blocks (x + attn(ln1 x) + mlp(ln2 "
                            "x)) are not modelled; ShardLab's blocks are sequential")
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
                 "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
                 "intermediate_size": "ffn_hidden", "max_position_embeddings": "seq_len", "rms_norm_eps": "norm_eps"}
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
