"""Parameter sweeps: the cartesian product of a grid over a base spec, each point validated.

Grid keys are dotted spec paths ("parallel.strategy", "train.microbatches") or the CLI flag names
("strategy", "world", "microbatches", "hidden", "zero-stage", ...) or unique field names ("d_model").
Fields the spec derives are dropped from the base when the grid changes what they derive from, so a
point is never rejected for a stale derived value: dp (and world_size when dp is swept) when the grid
changes the world/degree/strategy, the pure strategy's own degree (tp for "tp", ...) when it equals the
base world size, and microbatches when the grid changes the batch or dp.
"""

from __future__ import annotations

import copy
import itertools
import secrets
from datetime import UTC, datetime
from typing import Any

from backend.spec import ExperimentSpec, dims, validate_spec
from backend.spec.fields import FLAGS, SWITCHES
from backend.spec.user_text import MAX_NAME_CHARS

MAX_POINTS = 10_000
SECTIONS = ("model", "train", "parallel", "runtime")
WORLD_PATHS = dims.world_paths(dims.DIMS)
BATCH_PATHS = {"train.global_batch", "train.micro_batch"}
PURE_DEGREE = {name: name for name in dims.pure_strategies(dims.DIMS)}


def _aliases() -> dict[str, str]:
    out: dict[str, str] = {}
    for section in SECTIONS:
        for field in ExperimentSpec.model_fields[section].annotation.model_fields:
            out.setdefault(field, f"{section}.{field}")
    flags = {flag: f"{section}.{field}" if section else field for flag, (section, field, _) in FLAGS.items()}
    flags |= {flag: f"parallel.{f.name}" for flag, f in SWITCHES.items()}
    for flag, path in flags.items():
        out[flag.lstrip("-")] = path
        out[flag.lstrip("-").replace("-", "_")] = path
    out.update({"name": "name", "world": "parallel.world_size", "zero-stage": "zero_stage", "zero_stage": "zero_stage"})
    return out


ALIASES = _aliases()


def resolve_key(key: str) -> str:
    """A grid key as a dotted spec path ("zero_stage" stays itself: it maps onto parallel.strategy)."""
    if "." in key:
        section, _, field = key.partition(".")
        if section in SECTIONS and field in ExperimentSpec.model_fields[section].annotation.model_fields:
            return key
    elif key in ALIASES:
        return ALIASES[key]
    raise ValueError(f"unknown sweep key {key!r}: use a dotted spec path (e.g. parallel.world_size) or one of "
                     f"{', '.join(sorted(k for k in ALIASES if '_' not in k or k == 'zero_stage'))}")


def _base_dict(base: ExperimentSpec | dict) -> dict[str, Any]:
    return base.model_dump(mode="json") if isinstance(base, ExperimentSpec) else copy.deepcopy(dict(base))


def drop_derived(base: dict[str, Any], paths: set[str]) -> dict[str, Any]:
    """Remove from the base the derived fields the swept paths would contradict (swept fields are kept)."""
    out = copy.deepcopy(base)
    par, train = out.setdefault("parallel", {}), out.setdefault("train", {})
    changes_world = bool(paths & WORLD_PATHS) or "zero_stage" in paths
    if changes_world:
        if "parallel.dp" not in paths:
            par.pop("dp", None)
        elif "parallel.world_size" not in paths:
            par.pop("world_size", None)
        # "--strategy tp --world 4" derived tp = 4: re-derive it when the world or the strategy changes.
        degree = PURE_DEGREE.get(str(par.get("strategy", "")))
        if degree and f"parallel.{degree}" not in paths and par.get(degree) == par.get("world_size") \
                and paths & {"parallel.world_size", "parallel.strategy", "zero_stage"}:
            par.pop(degree, None)
    if (changes_world or paths & BATCH_PATHS) and "train.microbatches" not in paths:
        train.pop("microbatches", None)
    return out


ZERO_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def zero_strategy(value: Any) -> str:
    """The strategy a zero_stage value names; ValueError for anything but the integers 0..3 (no -1, 2.7 or true)."""
    if type(value) is not int or not 0 <= value < len(ZERO_STRATEGIES):
        raise ValueError(f"zero_stage={value!r} must be one of the integers 0, 1, 2, 3 (ddp, zero1, zero2, zero3)")
    return ZERO_STRATEGIES[value]


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    if path == "zero_stage":
        data.setdefault("parallel", {})["strategy"] = zero_strategy(value)
        return
    section, _, field = path.rpartition(".")
    (data.setdefault(section, {}) if section else data)[field] = value


def expand_grid(base: ExperimentSpec | dict,
                grid: dict[str, list]) -> tuple[list[ExperimentSpec], list[dict[str, Any]]]:
    """(valid specs, invalid points as {"point": {key: value}, "problems": [...]}) in grid order."""
    if not isinstance(grid, dict) or not grid:
        raise ValueError("a sweep grid is a non-empty JSON object {key: [values, ...]}")
    paths = {}
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"sweep key {key!r} needs a non-empty list of values (got {values!r})")
        paths[key] = resolve_key(key)
    n_points = 1
    for values in grid.values():
        n_points *= len(values)
    if n_points > MAX_POINTS:
        raise ValueError(f"the grid has {n_points} points (> {MAX_POINTS}): split it")
    template = drop_derived(_base_dict(base), set(paths.values()))
    base_name = str(template.get("name") or "")
    valid, invalid = [], []
    for combo in itertools.product(*grid.values()):
        point = dict(zip(grid.keys(), combo, strict=False))
        data = copy.deepcopy(template)
        try:
            for key, value in point.items():
                _set(data, paths[key], value)
        except ValueError as e:  # every value goes through the checks a single run's spec gets
            invalid.append({"point": point, "problems": [str(e)]})
            continue
        if "name" not in paths.values():
            label = " ".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())
            data["name"] = f"{base_name} {label}".strip()[:MAX_NAME_CHARS]
        spec, problems = validate_spec(data)
        if spec is None:
            invalid.append({"point": point, "problems": problems})
        else:
            valid.append(spec)
    return valid, invalid


def new_sweep_id() -> str:
    return f"sweep-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def submit_sweep(engine, base: ExperimentSpec | dict, grid: dict[str, list],
                 tags=()) -> tuple[str, list[int], list[dict]]:
    """Queue every valid point under one sweep id (one transaction); invalid points are returned, not queued."""
    from db.queries import submit_experiments

    valid, invalid = expand_grid(base, grid)
    sweep_id = new_sweep_id()
    ids = submit_experiments(engine, valid, tags=tags, sweep_id=sweep_id) if valid else []
    return sweep_id, ids, invalid
