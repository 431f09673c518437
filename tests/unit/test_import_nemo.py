"""NeMo YAML import of grouped-query attention: model.num_query_groups alone turns GQA on (NeMo has no
group_query_attention key; MegatronBaseModel.build_transformer_config copies num_query_groups into Megatron-Core's
TransformerConfig, where None means num_attention_heads), unlike Megatron-LM's CLI, which also needs
--group-query-attention.

Expected count: Meta-Llama-3-8B's published 8,030,261,248 (backend/presets.py); vocabulary 128,256 is already a
multiple of make_vocab_size_divisible_by 128 x tp 2, so Megatron pads nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.importers import import_config_text
from backend.presets import PRESETS

LLAMA3_8B = """\
name: megatron_llama3_8b
trainer:
  devices: 8
  num_nodes: 2
  precision: bf16-mixed
model:
  micro_batch_size: 1
  global_batch_size: 128
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 2
  encoder_seq_length: 8192
  max_position_embeddings: 8192
  num_layers: 32
  hidden_size: 4096
  ffn_hidden_size: 14336
  num_attention_heads: 32
  num_query_groups: {groups}
  make_vocab_size_divisible_by: 128
  normalization: rmsnorm
  activation: fast-swiglu
  bias: False
  position_embedding_type: rope
  share_embeddings_and_output_weights: False
  optim:
    name: distributed_fused_adam
"""


def _params(groups: str) -> tuple[int | None, int]:
    from backend.analytic.params import count_params
    from backend.spec import ExperimentSpec

    imported = import_config_text(LLAMA3_8B.format(groups=groups), name="megatron_gpt_config.yaml",
                                  vocab_size=128_256)
    assert imported.source_format == "nemo-yaml"
    model = imported.spec["model"]
    return model.get("n_kv_heads"), count_params(ExperimentSpec.for_prediction(imported.spec).model)


def test_num_query_groups_alone_is_gqa():
    assert _params("8") == (8, PRESETS["llama-3-8b"].published_params) == (8, 8_030_261_248)


@pytest.mark.parametrize("groups", ["null", "32"])
def test_no_groups_or_one_per_head_is_multi_head_attention(groups):
    kv_heads, params = _params(groups)
    assert kv_heads in (None, 32) and params == 8_835_567_616  # k and v as wide as q: 2 x 3 x 1024 x 4096 more / layer


def test_nemo_moe_and_attention_keys_are_megatrons():
    """NeMo's model keys are Megatron's arguments with underscores: the MoE layer pattern, the router, qk_layernorm
    and mtp_num_layers take the Megatron importer's mappings, reported under NeMo's own key names."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "imports" / "nemo_gpt_tp2.yaml"
    text = fixture.read_text().replace(
        "  expert_model_parallel_size: 1\n",
        "  expert_model_parallel_size: 2\n  num_moe_experts: 8\n  moe_router_topk: 2\n  moe_layer_freq: 2\n"
        "  moe_router_score_function: sigmoid\n  moe_router_enable_expert_bias: true\n  qk_layernorm: true\n"
        "  mtp_num_layers: 1\n  moe_token_dispatcher_type: alltoall\n", 1)
    imported = import_config_text(text, name="nemo_moe.yaml")
    m = imported.spec["model"]
    assert (m["moe_every"], m["router_score"], m["router_balance_bias"], m["qk_norm"]) == (2, "sigmoid", True, True)
    assert {"model.moe_layer_freq", "model.mtp_num_layers"} <= set(imported.unmapped), imported.unmapped
