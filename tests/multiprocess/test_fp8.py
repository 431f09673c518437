"""FP8 training (issue 26) in ranks: torchrun runs with torchao's float8 linears match the single-process fp8
reference (the prediction's fp8 terms: tests/unit/test_fp8.py)."""

from __future__ import annotations

import pytest

from tests.helpers.mp_launch import assert_parity, run_specs, tiny

SPECS = [
    tiny("fp8_ddp_tensorwise", model={"d_model": 64, "vocab_size": 128}, strategy="ddp", world_size=2,
         train={"precision": "fp8"}),
    tiny("fp8_ddp_rowwise", model={"d_model": 64, "vocab_size": 128}, strategy="ddp", world_size=2,
         train={"precision": "fp8", "fp8_recipe": "rowwise"}),
    tiny("fp8_fsdp_all_gather", model={"d_model": 64, "vocab_size": 128}, strategy="fsdp", world_size=2,
         train={"precision": "fp8"}),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_specs(2, SPECS, tmp_path_factory.mktemp("fp8"), timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8_ddp_tensorwise", "fp8_ddp_rowwise"])
def test_ddp_fp8_matches_the_fp8_reference(results, name):
    """Same casts (float8 linears converted the same way, bf16 autocast around them, the same microbatches so the
    same dynamic scales): the 1e-4 of every mix holds (measured 1.2e-7 loss / 4e-9 params tensorwise, 0 rowwise).
    fp8 needs no looser bound when the casts agree: its 2^-4 relative rounding is the same on both sides."""
    assert_parity(results[name])


@pytest.mark.slow
def test_fsdp_fp8_all_gather_within_the_mixed_precision_bound(results):
    """Pure FSDP runs under MixedPrecisionPolicy: it casts the weights to bf16 before their float8 cast (and the
    other params to bf16), where the reference's autocast casts fp32 weights: bf16 rounding of the weights, not fp8,
    sets the gap (measured 1.2e-3 loss, 4.0e-3 params after 2 steps): 1e-2."""
    assert_parity(results["fp8_fsdp_all_gather"], tol=1e-2)
