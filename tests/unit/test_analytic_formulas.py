"""Analytic formulas against numbers published in the papers they come from."""

from __future__ import annotations

import math

import pytest

from backend.analytic.memory.activations import model_layer_activation_bytes
from backend.analytic.textbook.comm_volume import (
    dp_allreduce_wire_bytes,
    ep_all_to_all_payload_bytes,
    pp_p2p_bytes,
    pp_stage_p2p_bytes_per_step,
    ring_wire_bytes,
    tp_layer_wire_bytes,
    zero3_wire_bytes,
    zero12_wire_bytes,
)
from backend.analytic.textbook.flops import (
    narayanan_flops_per_iteration,
    narayanan_param_count,
    training_flops_per_step,
    training_flops_per_token,
)
from backend.analytic.textbook.korthikanti import korthikanti_layer_bytes
from backend.analytic.textbook.kv_cache import kv_cache_bytes, kv_cache_bytes_per_token
from backend.analytic.textbook.pipeline import (
    bubble_fraction,
    bubble_over_ideal,
    in_flight_microbatches,
    in_flight_stage_activations,
)
from backend.analytic.textbook.zero import precision_bytes, zero_memory_reduction, zero_model_state_bytes
from backend.analytic.units import GB, GiB, MiB

# ---------------------------------------------------------------- ZeRO (Rajbhandari et al. 2020)


def _zero_gb(psi, n, stage):
    return zero_model_state_bytes(psi, n=n, stage=stage, k=12)["total_bytes"] / GB


def test_zero_paper_figure1_7_5b_n64():
    """ZeRO Figure 1: Ψ=7.5B, N=64, K=12 -> 120, 31.4, 16.6, 1.9 GB for baseline, P_os, P_os+g, P_os+g+p."""
    got = [round(_zero_gb(7.5e9, 64, stage), 1) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


# ZeRO Table 1: per-device model-state memory (GB) for P_os / P_os+g / P_os+g+p.
ZERO_TABLE1 = [
    # (Ψ, N, (P_os, P_os+g, P_os+g+p))
    (7.5e9, 1, (120, 120, 120)),
    (7.5e9, 4, (52.5, 41.3, 30)),
    (7.5e9, 16, (35.6, 21.6, 7.5)),
    (7.5e9, 64, (31.4, 16.6, 1.88)),
    (7.5e9, 256, (30.4, 15.4, 0.47)),
    (7.5e9, 1024, (30.1, 15.1, 0.12)),
    (128e9, 1, (2048, 2048, 2048)),
    (128e9, 4, (896, 704, 512)),
    (128e9, 16, (608, 368, 128)),
    (128e9, 64, (536, 284, 32)),
    (128e9, 1024, (513, 257, 2)),
    (1e12, 4, (7000, 5500, 4000)),
    (1e12, 64, (4187.5, 2218.75, 250)),
    (1e12, 1024, (4011.7, 2013.7, 15.6)),
]


@pytest.mark.parametrize(("psi", "n", "expected"), ZERO_TABLE1)
def test_zero_paper_table1(psi, n, expected):
    """ZeRO Table 1 cells reproduce to the paper's rounding (3 significant digits)."""
    for stage, published in zip((1, 2, 3), expected, strict=False):
        got = _zero_gb(psi, n, stage)
        assert got == pytest.approx(published, rel=5e-3, abs=0.01), (psi, n, stage, got)


def test_zero_paper_sec5_reductions_4x_8x_n():
    """ZeRO Sec 5 / Figure 1: P_os 4x, P_os+g 8x (large N), P_os+g+p exactly N."""
    assert zero_memory_reduction(n=10**6, stage=1) == pytest.approx(4, rel=1e-4)
    assert zero_memory_reduction(n=10**6, stage=2) == pytest.approx(8, rel=1e-4)
    assert zero_memory_reduction(n=64, stage=3) == pytest.approx(64)


def test_precision_bytes_zero_sec3_k12():
    """ZeRO Sec 3.1: mixed-precision Adam keeps 2Ψ + 2Ψ + 12Ψ; fp32 Adam 4+4+8; SGD one state."""
    assert precision_bytes("bf16-mixed", "adamw") == (2, 2, 12)
    assert precision_bytes("fp16-mixed", "adamw") == (2, 2, 12)
    assert precision_bytes("fp32", "adamw") == (4, 4, 8)
    assert precision_bytes("fp32", "sgd") == (4, 4, 4)
    assert precision_bytes("bf16-mixed", "sgd") == (2, 2, 8)
    with pytest.raises(ValueError, match="precision"):
        precision_bytes("int8", "adamw")


def test_zero_stage_generalised_bytes():
    """fp32 Ψ=1000, N=4: stage 2 = 4Ψ + (4+8)Ψ/4."""
    got = zero_model_state_bytes(1000, n=4, stage=2, k=8, param_bytes=4, grad_bytes=4)
    assert got == {"params_bytes": 4000, "grads_bytes": 1000, "optimizer_bytes": 2000, "total_bytes": 7000}
    with pytest.raises(ValueError, match="stage"):
        zero_model_state_bytes(1, n=1, stage=4)


# ---------------------------------------------------------------- Narayanan et al. 2021 (Megatron-LM at scale)

# Narayanan 2021 Table 1 rows: (published billions, heads, h, l); V = 51200, s = 2048.
NARAYANAN_TABLE1 = [(1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
                    (39.1, 64, 8192, 48), (145.6, 96, 12288, 80), (310.1, 128, 16384, 96),
                    (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128)]


@pytest.mark.parametrize(("billions", "heads", "h", "l"), NARAYANAN_TABLE1)
def test_narayanan_eq2_param_count_table1(billions, heads, h, l):  # noqa: E741 - the paper's l (layers)
    """Narayanan 2021 Eq. 2 reproduces Table 1's parameter counts to the paper's 0.1B rounding."""
    got = narayanan_param_count(l=l, h=h, V=51200, s=2048) / 1e9
    assert abs(got - billions) <= 0.051 + 1e-3 * billions, got


def test_narayanan_eq2_gpt3_175b():
    """Eq. 2 for GPT-3 (l=96, h=12288): 174.6B."""
    assert narayanan_param_count(l=96, h=12288, V=51200, s=2048) / 1e9 == pytest.approx(174.6, abs=0.05)


def test_narayanan_sec221_bubble_over_ideal():
    """Narayanan 2021 Sec 2.2.1: bubble/ideal = (p-1)/m; Sec 2.2.2 interleaved (p-1)/(v·m)."""
    assert bubble_over_ideal("1f1b", p=8, m=32) == pytest.approx(7 / 32)
    assert bubble_over_ideal("gpipe", p=8, m=32) == pytest.approx(7 / 32)
    assert bubble_over_ideal("interleaved_1f1b", p=8, m=32, v=4) == pytest.approx(7 / 128)


def test_gpipe_sec23_bubble_fraction_and_relation():
    """GPipe (Huang 2019) Sec 2.3: idle/total = (p-1)/(m+p-1); relation f = x/(1+x) with Narayanan's x."""
    for p, m in [(2, 1), (4, 4), (4, 16), (8, 3)]:
        f = bubble_fraction("gpipe", p=p, m=m)
        assert f == pytest.approx((p - 1) / (m + p - 1))
        x = bubble_over_ideal("1f1b", p=p, m=m)
        assert f == pytest.approx(x / (1 + x))
        assert bubble_fraction("1f1b", p=p, m=m) == pytest.approx(f)
    assert bubble_fraction("interleaved_1f1b", p=4, m=8, v=2) == pytest.approx(3 / (16 + 3))
    assert bubble_fraction("1f1b", p=1, m=5) == 0


def test_zero_bubble_paper_zbh1_third_of_1f1b():
    """Qi et al. 2023 Sec 2.1: ZB-H1 bubble is 1/3 of 1F1B's when T_F = T_B = T_W; ZB-V Sec 6: zero."""
    assert bubble_over_ideal("zero_bubble", p=4, m=8) == pytest.approx(bubble_over_ideal("1f1b", p=4, m=8) / 3)
    assert bubble_over_ideal("zbv", p=4, m=8, v=2) == 0
    with pytest.raises(ValueError, match="zbv"):
        bubble_over_ideal("zbv", p=4, m=8, v=1)


def test_dualpipev_bubble_and_memory_from_the_dualpipe_readme():
    """deepseek-ai/DualPipe README: DualPipeV's bubble (PP/2 - 1)(F&B + B - 3W) over PP = 2p stages, PP + 1 stage chunks
    of activations per device. torch runs F&B as F then B, so in the ZB unit costs (F = W = 1, B = 2 per chunk) the
    bubble is 2(p - 1) units over m x 2 chunks x 3 units: (p - 1) / (3m)."""
    p, m = 4, 8
    F, B, W = 1, 2, 1
    bubble_units = (p - 1) * ((F + B) + B - 3 * W)
    assert bubble_over_ideal("dualpipev", p=p, m=m, v=2) == pytest.approx(bubble_units / (m * 2 * (F + B)))
    assert [in_flight_microbatches("dualpipev", p=p, m=m, stage=r, v=2) for r in range(p)] == [2 * p + 1] * p
    with pytest.raises(ValueError, match="dualpipev"):
        bubble_over_ideal("dualpipev", p=4, m=8, v=1)


def test_in_flight_microbatches_gpipe_1f1b():
    """GPipe holds all m; 1F1B (Narayanan 2021 Sec 2.2.1) holds p - stage, at most m."""
    assert in_flight_microbatches("gpipe", p=4, m=8, stage=0) == 8
    assert [in_flight_microbatches("1f1b", p=4, m=8, stage=r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches("1f1b", p=4, m=2, stage=0) == 2


def test_interleaved_in_flight_korthikanti_sec423():
    """Korthikanti 2022 Sec 4.2.3: interleaved stage 0 holds p·(1 + (p-1)/(p·v)) microbatches' activations."""
    for p, v in [(4, 2), (8, 3), (2, 4)]:
        got = in_flight_stage_activations("interleaved_1f1b", p=p, m=64, stage=0, v=v)
        assert got == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert in_flight_microbatches("interleaved_1f1b", p=4, m=2, stage=0, v=2) == 4  # capped at m·v


# ---------------------------------------------------------------- FLOPs

def test_flops_narayanan_eq3_with_full_recompute():
    """Narayanan 2021 Eq. 3 (96 B s l h² (...)) vs 8N + 16 l s h per token for GPT-3 175B, batch 1536."""
    l, h, V, s, B = 96, 12288, 51200, 2048, 1536  # noqa: E741 - the paper's l (layers)
    n = narayanan_param_count(l=l, h=h, V=V, s=s)
    ours = training_flops_per_step(n_params_dense=n, tokens=B * s, n_layers=l, seq_len=s, d_model=h, recompute="full")
    assert ours == pytest.approx(narayanan_flops_per_iteration(B=B, s=s, l=l, h=h, V=V), rel=2e-3)


def test_flops_palm_appendix_b_no_recompute():
    """PaLM App. B: 6N + 12·L·h·s per token; equals Narayanan's 72 B s l h² (...) form."""
    l, h, V, s = 96, 12288, 51200, 2048  # noqa: E741 - the paper's l (layers)
    n = narayanan_param_count(l=l, h=h, V=V, s=s)
    per_token = training_flops_per_token(n_params_dense=n, n_layers=l, seq_len=s, d_model=h)
    assert per_token == 6 * n + 12 * l * s * h
    assert per_token * s == pytest.approx(narayanan_flops_per_iteration(B=1, s=s, l=l, h=h, V=V, recompute=False),
                                          rel=1e-3)
    sel = training_flops_per_token(n_params_dense=n, n_layers=l, seq_len=s, d_model=h, recompute="selective")
    assert sel - per_token == 4 * l * s * h
    moe = training_flops_per_token(n_params_dense=n, n_layers=l, seq_len=s, d_model=h, active_params=n / 2)
    assert moe == 3 * n + 12 * l * s * h


# ---------------------------------------------------------------- Korthikanti et al. 2022 Table 2

GPT3 = dict(s=2048, b=1, h=12288, a=96)


def test_korthikanti_table2_gpt3_t8():
    """Table 2 for a GPT-3 175B layer (s=2048, b=1, h=12288, a=96), t=8: hand-computed bytes."""
    sbh = 2048 * 12288
    assert 5 * 96 * 2048 / 12288 == 80  # the 5as/h term for GPT-3
    assert korthikanti_layer_bytes(**GPT3) == sbh * 114
    assert korthikanti_layer_bytes(**GPT3, t=8) == sbh * (10 + 3 + 10) == 578_813_952
    assert korthikanti_layer_bytes(**GPT3, t=8, sp=True) == sbh * 114 / 8
    assert korthikanti_layer_bytes(**GPT3, t=8, recompute="selective") == sbh * 13
    assert korthikanti_layer_bytes(**GPT3, t=8, sp=True, recompute="selective") == sbh * 34 / 8
    assert korthikanti_layer_bytes(**GPT3, t=8, recompute="full") == 2 * sbh
    assert korthikanti_layer_bytes(**GPT3, t=8, sp=True, recompute="full") == 2 * sbh / 8


def test_korthikanti_sec5_selective_saves_70pct_gpt3():
    """Korthikanti Sec 5: for GPT-3, selective recomputation removes 70% of the activation memory (80 of 114)."""
    full = korthikanti_layer_bytes(**GPT3)
    sel = korthikanti_layer_bytes(**GPT3, recompute="selective")
    assert 1 - sel / full == pytest.approx(0.70, abs=0.01)


def test_our_model_is_korthikanti_minus_dropout():
    """Our block (no dropout, 4h MLP, 16-bit) = Table 2 minus the dropout terms (2sbh masks, 3as²b)."""
    s, b, h, a = 256, 2, 512, 8
    for t, sp in [(1, False), (4, False)]:
        ours = model_layer_activation_bytes(s=s, b=b, h=h, a=a, kv_heads=a, ffn=4 * h, dtype_bytes=2, t=t, sp=sp)
        stats_mask = 2 * 2 * s * b * 4 + s * s
        dropout = 2 * s * b * h + 3 * a * s * s * b / t
        assert ours - stats_mask == pytest.approx(korthikanti_layer_bytes(s=s, b=b, h=h, a=a, t=t) - dropout)


# ---------------------------------------------------------------- KV cache

def test_kv_cache_vllm_sec3_opt13b_800kb_per_token():
    """Kwon et al. 2023 (vLLM) Sec 3: OPT-13B needs 2 x 5120 x 40 x 2 B = 800 KB per token, 1.6 GB at 2048."""
    per_token = kv_cache_bytes_per_token(n_layers=40, n_kv_heads=40, head_dim=128, dtype_bytes=2)
    assert per_token == 819_200
    full = kv_cache_bytes(batch=1, context=2048, n_layers=40, n_kv_heads=40, head_dim=128, dtype_bytes=2)
    assert full / GB == pytest.approx(1.6, rel=0.05)


def test_kv_cache_llama2_published_examples():
    """Llama-2-70B (80 layers, 8 KV heads, d 128, fp16): 327,680 B = 0.3125 MiB per token; NVIDIA blog
    "Mastering LLM Techniques: Inference Optimization" (2023): Llama-2-7B, batch 1, 4096 tokens = ~2 GB."""
    assert kv_cache_bytes_per_token(n_layers=80, n_kv_heads=8, head_dim=128, dtype_bytes=2) == 327_680
    assert 327_680 / MiB == 0.3125
    b7 = kv_cache_bytes(batch=1, context=4096, n_layers=32, n_kv_heads=32, head_dim=128, dtype_bytes=2)
    assert b7 == 2 * GiB


def test_kv_cache_tp_splits_heads():
    """Megatron TP splits KV heads; fewer KV heads than ranks are replicated (1 head per rank)."""
    full = kv_cache_bytes(batch=1, context=10, n_layers=2, n_kv_heads=8, head_dim=4, dtype_bytes=2)
    assert kv_cache_bytes(batch=1, context=10, n_layers=2, n_kv_heads=8, head_dim=4, dtype_bytes=2, tp=4) == full / 4
    assert kv_cache_bytes(batch=1, context=10, n_layers=2, n_kv_heads=2, head_dim=4, dtype_bytes=2, tp=8) == full / 8


# ---------------------------------------------------------------- communication

def test_ring_wire_bytes_patarasuk_yuan():
    """Ring all-reduce 2(N-1)/N·S; all-gather, reduce-scatter, all-to-all (N-1)/N·S; send S; N=1 -> 0."""
    assert ring_wire_bytes("all_reduce", 1000, 4) == 1500
    assert ring_wire_bytes("all_gather", 1000, 4) == 750
    assert ring_wire_bytes("reduce_scatter", 1000, 4) == 750
    assert ring_wire_bytes("all_to_all", 1000, 4) == 750
    assert ring_wire_bytes("send", 1000, 4) == 1000
    assert ring_wire_bytes("all_reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match="collective"):
        ring_wire_bytes("gossip", 1, 2)


def test_zero_sec7_communication_volumes():
    """ZeRO Sec 7.1: DP 2Ψ; Sec 7.2.1: ZeRO-1/2 2Ψ (no extra); Sec 7.2.2: ZeRO-3 3Ψ = 1.5x DP."""
    psi, n = 1e9, 64
    assert dp_allreduce_wire_bytes(psi, n) == pytest.approx(2 * psi * (n - 1) / n)
    assert zero12_wire_bytes(psi, n) == pytest.approx(dp_allreduce_wire_bytes(psi, n))
    assert zero3_wire_bytes(psi, n) / dp_allreduce_wire_bytes(psi, n) == pytest.approx(1.5)


def test_tp_wire_narayanan_sec32():
    """Narayanan 2021 Sec 3.2: 4 all-reduces of bsh per layer per microbatch -> 8bsh(t-1)/t elements."""
    b, s, h, t = 2, 2048, 12288, 8
    assert tp_layer_wire_bytes(b=b, s=s, h=h, t=t, dtype_bytes=2) == pytest.approx(8 * b * s * h * (t - 1) / t * 2)
    assert tp_layer_wire_bytes(b=b, s=s, h=h, t=1, dtype_bytes=2) == 0


def test_pp_and_ep_volumes():
    """PP: bsh per boundary per direction (Narayanan Sec 3.2); EP: 4 all-to-alls of tokens·k·h (GShard)."""
    assert pp_p2p_bytes(b=2, s=16, h=32, dtype_bytes=4) == 2 * 16 * 32 * 4
    one = pp_p2p_bytes(b=1, s=1, h=1, dtype_bytes=1)
    assert [pp_stage_p2p_bytes_per_step(b=1, s=1, h=1, dtype_bytes=1, m=3, stage=r, p=3) for r in range(3)] == \
        [3 * one, 6 * one, 3 * one]
    assert pp_stage_p2p_bytes_per_step(b=1, s=1, h=1, dtype_bytes=1, m=3, stage=0, p=3, v=2) == 9 * one
    assert ep_all_to_all_payload_bytes(tokens=64, h=32, top_k=2, dtype_bytes=4) == 4 * 64 * 2 * 32 * 4


def test_units():
    assert GB == 1e9 and GiB == 2**30 and math.isclose(MiB, 2**20)


def test_analytic_modules_are_pure_python():
    """The prediction model imports neither torch nor streamlit (project standard); the textbook formulas and the
    per-block activation formulas import no numpy either (the core's array path lives in scalar_or_array.py /
    layout.py)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "backend" / "analytic"
    numpy_free = {"textbook/zero", "memory/activations", "memory/moe_bytes", "textbook/korthikanti",
                  "textbook/kv_cache", "textbook/pipeline", "pipelining", "textbook/flops", "textbook/comm_volume",
                  "textbook/seeds", "units"}
    files = sorted(root.rglob("*.py"))
    assert {f"{n}.py" for n in numpy_free} <= {str(f.relative_to(root)) for f in files}
    for path in files:
        name = str(path.relative_to(root))[:-3]
        tree = ast.parse(path.read_text())
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        banned = {"torch", "streamlit"} | ({"numpy"} if name in numpy_free else set())
        assert not mods & banned, (name, mods)


def _torch_schedule_peak(cls_name: str, p: int, m: int, v: int, rank: int) -> int:
    """Max (forwards - releasing backwards) in the action list torch.distributed.pipelining builds."""
    from torch.distributed.pipelining import schedules as S

    cls = getattr(S, cls_name)
    obj = cls.__new__(cls)  # only the pure-Python planner is used: no process group, no stages
    obj.pp_group_size, obj.n_local_stages, obj._n_microbatches, obj.rank = p, v, m, rank
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    obj.num_stages = obj._num_stages = p * v
    release = {S._ComputationType.FULL_BACKWARD, S._ComputationType.BACKWARD_WEIGHT}
    held = peak = 0
    flat = []
    for action in obj._calculate_single_rank_operations(rank):
        flat += list(action.sub_actions) if action is not None and action.sub_actions else [action]
    for action in flat:
        if action is None:
            continue
        if action.computation_type == S._ComputationType.FORWARD:
            held += 1
            peak = max(peak, held)
        elif action.computation_type in release:
            held -= 1
    assert held == 0
    return peak


@pytest.mark.parametrize(("schedule", "cls_name", "v"), [("interleaved_1f1b", "ScheduleInterleaved1F1B", 2),
                                                          ("interleaved_1f1b", "ScheduleInterleaved1F1B", 3),
                                                          ("zero_bubble", "ScheduleInterleavedZeroBubble", 2),
                                                          ("zbv", "ScheduleZBVZeroBubble", 2),
                                                          ("dualpipev", "ScheduleDualPipeV", 2)])
def test_in_flight_matches_torch_pipelining_plans(schedule, cls_name, v):
    """in_flight_microbatches equals the peak of torch.distributed.pipelining's own action lists."""
    pytest.importorskip("torch")
    for p in (2, 4):
        for m in (p, 2 * p, 3 * p, 6, 8):
            if schedule == "dualpipev" and m < 2 * p:
                continue
            if m % max(1, m // p):
                continue  # torch rejects microbatches that are not a multiple of the rounds
            want = [_torch_schedule_peak(cls_name, p, m, v, r) for r in range(p)]
            got = [in_flight_microbatches(schedule, p=p, m=m, stage=r, v=v) for r in range(p)]
            assert got == want, (p, m)
