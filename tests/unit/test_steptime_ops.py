"""The step-time model's per-operation terms (steptime/ops.py, elementwise.py) and fitting a profile's tables to runs
(calibration/profile_fit.fit_profile)."""

from __future__ import annotations

import math

import pytest

from backend.analytic.steptime.elementwise import Widths, layer_passes, param_passes
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.ops import attention_flops, attention_time, passes_time
from backend.calibration.fit import Sample, fitted_params
from backend.calibration.profile_fit import fit_profile
from backend.spec import ExperimentSpec, ModelSpec

LLAMA = ModelSpec(vocab_size=1000, d_model=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=1408, seq_len=256,
                  norm="rmsnorm", mlp="swiglu", positions="rope", bias="none")
GPT = ModelSpec(vocab_size=1000, d_model=512, n_layers=2, n_heads=8, seq_len=256)


def _widths(m: ModelSpec, tokens: int = 4096, residual: float = 4) -> Widths:
    return Widths(tokens=tokens, norm_tokens=tokens, h=m.d_model, q=m.n_heads * m.head_dim, kv=m.kv_heads * m.head_dim,
                  ffn=m.ffn, act=2, residual=residual)


def _bytes(passes) -> float:
    return sum(p.bytes * p.count for p in passes)


def test_layer_passes_follow_the_block():
    """Counted from backend/models/gpt.py: autocast casts each Linear input (q, k, v, gate, up: 5 for SwiGLU, 4 for
    GELU); RoPE runs 5 kernels on q and on k; GQA repeats k and v; bytes grow linearly with the tokens."""
    kernels = lambda passes: sum(p.count for p in passes)  # noqa: E731
    fwd, _ = layer_passes(LLAMA, _widths(LLAMA))
    gfwd, _ = layer_passes(GPT, _widths(GPT))
    bf16, _ = layer_passes(LLAMA, _widths(LLAMA, residual=2))  # FSDP2 MixedPrecisionPolicy: no casts
    gbf16, _ = layer_passes(GPT, _widths(GPT, residual=2))
    assert kernels(fwd) - kernels(bf16) == 5 and kernels(gfwd) - kernels(gbf16) == 4
    # rope + repeat
    assert len([p for p in fwd if p.cls == "copy"]) - len([p for p in gfwd if p.cls == "copy"]) == 10 + 1
    double, _ = layer_passes(LLAMA, _widths(LLAMA, tokens=8192))
    assert _bytes(double) == pytest.approx(2 * _bytes(fwd))


def test_kernel_floor_and_bandwidth():
    """A kernel costs at least the profile's floor (the probe's seconds per tiny kernel), a large one its bytes at
    its class's measured fraction of the HBM peak."""
    from backend.analytic.steptime.elementwise import Pass

    hw = get_hardware("h100-sxm")
    assert passes_time(hw, [Pass("copy", 1.0, 3)]) == pytest.approx(3 * hw.tune.kernel_launch_s)
    big = 1e10
    assert (passes_time(hw, [Pass("rmsnorm", big)])
            == pytest.approx(big / (hw.hbm_bytes_per_s * hw.tables.elementwise["rmsnorm"])))


def test_causal_attention_counts_half_the_flops():
    hw = get_hardware("h100-sxm")
    assert attention_flops(1, 8, 4096, 128, causal=True) == attention_flops(1, 8, 4096, 128, causal=False) / 2
    fwd, bwd = attention_time(hw, "bf16-mixed", "flash", 1, 8, 4096, 128)
    cudnn_fwd, _ = attention_time(hw, "bf16-mixed", "cudnn", 1, 8, 4096, 128)
    assert bwd > 2 * fwd and cudnn_fwd < fwd  # the GH100 probe: cuDNN's kernel ~2x FlashAttention-2's throughput


def test_param_passes_only_under_autocast():
    assert param_passes(1e6, 1e3, 4, 2, False)[0][0].count == 0
    fwd, bwd = param_passes(1e6, 1e3, 4, 2, True)
    assert _bytes(fwd) == pytest.approx(6e6) and _bytes(bwd) == pytest.approx(6e6 + 12e6 + 12e3)


def _samples(hw) -> list[Sample]:
    layouts = [("ddp", 1, 1), ("zero2", 1, 1), ("zero3", 1, 1), ("ddp", 2, 1), ("zero3", 2, 1), ("ddp", 1, 2),
               ("zero3", 1, 2), ("ddp", 4, 1), ("zero2", 2, 2), ("zero3", 4, 1), ("ddp", 2, 2)]
    out = []
    for i, (strategy, mb, width) in enumerate(layouts):
        model = {"vocab_size": 8192, "d_model": 512 * width, "n_layers": 4, "n_heads": 8, "seq_len": 1024,
                 "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none"}
        spec = ExperimentSpec.model_validate({"model": model, "train": {"global_batch": 2 * mb, "micro_batch": mb,
                                              "precision": "bf16-mixed", "recompute": "full" if i % 3 == 0 else "none"},
                                              "parallel": {"strategy": strategy, "world_size": 2}})
        out.append(Sample(run_id=i, spec=spec, step_s=step_time(spec, hw).summary["step_s"], comm_s=None))
    return out


@pytest.mark.slow
def test_fit_profile_recovers_table_scales():
    """Runs measured on a profile whose GEMMs run at 0.8x its table, attention 1.2x, element-wise 0.7x (synthetic,
    made by the model itself): fit_profile returns a profile that predicts them (LOO MAPE < 3%), with the runs'
    residuals, and fits a scale for each operation table the profile has."""
    base = get_hardware("h100-sxm")
    truth = base.with_tunables(gemm_scale=0.8, attention_scale=1.2, elementwise_scale=0.7)
    runs = _samples(truth)
    assert {"attention_scale", "elementwise_scale", "optimizer_scale"} <= set(fitted_params(base))
    result = fit_profile(base, runs, iters=150)
    assert result.loo_mape is not None and result.loo_mape < 3.0, result.loo
    assert max(abs(r["residual_pct"]) for r in result.residuals) < 2.0
    assert math.isclose(result.profile.tune.gemm_scale, result.params["gemm_scale"])
