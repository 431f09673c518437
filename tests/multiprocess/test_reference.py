"""The loss reference in a forked CPU process of its own (reference.run_isolated) equals the in-process one."""

from __future__ import annotations

import pytest

from backend.engine import reference
from backend.spec import ExperimentSpec

TINY = dict(model=dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=8),
            train=dict(global_batch=4, micro_batch=1, steps=2, warmup_steps=1))


@pytest.mark.slow
def test_isolated_reference_equals_in_process():
    s = ExperimentSpec(**TINY, parallel={"strategy": "ddp", "world_size": 2})
    losses, note = reference.run_isolated(s)
    assert note is None and losses == reference.reference_losses(s)
