"""Worst-rank memory of a layout, by the exact estimator's own per-rank code on the ranks that can be worst.

`estimate.estimate` visits every rank (1,024 of them for a 1,024-GPU layout). The worst rank sits at tp index 0 and
FSDP dp index 0 (torch.chunk gives the first chunks the most rows), and for ZeRO-1 the dp index that owns
the largest optimizer share. Which pipeline rank peaks depends on the schedule (in-flight microbatches, held
stage inputs/outputs, the loss), so every pipeline rank is a candidate. This module runs `estimate._memory` (the same function) on those ranks only,
with each rank's local parameters cached per parallel layout, so it agrees with `estimate` on the worst rank
by construction (tests/test_planner.py checks 1,000 random layouts).
"""

from __future__ import annotations

from typing import Any

from backend.analytic import estimate as E
from backend.analytic.sharding import LocalParam, derived, local_params_shared, rank_layers, rank_stages, zero1_owned_all
from backend.spec import ExperimentSpec, ModelSpec, ParallelSpec, RuntimeSpec, TrainSpec


def light_spec(data: dict[str, Any]) -> ExperimentSpec:
    """An ExperimentSpec built without validation (the planner's rows are valid by construction): microbatches
    and dp filled in as spec_checks would derive them."""
    t, p = dict(data["train"]), dict(data["parallel"])
    t.setdefault("microbatches", t["global_batch"] // (t["micro_batch"] * p["dp"]))
    return ExperimentSpec.model_construct(name=data.get("name", ""), model=ModelSpec.model_construct(**data["model"]),
                                          train=TrainSpec.model_construct(**{**TrainSpec().model_dump(), **t}),
                                          parallel=ParallelSpec.model_construct(**{**ParallelSpec().model_dump(), **p}),
                                          runtime=RuntimeSpec())


def _zero1_worst(params: list[LocalParam], dp: int, optimizer: Any) -> list[LocalParam]:
    """The dp index's ZeRO-1 share with the most optimizer bytes (memoised per shared params tuple)."""
    return max(zero1_owned_all(params, dp), key=lambda o: E._optimizer_bytes(o, optimizer, fsdp=False))


def candidate_ranks(spec: ExperimentSpec) -> list[int]:
    p = spec.parallel
    return [r * p.dp * p.tp for r in range(p.pp)]


def worst_rank_bytes(spec: ExperimentSpec) -> tuple[int, E.RankEstimate]:
    """(total bytes, RankEstimate) of the worst rank: estimate._memory on the candidate ranks."""
    p = spec.parallel
    best: E.RankEstimate | None = None
    for rank in candidate_ranks(spec):
        shared = local_params_shared(spec, rank)  # shared with steptime.model: the pool's ranks are computed once
        params = list(shared)
        stages = rank_stages(spec, rank)
        fsdp = p.zero_stage >= 2
        r = E.RankEstimate(rank=rank, coords=p.coords(rank), stages=stages, layers=rank_layers(spec, stages),
                           params_count=sum(q.real_numel if fsdp else q.local_numel for q in params))
        E._memory(spec, rank, r, params)
        if p.zero_stage == 1 and p.dp > 1:  # the dp index owning the largest optimizer share
            worst = derived(shared, ("zero1_worst_share", p.dp, str(spec.train.optimizer)),
                            lambda ps: _zero1_worst(ps, p.dp, spec.train.optimizer))
            E._with_zero1_share(spec, r, worst)
        if best is None or r.total_bytes > best.total_bytes:
            best = r
    assert best is not None
    return best.total_bytes, best
