"""What `import-config` returns: the spec, and every source field it did not map, each with its value and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FRAMEWORKS = ("torchtitan", "megatron", "deepspeed")


class ConfigImportError(ValueError):
    """A config that cannot become a spec: every problem, each with the field and the arithmetic."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class LogImportError(ConfigImportError):
    """A log that cannot be imported: the reason, with line numbers."""


@dataclass
class ImportedConfig:
    framework: str
    """torchtitan, megatron (Megatron-LM argument list or NeMo YAML) or deepspeed."""
    source_format: str
    """torchtitan-toml, torchtitan-config-dump, megatron-args, megatron-log-args, nemo-yaml, deepspeed-json."""
    spec: dict[str, Any]
    """A valid ExperimentSpec as JSON (for prediction: `ExperimentSpec.for_prediction` accepts it)."""
    ignored: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Source field -> {"value", "reason"}: known, and changes nothing ShardLab predicts."""
    unmapped: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Source field -> {"value", "reason"} (+ "pending": the spec field it waits for): changes memory or time, and the
    spec cannot hold it (yet), or unknown to the importer."""
    notes: list[str] = field(default_factory=list)
    """Assumptions made (a default the framework applies, a derived degree, vocabulary padding)."""
    gpus: int | None = None
    """GPUs the config describes (all of them, context-parallel ranks included)."""

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "ignored": self.ignored, "unmapped": self.unmapped, "framework": self.framework,
                "source_format": self.source_format, "gpus": self.gpus, "notes": self.notes}


def safe_name(text: object, limit: int = 120) -> str:
    """A config's own words (a job description, a file name) as a spec name: control characters escaped, bounded."""
    from backend.spec.user_text import printable

    shown = printable(text)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"
