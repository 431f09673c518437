"""torchtitan's registry entry: its job TOML (torchtitan_toml.py) and its Trainer.Config dump (torchtitan_dump.py: a
JSON file, the "Running with configs:" block of a log, or the W&B config.yaml it is sent to), and its training log
(log_torchtitan.py). Its mesh is (pp, dp_replicate, dp_shard, cp, tp), tp fastest (torchtitan parallel_dims.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from backend.importers.entry import Clue, ConfigRequest, Importer, Probe, SourceFormat
from backend.importers.import_result import ImportedConfig
from backend.importers.log_series import Collector

MESH = re.compile(r"Building \d+-D device mesh with \[.*?\], \[([\d, ]+)\]")  # torchtitan v0.1.0 parallel_dims
MESH_NEW = re.compile(r"Building device mesh with parallelism: pp=(\d+), dp_replicate=(\d+), dp_shard=(\d+), "
                      r"cp=(\d+), tp=(\d+)")  # torchtitan 2026


def wandb_config(text: str) -> dict[str, Any] | None:
    """The run config of a W&B `config.yaml` ({key: {"value": ...}} with a `_wandb` entry), unwrapped: where torchtitan
    sends its Trainer.Config; None for any other YAML (or one too big to be a config)."""
    if "_wandb" not in text or len(text) > 1 << 20:
        return None
    import yaml

    from backend.importers.bounded import parse_bounded

    try:
        data = parse_bounded(yaml.safe_load, text, "the W&B config")
    except yaml.YAMLError:
        return None
    if not isinstance(data, dict) or "_wandb" not in data:
        return None
    return {k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in data.items() if k != "_wandb"}


def _toml(text: str, request: ConfigRequest) -> ImportedConfig:
    from backend.importers.torchtitan_toml import import_toml

    return import_toml(text, gpus=request.gpus, model_config=request.model_config, file=request.name)


def _dump(text: str, request: ConfigRequest) -> ImportedConfig:
    from backend.importers.torchtitan_dump import import_dump

    if (unwrapped := wandb_config(text)) is not None:
        text = json.dumps(unwrapped)
    return import_dump(text, gpus=request.gpus, model_config=request.model_config, file=request.name)


def _log(path: Path, imported: ImportedConfig) -> Collector:
    from backend.importers.log_torchtitan import parse

    return parse(path, imported)


def _dump_json(probe: Probe) -> bool:
    data = probe.json
    return isinstance(data, dict) and "parallelism" in data and "training" in data


def _in_log(probe: Probe) -> bool:
    from backend.importers.torchtitan_dump import MARKER

    return MARKER in probe.text


def _toml_sections(probe: Probe) -> bool:
    return any(s in probe.text for s in ("[model]", "[parallelism]", "[training]"))


def _forced(probe: Probe) -> str:
    dump = probe.text.lstrip().startswith("{") or _in_log(probe)
    return "torchtitan-config-dump" if dump else "torchtitan-toml"


def log_gpus(line: str) -> int | None:
    """The GPU count of torchtitan's device-mesh line (the product of its dimensions)."""
    if m := MESH.search(line):
        return math.prod(int(x) for x in m.group(1).split(",") if x.strip())
    if m := MESH_NEW.search(line):
        return math.prod(int(x) for x in m.groups())
    return None


IMPORTER = Importer(
    name="torchtitan", label="torchtitan", reads="a job .toml or the Trainer.Config dump",
    model_config_use="it replaces a torchtitan flavor",
    formats=(SourceFormat("torchtitan-toml", _toml), SourceFormat("torchtitan-config-dump", _dump)),
    detect=(Clue(10, "torchtitan-config-dump", lambda p: p.named(".yaml", ".yml") and wandb_config(p.text) is not None),
            Clue(20, "torchtitan-toml", lambda p: p.named(".toml")),
            Clue(30, "torchtitan-config-dump", _dump_json),
            Clue(40, "torchtitan-config-dump", _in_log),
            Clue(60, "torchtitan-toml", _toml_sections)),
    forced=_forced, parse_log=_log, log_records="metrics lines (step: N  loss: ...  tps: ...)",
    rank_order=("pp", "dp", "cp", "tp"), log_gpus=log_gpus)
