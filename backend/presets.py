"""Named model shapes with their published parameter counts (pure data, no torch).

Each preset is a `ModelSpec` field dict taken from the model's published config.json (Hugging Face Hub)
or paper table, plus the parameter count its publisher reports and where that number comes from. The
tests (tests/unit/test_presets.py) hold `count_params` to those counts to the parameter.
`seq_len` is the pre-training sequence length (it only changes parameters for learned positions).

`scaled_for_cpu` shrinks a preset to something the CPU engine runs in seconds while keeping its family
(norm, MLP type, positions, tying, biases, GQA ratio, MoE routing with shared experts, attention kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    name: str
    model: dict[str, Any]
    """ModelSpec fields."""
    published_params: int
    """Parameter count as published (exact unless `approx` says otherwise)."""
    source: str
    """Where the count and the shape come from."""
    approx: bool = False
    """True when the publisher gives only a rounded count (GPT-3: "175.0B")."""
    hf_family: str | None = None
    """model_type of the matching Hugging Face config.json, if any."""
    notes: tuple[str, ...] = field(default_factory=tuple)


_GPT2 = dict(norm="layernorm", mlp="gelu", positions="learned", tie_embeddings=True, bias="all", vocab_size=50257)
_LLAMA = dict(norm="rmsnorm", mlp="swiglu", positions="rope", tie_embeddings=False, bias="none")
_KERAS = ("keras-hub presets (keras_hub/src/models/{}_presets.py, \"params\" of {}), = Hugging Face Hub safetensors "
          "total of {}")
_HF = "Hugging Face Hub safetensors parameter total of {} (config.json shape as given)"
_TF = ("Hugging Face transformers 5.24 {cls} built on the meta device from {repo}'s published config.json "
       "(tests/fixtures/hf/{file}; tests/unit/test_families_2026.py). {card}")
_DS = dict(_LLAMA, n_kv_heads=None, router_score="sigmoid", router_balance_bias=True)
_OSS = dict(_LLAMA, bias="all", mlp="swiglu_clamped", n_heads=64, n_kv_heads=8, attn_head_dim=64, attention_sinks=True,
            router_bias=True, window=128, global_every=2, vocab_size=201088, d_model=2880, ffn_hidden=2880,
            expert_ffn_hidden=2880, top_k=4, seq_len=4096)
_L4 = dict(_LLAMA, vocab_size=202048, d_model=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_hidden=16384,
           seq_len=8192, top_k=1, expert_ffn_hidden=8192, n_shared_experts=1, shared_ffn_hidden=8192,
           router_score="sigmoid", window=8192, window_kind="chunked", global_every=4, global_layers_nope=True)
_Q3 = dict(_LLAMA, qk_norm=True, vocab_size=151936, seq_len=4096)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("gpt2", dict(_GPT2, d_model=768, n_layers=12, n_heads=12, ffn_hidden=3072, seq_len=1024), 124_439_808,
           _KERAS.format("gpt2/gpt2", "gpt2_base_en", "openai-community/gpt2"), hf_family="gpt2"),
    Preset("gpt2-xl", dict(_GPT2, d_model=1600, n_layers=48, n_heads=25, ffn_hidden=6400, seq_len=1024), 1_557_611_200,
           _KERAS.format("gpt2/gpt2", "gpt2_extra_large_en", "openai-community/gpt2-xl"), hf_family="gpt2"),
    Preset("gpt3-175b", dict(_GPT2, d_model=12288, n_layers=96, n_heads=96, ffn_hidden=49152, seq_len=2048),
           175_000_000_000, "Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1 (GPT-3 175B: "
           "n_layers 96, d_model 12288, n_heads 96, n_ctx 2048, GPT-2 architecture and vocabulary): '175.0B'",
           approx=True, notes=("Only the rounded 175.0B is published; the GPT-2 layout gives 174.6B.",)),
    Preset("llama-2-7b", dict(_LLAMA, vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=11008,
                              seq_len=4096), 6_738_415_616,
           _KERAS.format("llama/llama", "llama2_7b_en", "meta-llama/Llama-2-7b-hf"), hf_family="llama"),
    Preset("llama-2-13b", dict(_LLAMA, vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, ffn_hidden=13824,
                               seq_len=4096), 13_015_864_320, _HF.format("meta-llama/Llama-2-13b-hf"),
           hf_family="llama"),
    Preset("llama-2-70b", dict(_LLAMA, vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                               ffn_hidden=28672, seq_len=4096), 68_976_648_192,
           _HF.format("meta-llama/Llama-2-70b-hf"), hf_family="llama"),
    Preset("llama-3-8b", dict(_LLAMA, vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                              ffn_hidden=14336, seq_len=8192), 8_030_261_248,
           _KERAS.format("llama3/llama3", "llama3_8b_en", "meta-llama/Meta-Llama-3-8B"), hf_family="llama"),
    Preset("llama-3-70b", dict(_LLAMA, vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                               ffn_hidden=28672, seq_len=8192), 70_553_706_496,
           _HF.format("meta-llama/Meta-Llama-3-70B"), hf_family="llama"),
    Preset("llama-3.1-405b", dict(_LLAMA, vocab_size=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                  ffn_hidden=53248, seq_len=8192), 405_853_388_800,
           _HF.format("meta-llama/Llama-3.1-405B"), hf_family="llama"),
    Preset("mistral-7b", dict(_LLAMA, vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                              ffn_hidden=14336, seq_len=4096), 7_241_732_096,
           _KERAS.format("mistral/mistral", "mistral_7b_en", "mistralai/Mistral-7B-v0.1"), hf_family="mistral",
           notes=("sliding_window 4096: seq_len 4096 keeps every key in the window (full causal attention).",)),
    Preset("mixtral-8x7b", dict(_LLAMA, vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                ffn_hidden=14336, seq_len=4096, n_experts=8, top_k=2), 46_702_792_704,
           _KERAS.format("mixtral/mixtral", "mixtral_8_7b_en", "mistralai/Mixtral-8x7B-v0.1"), hf_family="mixtral"),
    Preset("mixtral-8x22b", dict(_LLAMA, vocab_size=32000, d_model=6144, n_layers=56, n_heads=48, n_kv_heads=8,
                                 ffn_hidden=16384, seq_len=4096, n_experts=8, top_k=2), 140_620_634_112,
           _HF.format("mistral-community/Mixtral-8x22B-v0.1"), hf_family="mixtral"),
    Preset("qwen2.5-0.5b", dict(_LLAMA, bias="qkv", tie_embeddings=True, vocab_size=151936, d_model=896, n_layers=24,
                                n_heads=14, n_kv_heads=2, ffn_hidden=4864, seq_len=8192), 494_032_768,
           _KERAS.format("qwen/qwen", "qwen2.5_0.5b_en", "Qwen/Qwen2.5-0.5B"), hf_family="qwen2"),
    Preset("qwen1.5-moe-a2.7b", dict(_LLAMA, bias="qkv", vocab_size=151936, d_model=2048, n_layers=24, n_heads=16,
                                     ffn_hidden=5632, seq_len=8192, n_experts=60, top_k=4, expert_ffn_hidden=1408,
                                     n_shared_experts=1, shared_ffn_hidden=5632, shared_expert_gate=True),
           14_315_784_192, _KERAS.format("qwen_moe/qwen_moe", "qwen1.5_moe_2.7b_en", "Qwen/Qwen1.5-MoE-A2.7B"),
           hf_family="qwen2_moe",
           notes=("Fine-grained MoE with a gated shared expert (DeepSeekMoE-style): 60 routed experts of 1408, "
                  "top-4, plus one always-on shared expert of 5632 = 4 x 1408.",)),
    # issue 24: the 2026 families (counts = transformers' model of the published config.json, to the parameter)
    Preset("deepseek-v3", dict(_DS, vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, ffn_hidden=18432,
                               seq_len=4096, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128, n_experts=256, top_k=8, expert_ffn_hidden=2048,
                               first_dense_layers=3, expert_groups=8, topk_groups=4, n_shared_experts=1,
                               shared_ffn_hidden=2048),
           671_026_404_352,
           _TF.format(cls="DeepseekV3ForCausalLM", repo="deepseek-ai/DeepSeek-V3", file="deepseek-v3.json",
                                       card="Model card: 671B total, 37B active."), hf_family="deepseek_v3",
           notes=("MLA, 256 routed experts top-8 in 8 groups (top-4 groups), sigmoid scores with the balance bias, one "
                  "shared expert, 3 dense blocks first.",
                  "Not counted (as in transformers and the 671B card): the MTP module (model.layers.61: 11,610,067,968 "
                  "unique parameters, 13,463,426,048 stored with its embedding and head copies; not modelled: ShardLab "
                  "trains the next-token objective only) and the 58 x 256 e_score_correction_bias buffer values (the "
                  "main model's safetensors total 671,026,419,200).")),
    Preset("deepseek-v2.5", dict(_LLAMA, n_kv_heads=None, vocab_size=102400, d_model=5120, n_layers=60, n_heads=128,
                                 ffn_hidden=12288, seq_len=4096, q_lora_rank=1536, kv_lora_rank=512,
                                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_experts=160, top_k=6,
                                 expert_ffn_hidden=1536, first_dense_layers=1, expert_groups=8, topk_groups=3,
                                 n_shared_experts=2, shared_ffn_hidden=1536),
           235_741_434_880, _TF.format(cls="DeepseekV2ForCausalLM", repo="deepseek-ai/DeepSeek-V2.5",
                                       file="deepseek-v2.5.json", card="Model card: 236B total, 21B active."),
           hf_family="deepseek_v2"),
    Preset("qwen3-8b", dict(_Q3, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=12288), 8_190_735_360,
           _TF.format(cls="Qwen3ForCausalLM", repo="Qwen/Qwen3-8B", file="qwen3-8b.json", card="Model card: 8.2B."),
           hf_family="qwen3"),
    Preset("qwen3-30b-a3b", dict(_Q3, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden=6144,
                                 attn_head_dim=128, n_experts=128, top_k=8, expert_ffn_hidden=768), 30_532_122_624,
           _TF.format(cls="Qwen3MoeForCausalLM", repo="Qwen/Qwen3-30B-A3B", file="qwen3-30b-a3b.json",
                      card="Model card: 30.5B total, 3.3B active."), hf_family="qwen3_moe"),
    Preset("qwen3-235b-a22b", dict(_Q3, d_model=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden=12288,
                                   attn_head_dim=128, n_experts=128, top_k=8, expert_ffn_hidden=1536), 235_093_634_560,
           _TF.format(cls="Qwen3MoeForCausalLM", repo="Qwen/Qwen3-235B-A22B", file="qwen3-235b-a22b.json",
                      card="Model card: 235B total, 22B active."), hf_family="qwen3_moe"),
    Preset("gpt-oss-20b", dict(_OSS, n_layers=24, n_experts=32), 20_914_757_184,
           _TF.format(cls="GptOssForCausalLM", repo="openai/gpt-oss-20b", file="gpt-oss-20b.json",
                      card="Model card: 20.91B total, 3.61B active."), hf_family="gpt_oss"),
    Preset("gpt-oss-120b", dict(_OSS, n_layers=36, n_experts=128), 116_829_156_672,
           _TF.format(cls="GptOssForCausalLM", repo="openai/gpt-oss-120b", file="gpt-oss-120b.json",
                      card="Model card: 116.83B total, 5.13B active."), hf_family="gpt_oss",
           notes=("The MXFP4 checkpoint stores the experts in 4-bit blocks: bytes on disk, not parameters.",)),
    Preset("gemma-3-1b", dict(_LLAMA, mlp="geglu", tie_embeddings=True, vocab_size=262144, d_model=1152, n_layers=26,
                              n_heads=4, n_kv_heads=1, ffn_hidden=6912, seq_len=8192, attn_head_dim=256, qk_norm=True,
                              sandwich_norm=True, scale_embeddings=True, window=512, global_every=6), 999_885_952,
           _TF.format(cls="Gemma3ForCausalLM", repo="google/gemma-3-1b-pt", file="gemma-3-1b.json",
                      card="Model card: 1B."), hf_family="gemma3_text"),
    Preset("llama-4-scout", dict(_L4, n_experts=16), 107_769_861_120,
           _TF.format(cls="Llama4ForCausalLM", repo="meta-llama/Llama-4-Scout-17B-16E",
                      file="llama-4-scout-17b-16e.text.json", card="Model card: 109B total with the vision encoder, "
                      "17B active."), hf_family="llama4_text", notes=("The text model only (Llama 4's text_config).",)),
    Preset("llama-4-maverick", dict(_L4, n_experts=128, moe_every=2), 400_711_848_960,
           _TF.format(cls="Llama4ForCausalLM", repo="meta-llama/Llama-4-Maverick-17B-128E",
                      file="llama-4-maverick-17b-128e.json", card="Model card: 400B total, 17B active."),
           hf_family="llama4_text", notes=("The text model only; MoE every second block, dense blocks of 16384.",)),
)}


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_model(name: str) -> dict[str, Any]:
    """ModelSpec fields of a preset, with its source recorded; KeyError names the known presets."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return dict(PRESETS[name].model, source={"preset": name})


def scaled_for_cpu(model: dict[str, Any], *, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                   seq_len: int = 32, vocab_size: int = 256, max_experts: int = 8) -> dict[str, Any]:
    """The same family, small enough for the CPU engine: fewer/narrower layers, the same block type.

    Kept: norm, mlp, positions, tying, biases, attention kernel, the GQA group size (heads per kv head, when it
    fits in n_heads), MoE top-k (capped by the expert count), shared experts and their gate, and the MLP and
    expert hidden sizes as ratios of d_model (rounded to a multiple of 4 so tp 2 and 4 divide them)."""
    out = dict(model)
    h0 = model.get("d_model", 128)
    heads0 = model.get("n_heads", 4)
    group = heads0 // (model.get("n_kv_heads") or heads0)
    out.update(d_model=d_model, n_layers=min(n_layers, model.get("n_layers", n_layers)), n_heads=n_heads,
               seq_len=seq_len, vocab_size=vocab_size)
    out["n_kv_heads"] = n_heads // group if group > 1 and n_heads % group == 0 else None
    ratio = lambda f: max(4, 4 * round(f / h0 * d_model / 4))  # noqa: E731 - keep f/h, multiple of 4
    out["ffn_hidden"] = ratio(model.get("ffn_hidden") or 4 * h0)
    if model.get("attn_head_dim"):
        out["attn_head_dim"] = max(2, 2 * round(model["attn_head_dim"] / heads0 / h0 * n_heads * d_model / 2))
    if model.get("kv_lora_rank"):  # MLA: the widths as ratios of d_model (even rope width)
        scale = d_model / h0
        out.update(kv_lora_rank=max(4, round(model["kv_lora_rank"] * scale)),
                   q_lora_rank=max(4, round(model["q_lora_rank"] * scale)) if model.get("q_lora_rank") else None,
                   qk_nope_head_dim=max(2, d_model // n_heads // 2),
                   qk_rope_head_dim=max(2, 2 * (d_model // n_heads // 8)), v_head_dim=max(2, d_model // n_heads // 2),
                   n_kv_heads=None)
    if model.get("window"):
        out["window"] = max(2, min(model["window"], seq_len // 2))
    if model.get("global_every"):
        out["global_every"] = min(model["global_every"], out["n_layers"])
    if model.get("first_dense_layers"):
        out["first_dense_layers"] = min(model["first_dense_layers"], out["n_layers"] - 1)
    if model.get("moe_every", 1) > 1:
        out["moe_every"] = min(model["moe_every"], out["n_layers"])
    if model.get("n_experts"):
        out["n_experts"] = min(model["n_experts"], max_experts)
        out["top_k"] = min(model.get("top_k", 2), out["n_experts"])
        if model.get("expert_groups", 1) > 1:  # keep group-limited routing: groups of 2 experts at least
            out["expert_groups"] = max(1, min(model["expert_groups"], out["n_experts"] // 2))
            out["topk_groups"] = min(model.get("topk_groups", 1), out["expert_groups"])
            per = out["n_experts"] // out["expert_groups"]
            out["top_k"] = min(out["top_k"], out["topk_groups"] * per)
        if model.get("expert_ffn_hidden"):
            out["expert_ffn_hidden"] = ratio(model["expert_ffn_hidden"])
        if model.get("shared_ffn_hidden"):
            out["shared_ffn_hidden"] = ratio(model["shared_ffn_hidden"])
    src = dict(model.get("source") or {})
    out["source"] = dict(src, scaled_for_cpu=True)
    return out


def describe(name: str) -> str:
    p = PRESETS[name]
    count = f"{p.published_params / 1e9:.1f}B (rounded)" if p.approx else f"{p.published_params:,}"
    return f"{name}: {count} parameters — {p.source}"

