"""A DeepSpeed or JAX spec is not traced as if it were the torch engine's (the trace runs ShardLab's own engine,
whose layout is not the framework's): it is refused as unsupported, with the reason, before any rank starts."""

from __future__ import annotations

import pytest

from backend.spec import ExperimentSpec
from backend.trace.trace_spec import trace_spec


def _spec(framework: str) -> ExperimentSpec:
    strategy = "tp" if framework == "jax" else "zero3"
    return ExperimentSpec.model_validate({
        "framework": framework, "model": {"n_layers": 2, "d_model": 64, "n_heads": 4},
        "parallel": {"strategy": strategy, "world_size": 2, **({"tp": 2} if strategy == "tp" else {})},
        "train": {"steps": 2}})


@pytest.mark.parametrize("framework", ["deepspeed", "jax"])
def test_a_non_torch_framework_is_unsupported_not_traced_as_torch(framework: str) -> None:
    def never(*_a):
        raise AssertionError("no rank is traced for a framework the trace does not run")

    out = trace_spec(_spec(framework), rank_runner=never)
    assert out["status"] == "unsupported"
    assert f"framework {framework}" in out["error"] and "--framework torch" in out["error"]
    assert out["per_rank"] == [] and out["kind"] == "traced"
