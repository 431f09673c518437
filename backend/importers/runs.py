"""A framework's config + training log -> one stored run of kind "imported", next to ShardLab's predictions.

`import_run` reads the config (importers/__init__.py), streams the log through its framework's parser (log_*.py),
applies the warm-up rule (log_series.py), and builds a RunResult whose measured part is what the log says (step time,
tokens/s, the framework's own MFU figures, peak allocated / reserved memory per rank it reports) and whose predicted
part is ShardLab's: per-category memory per rank (analytic estimate on CUDA ranks) and the step time on the
hardware profile (--hardware, else the profile of the device the log names). MFU is ShardLab's definition (model
FLOPs without recompute / peak of the profile, PaLM App. B), beside the framework's own figure.
Everything is built before anything is stored, and stored in one transaction (db.queries.store_finished_run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.importers import registry
from backend.importers.import_result import ImportedConfig
from backend.importers.log_series import LogImportError, Measured, summarise
from backend.result import ImportFacts, MemoryBreakdown, RankResult, RunResult, Status, error_pct


@dataclass
class Hardware:
    profile: Any = None
    band: tuple[float, float] | None = None
    calibration: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def resolve_hardware(name: str | None, device_name: str | None, db_url: str | None = None) -> Hardware:
    """The step-time profile: --hardware (a profile or a calibrated profile's name), else the device the log names."""
    from backend.calibration.records import profile_for_device, resolve

    key = name or profile_for_device(device_name)
    if key is None:
        why = f"the log names {device_name!r}, which maps to no profile" if device_name else "the log names no device"
        return Hardware(notes=[f"no step-time prediction and no MFU: {why}; pass --hardware NAME"])
    try:
        hw, band, cal = resolve(key, None, db_url)
    except ValueError as e:
        raise LogImportError([f"--hardware {key}: {e}"]) from None
    notes = [] if name else [f"hardware profile {key!r}: the device the log names ({device_name})"]
    return Hardware(profile=hw, band=band, calibration=cal, notes=notes)


SNIFF_LINES = 5000


def sniff_gpus(path: str | Path) -> int | None:
    """The GPU count a log states near its top (each importer's `log_gpus`: torchtitan's device mesh line,
    Megatron's "using world size"); None when the first SNIFF_LINES lines do not say."""
    from backend.importers.log_stream import LineStats, read_lines

    readers = [i.log_gpus for i in registry.IMPORTERS if i.log_gpus is not None]
    try:
        for line in read_lines(path, LineStats()):
            if line.number > SNIFF_LINES:
                return None
            for read in readers:
                if (gpus := read(line.text)) is not None:
                    return gpus
    except OSError:
        return None
    return None


def parse_log(path: str | Path, imported: ImportedConfig, *, warmup_steps: int | None = None):
    """(the parser's Collector, Measured) of a log file; LogImportError with line numbers."""
    path = Path(path)
    if not path.is_file():
        raise LogImportError([f"--log {path}: no such file"])
    importer = registry.by_name(imported.framework)
    collector = importer.parse_log(path, imported)
    if warmup_steps is None and collector.facts.get("single_profiled_step"):
        warmup_steps = collector.facts["single_profiled_step"] - 1
    return collector, summarise(collector, warmup_steps=warmup_steps, what=importer.log_records)


def spec_rank(rank_order: tuple[str, ...], rank: int, spec: Any, cp: int) -> int:
    """The spec's rank of a framework's global rank, its ranks laid out in `rank_order` (the importer's; Megatron's
    and torchtitan's put tp fastest, then cp, then dp, then pp, as ShardLab's (pp, dp x cp, tp) mesh does); `cp` > 1
    only for a spec without the cp degree (GPUs / world_size), whose cp coordinate is then dropped."""
    p = spec.parallel
    if "cp" not in rank_order or cp <= 1:
        return rank % p.world_size
    size = {"pp": p.pp, "dp": p.dp, "cp": cp, "tp": p.tp}
    at, rest = {}, rank
    for name in reversed(rank_order[1:]):
        at[name], rest = rest % size[name], rest // size[name]
    at[rank_order[0]] = rest
    return (at.get("pp", 0) * p.dp * p.tp + at.get("dp", 0) * p.tp + at.get("tp", 0)) % p.world_size


def build_result(imported: ImportedConfig, collector, measured: Measured, hw: Hardware, *, config_file: str,
                 log_file: str) -> RunResult:
    from backend.analytic.estimate import estimate
    from backend.spec import ExperimentSpec

    spec = ExperimentSpec.for_prediction(imported.spec)
    est = estimate(spec, device="cuda")
    cp = imported.gpus // spec.parallel.world_size if imported.gpus else 1
    ranks = sorted(set(measured.per_rank_step_s) | set(measured.memory)) or [0]
    order = registry.by_name(imported.framework).rank_order
    per_rank = [_rank(r, est.per_rank[spec_rank(order, r, spec, cp)], measured) for r in ranks]
    allocated = [m["allocated_bytes"] for m in measured.memory.values() if "allocated_bytes" in m]
    reserved = [m["reserved_bytes"] for m in measured.memory.values() if "reserved_bytes" in m]
    facts = ImportFacts(
        framework=imported.framework, source_format=imported.source_format, config_file=config_file, log_file=log_file,
        gpus=imported.gpus, device_name=_shown_text(collector.facts.get("device_name")), warmup_rule=measured.notes[0],
        warmup_cut_step=measured.warmup_cut_step, records_used=measured.records_used,
        records_total=measured.records_total, first_step=measured.first_step, last_step=measured.last_step,
        partial=bool(measured.partial_reasons), partial_reasons=measured.partial_reasons,
        peak_allocated_bytes=max(allocated) if allocated else None,
        peak_reserved_bytes=max(reserved) if reserved else None, memory_source=collector.facts.get("memory_source", ""),
        reported=measured.reported, unmapped=imported.unmapped, ignored=imported.ignored,
        lines={**collector.stats.to_dict(), "garbled_step_lines": collector.unparsed,
                                         "first_garbled_line": collector.first_unparsed_line or None,
                                         "repeated_step_lines": collector.duplicates},
        facts={k: v for k, v in collector.facts.items() if k not in ("device_name", "memory_source")})
    # an imported layout may be one this engine only predicts (Megatron's distributed optimizer = ZeRO-1 x TP/PP)
    result = RunResult.model_validate(
        {"status": Status.OK, "spec": spec, "per_rank": per_rank, "step_s_median": measured.step_s_median,
         "loss": measured.losses, "imported": facts, "env": _env(imported, facts),
         "bubble_predicted": est.bubble_fraction,  # the fraction engine runs store (assemble_result), not bubble_s
         "notes": _notes(imported, measured, facts, hw, spec)}, context={"predict_only": True})
    _speed(result, spec, hw, imported.gpus or spec.parallel.world_size)
    return result


def _rank(rank: int, predicted, measured: Measured) -> RankResult:
    mem = measured.memory.get(rank, {})
    pred = MemoryBreakdown(params_bytes=predicted.params_bytes, grads_bytes=predicted.grads_bytes,
                           optimizer_bytes=predicted.optimizer_bytes, activations_bytes=predicted.activations_bytes,
                           other_bytes=predicted.other_bytes, peak_bytes=predicted.fullest_bytes())
    allocated = mem.get("allocated_bytes")
    return RankResult(rank=rank, predicted=pred, step_s=measured.per_rank_step_s.get(rank, []),
                      cuda_max_allocated_bytes=allocated, cuda_max_reserved_bytes=mem.get("reserved_bytes"),
                      error_pct={"peak_bytes": error_pct(allocated, pred.peak_bytes)} if allocated else {})


def _env(imported: ImportedConfig, facts: ImportFacts) -> dict[str, Any]:
    return {"device_type": "cuda", "device_name": facts.device_name, "source": f"imported from {imported.framework}",
            "gpus": imported.gpus}


def _notes(imported: ImportedConfig, measured: Measured, facts: ImportFacts, hw: Hardware, spec) -> list[str]:
    from backend.analytic.params import count_params

    notes = [f"imported from a {imported.framework} log ({imported.source_format} config): step time, tokens/s and "
             "peak allocated / reserved memory are the log's; the memory categories are ShardLab's prediction only "
             "(the log measures none of them)", *measured.notes, *hw.notes, *imported.notes]
    notes += [f"partial import: {r}" for r in measured.partial_reasons]
    if facts.peak_allocated_bytes is None and facts.peak_reserved_bytes is None:
        notes.append("the log reports no memory: no measured peak to compare with the prediction")
    if imported.unmapped:
        notes.append("the prediction ignores config fields the spec cannot hold: " + ", ".join(imported.unmapped))
    counted = facts.facts.get("framework_param_count")
    if counted and counted != count_params(spec.model):
        notes.append(f"the log counts {counted:,} parameters, ShardLab's model {count_params(spec.model):,}")
    return notes


def _speed(result: RunResult, spec, hw: Hardware, gpus: int) -> None:
    """tokens/s, ShardLab's MFU / HFU on the profile's peak, and the step-time prediction with its breakdown."""
    from backend.analytic.model_flops import training_flops_per_step
    from backend.analytic.recompute_cost import flops_rerun
    from backend.analytic.steptime.model import step_time
    from backend.analytic.steptime.untimed import untimed_reason

    m, step = spec.model, result.step_s_median
    result.tokens_per_s = spec.tokens_per_step / step
    model_flops = training_flops_per_step(m, tokens=spec.tokens_per_step)
    flops = training_flops_per_step(m, tokens=spec.tokens_per_step, recompute=str(spec.train.recompute),
                                    rerun=flops_rerun(spec))
    result.model_flops_per_step, result.flops_per_step = model_flops, flops
    if hw.profile is None:
        return
    peak = hw.profile.peak(str(spec.train.precision)) * gpus
    result.mfu, result.hfu = model_flops / step / peak, flops / step / peak
    result.achieved_flops = flops / step
    from backend.calibration.fit import extrapolation

    if (why := untimed_reason(spec, hw.profile.kind, hw.profile)) is not None:  # (fp8 on a CPU profile, on Ampere)
        result.notes.append(f"No step-time prediction: {why}.")
        return
    st = step_time(spec, hw.profile, band=hw.band).summary
    result.step_time_predicted_s = st["step_s"]
    cal = hw.calibration
    # the device's profile, not a calibration name
    result.imported.hardware = cal["hardware"] if cal else hw.profile.key
    result.imported.step_prediction = {**st, "hardware": hw.profile.key, "calibration": cal["id"] if cal else None,
                                       "extrapolation": extrapolation(spec, cal["ranges"], hw.profile.gpus_per_node)
                                       if cal else []}


def import_run(engine, *, config: str | Path, log: str | Path, fmt: str | None = None, gpus: int | None = None,
               hardware: str | None = None, tags: list[str] | tuple[str, ...] = (),
               model_config: str | Path | None = None, seq_len: int | None = None, warmup_steps: int | None = None,
               db_url: str | None = None, vocab_size: int | None = None) -> int:
    """Import one run and store it (one transaction); its experiment id. ConfigImportError / LogImportError (nothing
    stored) with the reason."""
    from backend.importers import import_config
    from backend.spec.user_text import clean_tags
    from db.queries import store_finished_run

    if gpus is None and Path(log).is_file():
        gpus = sniff_gpus(log)
    imported = import_config(config, fmt=fmt, gpus=gpus, model_config=model_config, seq_len=seq_len,
                             vocab_size=vocab_size)
    collector, measured = parse_log(log, imported, warmup_steps=warmup_steps)
    hw = resolve_hardware(hardware, collector.facts.get("device_name"), db_url)
    result = build_result(imported, collector, measured, hw, config_file=_shown(config), log_file=_shown(log))
    if (seen := log_tag(log)) is not None:  # the config and log read: what is wrong with them is said first
        refuse_seen_log(engine, seen, log)
    all_tags = clean_tags([*tags, "imported", f"imported:{imported.framework}"]
                          + ([f"hardware:{hw.profile.key}"] if hw.profile is not None else [])
                          + ([seen] if seen is not None else []))
    return store_finished_run(engine, result, kind="imported", tags=all_tags)


LOG_TAG = "log:"
"""The tag naming the log an imported run was read from: `log:` + the first 16 hex digits of its SHA-256."""


def log_tag(log: str | Path) -> str | None:
    """`log:<sha256[:16]>` of the log's bytes (streamed); None for a log that cannot be read (parse_log says why)."""
    import hashlib

    digest = hashlib.sha256()
    try:
        with open(log, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return LOG_TAG + digest.hexdigest()[:16]


def refuse_seen_log(engine, tag: str, log: str | Path) -> None:
    """InputError when a run read from the same log bytes is stored already: a second copy of one measurement would
    count twice wherever imported runs are pooled (calibrate fits them and checks the fit leave-one-out, which a
    duplicate passes by construction)."""
    from backend.spec.user_text import InputError
    from db.queries import list_experiments

    rows = list_experiments(engine, tag=[tag], limit=1, columns=["id"])
    if rows:
        raise InputError(f"{_shown(log)} was imported already as run #{rows[0]['id']} (tag {tag}): a second copy "
                         f"would count its measurements twice (calibrate pools imported runs); delete run "
                         f"#{rows[0]['id']} first to import it again")


def _shown_text(text: str | None) -> str | None:
    from backend.importers.import_result import safe_name

    return None if text is None else safe_name(text, 200)


def _shown(path: str | Path) -> str:
    from backend.importers.import_result import safe_name

    return safe_name(Path(path).name, 200)
