"""Bring your own runs (issue 25): import torchtitan, Megatron-LM / NeMo and DeepSpeed configurations and training
logs, predict them, and compare the prediction with what they measured.

Configs (one module per framework and format; each parses its file as data and never runs it):
  torchtitan_toml.py    job TOML of the releases up to mid-2025          torchtitan_dump.py  the Trainer.Config dump
                                                                           (a JSON file, a log, or W&B's config.yaml)
  megatron_args.py      pretrain_gpt.py arguments (line, file, log block) nemo_yaml.py        NeMo's YAML
  deepspeed_config.py   ds_config.json + the model's config.json
Each flattens its config, maps every key through a table (fields.py: To / Ignore / Unmappable), and assembles the
spec with the shared degree and batch arithmetic (assemble.py). `import_config` picks the format.

Logs: see importers/logs.py (format detection) and the log_*.py parsers; runs.py turns a parsed log into a stored run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.importers.bounded import parse_bounded
from backend.importers.imported import FRAMEWORKS, ConfigImportError, ImportedConfig

MAX_CONFIG_BYTES = 8 << 20
"""A config (or the head of a log holding one) is read up to 8 MiB; a Megatron log's argument block is near its top."""


def detect(name: str, text: str) -> tuple[str, str]:
    """(framework, source_format) of a config from its name and content; ConfigImportError when neither tells."""
    found = sniff(name, text)
    if found is None:
        raise ConfigImportError([f"cannot tell which framework {name!r} is for: give --format torchtitan|megatron|"
                                 "deepspeed (torchtitan: a job .toml or the Trainer.Config dump; megatron: pretrain_gpt.py "
                                 "arguments, a launch script, a Megatron log, or a NeMo .yaml; deepspeed: ds_config.json "
                                 "with --model-config)"])
    return found


def sniff(name: str, text: str) -> tuple[str, str] | None:
    """(framework, source_format) as the name and content suggest, None when they do not; ConfigImportError only for
    content no format may hold (JSON nested too deep)."""
    from backend.importers.deepspeed_config import looks_like_ds_config
    from backend.importers.megatron_args import looks_like_args
    from backend.importers.torchtitan_dump import MARKER

    lower = name.lower()
    if lower.endswith((".yaml", ".yml")):
        return ("torchtitan", "torchtitan-config-dump") if wandb_config(text) is not None else ("megatron", "nemo-yaml")
    if lower.endswith(".toml"):
        return "torchtitan", "torchtitan-toml"
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            data = parse_bounded(json.loads, stripped, f"the JSON of {name!r}")
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and "parallelism" in data and "training" in data:
            return "torchtitan", "torchtitan-config-dump"
        if looks_like_ds_config(data):
            return "deepspeed", "deepspeed-json"
    if MARKER in text:
        return "torchtitan", "torchtitan-config-dump"
    if looks_like_args(text) or "pretrain_gpt.py" in text:
        return "megatron", "megatron-args"
    if "[model]" in text or "[parallelism]" in text or "[training]" in text:
        return "torchtitan", "torchtitan-toml"
    return None


def wandb_config(text: str) -> dict[str, Any] | None:
    """The run config of a W&B `config.yaml` ({key: {"value": ...}} with a `_wandb` entry), unwrapped: where torchtitan
    sends its Trainer.Config; None for any other YAML (or one too big to be a config)."""
    if "_wandb" not in text or len(text) > 1 << 20:
        return None
    import yaml

    try:
        data = parse_bounded(yaml.safe_load, text, "the W&B config")
    except yaml.YAMLError:
        return None
    if not isinstance(data, dict) or "_wandb" not in data:
        return None
    return {k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in data.items() if k != "_wandb"}


def import_config_text(text: str, *, name: str = "config", fmt: str | None = None, gpus: int | None = None,
                       model_config: dict[str, Any] | None = None, seq_len: int | None = None,
                       vocab_size: int | None = None) -> ImportedConfig:
    """The spec of a framework config given as text. Raises ConfigImportError (every problem, with the arithmetic;
    `needs` names what the caller could supply, such as the vocabulary size of a Megatron script)."""
    if gpus is not None and gpus < 1:
        raise ConfigImportError([f"--gpus must be >= 1 (got {gpus})"])
    if vocab_size is not None and vocab_size < 1:
        raise ConfigImportError([f"the vocabulary size must be >= 1 (got {vocab_size})"])
    if fmt is not None and fmt not in FRAMEWORKS:
        raise ConfigImportError([f"--format {fmt!r}: expected one of {', '.join(FRAMEWORKS)}"])
    framework, source_format = detect(name, text) if fmt is None else (sniff(name, text) or (None, None))
    if fmt is not None and fmt != framework:  # --format wins over what the file suggests, or when it suggests nothing
        source_format = {"torchtitan": "torchtitan-toml", "megatron": "megatron-args", "deepspeed": "deepspeed-json"}[fmt]
        framework = fmt
        if fmt == "torchtitan" and (text.lstrip().startswith("{") or "Running with configs:" in text):
            source_format = "torchtitan-config-dump"
        if fmt == "megatron" and name.lower().endswith((".yaml", ".yml")):
            source_format = "nemo-yaml"
    kwargs: dict[str, Any] = {"gpus": gpus, "model_config": model_config, "file": name}
    if vocab_size is not None:
        if source_format not in ("megatron-args", "nemo-yaml"):
            raise ConfigImportError([f"a vocabulary size is given for Megatron-LM / NeMo configs, which leave it to the "
                                     f"tokenizer; a {framework} config has its own (or takes the model's config.json)"])
        kwargs["vocab_size"] = vocab_size
    if source_format == "torchtitan-config-dump" and (unwrapped := wandb_config(text)) is not None:
        text = json.dumps(unwrapped)
    if source_format == "torchtitan-toml":
        from backend.importers.torchtitan_toml import import_toml as run
    elif source_format == "torchtitan-config-dump":
        from backend.importers.torchtitan_dump import import_dump as run
    elif source_format == "nemo-yaml":
        from backend.importers.nemo_yaml import import_yaml as run
    elif source_format == "megatron-args":
        from backend.importers.megatron_args import import_args as run
    else:
        from backend.importers.deepspeed_config import import_ds_config as run
        kwargs["seq_len"] = seq_len
    imported = run(text, **kwargs)
    if seq_len is not None and source_format != "deepspeed-json" and imported.spec["model"]["seq_len"] != seq_len:
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
        from backend.hf_config import HFConfigError, load_hf_config

        try:
            cfg = load_hf_config(model_config)
        except HFConfigError as e:
            raise ConfigImportError([f"--model-config: {e}"]) from None
    return import_config_text(read_config_file(path), name=Path(path).name, fmt=fmt, gpus=gpus, model_config=cfg,
                              seq_len=seq_len, vocab_size=vocab_size)


__all__ = ["ConfigImportError", "ImportedConfig", "FRAMEWORKS", "detect", "import_config", "import_config_text", "sniff"]
