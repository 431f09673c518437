"""Bring your own runs on the pages (issue 25): the "Import config" box of New experiment and Plan, and the page of
an imported run (predicted vs measured step time with its interval and breakdown; predicted memory categories beside
the peak allocated / reserved the log reports, labelled as such; the warm-up rule; what the import could not map).

Every string that came from a user's config or log reaches the page through st.text or a dataframe cell (never
markdown), so it is shown, not interpreted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from backend.analytic.units import GiB
from dashboard.theme import LAYOUT

AUTO = "auto (from the file)"
BREAKDOWN = (("compute_s", "compute"), ("exposed_comm_s", "exposed communication"), ("bubble_s", "pipeline bubble"),
             ("optimizer_s", "optimizer step"), ("other_s", "other"))
MEMORY_LABEL = ("measured: the allocator peaks the log prints (torch.cuda max allocated / max reserved), per rank it "
                "reports; predicted: ShardLab's categories at the activation peak on CUDA ranks. The log measures no "
                "category, so the comparison is predicted total vs measured peak allocated.")


def formats() -> dict[str, str | None]:
    """The Format select of the Import config box: its label -> the --format value (None: auto-detection), one per
    importer in the registry."""
    from backend.importers import registry

    return {AUTO: None, **{i.label: i.name for i in registry.IMPORTERS}}


def frameworks_text() -> str:
    """"torchtitan, Megatron-LM / NeMo, DeepSpeed": what the box imports."""
    from backend.importers import registry

    return ", ".join(i.label for i in registry.IMPORTERS)


def reads_text() -> str:
    """What each framework's files are, in the page's words (no CLI flag)."""
    from backend.importers import registry

    return "; ".join(f"{i.label}: {i.reads}" + (" with the model's config.json" if i.needs_model_config else "")
                     for i in registry.IMPORTERS)


def model_file_help() -> str:
    """The model config.json upload's help: what it does for each framework's configs."""
    from backend.importers import registry

    return "The model's Hugging Face config.json: " + "; ".join(registry.model_config_uses()) + "."


@dataclass(frozen=True)
class ImportRequest:
    """What the Import config box was given: the uploaded files and the fields beside them."""
    config: bytes
    name: str
    fmt: str | None = None
    gpus: int | None = None
    model_config: bytes | None = None
    vocab_size: int | None = None
    seq_len: int | None = None


@dataclass(frozen=True)
class ImportOutcome:
    imported: Any = None
    problems: tuple[str, ...] = ()
    """Every problem, in the importer's words."""
    needs: tuple[str, ...] = ()
    """What the person could supply (importers.imported.VOCAB_SIZE): the box asks for it with a field."""

    def shown_problems(self) -> list[str]:
        """The problems the page lists as errors: not those it asks about in its own words (the vocabulary size)."""
        from backend.importers.import_result import VOCAB_SIZE, VOCAB_UNKNOWN

        asked = VOCAB_SIZE in self.needs
        return [p for p in self.problems if not (asked and p.startswith(VOCAB_UNKNOWN))]


def import_request(request: ImportRequest) -> ImportOutcome:
    """The spec of an uploaded config (and model config.json), or every problem and what the person could supply."""
    from backend.hf.config import HFConfigError, parse_hf_config
    from backend.importers import ConfigImportError, import_config_text

    cfg = None
    if request.model_config is not None:
        try:
            cfg = parse_hf_config(request.model_config, name="the model's config.json")
        except HFConfigError as e:
            return ImportOutcome(problems=(str(e),))
    try:
        text = request.config.decode("utf-8", "replace")
        return ImportOutcome(imported=import_config_text(text, name=request.name, fmt=request.fmt, gpus=request.gpus,
                                                         model_config=cfg, seq_len=request.seq_len,
                                                         vocab_size=request.vocab_size))
    except ConfigImportError as e:
        return ImportOutcome(problems=tuple(e.problems), needs=e.needs)


def import_uploaded(config: bytes, name: str, *, fmt: str | None, gpus: int | None, model_config: bytes | None = None,
                    seq_len: int | None = None):
    """(ImportedConfig, None) or (None, [problems]) for an uploaded config (and model config.json)."""
    out = import_request(ImportRequest(config, name, fmt, gpus, model_config, seq_len=seq_len))
    return (out.imported, None) if out.imported is not None else (None, list(out.problems))


def fields_frame(entries: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """field, value (as JSON, shortened), why: the unmapped or ignored fields of an import."""
    rows = [{"field": k, "value": _short(v.get("value")), "why": v.get("reason", "")} for k, v in entries.items()]
    return pd.DataFrame(rows, columns=["field", "value", "why"])


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def summary_line(imported) -> str:
    """One line: framework, GPUs = every degree (dp x cp x tp x pp, ep), strategy, shape, batch, precision."""
    from backend.importers.import_result import layout_text

    p, t, m = imported.spec["parallel"], imported.spec["train"], imported.spec["model"]
    return (f"{imported.framework} ({imported.source_format}), {imported.gpus} GPUs = {layout_text(p)}: "
            f"{p['strategy']}, {m['n_layers']} layers x {m['d_model']}, seq {m['seq_len']}, global batch "
            f"{t['global_batch']}, {t['precision']}, recompute {t['recompute']}")


def is_imported(res: Any) -> bool:
    return getattr(res, "imported", None) is not None


def banner(res: Any) -> str:
    f = res.imported
    line = (f"Imported from {f.framework}: measured elsewhere ({f.gpus} GPUs"
            + (f", {f.device_name}" if f.device_name else "")
            + f"), read from {f.log_file} with config {f.config_file}.")
    return line + (" Partial import: " + "; ".join(f.partial_reasons) if f.partial else "")


def step_comparison(res: Any, engine: Any = None,
                    run_id: int | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """Measured (median after warm-up) vs the step-time model on the run's hardware profile with the newest calibration
    of that profile: (comparison, None) or (None, why not)."""
    from backend.analytic.steptime.hardware import get_hardware, load_profiles
    from backend.calibration.fit import extrapolation
    from backend.calibration.records import latest_for

    f = res.imported
    if not f.hardware or f.hardware not in load_profiles():
        return None, f"no hardware profile for this run (the log names {f.device_name or 'no device'}): import it " \
                     "with --hardware NAME"
    from backend.analytic.steptime.model import step_time
    from backend.analytic.steptime.untimed import NotTimed

    cal = latest_for(engine, f.hardware) if engine is not None else None
    hw = get_hardware(f.hardware).with_tunables(**cal["params"]) if cal else get_hardware(f.hardware)
    band = tuple(cal["band"]) if cal else None
    try:
        st = step_time(res.spec, hw, band=band).summary
    except NotTimed as e:  # e.g. an fp8 log imported with --hardware of an Ampere GPU
        return None, str(e)
    measured = res.step_s_median
    return {"hardware": f.hardware, "calibration": cal["id"] if cal else None,
            "calibration_name": cal.get("name") if cal else None, "loo_mape": cal["loo_mape"] if cal else None,
            "in_fit": bool(cal) and run_id in cal["fit_runs"],
            "measured_s": measured, "predicted_s": st["step_s"], "low_s": st["low_s"], "high_s": st["high_s"],
            "error_pct": (st["step_s"] - measured) / measured * 100, "inside": st["low_s"] <= measured <= st["high_s"],
            "breakdown": {label: st[key] for key, label in BREAKDOWN},
            "extrapolation": extrapolation(res.spec, cal["ranges"], hw.gpus_per_node) if cal else []}, None


def step_fig(cmp: dict[str, Any]) -> go.Figure:
    """Predicted step stacked by where the time goes, beside the measured step (one bar) with the interval."""
    fig = go.Figure()
    for label, seconds in cmp["breakdown"].items():
        fig.add_bar(name=label, x=["predicted"], y=[seconds], hovertemplate=f"{label}: %{{y:.3f}} s<extra></extra>")
    fig.add_bar(name="measured (median after warm-up)", x=["measured"], y=[cmp["measured_s"]], marker_color="#333",
                hovertemplate="measured: %{y:.3f} s<extra></extra>")
    fig.add_scatter(name="prediction interval", x=["predicted", "predicted"], y=[cmp["low_s"], cmp["high_s"]],
                    mode="lines+markers", line=dict(color="black", width=3),
                    marker=dict(symbol="line-ew-open", size=16))
    fig.update_layout(barmode="stack", title="Step time: predicted (where the time goes) vs measured",
                      yaxis_title="seconds per step", **LAYOUT)
    return fig


def memory_frame(res: Any) -> pd.DataFrame:
    """One row per rank the log reports: predicted categories and total (GiB) beside measured peak allocated and
    reserved (GiB), and allocated vs the predicted total."""
    rows = []
    for r in res.per_rank:
        p = r.predicted
        alloc, reserved = r.cuda_max_allocated_bytes, r.cuda_max_reserved_bytes
        rows.append({"rank": r.rank, "predicted params": p.params_bytes / GiB, "predicted grads": p.grads_bytes / GiB,
                     "predicted optimizer": p.optimizer_bytes / GiB, "predicted activations": p.activations_bytes / GiB,
                     "predicted other": p.other_bytes / GiB, "predicted total": p.peak_bytes / GiB,
                     "measured peak allocated": None if alloc is None else alloc / GiB,
                     "measured peak reserved": None if reserved is None else reserved / GiB,
                     "allocated vs predicted total %": None if alloc is None or not p.peak_bytes
                     else (alloc - p.peak_bytes) / p.peak_bytes * 100})
    return pd.DataFrame(rows)


def facts_lines(res: Any) -> list[str]:
    f = res.imported
    lines = [f"{f.warmup_rule}.", f"Logged steps {f.first_step}..{f.last_step}; {f.records_used} of {f.records_total} "
             f"step records used.", f"Memory: {f.memory_source}."]
    if f.reported:
        names = {"tps_per_device": "tokens/s per device", "tflops_per_device": "TFLOP/s per device", "mfu_pct": "MFU %"}
        lines.append(f"{f.framework}'s own figures (median after warm-up): "
                     + ", ".join(f"{names.get(k, k)} {v:,.2f}" for k, v in f.reported.items())
                     + "; ShardLab's MFU above is model FLOPs / the profile's peak (PaLM App. B).")
    if f.lines.get("truncated_last_line") or f.lines.get("overlong_lines_skipped") or f.lines.get("garbled_step_lines"):
        first = f" (first at line {f.lines['first_garbled_line']})" if f.lines.get("first_garbled_line") else ""
        lines.append(f"Read {f.lines.get('lines', 0):,} lines: {f.lines.get('garbled_step_lines', 0)} lines not "
                     f"understood{first}, {f.lines.get('overlong_lines_skipped', 0)} over-long lines skipped, cut last "
                     f"line: {bool(f.lines.get('truncated_last_line'))}.")
    return lines
