"""Megatron-Core's --recompute-modules on the megatron stack (issue 34): what each module frees of a Transformer Engine
block (memory/te_block.py, read from Megatron-LM d98e8a64 and TE d0067d0), the spec's checks, the importer, the CLI
flag, the planner, and the published recipes it lets fit their GPU."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from backend.analytic.device import with_device
from backend.analytic.estimate import estimate
from backend.analytic.memory.te_block import MlaWidths, MoeWidths, TeLayer, attention_bytes, mlp_bytes
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.importers.megatron_args import import_args
from backend.spec import ExperimentSpec
from backend.spec.checks import run_blockers

DSV3_MLA = MlaWidths(q_lora=1536, kv_lora=512, rope=64, nope=128, v_head=128)
"""DeepSeek-V3's attention (h 7168, 128 heads)."""


def _dsv3_attention(modules: tuple[str, ...] = (), fp8: bool = False) -> TeLayer:
    """One DeepSeek-V3 MLA block at tp 2 with SP, one token per rank (s b = tp = 2)."""
    return TeLayer(s=2, b=1, h=7168, q=0, kv=0, a=128, f=18432, gated=True, t=2, sp=True, norm_stats=1, c=2,
                   fp8=fp8, mla=DSV3_MLA, modules=frozenset(modules))


@pytest.mark.parametrize("modules, per_local_token", [
    ((), 201_228),  # x, its norm's output and rstd, q / kv compressed and their norms, q, k, v, O, softmax stats
    (("core_attn",), 200_716),  # the fp32 softmax stats only: q, k, v stay as inputs, O as proj's input
    (("mla_up_proj",), 66_436),  # q, k, v and the up projections' norm outputs discarded; kv_combined, k_pe pinned
    (("mla_up_proj", "core_attn"), 65_924),
    (("layernorm",), 186_888),  # the input norm's output and rstd
    (("mla_up_proj", "core_attn", "layernorm"), 51_584),
])
def test_mla_block_keeps_what_megatrons_multi_latent_attention_saves(modules, per_local_token):
    """Per local token (s / tp of the sequence), the inventory of multi_latent_attention.py + TE's FusedAttention,
    bf16, tp 2 with SP, DeepSeek-V3 widths."""
    assert attention_bytes(_dsv3_attention(modules)) == per_local_token


def test_mla_under_fp8_keeps_each_down_projections_fp8_copy_and_fp8_norm_outputs():
    assert attention_bytes(_dsv3_attention(fp8=True)) == 199_180
    assert attention_bytes(_dsv3_attention(("mla_up_proj",), fp8=True)) == 66_436


def _moe_layer(modules: tuple[str, ...] = (), fp8: bool = False) -> TeLayer:
    """The worked example of the MoE inventory: s 4096, tp 2 (N = 2048), k 8 of 256 experts (f 2048), one shared
    expert (f_s 2048), softmax router, uniform routing (R = N k)."""
    moe = MoeWidths(experts=256, top_k=8, expert_ffn=2048, shared_ffn=2048, rows_per_token=8, sigmoid=False)
    return TeLayer(s=4096, b=1, h=7168, q=0, kv=0, a=128, f=0, gated=True, t=2, sp=True, norm_stats=1, c=2, fp8=fp8,
                   moe=moe, modules=frozenset(modules))


def test_moe_layer_keeps_the_norm_router_permutation_experts_and_shared_experts():
    n, k, e, h, f, fs, c, rows = 2048, 8, 256, 7168, 2048, 2048, 2, 2048 * 8
    norm = 2 * n * h * c + 4 * n
    router, permute = 12 * n * k, 8 * n * e + 8 * n * k
    experts = rows * (h + 3 * f) * c + rows * c
    shared = 3 * n * fs * c
    assert mlp_bytes(_moe_layer()) == norm + router + permute + experts + shared
    assert mlp_bytes(_moe_layer(("moe_act",))) == norm + router + permute + experts - rows * f * c + shared
    assert mlp_bytes(_moe_layer(("shared_experts",))) == norm + router + permute + experts
    assert mlp_bytes(_moe_layer(("moe",))) == norm  # the checkpoint keeps the norm's output (its input)
    assert mlp_bytes(_moe_layer(("moe", "layernorm"))) == n * h * c
    assert mlp_bytes(_moe_layer(("layernorm",))) == norm - n * h * c - 4 * n + router + permute + experts + shared
    fp8 = mlp_bytes(_moe_layer(fp8=True))
    assert fp8 == norm + router + permute + rows * (h + f) + rows * (2 * f * c + c) + n * fs * (2 * c + 1)


def test_mlp_recompute_checkpoints_the_dense_mlp_and_leaves_moe_layers_alone():
    dense = replace(_dsv3_attention(), mla=None, q=7168, kv=7168, s=4096)
    assert mlp_bytes(replace(dense, modules=frozenset({"mlp"}))) == 4096 * 7168 * 2 / 2
    assert mlp_bytes(replace(_moe_layer(), modules=frozenset({"mlp"}))) == mlp_bytes(_moe_layer())


MOE = {"vocab_size": 512, "d_model": 256, "n_layers": 4, "n_heads": 8, "seq_len": 256, "n_experts": 8, "top_k": 2,
       "ffn_hidden": 512, "expert_ffn_hidden": 128, "first_dense_layers": 1, "kv_lora_rank": 64,
       "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "mlp": "swiglu", "norm": "rmsnorm",
       "positions": "rope", "bias": "none", "n_kv_heads": None, "moe_grouped_gemm": True}


def _spec(model: dict | None = None, **train) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": model or MOE, "parallel": {"strategy": "zero1", "world_size": 4, "tp": 2, "ep": 2,
                                            "sequence_parallel": True},
        "train": {"global_batch": 8, "micro_batch": 1, "precision": "bf16-mixed", "stack": "megatron",
                  "recompute": "selective"} | train})


def _fullest(spec: ExperimentSpec) -> int:
    return max(r.fullest_bytes() for r in estimate(with_device(spec, "cuda")).per_rank)


def test_each_module_frees_memory_and_the_default_is_core_attn():
    default = _fullest(_spec())
    assert _fullest(_spec(recompute_modules=["core_attn"])) == default
    nothing = _fullest(_spec(recompute_modules=[]))
    assert nothing > default  # the softmax stats
    for module in ("mla_up_proj", "moe", "moe_act", "mlp", "layernorm", "shared_experts"):
        model = MOE | ({"n_shared_experts": 1, "shared_ffn_hidden": 128} if module == "shared_experts" else {})
        assert _fullest(_spec(model, recompute_modules=[module])) < _fullest(_spec(model, recompute_modules=[])), module


def test_recompute_modules_cost_their_forward_again_in_the_step_time():
    hw = get_hardware("h100-sxm")

    def step(**train):
        return step_time(with_device(_spec(**train), "cuda"), hw).summary["step_s"]

    none, default = step(recompute_modules=[]), step()
    assert default > none  # core_attn: the attention core again
    assert step(recompute_modules=["moe"]) > step(recompute_modules=["moe_act"]) == pytest.approx(none)


@pytest.mark.parametrize("train, model, modules, words", [
    ({"stack": "shardlab"}, None, ["mlp"], "set stack megatron"),
    ({"recompute": "full"}, None, ["mlp"], "not 'selective'"),
    ({}, {k: v for k, v in MOE.items() if "lora" not in k and "head_dim" not in k}, ["mla_up_proj"],
     "needs multi-latent attention"),
    ({}, {**{k: v for k, v in MOE.items() if k not in ("first_dense_layers", "moe_grouped_gemm")}, "n_experts": 0,
          "top_k": 1, "expert_ffn_hidden": None}, ["moe"], "this model has no experts"),
    ({}, {**MOE, "moe_grouped_gemm": False}, ["moe_act"], "moe_act needs moe_grouped_gemm"),
    ({}, MOE, ["shared_experts"], "this model has no shared experts"),
])
def test_megatrons_own_refusals_are_said_before_anything_runs(train, model, modules, words):
    with pytest.raises(ValueError, match=words):
        _spec(model, recompute_modules=modules, **train)


def test_the_engine_refuses_modules_it_does_not_checkpoint():
    assert any("recompute_modules=moe_act" in r for r in run_blockers(_spec(recompute_modules=["moe_act"])))


def test_a_megatron_script_brings_its_recompute_modules(tmp_path):
    text = ("torchrun --nproc_per_node 4 pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 8 "
            "--seq-length 256 --max-position-embeddings 256 --ffn-hidden-size 512 --tensor-model-parallel-size 2 "
            "--sequence-parallel --micro-batch-size 1 --global-batch-size 8 --bf16 --use-distributed-optimizer "
            "--vocab-size 512 --recompute-granularity selective --recompute-modules core_attn mlp\n")
    imported = import_args(text)
    assert imported.spec["train"]["recompute_modules"] == ["core_attn", "mlp"]
    assert "--recompute-modules" not in imported.unmapped and "--recompute-modules" not in imported.ignored
    one = import_args(text.replace("core_attn mlp", "mlp"))
    assert one.spec["train"]["recompute_modules"] == ["mlp"]
    unknown = import_args(text.replace("core_attn mlp", "gdn_norm_out"))
    assert "not modelled" in unknown.unmapped["--recompute-modules"]["reason"]


def test_the_cli_flag_and_estimate_json_carry_the_modules(capsys):
    from backend.cli import main

    argv = ["estimate", "--json", "--preset", "gpt2", "--seq", "256", "--world", "2", "--strategy", "zero1", "--tp",
            "2", "--sequence-parallel", "--global-batch", "4", "--micro-batch", "1", "--precision", "bf16-mixed",
            "--stack", "megatron", "--attention-kernel", "cudnn", "--recompute", "selective", "--recompute-modules"]
    assert main([*argv, "mlp"]) in (0, None)
    mlp = json.loads(capsys.readouterr().out)
    assert mlp["stack"]["recompute_modules"] == ["mlp"]
    assert main(argv) in (0, None)  # the flag with no module: nothing checkpointed
    nothing = json.loads(capsys.readouterr().out)
    assert nothing["stack"]["recompute_modules"] == []
    assert mlp["per_rank"][0]["activations_bytes"] < nothing["per_rank"][0]["activations_bytes"]


def test_plan_prices_selective_layouts_with_the_held_modules():
    from backend.planner.held import HeldTraining

    held = HeldTraining.of_train({"stack": "megatron", "recompute": "selective", "recompute_modules": ["mlp"]})
    assert held.spec_train("selective")["recompute_modules"] == ["mlp"] and "recompute_modules" not in \
        held.spec_train("full")
    assert held.stack_memory(_spec().model, "cuda").recompute_modules == {"mlp"}
    assert held.with_stack(None, {"recompute_modules": ["moe"]}).recompute_modules == ("moe",)


@pytest.mark.heavy
def test_plan_flag_holds_the_modules_for_the_searched_selective_layouts(capsys):
    from backend.cli import main

    assert main(["plan", "--preset", "gpt2", "--seq", "1024", "--gpus", "8", "--hardware", "h100-sxm",
                 "--global-batch", "32", "--stack", "megatron", "--recompute-modules", "mlp", "--top", "500",
                 "--json"]) in (0, None)
    configs = json.loads(capsys.readouterr().out)["configs"]
    selective = [c["spec"]["train"] for c in configs if c["spec"]["train"]["recompute"] == "selective"]
    assert selective and all(t["recompute_modules"] == ["mlp"] for t in selective)
    assert not any("recompute_modules" in c["spec"]["train"] for c in configs
                   if c["spec"]["train"]["recompute"] != "selective")


@pytest.mark.heavy
def test_the_published_moe_recipes_fit_the_gpus_they_ran_on():
    """Issue 34: every published recipe predicted to fit its GPU. DeepSeek-V3 (bridge 25.09, 1,024 H100s) fits
    with its recipe's --recompute-modules mla_up_proj mlp (perf_recipes/deepseek/h100/deepseek_v3.py l. 42)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
    from published_gpu import memory_prediction

    from backend.analytic.steptime.published_gpu import published_rows

    moe = [r for r in published_rows() if r.group == "H100 MoE"]
    assert len(moe) == 5
    for r in moe:
        assert memory_prediction(r.spec, r.hardware)["fits"], r.id


def test_freed_memory_against_megatron_bridges_matched_moonlight_study():
    """benchmarks/recompute_modules.py: the memory core_attn frees is the measured 4 MB; mla_up_proj's and moe_act's
    are within 40% of what the study measured (predicted 1.3x today). A guard, not a fit: nothing is tuned to it."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
    from recompute_modules import rows

    by = {tuple(r["modules"]): r for r in rows()}
    assert by[("core_attn",)]["predicted_freed_gb"] == pytest.approx(by[("core_attn",)]["measured_freed_gb"],
                                                                      abs=0.002)
    for modules in (("mla_up_proj",), ("moe_act",)):
        r = by[modules]
        assert r["predicted_freed_gb"] == pytest.approx(r["measured_freed_gb"], rel=0.4), modules
