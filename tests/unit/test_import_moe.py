"""Issue 35 "Importers": Megatron's MoE arguments (--expert-tensor-parallel-size, --moe-expert-capacity-factor,
--moe-pad-expert-input-to-capacity, --moe-token-dispatcher-type, --moe-grouped-gemm, --moe-aux-loss-coeff) and
torchtitan's MoE settings (expert_parallel_degree, expert_tensor_parallel_degree, expert_parallel_comm_backend) reach
the spec's MoE fields and parallel.etp, with the frameworks' defaults (Megatron-Core core_v0.19.0, torchtitan v0.2.2;
importers/megatron_moe.py, importers/torchtitan_moe.py), and an unmappable value is reported or refused, never
dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.importers import ConfigImportError, import_config_text

pytestmark = pytest.mark.unit

HF = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
MOE = ("capacity_factor", "moe_pad_to_capacity", "moe_dispatcher", "moe_grouped_gemm", "moe_aux_loss_coeff")
ARGS = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
        "--micro-batch-size 1 --global-batch-size 64 --vocab-size 32000 --swiglu --bf16 --use-distributed-optimizer "
        "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 2048 --world-size 16 ")


def _megatron(extra: str):
    return import_config_text(ARGS + extra, name="args.txt")


def _moe(imported) -> tuple:
    return tuple(imported.spec["model"][k] for k in MOE)


def test_megatron_moe_arguments_are_spec_fields():
    """NVIDIA's MoE recipe settings (capacity 1.0 with padding, alltoall, grouped GEMMs, aux loss 1e-2); etp unset
    with ep > 1 is tp (Megatron's default, arguments.py l. 569-570), named in the notes."""
    imported = _megatron("--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 "
                         "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --moe-grouped-gemm "
                         "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2")
    par = imported.spec["parallel"]
    assert (par["tp"], par["ep"], par["etp"], par["dp"]) == (2, 4, 2, 8)
    assert _moe(imported) == (1.0, True, "alltoall", True, 0.01)
    assert any("--expert-tensor-parallel-size not given" in n and "core_v0.19.0" in n for n in imported.notes)
    assert not {"--moe-expert-capacity-factor", "--moe-grouped-gemm", "--expert-tensor-parallel-size"} & (
        set(imported.ignored) | set(imported.unmapped))
    explicit = _megatron("--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 "
                         "--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall")
    assert explicit.spec["parallel"]["etp"] == 1


def test_megatron_moe_defaults_are_megatrons():
    """Nothing given: dropless, allgather (transformer_config.py l. 862), no grouped GEMM, no aux loss; a negative
    capacity factor is dropless too (l. 1661-1662)."""
    imported = _megatron("--expert-model-parallel-size 2 --moe-expert-capacity-factor -1")
    assert _moe(imported) == (None, False, "allgather", False, 0.0)
    assert any("token dispatcher allgather" in n for n in imported.notes)
    assert imported.spec["parallel"]["etp"] == 1


def test_megatron_flex_dispatcher_maps_and_a_bad_one_is_refused():
    imported = _megatron("--expert-model-parallel-size 2 --moe-token-dispatcher-type flex")
    assert imported.spec["model"]["moe_dispatcher"] == "flex"
    assert "--moe-token-dispatcher-type" not in imported.unmapped
    with pytest.raises(ConfigImportError, match="expected one of allgather, alltoall, flex"):
        _megatron("--expert-model-parallel-size 2 --moe-token-dispatcher-type ring")
    with pytest.raises(ConfigImportError, match="capacity factor of 0"):
        _megatron("--expert-model-parallel-size 2 --moe-expert-capacity-factor 0")
    with pytest.raises(ConfigImportError, match="moe_pad_to_capacity"):  # Megatron refuses it too (l. 1686-1690)
        _megatron("--expert-model-parallel-size 2 --moe-pad-expert-input-to-capacity")


def test_megatron_etp_other_than_tp_at_ep_1_is_reported():
    imported = _megatron("--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1")
    assert imported.spec["parallel"]["etp"] == 1 and imported.spec["parallel"]["ep"] == 1
    assert "etp = tp = 2" in imported.unmapped["--expert-tensor-parallel-size"]["reason"]


def _block(args: dict) -> str:
    lines = ["------------------------ arguments ------------------------"]
    lines += [f"  {k} {'.' * (48 - len(k))} {args[k]}" for k in sorted(args)]
    return "\n".join(lines + ["-------------------- end of arguments ---------------------"])


LOG = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 2048,
       "max_position_embeddings": 2048, "micro_batch_size": 1, "global_batch_size": 64, "padded_vocab_size": 32000,
       "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
       "world_size": 8, "data_parallel_size": 8, "swiglu": True, "ffn_hidden_size": 2816, "bf16": True,
       "expert_tensor_parallel_size": 1, "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": False,
       "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False, "moe_aux_loss_coeff": [0.01],
       "moe_router_load_balancing_type": ["aux_loss"]}


def test_megatron_log_block_moe_arguments():
    """The printed namespace: a one-element coefficient list is that value (arguments.py l. 1608-1609); under load
    balancing 'none' the coefficient adds no loss; a dense model's printed MoE defaults leave no MoE field."""
    moe = import_config_text(_block({**LOG, "num_experts": 8, "moe_router_topk": 2, "expert_model_parallel_size": 4}),
                             name="megatron.log")
    assert _moe(moe) == (None, False, "alltoall", False, 0.01) and moe.spec["parallel"]["ep"] == 4
    none = import_config_text(_block({**LOG, "num_experts": 8, "moe_router_topk": 2, "expert_model_parallel_size": 4,
                                      "moe_router_load_balancing_type": "none"}), name="megatron.log")
    assert none.spec["model"]["moe_aux_loss_coeff"] == 0.0
    assert any("no aux loss under --moe-router-load-balancing-type none" in n for n in none.notes)
    dense = import_config_text(_block({**LOG, "num_experts": None, "expert_model_parallel_size": 1}),
                               name="megatron.log")
    assert dense.spec["model"]["n_experts"] == 0 and _moe(dense) == (None, False, "alltoall", False, 0.0)


def test_megatron_deepseek_router_layer_pattern_and_mtp_reach_the_spec():
    """DeepSeek-V3's Megatron recipe: --moe-layer-freq "([0]*3+[1]*N)" is three dense layers first, the sigmoid router
    with the expert bias and group-limited routing are the spec's router fields, and --mtp-num-layers (one more block
    per layer, memory and time) is reported, never filed under "ignored"."""
    imported = _megatron("--expert-model-parallel-size 4 --moe-layer-freq '([0]*1+[1]*3)' --moe-router-score-function "
                         "sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 4 --moe-router-group-topk 2 "
                         "--mtp-num-layers 1")
    m = imported.spec["model"]
    assert (m["first_dense_layers"], m["moe_every"]) == (1, 1)
    assert (m["router_score"], m["router_balance_bias"], m["expert_groups"], m["topk_groups"]) == ("sigmoid", True, 4,
                                                                                                   2)
    assert "--mtp-num-layers" in imported.unmapped and "--mtp-num-layers" not in imported.ignored
    assert not {"--moe-layer-freq", "--moe-router-score-function", "--moe-router-num-groups"} & (
        set(imported.ignored) | set(imported.unmapped))


@pytest.mark.parametrize("freq, fields, reported", [
    ("2", (0, 2), True),  # MoE at 0, 2: predicted at 1, 3 (same count), said
    ("([0]*2+[1]*2)", (2, 1), False),
    ("[0,1,0,1]", (0, 2), False),
    ("([1]*3+[0]*1)", None, True),  # no dense prefix + interleave expresses it
])
def test_megatron_moe_layer_freq(freq, fields, reported):
    imported = _megatron(f"--expert-model-parallel-size 4 --moe-layer-freq '{freq}'")
    m = imported.spec["model"]
    if fields is not None:
        assert (m["first_dense_layers"], m["moe_every"]) == fields
    assert ("--moe-layer-freq" in imported.unmapped) is reported


@pytest.mark.parametrize("freq, words", [("([0]*3+[1]*3)", "6 entries != --num-layers 4"),
                                         ("__import__('os')", "list expression"), ("([2]*4)", "0 (dense) and 1")])
def test_megatron_bad_moe_layer_freq_is_refused_with_the_reason(freq, words):
    with pytest.raises(ConfigImportError) as e:
        _megatron(f"--moe-layer-freq {freq!r}")
    assert words in str(e.value), str(e.value)


TOML = """
[model]
name = "qwen3"
flavor = "30B-A3B"
[training]
local_batch_size = 4
seq_len = 4096
[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = {tp}
expert_parallel_degree = {ep}
expert_tensor_parallel_degree = {etp}
"""


def _titan(tp: int = 1, ep: int = 8, etp: int = 1, extra: str = "", model: str = "qwen3-30b-a3b.json"):
    text = TOML.format(tp=tp, ep=ep, etp=etp) + extra
    return import_config_text(text, name="qwen3_moe.toml", gpus=64, model_config=json.loads((HF / model).read_text()))


def test_torchtitan_expert_degrees_and_moe_defaults():
    """job_config.py @ v0.2.2 (l. 454, 464): ep over dp_shard, etp = tp or 1; MoEArgs: grouped GEMMs, dropless,
    all-to-all, aux-loss-free (no loss term)."""
    imported = _titan()
    par = imported.spec["parallel"]
    assert (par["dp"], par["ep"], par["etp"], par["strategy"]) == (64, 8, 1, "zero3")
    assert _moe(imported) == (None, False, "alltoall", True, 0.0)
    assert any("aux-loss-free" in n for n in imported.notes)
    assert "parallelism.expert_parallel_degree" not in imported.unmapped
    assert _titan(tp=2, etp=2).spec["parallel"]["etp"] == 2


def test_torchtitan_expert_settings_it_cannot_hold_are_named():
    with pytest.raises(ConfigImportError, match=r"etp = tp \(4\) or etp = 1 only"):
        _titan(tp=4, etp=2)
    spans_tp = _titan(tp=2, etp=1)  # torchtitan's "[partial dp + all tp -> ep] etp = 1"
    assert ("ShardLab's ep spans dp x cp only"
            in spans_tp.unmapped["parallelism.expert_tensor_parallel_degree"]["reason"])
    deepep = _titan(extra='expert_parallel_comm_backend = "deepep"\n')
    assert deepep.spec["model"]["moe_dispatcher"] == "flex"  # DeepEP: the flex dispatch (analytic/ep_dispatch.py)
    assert "parallelism.expert_parallel_comm_backend" not in deepep.unmapped


def test_torchtitan_dense_model_ignores_expert_degrees_and_dualpipev_is_a_schedule():
    """"No effect for non-MoE models" (job_config.py l. 454); pipeline_parallel_schedule DualPipeV is the spec's
    dualpipev (2 stages per rank)."""
    dense = _titan(ep=4, model="llama-3-8b.json")
    assert dense.spec["parallel"]["ep"] == 1 and dense.spec["model"]["moe_grouped_gemm"] is False
    text = TOML.format(tp=1, ep=8, etp=1).replace("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 8\n"
                                                  "pipeline_parallel_degree = 8\npipeline_parallel_schedule = "
                                                  '"DualPipeV"\npipeline_parallel_microbatch_size = 1')
    text = text.replace("local_batch_size = 4", "local_batch_size = 16")
    par = import_config_text(text, name="q.toml", gpus=64,
                             model_config=json.loads((HF / "qwen3-30b-a3b.json").read_text())).spec["parallel"]
    assert (par["pp_schedule"], par["virtual_stages"], par["pp"], par["ep"]) == ("dualpipev", 2, 8, 8)


DEEPSEEK_V3 = ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128 "
               "--seq-length 4096 --max-position-embeddings 163840 --position-embedding-type rope --normalization "
               "RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 129280 "
               "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
               "--qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --mscale 1.0 --mscale-all-dim 1.0 "
               "--num-experts 256 --moe-layer-freq '([0]*3+[1]*58)' --moe-ffn-hidden-size 2048 "
               "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-num-groups 8 "
               "--moe-router-group-topk 4 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
               "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --tensor-model-parallel-size 2 "
               "--pipeline-model-parallel-size 16 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 "
               "--sequence-parallel --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 8192 --bf16 "
               "--recompute-granularity selective --recompute-modules mla_up_proj moe_act --world-size 256")


def test_megatron_deepseek_v3_recipe_is_the_hf_model():
    """Megatron's DeepSeek-V3 arguments (MLA, kv-channels 128 that MLA never reads, three dense layers, the
    group-limited sigmoid router) give the model the Hugging Face config.json gives, to the parameter."""
    from backend.analytic.params import count_params
    from backend.hf.config import from_hf_config
    from backend.spec import ExperimentSpec
    from backend.spec.model_spec import ModelSpec

    imported = import_config_text(DEEPSEEK_V3, name="args.txt")
    hf = ModelSpec.model_validate(from_hf_config(json.loads((HF / "deepseek-v3.json").read_text()), seq_len=4096)[0])
    hf_model = {k: v if isinstance(v, (int, type(None))) else str(v) for k, v in hf.model_dump().items()}
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_dense_layers",
            "moe_every", "router_score", "router_balance_bias", "expert_groups", "topk_groups")
    assert {k: imported.spec["model"][k] for k in keys} == {k: hf_model[k] for k in keys}
    assert imported.spec["train"]["recompute_modules"] == ["mla_up_proj", "moe_act"]
    assert "--kv-channels" in imported.ignored and not {"--multi-latent-attention", "--q-lora-rank"} & (
        set(imported.ignored) | set(imported.unmapped))
    spec = ExperimentSpec.for_prediction(imported.spec)
    assert count_params(spec.model) == count_params(hf) == 671_026_404_352  # DeepSeek-V3 without its MTP module


def test_megatron_head_width_and_qk_norm_of_ordinary_attention():
    """Qwen3-30B-A3B's Megatron arguments: --kv-channels 128 over hidden 2048 / 32 heads is the spec's attn_head_dim
    (it was refused as 'not modelled'), --qk-layernorm its qk_norm; MLA defaults fill what an MLA script omits."""
    qwen = import_config_text(ARGS.replace("--hidden-size 1024", "--hidden-size 2048").replace(
        "--num-attention-heads 16", "--num-attention-heads 32") + "--kv-channels 128 --qk-layernorm", name="args.txt")
    assert (qwen.spec["model"]["attn_head_dim"], qwen.spec["model"]["qk_norm"]) == (128, True)
    plain = import_config_text(ARGS + "--kv-channels 64", name="args.txt")  # = 1024 / 16: nothing to set
    assert plain.spec["model"]["attn_head_dim"] is None
    mla = import_config_text(ARGS + "--multi-latent-attention --position-embedding-type rope", name="args.txt")
    m = mla.spec["model"]
    assert (m["q_lora_rank"], m["kv_lora_rank"], m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]) == (
        None, 32, 128, 64, 128)
    assert any("Megatron's default 32" in n for n in mla.notes), mla.notes
