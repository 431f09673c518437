"""Bring your own runs (issue 25): import torchtitan, Megatron-LM / NeMo and DeepSpeed configurations and training
logs, predict them, and compare the prediction with what they measured.

Configs (one module per framework and format; each parses its file as data and never runs it):
  torchtitan_toml.py    job TOML of the releases up to mid-2025          torchtitan_dump.py  the Trainer.Config dump
                                                                           (a JSON file, a log, or W&B's config.yaml)
  megatron_args.py      pretrain_gpt.py arguments (line, file, log block) nemo_yaml.py        NeMo's YAML
  deepspeed_config.py   ds_config.json + the model's config.json
Each flattens its config, maps every key through a table (fields.py: To / Ignore / Unmappable), and assembles the
spec with the shared degree and batch arithmetic (assemble.py). `import_config` picks the format: --format, else the
registry's detection clues (registry.py; each framework's entry is its own module: torchtitan.py, megatron.py,
deepspeed.py).

Logs: the log_*.py parsers, each named by its framework's entry; runs.py turns a parsed log into a stored run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backend.importers import registry
from backend.importers.entry import ConfigRequest, Importer, Probe, SourceFormat
from backend.importers.import_result import ConfigImportError, ImportedConfig

MAX_CONFIG_BYTES = 8 << 20
"""A config (or the head of a log holding one) is read up to 8 MiB; a Megatron log's argument block is near its top."""


def detect(name: str, text: str) -> tuple[str, str]:
    """(framework, source_format) of a config from its name and content; ConfigImportError when neither tells."""
    found = sniff(name, text)
    if found is None:
        raise ConfigImportError([registry.undetected(name)])
    return found


def sniff(name: str, text: str) -> tuple[str, str] | None:
    """(framework, source_format) as the name and content suggest (the registry's clues), None when they do not;
    ConfigImportError only for content no format may hold (JSON nested too deep)."""
    found = registry.sniff(Probe(name, text))
    return None if found is None else (found[0].name, found[1].name)


def read_as(fmt: str | None, probe: Probe) -> tuple[Importer, SourceFormat]:
    """The importer and format that read the config: what detection finds, unless --format names another framework
    (--format wins over what the file suggests, or when it suggests nothing)."""
    found = registry.sniff(probe)
    if fmt is None and found is None:
        raise ConfigImportError([registry.undetected(probe.name)])
    if found is not None and (fmt is None or found[0].name == fmt):
        return found
    importer = registry.by_name(fmt)
    return importer, importer.source_format(importer.forced(probe))


def import_config_text(text: str, *, name: str = "config", fmt: str | None = None, gpus: int | None = None,
                       model_config: dict[str, Any] | None = None, seq_len: int | None = None,
                       vocab_size: int | None = None) -> ImportedConfig:
    """The spec of a framework config given as text. Raises ConfigImportError (every problem, with the arithmetic;
    `needs` names what the caller could supply, such as the vocabulary size of a Megatron script)."""
    if gpus is not None and gpus < 1:
        raise ConfigImportError([f"--gpus must be >= 1 (got {gpus})"])
    if vocab_size is not None and vocab_size < 1:
        raise ConfigImportError([f"the vocabulary size must be >= 1 (got {vocab_size})"])
    if fmt is not None and fmt not in registry.names():
        raise ConfigImportError([f"--format {fmt!r}: expected one of {', '.join(registry.names())}"])
    importer, source_format = read_as(fmt, Probe(name, text))
    if vocab_size is not None and not source_format.takes_vocab:
        raise ConfigImportError([f"a vocabulary size is given for {registry.labels_where(lambda f: f.takes_vocab)} "
                                 f"configs, which leave it to the tokenizer; a {importer.name} config has its own (or "
                                 "takes the model's config.json)"])
    request = ConfigRequest(name=name, gpus=gpus, model_config=model_config, seq_len=seq_len, vocab_size=vocab_size)
    imported = source_format.parse(text, request)
    if seq_len is not None and not source_format.takes_seq and imported.spec["model"]["seq_len"] != seq_len:
        raise ConfigImportError([f"--seq {seq_len} contradicts the config's sequence length "
                                 f"{imported.spec['model']['seq_len']}"])
    return imported


def read_config_file(path: str | Path) -> str:
    """A config file's text, the first MAX_CONFIG_BYTES of it at most (a config inside a long log is near its top)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigImportError([f"cannot read {path}: {e.strerror or e}"]) from None
    if len(data) > MAX_CONFIG_BYTES:
        data = data[:MAX_CONFIG_BYTES]
    return data.decode("utf-8", "replace")


def import_config(path: str | Path, *, fmt: str | None = None, gpus: int | None = None,
                  model_config: str | Path | None = None, seq_len: int | None = None,
                  vocab_size: int | None = None) -> ImportedConfig:
    """The spec of a framework config file (and the model's config.json where the format needs one)."""
    cfg = None
    if model_config is not None:
        from backend.hf.config import HFConfigError, load_hf_config

        try:
            cfg = load_hf_config(model_config)
        except HFConfigError as e:
            raise ConfigImportError([f"--model-config: {e}"]) from None
    return import_config_text(read_config_file(path), name=Path(path).name, fmt=fmt, gpus=gpus, model_config=cfg,
                              seq_len=seq_len, vocab_size=vocab_size)


__all__ = ["ConfigImportError", "ImportedConfig", "detect", "import_config", "import_config_text", "sniff"]
