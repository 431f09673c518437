"""Shape experiment rows (db.queries.list_experiments dicts) into the Runs table (downloads come from db.export)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pandas as pd

from backend.analytic.units import MiB
from backend.result import PARITY_FAILS, parity_verdict
from backend.spec.dims import DIMS, degree_names

DEGREES = degree_names(DIMS)

ACTIVE = ("queued", "running")
COLUMNS = ["id", "status", "loss parity", "progress", "name", "framework", "strategy", "world", "degrees", "schedule",
           "tags", "step time (ms)", "tokens/s", "peak (MiB)", "created"]
# The list_experiments columns table_frame reads (26 of the columns plus tags).
TABLE_KEYS = ("id", "status", "progress_step", "progress_total", "progress_phase", "error", "name", "strategy",
              "world_size", *DEGREES, "sequence_parallel", "schedule", "microbatches", "tags", "step_s_median",
              "tokens_per_s", "peak_bytes_max", "created_at", "kind",
              "framework", "source_framework", "diverged", "loss_max_abs_diff", "precision")
DIVERGED = "ok, diverged"
"""The status an ok run shows when some loss was NaN or inf."""
PARITY_MARK = {PARITY_FAILS: "⚠ fails", "ok": "ok", None: ""}
"""The Runs table's loss-parity cell: a run whose loss left the single-process reference's bound is marked, not
hidden in a note (issue 30)."""


def progress_text(row: dict[str, Any]) -> str:
    st = row.get("status")
    if st == "running":
        k, n, ph = row.get("progress_step"), row.get("progress_total"), row.get("progress_phase")
        if k is not None and n:
            return f"step {k}/{n}" + (f" ({ph})" if ph else "")
        return ph or "starting"  # e.g. a SLURM job's queue state: "slurm PENDING (Resources)"
    if st == "queued":
        return "waiting for a worker"
    return "" if st == "ok" else (row.get("error") or "")[:80]


def progress_fraction(row: dict[str, Any]) -> float | None:
    k, n = row.get("progress_step"), row.get("progress_total")
    return None if k is None or not n else max(0.0, min(1.0, k / n))


def degrees_text(row: dict[str, Any]) -> str:
    parts = [f"dp{row.get('dp')}"]
    for k in DEGREES:  # tp, pp, ep, cp (backend/spec/dims.py), each when split
        if k != "dp" and (row.get(k) or 1) > 1:
            parts.append(f"{k}{row[k]}")
    if row.get("sequence_parallel"):
        parts.append("sp")
    return "×".join(parts)


_KIND_MARK = {"traced": "[traced] ", "imported": "[imported] "}
"""Marks before the name: a traced run measured fake tensors, an imported one ran elsewhere (issue 25)."""


def table_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """One display row per experiment, built column-wise (10,000 rows in tens of ms); numbers stay numbers.
    Needs only TABLE_KEYS of each row (list_experiments(columns=TABLE_KEYS) reads just those)."""
    col = lambda k: [r.get(k) for r in rows]  # noqa: E731
    status = [DIVERGED if st == "ok" and r.get("diverged") else st for r, st in zip(rows, col("status"), strict=False)]
    data = {
        "id": [int(r["id"]) for r in rows],
        "status": status,
        "loss parity": [PARITY_MARK[parity_of(r)] for r in rows],
        "progress": ["" if st in ("ok", DIVERGED) else progress_text(r) for r, st in zip(rows, status, strict=False)],
        "name": [_KIND_MARK.get(r.get("kind"), "") + (r.get("name") or "") for r in rows],
        "framework": [f"{r['source_framework']} (imported)" if r.get("kind") == "imported" and r.get("source_framework")
                      else r.get("framework") or "torch" for r in rows],
        "strategy": col("strategy"),
        "world": col("world_size"),
        "degrees": [degrees_text(r) for r in rows],
        "schedule": [f"{r.get('schedule')} m={r.get('microbatches')}" if (r.get("pp") or 1) > 1 else "" for r in rows],
        "tags": [", ".join(t) if t else "" for t in col("tags")],
        "step time (ms)": _scaled(col("step_s_median"), 1e3, 2),
        "tokens/s": _scaled(col("tokens_per_s"), 1.0, 0),  # whole tokens: decimals only add noise
        "peak (MiB)": _scaled(col("peak_bytes_max"), 1 / MiB, 3),
        "created": [_created(v) for v in col("created_at")],
    }
    return pd.DataFrame(data, columns=COLUMNS)


def parity_of(row: dict[str, Any]) -> str | None:
    """'ok', 'fails' or None for a list_experiments row (backend.result.parity_verdict)."""
    return parity_verdict(str(row.get("precision") or "fp32"), row.get("loss_max_abs_diff"))


def _scaled(values: list, factor: float, ndigits: int) -> pd.arrays.FloatingArray:
    """values × factor rounded for display, None kept as <NA>."""
    return pd.array([None if v is None else round(v * factor, ndigits) for v in values], dtype="Float64")


def _created(v: Any) -> str:
    # str(datetime) is "YYYY-MM-DD HH:MM:SS[.ffffff][+00:00]": slicing is ~5x faster than strftime on 10k rows.
    return str(v)[:19] if isinstance(v, datetime) else str(v or "")[:19].replace("T", " ")


def any_active(rows: list[dict[str, Any]]) -> bool:
    return any(r.get("status") in ACTIVE for r in rows)


def run_label(row: dict[str, Any]) -> str:
    """'#12 name-or-strategy · world 4 · ok' for pickers."""
    if "strategy" not in row:
        return f"#{row.get('id')}"
    kind = f" · {row['kind']}" if row.get("kind") in ("traced", "imported") else ""
    status = DIVERGED if row.get("status") == "ok" and row.get("diverged") else row.get("status")
    parity = " · ⚠ loss parity fails" if parity_of(row) == PARITY_FAILS else ""
    return f"#{row['id']} {row.get('name') or row['strategy']} · world {row.get('world_size')} · {status}{parity}{kind}"
