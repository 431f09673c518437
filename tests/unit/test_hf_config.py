"""Hugging Face config.json import: each family's published config gives its preset's count; refusals name the field.

The fixtures in tests/fixtures/hf/ are the published config.json files of the named checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.analytic.params import count_params
from backend.hf.config import HFConfigError, from_hf_config, load_hf_config, parsed_fields
from backend.presets import PRESETS, preset_model
from backend.spec import ModelSpec

HF = Path(__file__).parents[1] / "fixtures" / "hf"
FAMILY_FILES = [("llama-2-7b.json", "llama-2-7b"), ("llama-3-8b.json", "llama-3-8b"), ("mistral-7b.json", "mistral-7b"),
                ("mixtral-8x7b.json", "mixtral-8x7b"), ("qwen2.5-0.5b.json", "qwen2.5-0.5b"),
                ("qwen1.5-moe-a2.7b.json", "qwen1.5-moe-a2.7b"), ("gpt2.json", "gpt2")]


def _import(name: str, **kw):
    cfg = load_hf_config(HF / name)
    return cfg, *from_hf_config(cfg, file=name, **kw)


@pytest.mark.parametrize("file,preset", FAMILY_FILES)
def test_family_config_gives_preset_count(file, preset):
    cfg, model, notes = _import(file, seq_len=PRESETS[preset].model["seq_len"])
    m = ModelSpec(**model)
    assert count_params(m) == PRESETS[preset].published_params
    same = ModelSpec(**preset_model(preset))
    for f in ("norm", "mlp", "positions", "bias", "tie_embeddings", "n_kv_heads", "n_experts", "top_k",
              "expert_ffn_hidden", "n_shared_experts", "shared_expert_gate"):
        assert getattr(m, f) == getattr(same, f), f
    # the run keeps the config's parsed fields with its spec (issue 21: not ids, labels or other metadata)
    assert m.source == {"hf_config": parsed_fields(cfg), "file": file}
    assert m.source["hf_config"]["model_type"] == cfg["model_type"] and "architectures" not in m.source["hf_config"]


def test_gpt_neox_parallel_residual_refused_by_name():
    with pytest.raises(HFConfigError, match="use_parallel_residual"):
        _import("pythia-160m.json")


def test_gpt_neox_sequential_counts_like_pythia():
    """Pythia-160M (Biderman et al. 2023, Table 1; HF EleutherAI/pythia-160m): 162,322,944 parameters. The
    parallel-residual layout has the same parameters as the sequential one ShardLab models."""
    cfg = load_hf_config(HF / "pythia-160m.json") | {"use_parallel_residual": False}
    model, notes = from_hf_config(cfg, seq_len=2048)
    assert count_params(ModelSpec(**model)) == 162_322_944
    assert any("rotary_pct" in n for n in notes)


def test_mistral_sliding_window_shorter_than_seq_refused():
    with pytest.raises(HFConfigError, match=r"sliding_window=4096 < seq_len=8192"):
        _import("mistral-7b.json", seq_len=8192)
    _, model, notes = _import("mistral-7b.json")
    assert model["seq_len"] == 4096 and any("sliding window" in n for n in notes)


@pytest.mark.parametrize("patch,field", [
    ({"kv_lora_rank": 512}, "kv_lora_rank"),
    ({"some_new_knob": 3}, "some_new_knob"),
    ({"model_type": "deepseek_v2"}, "model_type"),
    ({"head_dim": 256}, "head_dim"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_unmodelled_fields_refused_by_name(patch, field):
    cfg = load_hf_config(HF / "llama-2-7b.json") | patch
    with pytest.raises(HFConfigError, match=field):
        from_hf_config(cfg)


def test_qwen_moe_partial_layouts_refused():
    cfg = load_hf_config(HF / "qwen1.5-moe-a2.7b.json")
    with pytest.raises(HFConfigError, match="decoder_sparse_step"):
        from_hf_config(cfg | {"decoder_sparse_step": 2})
    with pytest.raises(HFConfigError, match="mlp_only_layers"):
        from_hf_config(cfg | {"mlp_only_layers": [0]})


def test_dropout_and_numerics_are_reported_not_silent():
    _, _, notes = _import("gpt2.json")
    assert any("attn_pdrop" in n for n in notes)
    _, _, notes = _import("llama-3-8b.json")
    assert any("rope_theta" in n for n in notes)


def test_unreadable_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("[1, 2]")
    with pytest.raises(HFConfigError, match="not a JSON object"):
        load_hf_config(bad)
    bad.write_text("{")
    with pytest.raises(HFConfigError, match="cannot read"):
        load_hf_config(bad)
    json.loads((HF / "gpt2.json").read_text())
