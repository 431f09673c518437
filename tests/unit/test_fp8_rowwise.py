"""torchao's rowwise float8 recipe in the step-time model: its GEMMs scale each row of both operands, which the GPU
check's probe measures as its own table (gemm_fp8_rowwise -> the profile's fp8_rowwise GEMM table). A profile with that
table times rowwise GEMMs by it; one without times them as tensorwise and says so."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from backend.analytic.steptime.float8_casts import float8_casts_s
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.op_tables import GemmTable, tables_from_measured
from backend.analytic.steptime.ops import FP8_ROWWISE, float8_gemm_time
from backend.analytic.steptime.stack_kernels import TORCHAO_ROWWISE
from backend.bench import op_probe
from backend.bench.op_timing import Deadline
from backend.spec import ExperimentSpec

LLAMA_8B = {"vocab_size": 128256, "d_model": 4096, "n_layers": 4, "n_heads": 32, "n_kv_heads": 8,
            "ffn_hidden": 14336, "seq_len": 8192, "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope",
            "bias": "none", "attention": "flash"}
LLAMA_8B_LINEARS = ((4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336),
                    (14336, 4096))
"""(in, out) of each block linear."""


def _spec(recipe: str) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": LLAMA_8B, "parallel": {"strategy": "fsdp", "dp": 8},
        "train": {"global_batch": 8, "micro_batch": 1, "precision": "fp8", "fp8_recipe": recipe,
                  "stack": "torchtitan", "fp8_all_gather": False}})


def _with_rowwise_table(slowdown: float):
    """h100-sxm with an fp8_rowwise table at 1/slowdown of its fp8 table's efficiency, shape for shape."""
    hw = get_hardware("h100-sxm")
    fp8 = hw.tables.gemm_table("fp8")
    rows = tuple((m, k, n, e / slowdown) for m, k, n, e in fp8.rows)
    return replace(hw, tables=replace(hw.tables, gemm={**hw.tables.gemm, FP8_ROWWISE: GemmTable(rows, "test")}))


def test_the_probe_measures_rowwise_scaled_gemms_on_the_cpu():
    table = op_probe.gemm_table(torch.device("cpu"), op_probe.TINY, Deadline.after(60), fp8=True, rowwise=True)
    assert table["rows"] and all(r.get("scaling") == "rowwise" and r["flops_per_s"] > 0 for r in table["rows"])
    tensorwise = op_probe.gemm_table(torch.device("cpu"), op_probe.TINY, Deadline.after(60), fp8=True)
    assert all("scaling" not in r for r in tensorwise["rows"])
    measured = {"gemm_fp8": tensorwise, "gemm_fp8_rowwise": table}
    tables = tables_from_measured(measured, {"bf16": 1e12, "fp8": 2e12, "fp32": 1e12}, 1e11, "cpu probe")
    assert set(tables.gemm) == {"fp8", FP8_ROWWISE}


def test_a_profile_with_a_rowwise_table_times_rowwise_gemms_by_it():
    hw = _with_rowwise_table(2.0)
    tensorwise = float8_gemm_time(hw, 8192, 4096, 14336)
    assert float8_gemm_time(hw, 8192, 4096, 14336, rowwise=True) == pytest.approx(2 * tensorwise, rel=0.02)
    slow, fast = step_time(_spec("rowwise"), hw), step_time(_spec("tensorwise"), hw)
    assert slow.summary["step_s"] > fast.summary["step_s"]
    assert not any("rowwise" in n for n in slow.notes)


def test_without_a_rowwise_table_rowwise_is_timed_as_tensorwise_and_says_so():
    hw = get_hardware("h100-sxm")
    assert hw.tables.gemm_table(FP8_ROWWISE) is None
    assert float8_gemm_time(hw, 8192, 4096, 14336, rowwise=True) == float8_gemm_time(hw, 8192, 4096, 14336)
    rowwise, tensorwise = step_time(_spec("rowwise"), hw), step_time(_spec("tensorwise"), hw)
    # the GEMMs alike, the step differs by the recipes' casts alone (float8_casts.py; test_float8_casts.py)
    casts = {r: sum(sum(float8_casts_s(hw, _spec(r), gemms, False, (8192, k, n))) for k, n in LLAMA_8B_LINEARS)
             for r, gemms in (("rowwise", TORCHAO_ROWWISE), ("tensorwise", "torchao"))}
    assert rowwise.summary["compute_s"] - tensorwise.summary["compute_s"] == pytest.approx(
        LLAMA_8B["n_layers"] * (casts["rowwise"] - casts["tensorwise"]))
    (note,) = [n for n in rowwise.notes if n.startswith("fp8_recipe rowwise")]
    assert "timed as tensorwise" in note and "gemm_fp8_rowwise" in note
