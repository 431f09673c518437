"""The loss reference can never break a run: skipped with the arithmetic when it would not fit, isolated otherwise."""

from __future__ import annotations

import pytest

from backend.analytic.estimate import estimate
from backend.engine import reference
from backend.spec import ExperimentSpec

TINY = dict(model=dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=8),
            train=dict(global_batch=4, micro_batch=1, steps=2, warmup_steps=1))


def test_one_rank_spec_keeps_model_and_batch():
    s = ExperimentSpec(**TINY, parallel={"strategy": "zero3", "world_size": 4, "tp": 2})
    one = reference.one_rank_spec(s)
    assert one.parallel.world_size == 1 and one.model == s.model and one.train.global_batch == s.train.global_batch
    assert one.train.microbatches == s.train.global_batch // s.train.micro_batch


def test_skipped_with_the_arithmetic_when_over_budget(monkeypatch):
    s = ExperimentSpec(**TINY, parallel={"strategy": "ddp", "world_size": 2})
    need = estimate(reference.one_rank_spec(s)).per_rank[0]
    monkeypatch.setenv(reference.BUDGET_ENV, str(need.total_bytes // 2))
    losses, note = reference.run_isolated(s)
    assert losses == [] and note.startswith("Loss reference skipped") and "GiB" in note
    monkeypatch.setenv(reference.BUDGET_ENV, str(need.total_bytes + need.optimizer_temp_bytes))
    assert reference.skip_reason(s) is None


# ---- in processes of their own ----------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.slow
def test_isolated_reference_equals_in_process():
    s = ExperimentSpec(**TINY, parallel={"strategy": "ddp", "world_size": 2})
    losses, note = reference.run_isolated(s)
    assert note is None and losses == reference.reference_losses(s)
