"""Spec fields the New-experiment form has no widget for: an fp8 run's all-gather switch, op-SAC's op list, a
config's norm epsilon, the process-group backend and the device (a Plan layout's or a GPU run's cuda, which the
prediction prices with the CUDA context, NCCL buffers and allocator slack). A spec loaded into the form (Edit as
new, an import, Plan's "Open in New experiment") keeps them as it set them, so the run the form submits is the
spec that was loaded, not the defaults."""

from __future__ import annotations

from typing import Any

from backend.spec import ExperimentSpec

FIELDS: dict[str, tuple[str, ...]] = {"model": ("norm_eps",), "train": ("fp8_all_gather", "recompute_ops"),
                                      "runtime": ("backend", "device")}
"""Per spec section, the fields no widget shows."""


def of_spec(spec: ExperimentSpec) -> dict[str, dict[str, Any]]:
    """The fields of FIELDS this spec sets away from their defaults, by section (JSON values)."""
    out: dict[str, dict[str, Any]] = {}
    for section, names in FIELDS.items():
        part = getattr(spec, section)
        data = part.model_dump(mode="json", include=set(names))
        changed = {k: data[k] for k in names if getattr(part, k) != type(part).model_fields[k].default}
        if changed:
            out[section] = changed
    return out


def of_model(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The model fields of FIELDS a model dict (a config.json's) sets away from their defaults, as kept fields."""
    from backend.spec import ModelSpec

    changed = {k: model[k] for k in FIELDS["model"]
               if model.get(k) is not None and model[k] != ModelSpec.model_fields[k].default}
    return {"model": changed} if changed else {}


def in_use(kept: dict[str, dict[str, Any]] | None, recompute: str, run_here: bool = False) -> dict[str, dict[str, Any]]:
    """The kept fields that still apply: op-SAC's op list only while recompute is still 'op' (a user who picked
    another policy dropped it); no device or backend when "Run it here" runs it on this host's CPU ranks."""
    out = {s: {k: x for k, x in f.items() if k != "recompute_ops" or recompute == "op"}
           for s, f in (kept or {}).items() if not (run_here and s == "runtime")}
    return {s: f for s, f in out.items() if f}


def merge_into(spec_dict: dict[str, Any], kept: dict[str, dict[str, Any]] | None, run_here: bool = False) -> None:
    """Write the kept fields that still apply into a nested spec dict (form_to_spec_dict's)."""
    for section, fields in in_use(kept, str(spec_dict["train"].get("recompute")), run_here).items():
        spec_dict.setdefault(section, {}).update(fields)


def without(kept: dict[str, dict[str, Any]] | None, section: str) -> dict[str, dict[str, Any]]:
    """The kept fields less one section (a new preset or config.json replaces the model's)."""
    return {k: v for k, v in (kept or {}).items() if k != section}


def lines(kept: dict[str, dict[str, Any]] | None, recompute: str, run_here: bool = False) -> list[str]:
    """'train.fp8_all_gather = false' per kept field that still applies, for the form's caption."""
    return [f"{section}.{k} = {_word(x)}" for section, fields in in_use(kept, recompute, run_here).items()
            for k, x in fields.items()]


def _word(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    return ", ".join(map(str, x)) if isinstance(x, list) else str(x)
