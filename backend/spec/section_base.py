"""The base of every spec section (unknown keys refused, booleans never read as numbers) and the bounds the sections
share. The sections: model_spec.py, train_spec.py, parallel_spec.py, runtime_spec.py; what the cross-field checks read
of a whole spec: spec_parts.py; the checks: checks.py; the whole spec: experiment.py."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

MAX_DIM = 1_000_000
MAX_LAYERS = 10_000
MAX_VOCAB = 10_000_000
MAX_SEQ = 10_000_000
MAX_BATCH = 100_000_000
MAX_STEPS = 1_000_000


_NUMBERS = (int, float, int | None, float | None)

READ_BACK = {"read_back": True}
"""Validation context of a stored spec read back (the store's rows, a run's result, a failed run's own spec): types,
shapes and derived values as always, but none of the rules for new specs (cross-field checks, the run rules, plain-text
names): a spec stored by an older version may break a rule added since, and its run must still show and fail with the
reason. Whether this version would run it is `validate_spec` of its JSON, as for any new spec."""


def reading_back(info: ValidationInfo) -> bool:
    """Whether a validator runs on a stored spec read back (READ_BACK), not on a new one."""
    return bool((info.context or {}).get("read_back"))


class SpecSection(BaseModel):
    """A part of the spec: unknown keys are refused, booleans are never read as numbers."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1: a sweep value `true` for zero_stage or world_size is a mistake
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation in _NUMBERS:
            raise ValueError(f"{value!r} is a boolean, not a number")
        return value
