"""A compiled torchao rowwise float8 linear timed whole from torchao's own microbenchmark (steptime/torchao_rowwise.py):
the table read at its grid points, interpolated between them and held at its edges; the linear's seconds are its bf16
GEMMs plus the benchmark chain's (1 / speedup - 1); the stack picks it only compiled on Hopper without a measured
rowwise GEMM table, and then counts no casts apart."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from backend.analytic.steptime.float8_casts import float8_casts_cost
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.op_tables import GemmTable
from backend.analytic.steptime.ops import FP8_ROWWISE, dtype_gemm_time
from backend.analytic.steptime.stack_kernels import TORCHAO_ROWWISE
from backend.analytic.steptime.stack_knobs import stack_knobs
from backend.analytic.steptime.torchao_rowwise import (
    GRID,
    SPEEDUP,
    TORCHAO_ROWWISE_LINEAR,
    rowwise_linear_s,
    rowwise_speedup,
)
from backend.spec import ExperimentSpec

pytestmark = pytest.mark.unit

LLAMA_8B = {"vocab_size": 128256, "d_model": 4096, "n_layers": 4, "n_heads": 32, "n_kv_heads": 8,
            "ffn_hidden": 14336, "seq_len": 8192, "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope",
            "bias": "none", "attention": "flash"}


def _spec(recipe: str, elementwise: str = "compiled", tp: int = 1, precision: str = "fp8") -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": LLAMA_8B, "parallel": {"strategy": "fsdp", "dp": 8, "tp": tp, "sequence_parallel": tp > 1},
        "train": {"global_batch": 8, "micro_batch": 1, "precision": precision, "fp8_recipe": recipe,
                  "stack": "torchtitan", "elementwise": elementwise, "fp8_all_gather": False}})


def test_the_table_is_read_at_its_grid_points():
    assert len(SPEEDUP) == len(GRID) and all(len(k) == len(GRID) and all(len(n) == len(GRID) for n in k)
                                              for k in SPEEDUP)
    assert rowwise_speedup(1024, 1024, 1024) == pytest.approx(0.42)
    assert rowwise_speedup(8192, 4096, 4096) == pytest.approx(1.00)
    assert rowwise_speedup(16384, 32768, 32768) == pytest.approx(1.72)
    assert rowwise_speedup(32768, 32768, 32768) == pytest.approx(1.52)
    assert rowwise_speedup(4096, 2048, 16384) == pytest.approx(0.90)


def test_between_grid_points_it_interpolates_in_log_size_and_holds_at_the_edges():
    mid = math.sqrt(2048 * 4096)  # halfway between N = 2048 (0.42) and 4096 (0.50) on a log axis
    assert rowwise_speedup(1024, 1024, mid) == pytest.approx(0.46)
    assert rowwise_speedup(98304, 4096, 128) == rowwise_speedup(32768, 4096, 1024) == pytest.approx(0.59)
    rows = np.array([1024, 8192, 98304])
    assert np.allclose(rowwise_speedup(rows, 4096, 14336), [rowwise_speedup(float(r), 4096, 14336) for r in rows])


def test_a_linear_costs_its_bf16_gemms_plus_the_chains_share_of_the_slowdown():
    hw = get_hardware("h100-sxm")
    rows, k, n = 8192, 4096, 1024
    fwd, dgrad, wgrad = rowwise_linear_s(hw, rows, k, n)
    gemms = [dtype_gemm_time(hw, "bf16", *shape, 2) for shape in ((rows, k, n), (rows, n, k), (k, rows, n))]
    bandwidth = hw.hbm_bytes_per_s * hw.elementwise_fraction("copy")
    passes = sum(max(b * rows * w / bandwidth, hw.tune.kernel_launch_s) for b, w in ((4, k), (6, k), (4, n), (6, n)))
    extra = (sum(gemms) + passes) * (1 / rowwise_speedup(rows, k, n) - 1)
    assert fwd + dgrad + wgrad == pytest.approx(sum(gemms) + extra)
    assert fwd / dgrad == pytest.approx(gemms[0] / gemms[1])  # the extra shared as the GEMMs are
    assert fwd > gemms[0]  # speedup 0.77 < 1: slower than bf16
    big = rowwise_linear_s(hw, 32768, 8192, 32768)
    assert sum(big) < sum(dtype_gemm_time(hw, "bf16", *s, 2) for s in ((32768, 8192, 32768),) * 3)


def test_the_stack_times_a_compiled_rowwise_linear_whole_on_hopper_and_counts_no_casts_apart():
    hw = get_hardware("h100-sxm")
    knobs = stack_knobs(_spec("rowwise"), hw)
    assert knobs.fp8_gemms == TORCHAO_ROWWISE_LINEAR
    assert any("torchao_rowwise.py" in n for n in knobs.notes)
    assert float8_casts_cost(hw, _spec("rowwise"), ((((1024, 4096), False, True, None),), (0,)), 8192,
                             TORCHAO_ROWWISE_LINEAR, True) == (0.0, 0.0)
    assert stack_knobs(_spec("rowwise", "eager"), hw).fp8_gemms == TORCHAO_ROWWISE  # eager: kernel by kernel
    assert stack_knobs(_spec("tensorwise"), hw).fp8_gemms == "torchao"
    fp8 = hw.tables.gemm_table("fp8")
    measured = replace(hw, tables=replace(hw.tables, gemm={**hw.tables.gemm, FP8_ROWWISE: GemmTable(fp8.rows, "t")}))
    assert stack_knobs(_spec("rowwise"), measured).fp8_gemms == TORCHAO_ROWWISE  # a measured table of its own wins


def test_under_tp8_the_small_linears_make_rowwise_slower_than_bf16_as_torchtitan_1207_found():
    hw = get_hardware("h100-sxm")
    rowwise = step_time(_spec("rowwise", tp=8), hw).summary["compute_s"]
    bf16 = step_time(_spec("rowwise", tp=8, precision="bf16-mixed"), hw).summary["compute_s"]
    tensorwise = step_time(_spec("tensorwise", tp=8), hw).summary["compute_s"]
    assert rowwise > bf16 > tensorwise
