"""torchao's float8 casts around each float8 linear (steptime/float8_casts.py), kernel by kernel as torchao's roofline
counts them (pytorch/ao 0598012 torchao/testing/training/roofline_utils.py), checked against the bytes by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backend.analytic.steptime import compute
from backend.analytic.steptime.float8_casts import CastRole, cast_roles, float8_casts_s
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.stack_kernels import TORCHAO_ROWWISE
from backend.spec import ExperimentSpec

LLAMA_8B = {"vocab_size": 128256, "d_model": 4096, "n_layers": 2, "n_heads": 32, "n_kv_heads": 8,
            "ffn_hidden": 14336, "seq_len": 8192, "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope",
            "bias": "none", "attention": "flash"}
ROWS, K, N_OUT = 8192, 4096, 14336


def _spec(strategy: str = "fsdp", dp: int = 8, fp8_all_gather: bool = False) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": LLAMA_8B, "parallel": {"strategy": strategy, "dp": dp},
        "train": {"global_batch": dp, "micro_batch": 1, "precision": "fp8", "stack": "torchtitan",
                  "fp8_all_gather": fp8_all_gather}})


def _seconds(hw, n_bytes: float, kernels: int) -> float:
    """n_bytes at the profile's copy bandwidth, plus the floors of `kernels` kernels that move nothing."""
    return n_bytes / (hw.hbm_bytes_per_s * hw.elementwise_fraction("copy")) + kernels * hw.tune.kernel_launch_s


def _kernels(hw, *kernel_bytes: float) -> float:
    """Kernels moving these bytes each, every one at least the kernel floor."""
    return sum(max(_seconds(hw, b, 0), hw.tune.kernel_launch_s) for b in kernel_bytes)


def test_tensorwise_casts_move_the_bytes_torchaos_roofline_counts():
    hw = get_hardware("h100-sxm")
    fwd, bwd = float8_casts_s(hw, _spec(), "torchao", False, (ROWS, K, N_OUT))
    x, w, dy = ROWS * K, K * N_OUT, ROWS * N_OUT
    # input: amax 2 B, its second stage, cast 2 + 1 + 1 B; weight: amax 2 B, second stage, cast 3 B (and 3 B backward)
    assert fwd == pytest.approx(_seconds(hw, 6 * x + 5 * w, 2))
    assert bwd == pytest.approx(_seconds(hw, 6 * dy + 3 * w, 1))


def test_compile_fuses_the_activations_amax_read_into_the_op_before():
    hw = get_hardware("h100-sxm")
    eager = float8_casts_s(hw, _spec(), "torchao", False, (ROWS, K, N_OUT))
    compiled = float8_casts_s(hw, _spec(), "torchao", True, (ROWS, K, N_OUT))
    floor = hw.tune.kernel_launch_s  # the fused amax kernel keeps its launch (roofline_utils: max(bytes, launch))
    assert eager[0] - compiled[0] == pytest.approx(_seconds(hw, 2 * ROWS * K, 0) - floor)
    assert eager[1] - compiled[1] == pytest.approx(_seconds(hw, 2 * ROWS * N_OUT, 0) - floor)


def test_rowwise_casts_also_write_a_bf16_transpose():
    hw = get_hardware("h100-sxm")
    fwd, bwd = float8_casts_s(hw, _spec(), TORCHAO_ROWWISE, False, (ROWS, K, N_OUT))
    x, w, dy = ROWS * K, K * N_OUT, ROWS * N_OUT
    assert fwd == pytest.approx(_seconds(hw, 8 * x + 3 * w, 0))
    assert bwd == pytest.approx(_seconds(hw, 8 * dy + 7 * w, 0))


def test_fsdp_fp8_all_gather_casts_the_weight_shard_and_transposes_the_gathered_weight():
    hw = get_hardware("h100-sxm")
    spec = _spec(fp8_all_gather=True)
    assert spec.train.fp8_gathers and spec.parallel.zero_stage == 3
    fwd, bwd = float8_casts_s(hw, spec, "torchao", False, (ROWS, K, N_OUT))
    x, w, dy, shard = ROWS * K, K * N_OUT, ROWS * N_OUT, K * N_OUT / 8
    shard_cast = max(_seconds(hw, 3 * shard, 0), hw.tune.kernel_launch_s)  # a 7.3 M-element shard: the floor
    assert fwd == pytest.approx(_seconds(hw, 6 * x, 1) + shard_cast)
    # backward: ZeRO-3 re-gathers (another shard cast), then preprocess_addmm's column-major copy, 1 + 1 B
    assert bwd == pytest.approx(_seconds(hw, 6 * dy + 2 * w, 1) + shard_cast)


def test_a_float8_step_pays_every_float8_linears_casts_once(monkeypatch):
    hw = get_hardware("h100-sxm")
    spec = _spec()
    linears = ((4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096))
    per_layer = sum(sum(float8_casts_s(hw, spec, "torchao", False, (ROWS, k, n))) for k, n in linears)
    with_casts = step_time(spec, hw).summary["compute_s"]
    monkeypatch.setattr(compute, "float8_casts_cost", lambda *args: (0.0, 0.0))
    without = step_time(spec, replace(hw, memo={})).summary["compute_s"]  # a fresh profile: nothing memoised
    assert with_casts - without == pytest.approx(LLAMA_8B["n_layers"] * per_layer)


def test_under_float8_tp_the_module_input_is_cast_once_on_its_sequence_shard():
    """torchao's PrepareFloat8ModuleInput casts q / k / v's shared input before the SP all-gather
    (float8_tensor_parallel.py), and Float8RowwiseParallel o's output gradient after its redistribute: rows / tp."""
    hw = get_hardware("h100-sxm")
    tp = ExperimentSpec.for_prediction({
        "model": LLAMA_8B, "parallel": {"strategy": "fsdp", "dp": 2, "tp": 4, "sequence_parallel": True},
        "train": {"global_batch": 2, "micro_batch": 1, "precision": "fp8", "stack": "torchtitan",
                  "fp8_all_gather": False}})
    roles = cast_roles([f"layers.0.attn.{n}.weight" for n in "qkvo"] + ["layers.0.mlp.down.weight"])
    assert roles["layers.0.attn.q.weight"] == CastRole(module_input=True, fed_by=3)
    assert roles["layers.0.attn.o.weight"] == roles["layers.0.mlp.down.weight"] == CastRole(output_projection=True)
    q = float8_casts_s(hw, tp, "torchao", False, (ROWS, K, K // 4), roles["layers.0.attn.q.weight"])
    x, dy, w = ROWS // 4 * K, ROWS * K // 4, K * K // 4
    # one cast of (rows / tp, d) shared by q, k and v: a third each; then the weight's amax, second stage and cast
    assert q[0] == pytest.approx(_kernels(hw, 2 * x, 0, 4 * x) / 3 + _kernels(hw, 2 * w, 0, 3 * w))
    assert q[1] == pytest.approx(_kernels(hw, 2 * dy, 0, 4 * dy, 3 * w))
    o = float8_casts_s(hw, tp, "torchao", False, (ROWS, K // 4, K), roles["layers.0.attn.o.weight"])
    x, dy = ROWS * K // 4, ROWS // 4 * K
    assert o[0] == pytest.approx(_kernels(hw, 2 * x, 0, 4 * x, 2 * w, 0, 3 * w))
    assert o[1] == pytest.approx(_kernels(hw, 2 * dy, 0, 4 * dy, 3 * w))
