"""Sweeps: grid expansion over a base spec, derived fields re-derived, invalid points reported not queued."""

from __future__ import annotations

import pytest

from backend.spec import ExperimentSpec
from backend.sweep import drop_derived, expand_grid, resolve_key, submit_sweep
from db import queries as q
from tests.helpers.store_helpers import TINY, file_db, spec


def test_keys_accept_dotted_paths_flag_names_and_fields():
    assert resolve_key("parallel.strategy") == "parallel.strategy"
    assert resolve_key("world") == "parallel.world_size"
    assert resolve_key("microbatches") == "train.microbatches"
    assert resolve_key("hidden") == "model.d_model" and resolve_key("d_model") == "model.d_model"
    assert resolve_key("global-batch") == "train.global_batch"
    with pytest.raises(ValueError, match="unknown sweep key 'parallel.nope'"):
        resolve_key("parallel.nope")
    with pytest.raises(ValueError, match="non-empty list"):
        expand_grid(TINY, {"world": []})


def test_world_sweep_rederives_dp_and_microbatches_from_a_validated_base():
    base = spec("b", world_size=2)  # validated: dp=2 and microbatches=1 are now explicit
    assert (base.parallel.dp, base.train.microbatches) == (2, 1)
    valid, invalid = expand_grid(base, {"world": [1, 2, 4]})
    assert invalid == [{"point": {"world": 4}, "problems": [
        "global batch 4 is not divisible by micro-batch 2 * dp 4 = 8"]}]
    assert [(s.parallel.world_size, s.parallel.dp, s.train.microbatches) for s in valid] == [(1, 1, 2), (2, 2, 1)]
    assert [s.name for s in valid] == ["b world=1", "b world=2"]


def test_without_dropping_derived_fields_the_points_would_conflict():
    base = spec(world_size=2).model_dump(mode="json")
    data = {**base, "parallel": {**base["parallel"], "world_size": 1}}
    assert ExperimentSpec.model_validate(drop_derived(data, {"parallel.world_size"})).parallel.dp == 1
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(1\) \* pp\(1\) = 2 != world_size\(1\)"):
        ExperimentSpec.model_validate(data)


def test_pure_strategy_degree_and_batch_dims_are_rederived():
    base = spec(strategy="tp", world_size=2)
    assert base.parallel.tp == 2
    valid, invalid = expand_grid(base, {"strategy": ["tp", "ddp"], "parallel.world_size": [2]})
    assert invalid == []
    assert [(str(s.parallel.strategy), s.parallel.tp, s.parallel.dp) for s in valid] == [("tp", 2, 1), ("ddp", 1, 2)]
    valid, _ = expand_grid(spec(), {"train.global_batch": [4, 8]})
    assert [s.train.microbatches for s in valid] == [1, 2]


def test_an_explicit_swept_field_is_never_dropped():
    valid, invalid = expand_grid(spec(), {"microbatches": [1, 3]})
    assert [s.train.microbatches for s in valid] == [1]
    assert "microbatches=3 != global batch 4 / (micro-batch 2 * dp 2) = 1" in invalid[0]["problems"][0]


def test_zero_stage_key_maps_to_the_strategy():
    valid, _ = expand_grid(TINY, {"zero-stage": [0, 1, 2, 3]})
    assert [str(s.parallel.strategy) for s in valid] == ["ddp", "zero1", "zero2", "zero3"]


def test_submit_sweep_queues_only_valid_points_under_one_id(tmp_path):
    engine = file_db(tmp_path)
    grid = {"strategy": ["ddp", "zero2", "tp"], "world": [1, 2]}
    sweep_id, ids, invalid = submit_sweep(engine, TINY, grid, tags=["grid"])
    assert [bad["point"] for bad in invalid] == [{"strategy": "tp", "world": 1}]
    assert "strategy tp needs tp >= 2" in invalid[0]["problems"][0]
    rows = q.list_experiments(engine, sweep_id=sweep_id, order_by="id", descending=False)
    assert [r["id"] for r in rows] == ids and len(ids) == 5
    assert [(r["strategy"], r["world_size"]) for r in rows] == [("ddp", 1), ("ddp", 2), ("zero2", 1), ("zero2", 2),
                                                                ("tp", 2)]
    assert all(r["tags"] == ["grid"] and r["status"] == "queued" for r in rows)
