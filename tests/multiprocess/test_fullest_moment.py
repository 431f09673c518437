"""Issue 32: the predicted fullest moment (RankEstimate.fullest_bytes: the activation peak, optimizer.step, the start of
the loss's backward or inside backward) equals the step's peak within 3%: traced at full shapes on fake tensors (a
grid of layouts, one process: backend/trace/batch.py) and measured by the engine on gloo (engine jobs of the test
farm, tests/helpers/farm.py: one torchrun launch per world), for every data-parallel flavour and recompute policy,
with and without pipelining.
The full-size grid (a 7B-shaped model at world 64 and zero3 x tp8 x pp4) is benchmarks/fullest_moment.py."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from backend.analytic.estimate import estimate
from backend.spec import ExperimentSpec
from backend.trace.batch import trace_many
from tests.helpers.farm import Job, engine_job, run_now, uses

POLICIES = ("none", "selective", "full", "op", "layers:2", "block:2", "uniform:2")
BOUND_PCT = 3.0


def spec(name: str, model: dict, train: dict, parallel: dict) -> ExperimentSpec:
    return ExperimentSpec.model_validate({"name": name, "model": model, "train": train, "parallel": parallel})


def off_pct(peak: int, s: ExperimentSpec, rank: int) -> tuple[float, str]:
    r = estimate(s).per_rank[rank]
    return (r.fullest_bytes() - peak) / peak * 100.0, r.fullest_moment()


TRACE_MODEL = {"n_layers": 4, "d_model": 256, "n_heads": 4, "seq_len": 256, "vocab_size": 2048}
TRACE_TRAIN = {"global_batch": 16, "micro_batch": 1, "precision": "bf16-mixed"}


def trace_grid(pipelined: bool) -> list[tuple[ExperimentSpec, int]]:
    """Every flavour at world 8 without pipelining (rank 0) under every policy (28 traces, 2 accumulated microbatches);
    or zero3 / ddp x tp2 x pp2 1F1B (both stages) under none, full and uniform:2 (12 traces) at 4 microbatches: two
    steady 1F1B rounds, as many as 8 gave (the same 0 misses; 66 CPU-s for the 12 traces instead of 125)."""
    items = []
    for rc in POLICIES:
        train = TRACE_TRAIN | {"recompute": rc} | ({"global_batch": 8} if pipelined else {})
        if not pipelined:
            for strategy in ("ddp", "zero1", "zero2", "zero3"):
                items.append((spec(f"{strategy} {rc}", TRACE_MODEL, train, {"strategy": strategy, "world_size": 8}), 0))
            continue
        if rc not in ("none", "full", "uniform:2"):
            continue
        for strategy in ("zero3", "ddp"):
            s = spec(f"{strategy} tp2 pp2 {rc}", TRACE_MODEL, train,
                     {"strategy": strategy, "world_size": 8, "tp": 2, "pp": 2, "pp_schedule": "1f1b"})
            items += [(s, 0), (s, 4)]
    return items


def grid_misses(items: list[tuple[ExperimentSpec, int]], tmp_path: Path) -> list[str]:
    records = trace_many([{"spec": s.model_dump(mode="json"), "rank": r} for s, r in items], tmp_path)
    misses = []
    for (s, rank), rec in zip(items, records, strict=False):
        assert rec["status"] == "ok", (s.name, rec.get("error"))
        pct, moment = off_pct(rec["traced"]["peak_bytes"], s, rank)
        if abs(pct) > BOUND_PCT:
            misses.append(f"{s.name} rank {rank}: {pct:+.2f}% ({moment})")
    return misses


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_traced_peak_is_the_predicted_fullest_moment_on_a_grid_of_layouts(tmp_path: Path) -> None:
    assert not (misses := grid_misses(trace_grid(pipelined=False), tmp_path)), misses


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_traced_peak_of_pipelined_tp_layouts_is_the_predicted_fullest_moment(tmp_path: Path) -> None:
    assert not (misses := grid_misses(trace_grid(pipelined=True), tmp_path)), misses


THREE_STAGES = {"n_layers": 12, "d_model": 256, "n_heads": 4, "seq_len": 256, "vocab_size": 2048}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_traced_peak_of_a_three_stage_layers_policy_is_the_predicted_fullest_moment(tmp_path: Path) -> None:
    """layers:2 on zero3 x tp2 x pp3 1F1B (4 blocks a stage, every stage): the stages peak in their second block's
    re-run, the first block's saved tensors still alive, and the later backwards of the stages that send gradients hold
    the previous backward's input gradient (memory/backward_moment.py lowest_checkpoint, sent_grad_bytes). Before those
    terms: rank 0 -2.03%, rank 4 -3.95%, rank 8 -3.23%; after: +0.00%, +0.00%, +0.61%. ~1 min of one core."""
    s = spec("zero3 tp2 pp3 layers:2", THREE_STAGES, TRACE_TRAIN | {"global_batch": 8, "microbatches": 4,
                                                                    "recompute": "layers:2"},
             {"strategy": "zero3", "world_size": 12, "tp": 2, "pp": 3, "pp_schedule": "1f1b"})
    assert not (misses := grid_misses([(s, 0), (s, 4), (s, 8)], tmp_path)), misses


TOY_MODEL = {"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4, "seq_len": 32}


def gloo_grid(world: int, parallel: dict, strategies: tuple, policies: tuple) -> dict[str, Job]:
    specs = [spec(f"{strategy}-{rc}", TOY_MODEL, {"global_batch": 8, "micro_batch": 1, "steps": 1, "warmup_steps": 1,
                                                  "recompute": rc},
                  {"strategy": strategy, "world_size": world} | parallel)
             for strategy in strategies for rc in policies]
    return {s.name: engine_job(s) for s in specs}


GLOO_GRIDS = {"world2": gloo_grid(2, {}, ("ddp", "zero1", "zero2", "zero3"), POLICIES),
              "world4-pp2": gloo_grid(4, {"pp": 2, "pp_schedule": "1f1b"}, ("ddp", "zero3"),
                                      ("none", "full", "uniform:2"))}


def measured_misses(s: ExperimentSpec, result: dict) -> list[str]:
    misses = []
    for rr in result["result"].per_rank:
        assert rr.predicted.peak_bytes == estimate(s).per_rank[rr.rank].fullest_bytes()
        pct, moment = off_pct(rr.measured.peak_bytes, s, rr.rank)
        if abs(pct) > BOUND_PCT:
            misses.append(f"{s.name} rank {rr.rank}: {pct:+.2f}% ({moment})")
    return misses


@pytest.mark.slow
@pytest.mark.parametrize("grid", [pytest.param(k, marks=uses(*jobs.values()), id=k) for k, jobs in GLOO_GRIDS.items()])
def test_measured_peak_on_gloo_is_the_predicted_fullest_moment(farm, grid: str, tmp_path: Path) -> None:
    """A layout that misses is run once more in a launch of its own and must hold there; a model error repeats and
    fails. The misses CI saw (zero2 / zero3 3-3.9% above on one rank, the rerun missing again) were buffers gloo's
    worker thread freed late, reproduced with six CPU burners (5 misses in 8 grids) and gone since the memory step
    settles gloo's collectives (backend/bench/settle.py: 0 misses in 8 loaded grids, no buffer freed off the main
    thread)."""
    specs = {name: ExperimentSpec.from_json(job.payload) for name, job in GLOO_GRIDS[grid].items()}
    first = {name: m for name, job in GLOO_GRIDS[grid].items() if (m := measured_misses(specs[name], farm.result(job)))}
    if not first:
        return
    warnings.warn(f"measured peak missed the {BOUND_PCT}% bound, run again: {first}", stacklevel=1)
    again = run_now([engine_job(specs[name]) for name in first], tmp_path / "again")
    assert not (still := [m for name in first for m in measured_misses(specs[name], again[name])]), (first, still)
