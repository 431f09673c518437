"""What `import-config` returns: the spec, and every source field it did not map, each with its value and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VOCAB_SIZE = "vocab_size"
"""A need (ConfigImportError.needs): the vocabulary size, which Megatron-LM and NeMo read from the tokenizer."""
VOCAB_UNKNOWN = "the vocabulary size is unknown"
"""How the problem behind VOCAB_SIZE starts (a page asking for the size in its own words leaves that line out)."""


class ConfigImportError(ValueError):
    """A config that cannot become a spec: every problem, each with the field and the arithmetic. `needs` names what
    the person importing can supply to get past a problem (VOCAB_SIZE: the vocabulary a Megatron script leaves to its
    tokenizer); the CLI and the dashboard each ask for it in their own words."""

    def __init__(self, problems: list[str], needs: tuple[str, ...] | set[str] = ()):
        self.problems = list(problems)
        self.needs = tuple(sorted(needs))
        super().__init__("; ".join(self.problems))


class LogImportError(ConfigImportError):
    """A log that cannot be imported: the reason, with line numbers."""


@dataclass
class ImportedConfig:
    framework: str
    """The importer's name (importers/registry.py): torchtitan, megatron (Megatron-LM arguments or NeMo YAML), ..."""
    source_format: str
    """One of its formats (registry.source_formats()): torchtitan-toml, megatron-args, nemo-yaml, deepspeed-json, ..."""
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


def layout_text(parallel: dict[str, Any]) -> str:
    """Every degree of an imported layout, in the frameworks' mesh order: "dp 1 x cp 2 x tp 4 x pp 2, ep 1"."""
    return (f"dp {parallel['dp']} x cp {parallel.get('cp', 1)} x tp {parallel['tp']} x pp {parallel['pp']}, "
            f"ep {parallel.get('ep', 1)}")


def safe_name(text: object, limit: int = 120) -> str:
    """A config's own words (a job description, a file name) as a spec name: control characters escaped, bounded."""
    from backend.spec.user_text import printable

    shown = printable(text)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"
