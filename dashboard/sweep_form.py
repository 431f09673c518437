"""Expand the form's sweep grid (strategies x world sizes x microbatches) into validated specs."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from backend.spec import ExperimentSpec, Strategy, validate_spec
from dashboard.spec_form import form_to_spec_dict


def expand_sweep(
    base: dict[str, Any], *, strategies: list[str], worlds: list[int], microbatches: list[int]
) -> tuple[list[ExperimentSpec], list[str]]:
    """Every combination as a spec; invalid ones are returned as problems, not raised.

    For a microbatch count m the global batch becomes micro_batch * dp * m, so each point keeps the
    per-rank microbatch size fixed and the spec's batch arithmetic stays consistent.
    """
    specs: list[ExperimentSpec] = []
    problems: list[str] = []
    for st, world, m in itertools.product(strategies or [base["strategy"]], worlds or [base["world_size"]],
                                          microbatches or [0]):
        label = f"{st} world={world}" + (f" microbatches={m}" if m else "")
        spec, errs = _one(base, st, int(world), int(m))
        if spec is None:
            problems.append(f"{label}: " + "; ".join(errs))
        else:
            specs.append(spec)
    return specs, problems


def _one(base: dict[str, Any], strategy: str, world: int, m: int) -> tuple[ExperimentSpec | None, list[str]]:
    v = dict(base, strategy=strategy, world_size=world)
    if strategy in (Strategy.TP, Strategy.PP, Strategy.EP):
        v[strategy] = 1  # the pure strategy's degree is re-derived from the world size
    d = form_to_spec_dict(v)
    if not m:
        return validate_spec(d)
    probe = copy.deepcopy(d)
    probe["train"]["microbatches"] = None
    probe["train"]["global_batch"] = int(v["micro_batch"]) * world * m
    spec, errs = validate_spec(probe)
    if spec is None:
        return None, errs
    d["train"]["microbatches"] = m
    d["train"]["global_batch"] = int(v["micro_batch"]) * spec.parallel.dp * m
    return validate_spec(d)
