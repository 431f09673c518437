"""Issue 23: the planner calls the prediction core itself. The worst-rank memory of arrays of layouts
(analytic/memory/rank.worst_rank_memory) equals, byte for byte, the same core on one layout (estimate.worst_rank_bytes)
and the full estimator's worst rank (estimate.estimate, every rank) on 1,000 random enumerated layouts and at 70B /
1,024 GPUs; the step-time screen is a named approximation whose fields come from the step-time model's functions; the
plan's reported order is the step-time model's.

Model shapes: Llama-70B (Touvron et al. 2023, "Llama 2", Table 1 / Appendix: 80 layers, d_model 8192, 64 heads,
8 KV heads, FFN 28672, vocab 32000); TinyLlama-1.1B (Zhang et al. 2024, "TinyLlama", Sec 2.1 Table 1: 22 layers,
d_model 2048, 32 heads, 4 KV heads, FFN 5632, vocab 32000); a small Mixtral-style MoE and a tied GPT for the
other families.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from backend.analytic.device import fits_device
from backend.analytic.estimate import estimate, worst_rank_bytes
from backend.analytic.layout import Layout, PipelineSchedule, ZeroStage
from backend.analytic.memory.rank_memory import worst_rank_memory
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.screen import screen_step_s, step_screen
from backend.planner.search import plan
from backend.planner.space import enumerate_layouts, light_spec
from backend.spec import ExperimentSpec, ModelSpec

LLAMA = dict(norm="rmsnorm", mlp="swiglu", positions="rope", bias="none")
TINYLLAMA = ModelSpec(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
                      seq_len=2048, **LLAMA)
LLAMA70B = ModelSpec(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                     seq_len=4096, **LLAMA)
MOE = ModelSpec(vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn_hidden=2816, seq_len=1024,
                n_experts=8, top_k=2, n_shared_experts=1, shared_expert_gate=True, **LLAMA)
GPT_TIED = ModelSpec(vocab_size=50257, d_model=1536, n_layers=12, n_heads=12, seq_len=1024, tie_embeddings=True)
CASES = [(TINYLLAMA, 32, 64, "bf16-mixed"), (TINYLLAMA, 64, 128, "bf16-mixed"), (MOE, 32, 64, "bf16-mixed"),
         (GPT_TIED, 48, 96, "fp32")]


def _exact(model: ModelSpec, layouts: Layout, i: int) -> int:
    """The estimator's fullest rank at its fullest moment (RankEstimate.fullest_bytes: the activation peak,
    optimizer.step, the start of the loss's backward, inside backward), every rank."""
    return max(r.fullest_bytes()
               for r in estimate(ExperimentSpec.for_prediction(layouts.take(i).spec_dict(model))).per_rank)


@pytest.mark.heavy
def test_array_and_single_layout_memory_agree_on_1000_random_layouts():
    """Every flavour (ddp, zero1, zero2, zero3) x tp x SP x pp x schedule x virtual stages x ep x recompute x
    micro-batch of four (model, GPUs, precision) cases; 1,000 layouts drawn with a fixed seed: the array path, the
    same core on the one layout, and the full estimator's worst rank give the same bytes."""
    pool = []
    for k, (model, gpus, batch, precision) in enumerate(CASES):
        layouts = enumerate_layouts(model, gpus=gpus, gpus_per_node=8, global_batch=batch, precision=precision)
        fast, at = worst_rank_memory(model, layouts)
        pool += [(k, layouts, i, fast[i], at[i]) for i in range(len(layouts))]
    sample = random.Random(13).sample(pool, 1000)
    zero = {int(lay.zero_stage[i]) for _, lay, i, _, _ in sample}
    schedules = {int(lay.schedule[i]) for _, lay, i, _, _ in sample}
    assert zero == set(ZeroStage.ALL) and schedules == set(PipelineSchedule.ALL)
    assert max(int(lay.ep[i]) for _, lay, i, _, _ in sample) > 1
    for k, layouts, i, fast, at in sample:
        model = CASES[k][0]
        one, rank = worst_rank_bytes(light_spec(layouts.take(i).spec_dict(model)))
        assert (fast, at * layouts.dp[i] * layouts.tp[i]) == (one, rank.rank), (CASES[k][1:], i)
        assert fast == _exact(model, layouts, i), (CASES[k][1:], i)


# Long sequences, context parallelism (flash attention), pipelines and a 128k vocabulary, where the start of the loss's
# backward and the moments inside backward are the fullest: Llama-3-8B's shape (Dubey et al. 2024, Table 3: 32 layers,
# d_model 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256) at 32k tokens and a GPT with tied 100k embeddings.
LLAMA3_8B_32K = ModelSpec(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                          seq_len=32768, attention="flash", **LLAMA)
WIDE_VOCAB = ModelSpec(vocab_size=100352, d_model=1024, n_layers=8, n_heads=16, seq_len=8192, tie_embeddings=True,
                       attention="flash")
LONG_CASES = [(LLAMA3_8B_32K, 64, 64, "bf16-mixed"), (WIDE_VOCAB, 32, 64, "bf16-mixed"), (WIDE_VOCAB, 16, 32, "fp32")]


@pytest.mark.heavy
def test_array_and_estimator_fullest_moment_agree_on_long_sequences_cp_pp_and_large_vocabularies():
    """Issue 32: the planner's memory is `estimate`'s fullest moment. 300 random layouts with cp, pp and every
    recompute the planner searches, where the loss's backward or a moment inside backward is the fullest: the array
    path equals the estimator's fullest rank, byte for byte; every kind of moment wins somewhere."""
    pool = []
    for k, (model, gpus, batch, precision) in enumerate(LONG_CASES):
        layouts = enumerate_layouts(model, gpus=gpus, gpus_per_node=8, global_batch=batch, precision=precision)
        fast, _ = worst_rank_memory(model, layouts)
        pool += [(k, layouts, i, fast[i]) for i in range(len(layouts))]
    sample = random.Random(32).sample(pool, 300)
    assert max(int(lay.cp[i]) for _, lay, i, _ in sample) > 1 and max(int(lay.pp[i]) for _, lay, i, _ in sample) > 1
    moments = set()
    for k, layouts, i, fast in sample:
        model = LONG_CASES[k][0]
        est = estimate(ExperimentSpec.for_prediction(layouts.take(i).spec_dict(model)))
        worst = est.worst()
        assert fast == worst.fullest_bytes(), (LONG_CASES[k][1:], i)
        moments.add(worst.fullest_moment())
    assert {"loss_backward", "backward"} <= moments, moments


@pytest.mark.heavy
def test_array_memory_equals_the_estimator_at_70b_on_1024_gpus():
    layouts = enumerate_layouts(LLAMA70B, gpus=1024, gpus_per_node=8, global_batch=1024)
    fast, _ = worst_rank_memory(LLAMA70B, layouts)
    rng = random.Random(70)
    by_pp = {pp: np.nonzero(layouts.pp == pp)[0].tolist() for pp in np.unique(layouts.pp).tolist()}
    picks = [i for pp in sorted(by_pp) for i in rng.sample(by_pp[pp], min(3, len(by_pp[pp])))]  # every pp degree
    for i in picks:
        assert fast[i] == _exact(LLAMA70B, layouts, i), i


def test_plan_feasible_is_every_fitting_layout_and_order_is_the_step_time_models():
    hw = get_hardware("a100-80gb-sxm")
    res = plan(TINYLLAMA, gpus=32, gpus_per_node=8, hw=hw, global_batch=64, top=5, memory_bytes=20e9)
    layouts = enumerate_layouts(TINYLLAMA, gpus=32, gpus_per_node=8, global_batch=64, device="cuda")  # a GPU profile's
    mem, _ = worst_rank_memory(TINYLLAMA, layouts)
    assert res.searched == len(layouts) and res.feasible == int(fits_device(mem, layouts, "cuda", 20e9).sum()) > 0
    steps = [c["step_time"]["step_s"] for c in res.configs]
    assert len(steps) == 5 and steps == sorted(steps) and all(c["fits_exact"] for c in res.configs)
    for c in res.configs:  # the reported step time is steptime.model's, not the screen's
        assert c["step_time"]["step_s"] == step_time(light_spec(c["spec"]), hw, gpus_per_node=8).summary["step_s"]


def test_step_screen_keeps_the_exact_models_best_inside_the_pool():
    """The screen only picks the pool that steptime.model re-times. Its documented tolerance: among the screen's 200
    fastest fitting layouts, the exact model's 5 fastest are within the screen's first 15 (the pool of
    `plan --top 5`), so the plan reports them in the exact model's order."""
    hw = get_hardware("a100-80gb-sxm")
    layouts = enumerate_layouts(TINYLLAMA, gpus=32, gpus_per_node=8, global_batch=64, device="cuda")
    mem, _ = worst_rank_memory(TINYLLAMA, layouts)
    screen = screen_step_s(TINYLLAMA, layouts, hw, gpus_per_node=8)
    keep = np.nonzero(fits_device(mem, layouts, "cuda", 20e9))[0]
    order = keep[np.argsort(screen[keep], kind="stable")][:200]
    exact = [step_time(light_spec(layouts.take(int(i)).spec_dict(TINYLLAMA)), hw, gpus_per_node=8).summary["step_s"]
             for i in order]
    assert max(np.argsort(exact, kind="stable")[:5]) < 15
    res = plan(TINYLLAMA, gpus=32, gpus_per_node=8, hw=hw, global_batch=64, top=5, memory_bytes=20e9)
    assert [c["step_time"]["step_s"] for c in res.configs] == sorted(exact)[:5]


def test_screen_compute_is_the_step_time_models_compute_without_what_it_leaves_out():
    """The screen's compute field is step_time's compute (the same compute.* functions) for a one-stage layout,
    except what it leaves out by design: the 2 x 4 kernel launches of the loss's softmax passes per microbatch and,
    under the recompute policies that re-run weight GEMMs, their share of lm_head's GEMM re-run in backward."""
    from backend.analytic.layout import RecomputeMode
    from backend.analytic.recompute_cost import rerun_share
    from backend.analytic.steptime.compute import gemm_s
    from backend.planner.space import SEARCHED_RECOMPUTE

    hw = get_hardware("h100-sxm")
    layouts = enumerate_layouts(TINYLLAMA, gpus=8, gpus_per_node=8, global_batch=16)
    rows = np.nonzero(layouts.pp == 1)[0][::7]
    screen = step_screen(TINYLLAMA, layouts, hw, gpus_per_node=8)
    assert {int(layouts.recompute[i]) for i in rows} == set(SEARCHED_RECOMPUTE)
    for i in rows.tolist():
        one = layouts.take(i)
        exact = step_time(light_spec(one.spec_dict(TINYLLAMA)), hw, gpus_per_node=8, attention="flash").per_rank[0]
        left_out = 8 * hw.tune.kernel_launch_s
        if one.recompute not in (RecomputeMode.NONE, RecomputeMode.SELECTIVE):  # its share of lm_head's GEMM re-run
            left_out += float(rerun_share(TINYLLAMA, one, flash=True).gemm) * gemm_s(
                hw, hw.peak(one.precision), one.micro_batch * TINYLLAMA.seq_len, TINYLLAMA.d_model,
                TINYLLAMA.vocab_size / one.tp, one.compute_bytes, one.precision)
        assert screen.compute_s[i] == pytest.approx(exact.compute_s - one.microbatches * left_out, rel=1e-12), i


def test_screen_on_a_table_equals_the_screen_of_each_layout_alone():
    hw = get_hardware("a100-80gb-sxm")
    layouts = enumerate_layouts(MOE, gpus=32, gpus_per_node=8, global_batch=64)
    table = screen_step_s(MOE, layouts, hw, gpus_per_node=8)
    for i in range(0, len(layouts), 97):
        alone = screen_step_s(MOE, layouts.take(np.array([i])), hw, gpus_per_node=8)
        assert alone[0] == table[i], i


def test_interleaved_peak_state_closed_form_equals_the_action_walk():
    """fsdp_state.interleaved_peak_states (closed form, the core's) = fsdp_state.multi_stage_peak (walks torch's
    action order, the definition)."""
    from types import SimpleNamespace

    from backend.analytic.memory.fsdp_state import interleaved_peak_states, multi_stage_peak

    for zero in (2, 3):
        for p in (2, 3, 4, 8):
            for v in (2, 3, 4):
                for m in range(p, 4 * p + 1):
                    for rank in range(p):
                        spec = SimpleNamespace(train=SimpleNamespace(microbatches=m), parallel=SimpleNamespace(
                            pp=p, zero_stage=zero, pp_schedule="interleaved_1f1b", virtual_stages=v))
                        ref = multi_stage_peak(spec, [rank + k * p for k in range(v)])
                        want = {s: (x.unsharded, x.grads, x.in_forward, x.gathered) for s, x in ref.items()}
                        assert interleaved_peak_states(p, v, m, rank, zero) == want, (zero, p, v, m, rank)


@pytest.mark.heavy
def test_plan_memory_is_the_estimators_fullest_moment_on_the_issue_32_scenario():
    """Issue 32's steps: Plan with llama-3-70b at seq 32768 on 128 H100s (global batch 256, flash attention) printed
    zero1 dp2·tp8·pp4·cp2 at 68.2 GiB (its activation peak) against a 68.5 GiB budget, while `estimate` and New
    experiment said 76.74 GiB at the start of the loss's backward. Every layout Plan prints now carries `estimate`'s
    fullest moment of its fullest rank, to the byte, priced on CUDA ranks as `estimate --hardware` prices its fit, and
    fits by that fit rule (analytic/device.fits_device)."""
    from backend.presets import PRESETS

    model = ModelSpec(**(PRESETS["llama-3-70b"].model | {"seq_len": 32768, "attention": "flash"}))
    hw = get_hardware("h100-sxm")
    res = plan(model, gpus=128, gpus_per_node=8, hw=hw, global_batch=256, top=10)
    assert len(res.configs) == 10
    for c in res.configs:
        spec = ExperimentSpec.for_prediction(c["spec"])  # its ranks: CUDA (the profile's), as the planner priced it
        worst = estimate(spec).worst()
        assert c["mem_bytes_max"] == worst.fullest_bytes(), c["spec"]["name"]
        assert fits_device(worst.fullest_bytes(), spec.parallel, "cuda", hw.memory_bytes), c["spec"]["name"]
        assert c["fullest_moment"] == worst.fullest_moment()
    layouts = enumerate_layouts(model, gpus=128, gpus_per_node=8, global_batch=256)
    mem, _ = worst_rank_memory(model, layouts)
    row8 = [i for i in range(len(layouts)) if layouts.take(i).spec_dict(model)["name"] == "plan dp2·tp8·pp4·cp2 zero1"]
    for i in row8:  # the issue's row: wherever its activation peak fits, its fullest moment is what Plan compares
        worst = estimate(ExperimentSpec.for_prediction(layouts.take(i).spec_dict(model))).worst()
        assert mem[i] == worst.fullest_bytes() >= worst.total_bytes
