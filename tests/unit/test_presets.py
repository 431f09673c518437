"""Preset parameter counts against the published counts, to the parameter (each case names its source)."""

from __future__ import annotations

import pytest

from backend.analytic.params import active_params, count_params, param_list
from backend.presets import PRESETS, preset_model, scaled_for_cpu
from backend.spec import ModelSpec

# (preset, published count, source). Sources: keras-hub's preset tables ("params", counted from the released
# weights) and the Hugging Face Hub safetensors totals of the official checkpoints.
PUBLISHED = [
    ("gpt2", 124_439_808, "keras-hub gpt2_presets.py gpt2_base_en; HF openai-community/gpt2"),
    ("gpt2-xl", 1_557_611_200, "keras-hub gpt2_presets.py gpt2_extra_large_en; HF openai-community/gpt2-xl"),
    ("llama-2-7b", 6_738_415_616, "keras-hub llama_presets.py llama2_7b_en; HF meta-llama/Llama-2-7b-hf"),
    ("llama-2-13b", 13_015_864_320, "HF meta-llama/Llama-2-13b-hf safetensors total"),
    ("llama-2-70b", 68_976_648_192, "HF meta-llama/Llama-2-70b-hf safetensors total"),
    ("llama-3-8b", 8_030_261_248, "keras-hub llama3_presets.py llama3_8b_en; HF meta-llama/Meta-Llama-3-8B"),
    ("llama-3-70b", 70_553_706_496, "HF meta-llama/Meta-Llama-3-70B safetensors total"),
    ("llama-3.1-405b", 405_853_388_800, "HF meta-llama/Llama-3.1-405B safetensors total"),
    ("mistral-7b", 7_241_732_096, "keras-hub mistral_presets.py mistral_7b_en; HF mistralai/Mistral-7B-v0.1"),
    ("mixtral-8x7b", 46_702_792_704, "keras-hub mixtral_presets.py mixtral_8_7b_en; HF mistralai/Mixtral-8x7B-v0.1"),
    ("mixtral-8x22b", 140_620_634_112, "HF mistral-community/Mixtral-8x22B-v0.1 safetensors total"),
    ("qwen2.5-0.5b", 494_032_768, "keras-hub qwen_presets.py qwen2.5_0.5b_en; HF Qwen/Qwen2.5-0.5B"),
    ("qwen1.5-moe-a2.7b", 14_315_784_192,
     "keras-hub qwen_moe_presets.py qwen1.5_moe_2.7b_en; HF Qwen/Qwen1.5-MoE-A2.7B"),
    # issue 24: transformers 5.24's model of each published config.json on the meta device (test_families_2026.py
    # says what the model-card totals count differently: DeepSeek-V3's MTP module, Llama 4's vision encoder)
    ("deepseek-v3", 671_026_404_352, "transformers DeepseekV3ForCausalLM, deepseek-ai/DeepSeek-V3 config.json"),
    ("deepseek-v2.5", 235_741_434_880, "transformers DeepseekV2ForCausalLM, deepseek-ai/DeepSeek-V2.5 config.json"),
    ("qwen3-8b", 8_190_735_360, "transformers Qwen3ForCausalLM, Qwen/Qwen3-8B config.json"),
    ("qwen3-30b-a3b", 30_532_122_624, "transformers Qwen3MoeForCausalLM, Qwen/Qwen3-30B-A3B config.json"),
    ("qwen3-235b-a22b", 235_093_634_560, "transformers Qwen3MoeForCausalLM, Qwen/Qwen3-235B-A22B config.json"),
    ("gpt-oss-20b", 20_914_757_184, "transformers GptOssForCausalLM, openai/gpt-oss-20b config.json (card 20.91B)"),
    ("gpt-oss-120b", 116_829_156_672, "transformers GptOssForCausalLM, openai/gpt-oss-120b config.json (card 116.83B)"),
    ("gemma-3-1b", 999_885_952, "transformers Gemma3ForCausalLM, google/gemma-3-1b config.json"),
    ("llama-4-scout", 107_769_861_120, "transformers Llama4ForCausalLM, Llama-4-Scout-17B-16E text_config"),
    ("llama-4-maverick", 400_711_848_960, "transformers Llama4ForCausalLM, Llama-4-Maverick-17B-128E text_config"),
]


@pytest.mark.parametrize("name,published,source", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_preset_count_equals_published(name, published, source):
    m = ModelSpec(**preset_model(name))
    assert PRESETS[name].published_params == published, source
    assert count_params(m) == published, f"{name}: {count_params(m):,} != {published:,} ({source})"
    assert sum(p.numel for p in param_list(m)) == published


def test_every_exact_preset_is_tested():
    assert {n for n, p in PRESETS.items() if not p.approx} == {p[0] for p in PUBLISHED}


def test_gpt3_175b_within_rounding():
    """Brown et al. 2020 Table 2.1 publishes only '175.0B'; the GPT-2 layout at its shape gives 174.6B (0.23% low)."""
    n = count_params(ModelSpec(**preset_model("gpt3-175b")))
    assert n == 174_604_259_328
    assert abs(n - 175.0e9) / 175.0e9 < 0.003


def test_published_active_params():
    """Mixtral paper (Jiang et al. 2024, Sec 2): 13B active of 47B; Qwen1.5-MoE-A2.7B model card: 2.7B activated."""
    assert round(active_params(ModelSpec(**preset_model("mixtral-8x7b"))) / 1e9) == 13
    assert round(active_params(ModelSpec(**preset_model("qwen1.5-moe-a2.7b"))) / 1e9, 1) == 2.7


@pytest.mark.parametrize("name", list(PRESETS))
def test_scaled_for_cpu_keeps_family(name):
    big = preset_model(name)
    small = ModelSpec(**scaled_for_cpu(big))
    for f in ("norm", "mlp", "positions", "tie_embeddings", "bias", "shared_expert_gate", "n_shared_experts"):
        assert str(getattr(small, f)) == str(big.get(f, getattr(ModelSpec(), f))), f
    assert (small.n_experts > 0) == bool(big.get("n_experts"))
    assert count_params(small) < 5_000_000
    assert small.source == {"preset": name, "scaled_for_cpu": True}


def test_matmul_params_of_tied_and_swiglu_moe():
    """6N training FLOPs (Kaplan 2020 Sec 2.1) count the tied lm_head matmul and only top-k SwiGLU experts."""
    from backend.analytic.params import matmul_params

    gpt2 = ModelSpec(**preset_model("gpt2"))
    assert matmul_params(gpt2) == 124_439_808 - 1024 * 768 - sum(p.numel for p in param_list(gpt2) if len(p.shape) == 1)
    mix = ModelSpec(**preset_model("mixtral-8x7b"))
    dense_per_token = matmul_params(mix, active=True)
    assert matmul_params(mix) - dense_per_token == 32 * 6 * 3 * 4096 * 14336
