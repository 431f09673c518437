"""Megatron-LM's and NeMo's registry entry: pretrain_gpt.py arguments (megatron_args.py: a launch script, a shell
line, a file of them, or the arguments block a Megatron log prints), NeMo's YAML (nemo_yaml.py), and Megatron's
training log (log_megatron.py). Its ranks are laid out tp fastest, then cp, dp, pp (Megatron-Core
parallel_state's default order "tp-cp-ep-dp-pp", ep folded into dp)."""

from __future__ import annotations

import re
from pathlib import Path

from backend.importers.entry import Clue, ConfigRequest, Importer, Probe, SourceFormat
from backend.importers.import_result import ImportedConfig
from backend.importers.log_series import Collector

WORLD = re.compile(r"using world size: (\d+)")  # Megatron arguments.py


def _args(text: str, request: ConfigRequest) -> ImportedConfig:
    from backend.importers.megatron_args import import_args

    return import_args(text, gpus=request.gpus, model_config=request.model_config, file=request.name,
                       vocab_size=request.vocab_size)


def _yaml(text: str, request: ConfigRequest) -> ImportedConfig:
    from backend.importers.nemo_yaml import import_yaml

    return import_yaml(text, gpus=request.gpus, model_config=request.model_config, file=request.name,
                       vocab_size=request.vocab_size)


def _log(path: Path, imported: ImportedConfig) -> Collector:
    from backend.importers.log_megatron import parse

    return parse(path, imported)


def _arguments(probe: Probe) -> bool:
    from backend.importers.megatron_args import looks_like_args

    return looks_like_args(probe.text) or "pretrain_gpt.py" in probe.text


def log_gpus(line: str) -> int | None:
    """The world size Megatron's arguments.py prints."""
    m = WORLD.search(line)
    return int(m.group(1)) if m else None


IMPORTER = Importer(
    name="megatron", label="Megatron-LM / NeMo",
    reads="pretrain_gpt.py arguments, a launch script, a Megatron log, or a NeMo .yaml",
    model_config_use="it gives a Megatron-LM or NeMo config the vocabulary size that their tokenizer holds",
    formats=(SourceFormat("megatron-args", _args, takes_vocab=True, reports=("megatron-log-args",)),
             SourceFormat("nemo-yaml", _yaml, takes_vocab=True)),
    detect=(Clue(11, "nemo-yaml", lambda p: p.named(".yaml", ".yml")),
            Clue(50, "megatron-args", _arguments)),
    forced=lambda p: "nemo-yaml" if p.named(".yaml", ".yml") else "megatron-args",
    parse_log=_log, log_records="iteration lines (iteration N/M | ... elapsed time per iteration (ms): ...)",
    rank_order=("pp", "dp", "cp", "tp"), log_gpus=log_gpus)
