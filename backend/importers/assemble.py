"""Canonical fields -> an ExperimentSpec dict: the degree and batch arithmetic every framework shares.

Degrees follow the frameworks' own rule, world = dp_replicate x dp_shard x cp x tp x pp (torchtitan
ParallelDims; Megatron: tp x pp x cp x dp; DeepSpeed: dp), with at most one degree written as -1 / "auto" (the
rest of the GPUs). A contradiction is an error with the arithmetic, in torchtitan's words:
"dp_replicate(1) * dp_shard(4) * cp(2) * tp(2) * pp(1) = 16 != GPUs(8)".
Context parallelism maps to parallel.cp (all GPUs in the spec, the frameworks' tp-fastest, then cp, dp, pp order
is ShardLab's mesh order too), with flash attention unless the config names a kernel (CP runs over fused attention).
"""

from __future__ import annotations

import math
from typing import Any

from backend.importers.fields import SPEC_FIELDS, Flat, Pending
from backend.importers.import_result import ConfigImportError, ImportedConfig

DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
"""torchtitan's names; a framework with one data-parallel degree (Megatron, DeepSpeed) sets "dp" instead."""


def resolve_dp(flat: Flat, gpus: int | None) -> tuple[int, int]:
    """(dp = dp_replicate x dp_shard, GPUs) with -1 resolved; ConfigImportError with the arithmetic."""
    config_gpus = flat.get("gpus")
    if gpus is not None and config_gpus is not None and gpus != config_gpus:
        raise ConfigImportError([f"--gpus {gpus} contradicts the config's {config_gpus} GPUs "
                                 f"({flat.source_of('gpus')})"])
    total = gpus if gpus is not None else config_gpus
    shown = f"GPUs({total})" if gpus is not None or config_gpus is None else f"GPUs({total}, {flat.source_of('gpus')})"
    names = ("dp", *DEGREES[2:]) if "dp" in flat.canonical else DEGREES
    values = {d: flat.get(d, 1) for d in names}
    auto = [d for d, v in values.items() if v == -1]
    text = " * ".join(f"{d}({v})" for d, v in values.items())
    if len(auto) > 1:
        raise ConfigImportError([f"{' and '.join(f'{d}={flat.source_of(d)}' for d in auto)} are all -1/auto: at most "
                                 "one degree can take the rest of the GPUs"])
    if auto:
        if total is None:
            raise ConfigImportError([f"{flat.source_of(auto[0])} = -1/auto takes the rest of the GPUs: pass --gpus N "
                                     f"({text.replace(f'{auto[0]}(-1)', f'{auto[0]}(?)')} = N)"])
        fixed = math.prod(v for v in values.values() if v != -1)
        if total % fixed:
            raise ConfigImportError([f"{text} != {shown}: the other degrees multiply to {fixed}, which does not "
                                     f"divide {total} ({total} % {fixed} = {total % fixed})"])
        values[auto[0]] = total // fixed
        flat.put(auto[0], total // fixed, flat.source_of(auto[0]))
    product = math.prod(values.values())
    if total is not None and product != total:
        raise ConfigImportError([f"{' * '.join(f'{d}({v})' for d, v in values.items())} = {product} != {shown}"])
    return math.prod(v for d, v in values.items() if d.startswith("dp")), product


def batch(flat: Flat, dp: int) -> tuple[int, int, list[str]]:
    """(global batch, micro batch, notes) from global_batch | local_batch x dp | micro x grad_accum x dp."""
    micro = flat.get("micro_batch") or flat.get("local_batch")
    if micro is None:
        raise ConfigImportError(["the config gives no micro-batch size (sequences per GPU per forward pass)"])
    glob = flat.get("global_batch")
    notes = []
    if glob is None:
        local = flat.get("local_batch") or micro * (flat.get("grad_accum") or 1)
        glob = local * dp
        notes.append(f"global batch {glob} = {local} sequences per data-parallel rank x dp {dp}")
    return glob, micro, notes


def to_spec(flat: Flat, *, framework: str, source_format: str, name: str, gpus: int | None,
            spec_frameworks: tuple[str, ...] = ("torch",)) -> ImportedConfig:
    """The ImportedConfig of a flattened, mapped config. Raises ConfigImportError (every problem at once).
    spec_frameworks: the spec's `framework` values to validate, in order; the first that validates is taken (a
    DeepSpeed config is a deepspeed spec where ShardLab's DeepSpeed engine runs the layout, else a torch one)."""
    if flat.problems:
        raise ConfigImportError(flat.problems, flat.needs)
    dp, world = resolve_dp(flat, gpus)
    glob, micro, notes = batch(flat, dp)
    spec: dict[str, Any] = {"name": name, "framework": "torch",
                            "model": dict(flat.get("model_base") or {}),
                            "train": {"global_batch": glob, "micro_batch": micro},
                            "parallel": {"strategy": flat.get("dp_flavour", "ddp"), "dp": dp},
                            "runtime": {"device": "cuda", "backend": "nccl"}}
    for canon, (value, source) in flat.canonical.items():
        target = SPEC_FIELDS.get(canon)
        if isinstance(target, Pending):
            if not target.is_off(value):
                flat.unmap(source, value, f"needs {target.feature}, which this ShardLab's spec does not have yet",
                           pending=target.target)
        elif target is not None and canon not in ("global_batch", "micro_batch"):
            section, field = target.split(".")
            spec[section][field] = value
    if flat.get("cp", 1) > 1 and "attention" not in spec["model"]:
        spec["model"]["attention"] = "flash"  # torch's and Megatron's context parallelism run over fused attention
        notes.append(f"attention kernel: flash, as context parallelism ({flat.source_of('cp')} = {flat.get('cp')}) "
                     "runs ring attention over the fused kernels")
    spec["parallel"]["world_size"] = world
    return _validated(ImportedConfig(framework=framework, source_format=source_format, spec=spec, ignored=flat.ignored,
                                     unmapped=flat.unmapped, notes=notes + _notes(flat), gpus=world), spec_frameworks)


def _notes(flat: Flat) -> list[str]:
    return list(flat.get("notes") or [])


def _validated(imported: ImportedConfig, spec_frameworks: tuple[str, ...]) -> ImportedConfig:
    """The spec through ShardLab's own validation for prediction (the usual errors, with their arithmetic), as the
    first of spec_frameworks that takes it: a framework's own refusals (framework_support.check_framework) are part
    of that validation, so the framework is chosen before it, not switched after."""
    from backend.spec import validate_spec

    refused: dict[str, list[str]] = {}
    for spec_framework in spec_frameworks:
        spec, problems = validate_spec({**imported.spec, "framework": spec_framework}, predict_only=True)
        if spec is not None:
            imported.spec = spec.model_dump(mode="json")
            imported.notes += [_fallback_note(spec_framework, fw, why) for fw, why in refused.items()]
            return imported
        refused[spec_framework] = problems
    raise ConfigImportError(_refusal(imported.framework, refused))


def _fallback_note(taken: str, refused: str, why: list[str]) -> str:
    return (f"predicted as a {taken} spec of the same layout: ShardLab's {refused} engine does not run it "
            f"({'; '.join(why)})")


def _refusal(source: str, refused: dict[str, list[str]]) -> list[str]:
    """Every framework's problems; those all of them share once, the rest named by framework."""
    lists = list(refused.values())
    shared = [p for p in lists[0] if all(p in other for other in lists[1:])]
    head = f"the imported {source} config is not a layout ShardLab can predict"
    own = [f"{head} as framework {fw}: {p}" for fw, why in refused.items() for p in why if p not in shared]
    return [f"{head}: {p}" for p in shared] + own
