"""The one typed experiment spec that flows UI -> DB -> launcher -> ranks -> results -> plots.

Every rejection names the offending values and shows the arithmetic, in the style of torchtitan's
`ParallelDims`: "dp(2) * tp(3) * pp(1) = 6 != world_size(4)".
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from backend.spec.checks import RunOnly, derive_and_check
from backend.spec.choices import Framework
from backend.spec.model_spec import ModelSpec
from backend.spec.parallel_spec import ParallelSpec
from backend.spec.runtime_spec import RuntimeSpec
from backend.spec.section_base import SpecSection, reading_back
from backend.spec.train_spec import TrainSpec
from backend.spec.user_text import MAX_NAME_CHARS, InputError, check_depth, load_json_text, text_problem


class SpecError(ValueError):
    """A spec that cannot run, with every problem listed."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class ExperimentSpec(SpecSection):
    name: str = ""
    """Free-text label shown in the history (plain text: no control characters, at most 200 characters)."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """Transformer shape."""
    train: TrainSpec = Field(default_factory=TrainSpec)
    """Batch, steps, precision, optimizer, recompute, seed."""
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    """Strategy and degrees."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """Backend, device, nodes and timeout."""
    framework: Framework = Framework.TORCH
    """torch (native strategies), deepspeed (DeepSpeed's ZeRO engine) or jax (XLA GSPMD on virtual CPU devices)."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str, info: ValidationInfo) -> str:
        if reading_back(info):  # a name stored before these rules: `printable` escapes it on output
            return value
        if len(value) > MAX_NAME_CHARS:
            raise PydanticCustomError("string_too_long", "String should have at most {max_length} characters",
                                      {"max_length": MAX_NAME_CHARS})
        if problem := text_problem(value, "name", MAX_NAME_CHARS):
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> ExperimentSpec:
        problems = derive_and_check(self)
        if reading_back(info) and self._derived():
            problems = []
        elif (info.context or {}).get("predict_only"):
            problems = [p for p in problems if not isinstance(p, RunOnly)]
        if problems:
            raise SpecError(problems)
        return self

    def _derived(self) -> bool:
        """Whether the degrees and microbatches are all known (a stored spec has them; a broken one is unreadable)."""
        p = self.parallel
        return None not in (p.dp, p.world_size, self.train.microbatches)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.model.seq_len

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> ExperimentSpec:
        return cls.model_validate_json(text)

    @classmethod
    def for_prediction(cls, data: dict[str, Any]) -> ExperimentSpec:
        """Validate a layout the analytic model can predict but this engine cannot run (ZeRO-1 x TP/PP =
        Megatron's distributed optimizer, split-backward schedules x FSDP, EP x TP/PP): every check except
        the `checks.RunOnly` ones. Such a spec is for estimate / plan only, never for the launcher."""
        return cls.model_validate(data, context={"predict_only": True})


def validate_spec(data: dict[str, Any] | str, *, predict_only: bool = False) -> tuple[ExperimentSpec | None, list[str]]:
    """Parse a spec from a dict or JSON text; return (spec, []) or (None, problems). Never raises: a spec too big
    or nested too deep (backend/spec/user_text.py limits) is a problem like any other.
    predict_only: every check except the run-only ones (see `ExperimentSpec.for_prediction`, `checks.run_blockers`)."""
    context = {"predict_only": True} if predict_only else None
    try:
        if isinstance(data, (str, bytes)):
            data = load_json_text(data, "the spec")
        else:
            check_depth(data, "the spec")
        spec = ExperimentSpec.model_validate(data, context=context)
        return spec, []
    except InputError as e:
        return None, [str(e)]
    except SpecError as e:
        return None, list(e.problems)
    except ValidationError as e:
        problems: list[str] = []
        for err in e.errors():
            ctx_err = (err.get("ctx") or {}).get("error")
            # pydantic wraps the model validator's SpecError: keep its problems as separate items
            problems += ctx_err.problems if isinstance(ctx_err, SpecError) else [_format_pydantic(err)]
        return None, problems


def _format_pydantic(err: dict[str, Any]) -> str:
    loc = ".".join(str(x) for x in err.get("loc", ())) or "spec"
    msg = err.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    shown = repr(err.get("input"))
    if len(shown) > 80:  # a 100 KB name must not become a 100 KB error message
        shown = f"{shown[:60]}... ({len(shown):,} characters)"
    return f"{loc}: {msg} (got {shown})"
