"""DeepSpeed's registry entry: its ds_config.json (deepspeed_config.py, with the model's config.json for the shape)
and its training log (log_deepspeed.py). Data parallelism only: a global rank is its data-parallel rank."""

from __future__ import annotations

from pathlib import Path

from backend.importers.entry import Clue, ConfigRequest, Importer, Probe, SourceFormat
from backend.importers.import_result import ImportedConfig
from backend.importers.log_series import Collector


def _json(text: str, request: ConfigRequest) -> ImportedConfig:
    from backend.importers.deepspeed_config import import_ds_config

    return import_ds_config(text, gpus=request.gpus, model_config=request.model_config, file=request.name,
                            seq_len=request.seq_len)


def _log(path: Path, imported: ImportedConfig) -> Collector:
    from backend.importers.log_deepspeed import parse

    return parse(path, imported)


def _ds_config(probe: Probe) -> bool:
    from backend.importers.deepspeed_config import looks_like_ds_config

    return looks_like_ds_config(probe.json)


IMPORTER = Importer(
    name="deepspeed", label="DeepSpeed", reads="ds_config.json", needs_model_config=True,
    model_config_use="a DeepSpeed config needs it for the model's shape",
    formats=(SourceFormat("deepspeed-json", _json, takes_seq=True),),
    detect=(Clue(31, "deepspeed-json", _ds_config),),
    forced=lambda p: "deepspeed-json", parse_log=_log,
    log_records="step timings (wall_clock_breakdown 'time (ms) | fwd: ...', the throughput timer's CurrSamplesPerSec, "
                "or the flops profiler's iter latency)",
    rank_order=("dp",))
