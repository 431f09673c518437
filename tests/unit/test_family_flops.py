"""FLOPs, EP traffic and step-time terms of the 2026 families (issue 24): a windowed block's attention scores
min(window, s) keys, MLA's attention has its own q / k and v widths, MoE FLOPs go through the active experts only,
and EP's all-to-alls move tokens x top_k x h per MoE block; the step-time model and the planner's step-time screen
take them from the same functions (model_flops, compute.attention_pass, traffic.model_parallel_traffic)."""

from __future__ import annotations

import numpy as np
import pytest

from backend.analytic import model_flops
from backend.analytic.estimate import estimate
from backend.analytic.layout import Layout
from backend.analytic.params import active_params, matmul_params
from backend.analytic.steptime.compute import attention_pass
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.ops import attention_time
from backend.analytic.steptime.screen import step_screen
from backend.analytic.textbook.flops import training_flops_per_token
from backend.presets import preset_model
from backend.spec import ExperimentSpec, ModelSpec
from benchmarks.family_accuracy import STRATEGIES, spec


def _model(name: str, **over) -> ModelSpec:
    return ModelSpec(**(preset_model(name) | over))


def test_window_attention_flops_are_not_s_squared():
    """gpt-oss-120b at s = 4,096: 18 sliding blocks score 128 keys, 18 full blocks 4,096 (Longformer Sec 3.1: O(n w));
    64 heads of 64 for q / k and v. A model without windows keeps PaLM's 4 L s h."""
    m = _model("gpt-oss-120b", seq_len=4096)
    assert model_flops.kv_lengths(m) == [128, 4096] * 18
    assert model_flops.attention_fwd_flops_per_token(m) == 18 * 2 * 64 * (128 + 4096) * (64 + 64)
    dense = _model("llama-3-8b")
    assert model_flops.attention_fwd_flops_per_token(dense) == 4 * dense.n_layers * dense.seq_len * dense.d_model
    chunked = _model("llama-4-scout", seq_len=32768)  # chunks of 8,192 on 3 of 4 blocks (NoPE global ones: whole)
    assert model_flops.kv_lengths(chunked)[:4] == [8192, 8192, 8192, 32768]


def test_mla_attention_flops_use_its_own_widths():
    """DeepSeek-V3: 128 heads, QK^T over nope + rope = 192 channels, P.V over v_head_dim = 128 (DeepSeek-V2 Sec 2.1)."""
    m = _model("deepseek-v3")
    assert model_flops.attention_fwd_flops_per_token(m) == 61 * 2 * 128 * m.seq_len * (192 + 128)


@pytest.mark.parametrize("name,card_active_b", [("deepseek-v3", 37), ("qwen3-235b-a22b", 22), ("llama-4-maverick", 17)])
def test_moe_flops_go_through_the_active_experts(name, card_active_b):
    """Router + top_k routed experts + shared experts of each MoE block, the dense MLP of each dense block: the
    active count is the model card's (DeepSeek-V3 37B activated, Qwen3 A22B, Llama 4 17B active, within 2%) and the
    training FLOPs are 6 x the active matmul weights + attention."""
    m = _model(name)
    assert active_params(m) == pytest.approx(card_active_b * 1e9, rel=0.02)
    tokens = 1000
    assert model_flops.training_flops_per_step(m, tokens=tokens) == tokens * (
        6 * matmul_params(m, active=True) + 3 * model_flops.attention_fwd_flops_per_token(m))
    assert training_flops_per_token(n_params_dense=matmul_params(m), n_layers=m.n_layers, seq_len=m.seq_len,
                                    d_model=m.d_model, recompute="full", active_params=matmul_params(m, active=True),
                                    attention_fwd_per_token=model_flops.attention_fwd_flops_per_token(m)) == \
        8 * matmul_params(m, active=True) + 4 * model_flops.attention_fwd_flops_per_token(m)


def test_step_time_attention_pass_of_a_window():
    """A windowed flash block's FLOPs and seconds are the window's; the eager path materialises the (s, s) scores."""
    m = _model("gpt-oss-120b", seq_len=4096)
    s = ExperimentSpec.for_prediction({"model": m.model_dump(), "train": {"precision": "bf16-mixed", "micro_batch": 1,
                                                                          "global_batch": 8},
                                       "parallel": {"strategy": "fsdp", "world_size": 8}})
    hw, layout = get_hardware("h100-sxm"), Layout.of(s)
    full, win = attention_pass(m, layout, hw, "flash"), attention_pass(m, layout, hw, "flash", windowed=True)
    assert win.fwd_flops == 2 * 64 * 4096 * 128 * 128 and full.fwd_flops == 2 * 64 * 4096 * 4096 * 128
    assert win.fwd_s < full.fwd_s / 10
    # the fused kernel skips the blocks outside the window: of the causal triangle s^2/2 the band sw - w^2/2 is left
    # (FlashAttention-2 window_size); the causal global block is tables' ops.attention_time
    band = (2 * 4096 * 128 - 128 * 128) / 4096 ** 2
    assert win.fwd_s == pytest.approx(full.fwd_s * band) and win.bwd_s == pytest.approx(full.bwd_s * band)
    assert (full.fwd_s, full.bwd_s) == attention_time(hw, layout.precision, "flash", 1, 64, 4096, 64, causal=True)
    assert attention_pass(m, layout, hw, "eager", windowed=True).fwd_s == attention_pass(m, layout, hw, "eager").fwd_s


def test_step_time_attention_pass_of_mla_times_its_own_widths():
    """DeepSeek-V3's fused attention: QK^T over 192 channels and P.V over 128 take the FLOPs of one head width of
    (192 + 128) / 2 = 160 in ops.attention_time (its FLOP count 4 b a s^2 d, halved causal)."""
    m = _model("deepseek-v3", seq_len=4096)
    s = ExperimentSpec.for_prediction({"model": m.model_dump(), "train": {"precision": "bf16-mixed", "micro_batch": 1,
                                                                          "global_batch": 8},
                                       "parallel": {"strategy": "fsdp", "world_size": 8}})
    hw, layout = get_hardware("h100-sxm"), Layout.of(s)
    cost = attention_pass(m, layout, hw, "flash")
    assert (cost.fwd_s, cost.bwd_s) == attention_time(hw, layout.precision, "flash", 1, 128, 4096, 160, causal=True)
    assert cost.fwd_flops == 2 * 128 * 4096 * 4096 * (192 + 128)


def test_ep_all_to_all_per_moe_block():
    """Llama 4 scaled down (MoE every 2nd block): 4 microbatches x 2 MoE blocks x (dispatch + combine, fwd + bwd of
    16 tokens x top-1 x 32 fp32 = 8,192 B, + 4 int64 counts); it was counted for all 4 blocks (263,168 B)."""
    s = spec("llama4", "ep", STRATEGIES["ep"], 2, {"global_batch": 8, "micro_batch": 1})
    assert estimate(s).per_rank[0].comm_bytes["all_to_all"] == 4 * 2 * (4 * 16 * 1 * 32 * 4 + 8 * 4)


def test_screen_has_the_ep_all_to_alls_and_each_block_kind():
    """The planner's step-time screen: EP all-to-alls (4 x tokens x top_k x h per MoE block and microbatch) and, for
    mixed stacks, the dense blocks' GEMMs apart from the MoE blocks' (DeepSeek-V3's 3 dense blocks of ffn 18,432)."""
    from backend.analytic.layout import CHOICES
    from backend.analytic.memory.parts import ALT_PART
    from backend.analytic.steptime.screen import _layer_gemm_s

    m = _model("deepseek-v3")
    row = dict(tp=1, pp=1, dp=256, ep=1, zero_stage=3, micro_batch=1, recompute=2, schedule=0, virtual_stages=1,
               sequence_parallel=0, cp=1, recompute_layers=0, etp=1)  # etp: the planner's column since 29e7aea
    table = np.array([[row[c] for c in CHOICES], [(row | {"ep": 32})[c] for c in CHOICES]])
    layouts = Layout.table(table, global_batch=512, device="cuda")
    hw = get_hardware("h100-sxm")
    screen = step_screen(m, layouts, hw, gpus_per_node=8)
    assert screen.ep_comm_s[0] == 0 and screen.ep_comm_s[1] > 0
    # forward and backward GEMMs of each kind (main's _layer_gemm_s returns the pair)
    dense, moe = np.asarray(_layer_gemm_s(m, layouts, hw)), np.asarray(_layer_gemm_s(m, layouts, hw, ALT_PART))
    assert np.all(dense != moe)


@pytest.mark.parametrize("ep", [1, 8])
def test_screen_times_only_the_ranks_own_experts(ep):
    """The planner's step-time screen times an ep rank's n_experts / ep local experts, each at tokens x top_k x ep / E
    rows, as the step-time model does: its compute stays within 20% of the model's (it once timed all 128 experts of
    gpt-oss-120b at ep 8: 8x the expert GEMMs, 9.7 s against the model's 1.9 s, so the planner's pool lost the
    fastest EP layouts)."""
    from backend.analytic.steptime.model import step_time
    from backend.spec import ExperimentSpec

    m = _model("gpt-oss-120b")
    spec = ExperimentSpec.for_prediction({"model": m.model_dump(),
                                          "parallel": {"strategy": "zero3", "world_size": 64, "ep": ep},
                                          "train": {"global_batch": 256, "micro_batch": 2, "precision": "bf16-mixed"},
                                          "runtime": {"device": "cuda"}})
    hw = get_hardware("h100-sxm")
    screen = step_screen(m, Layout.of(spec), hw, gpus_per_node=8)
    assert float(screen.compute_s) == pytest.approx(step_time(spec, hw).summary["compute_s"], rel=0.2)


@pytest.mark.parametrize("strategy,ep", [("zero3", 64), ("zero3", 8), ("ddp", 8)])
def test_screen_times_ep_and_its_dp_sync_like_the_model(strategy, ep):
    """gpt-oss-120b on 64 H100s, full recompute: the screen's EP all-to-alls and data-parallel sync come within 10% /
    0.05 s of steptime.model's. It once drove each inter-node all-to-all over 8 NICs (a ring's node boundary; an
    all-to-all rank sends its rows through its own NIC) and left out the re-run forward's, 0.30 s against 3.76 s at
    ep 64; and it FSDP-gathered the routed experts over all 64 ranks (0.57 s against 0.11 s exposed at ep 8), where
    they sit outside FSDP2 and are all-reduced over the dp / ep expert replicas."""
    from backend.analytic.steptime.model import step_time

    m = _model("gpt-oss-120b", seq_len=4096, attention="flash")
    spec = ExperimentSpec.for_prediction({"model": m.model_dump(),
                                          "parallel": {"strategy": strategy, "world_size": 64, "ep": ep},
                                          "train": {"global_batch": 256, "micro_batch": 1, "precision": "bf16-mixed",
                                                    "recompute": "full"},
                                          "runtime": {"device": "cuda"}})
    hw = get_hardware("h100-sxm")
    screen = step_screen(m, Layout.of(spec), hw, gpus_per_node=8)
    exposed = step_time(spec, hw, gpus_per_node=8).per_rank[0].exposed_by_dim_s
    assert float(screen.ep_comm_s) == pytest.approx(exposed["ep"], rel=0.1)  # the model adds the ring latency
    assert float(screen.dp_exposed_s) == pytest.approx(exposed["dp"], abs=0.05)
