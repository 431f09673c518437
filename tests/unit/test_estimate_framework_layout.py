"""`estimate` of a DeepSpeed / JAX spec says what that framework's run will predict for its own layout (the same
numbers the run's assembler puts beside its measurement), not only the torch layout's table, which for ZeRO-3 under
DeepSpeed misses its 19 MiB reduce bucket on a tiny model."""

from __future__ import annotations

import json

from backend.analytic.frameworks.deepspeed_layout import deepspeed_rank
from backend.analytic.frameworks.gspmd import predicted_bytes
from backend.frameworks.deepspeed.ds_config import BUCKET_ELEMENTS, PERSISTENCE_THRESHOLD
from backend.spec import ExperimentSpec
from tests.helpers.launch import cli

TINY = ("--layers", "2", "--hidden", "64", "--heads", "4", "--world", "2", "--steps", "2")


def _estimate(*argv: str) -> dict:
    out = cli("estimate", *TINY, *argv, "--json")
    assert out.code == 0, out.err
    return json.loads(out.out)


def _spec(framework: str, strategy: str, **parallel: int) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "framework": framework, "model": {"n_layers": 2, "d_model": 64, "n_heads": 4},
        "parallel": {"strategy": strategy, "world_size": 2, **parallel}, "train": {"steps": 2}})


def test_deepspeed_estimate_carries_the_runs_layout_prediction() -> None:
    data, spec = _estimate("--strategy", "zero3", "--framework", "deepspeed"), _spec("deepspeed", "zero3")
    lay = deepspeed_rank(spec, bucket_elements=BUCKET_ELEMENTS, persistence_threshold=PERSISTENCE_THRESHOLD)
    assert data["framework_layout"] == {
        "framework": "deepspeed", "params_bytes": lay.params_bytes, "grads_bytes": lay.grad_bucket_bytes,
        "optimizer_bytes": lay.master_bytes + lay.optimizer_state_bytes, "other_bytes": 0,
        "backward_bucket_bytes": 0, "offload": "none"}
    assert data["framework_layout"]["grads_bytes"] == 4 * BUCKET_ELEMENTS != data["per_rank"][0]["grads_bytes"]
    table = cli("estimate", *TINY, "--strategy", "zero3", "--framework", "deepspeed").out
    assert "framework deepspeed: its run predicts per rank" in table and "19.07 MiB" in table


def test_jax_estimate_carries_the_gspmd_prediction_and_torch_has_none() -> None:
    data, spec = _estimate("--strategy", "tp", "--tp", "2", "--framework", "jax"), _spec("jax", "tp", tp=2)
    pb = predicted_bytes(spec)
    assert data["framework_layout"]["params_bytes"] == pb["params_bytes"]
    assert data["framework_layout"]["optimizer_bytes"] == pb["optimizer_bytes"]
    torch_data = _estimate("--strategy", "zero3")
    assert "framework_layout" not in torch_data


def test_an_offloaded_deepspeed_layout_says_where_its_states_sit() -> None:
    table = cli("estimate", *TINY, "--strategy", "zero3", "--framework", "deepspeed", "--offload", "optimizer").out
    assert "offload optimizer: on a GPU those states sit in host memory" in table
