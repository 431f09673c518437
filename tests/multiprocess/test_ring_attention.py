"""ShardLab's CPU ring attention (backend/strategies/ring_attention.py) equals one process's causal SDPA on the whole
sequence, forward and backward, for both K/V rotations and both chunk layouts, at world 4 on gloo (a farm job,
tests/helpers/cp_ring_check.py)."""

import pytest

from tests.helpers.farm import program_job, uses

BOUND = {"float32": 1e-5, "bfloat16": 3e-2}  # bf16: 8-bit mantissa; blocks merged in fp32 in both orders
RING = program_job("ring_attention", 4)


@pytest.mark.slow
@uses(RING)
def test_ring_attention_matches_sdpa_on_every_variant(farm):
    rows = farm.result(RING)
    assert len(rows) == 8
    for row in rows:
        bound = BOUND[row["dtype"]]
        assert max(row[k] for k in ("out", "dq", "dk", "dv")) < bound, row
