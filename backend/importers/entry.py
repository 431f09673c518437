"""One framework's importer, as the registry (importers/registry.py) holds it: its name, how detection tells its files
apart (`detect`), the parser of each format it reads (`parse_config`), its log parser (`parse_log`) and how its global
ranks are laid out (`rank_order`). Each framework's entry lives in a module of its own (importers/torchtitan.py,
megatron.py, deepspeed.py); everything that lists frameworks derives from the registry.

What detection sees (`Probe`) and what a parser is given besides the text (`ConfigRequest`) are here too."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from backend.importers.import_result import ImportedConfig
from backend.importers.log_series import Collector


@dataclass
class Probe:
    """A config as detection sees it: its file name and text, and the JSON object the text holds (parsed once, when a
    clue first asks)."""

    name: str
    text: str

    @property
    def lower_name(self) -> str:
        return self.name.lower()

    def named(self, *suffixes: str) -> bool:
        """The file name ends with one of `suffixes` (any case)."""
        return self.lower_name.endswith(suffixes)

    @cached_property
    def json(self) -> Any:
        """The parsed JSON of a text starting with "{" (None for any other text, or one that does not parse);
        ConfigImportError when it nests too deep for any format to hold."""
        from backend.importers.bounded import parse_bounded

        stripped = self.text.lstrip()
        if not stripped.startswith("{"):
            return None
        try:
            return parse_bounded(json.loads, stripped, f"the JSON of {self.name!r}")
        except json.JSONDecodeError:
            return None


@dataclass(frozen=True)
class ConfigRequest:
    """What the person gave besides the config's text."""

    name: str = "config"
    """The file's name (as uploaded, or the path's last part): a spec name, and what errors call the file."""
    gpus: int | None = None
    """--gpus: resolves a degree written as -1 / auto; must agree with a count the config states."""
    model_config: dict[str, Any] | None = None
    """The model's Hugging Face config.json, parsed (--model-config)."""
    seq_len: int | None = None
    """--seq: read only by a format that `takes_seq`; any other must agree with it (import_config_text checks)."""
    vocab_size: int | None = None
    """--vocab: given only to a format that `takes_vocab` (import_config_text refuses it for any other)."""


@dataclass(frozen=True)
class SourceFormat:
    """One way a framework writes its config (ImportedConfig.source_format)."""

    name: str
    """"torchtitan-toml", "megatron-args", ...: the JSON key `source_format`'s value."""
    parse: Callable[[str, ConfigRequest], ImportedConfig]
    """The config's text -> its spec; ConfigImportError with every problem."""
    takes_vocab: bool = False
    """It may lack the vocabulary size (left to a tokenizer): --vocab N supplies it."""
    takes_seq: bool = False
    """It has no sequence length of its own: --seq N is its sequence length."""
    reports: tuple[str, ...] = ()
    """Other source_format values its parser reports for variants it reads (megatron-args: a log's arguments block
    is megatron-log-args)."""


@dataclass(frozen=True)
class Clue:
    """A sign that a file is in one format. Detection tries every importer's clues by `order`, lowest first (ties in
    registry order), and the first that holds names the format."""

    order: int
    source_format: str
    holds: Callable[[Probe], bool]


@dataclass(frozen=True)
class Importer:
    """One framework's entry in the registry."""

    name: str
    """--format's value, ImportedConfig.framework, the store's `source_framework`, the `imported:<name>` tag."""
    label: str
    """The pages' name for it ("Megatron-LM / NeMo"), in the Import config box's Format select."""
    reads: str
    """The files it reads, in words ("a job .toml or the Trainer.Config dump"): detection's error, --format's help and
    the box's caption."""
    model_config_use: str
    """What the model's config.json does for its configs, for --model-config's help and the box's upload help."""
    formats: tuple[SourceFormat, ...]
    """Its parse_config: one parser per format it reads."""
    detect: tuple[Clue, ...]
    """How auto-detection tells its files apart."""
    forced: Callable[[Probe], str]
    """The format `--format <name>` reads a file in when detection names another framework's format or none."""
    parse_log: Callable[[Path, ImportedConfig], Collector]
    """Its training log -> step records, memory peaks and facts (log_*.py)."""
    log_records: str
    """What its per-step log lines are, for the error when a log holds none."""
    rank_order: tuple[str, ...]
    """Its global ranks' layout, slowest dimension first: ("pp", "dp", "cp", "tp") when tp varies fastest (as
    ShardLab's mesh), ("dp",) for data parallelism alone. import-run maps a log's ranks onto the spec's with it."""
    needs_model_config: bool = False
    """Its configs hold no model shape: detection's error says to give --model-config."""
    log_gpus: Callable[[str], int | None] | None = None
    """The GPU count one log line states (a device-mesh line, a world-size line), None when it states none:
    import-run without --gpus reads it from the log's first lines."""

    def source_format(self, name: str) -> SourceFormat:
        """The format named `name`; KeyError when it has none by that name."""
        for f in self.formats:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no format {name!r}")
