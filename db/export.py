"""CSV and JSON export of the experiment store (same filters as `db.queries.list_experiments`).

CSV, one row per experiment: parallelism and model columns, status, per memory category the measured
and predicted bytes (max over ranks) and the error % of those maxima, step time, tokens/s, comm bytes
(per-rank totals per step, max over ranks; and per collective), bubble fractions, timestamps, versions.
`long=True` gives one row per (experiment, rank) with that rank's own numbers instead.
The maxima are computed once when a result is stored (experiment_summaries, rank_results.comm_*), so an
export is a plain join: 10,000 experiments in well under a second (benchmarks/export_bench.py).
Text cells starting with = + - @ TAB or CR get a leading single quote so spreadsheets do not run them as
formulas; numbers are never touched (a negative number stays a number).

JSON: a list of {id, name, status, tags, sweep_id, requeue_of, timestamps, worker, error, "env",
"spec", "result"} with the stored env, spec and result JSON spliced in verbatim.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timezone
from typing import Any, TextIO

from sqlalchemy import Engine, String, Text, select, type_coerce

from backend.result import COLLECTIVES
from db.models import Experiment, ExperimentSummary, RankResultRow
from db.queries import ROW_KEYS, _filtered, _tags_for
from db.result_rows import CATEGORIES, ERROR_CATEGORIES

DANGEROUS_PREFIXES = ("=", "+", "-", "@", "\t", "\r")
EXP_COLUMNS = [k for k in ROW_KEYS if k not in ("cancel_requested", "progress_step", "progress_total", "progress_phase",
                                                "heartbeat_at", "peak_bytes_max")]
MEM_COLUMNS = [f"{kind}_{c}_bytes" for c in CATEGORIES for kind in ("measured", "predicted")]
ERR_COLUMNS = [f"error_pct_{c}" for c in ERROR_CATEGORIES]
COMM_COLUMNS = ["comm_bytes", "comm_wire_bytes", "comm_predicted_bytes", "comm_seconds", *[f"comm_{c}_bytes" for c in COLLECTIVES]]
VERSION_COLUMNS = ["torch_version", "python_version"]
TIME_KEYS = ("created_at", "started_at", "finished_at")
RANK_COLUMNS = ["rank", "coords", "steps_timed", "rank_step_s_median", "rank_step_s_mean", "rank_step_s_min",
                "rank_step_s_max", "tokens_per_s_share", "rss_bytes"]
WIDE_HEADER = ["tags", *EXP_COLUMNS, *MEM_COLUMNS, *ERR_COLUMNS, *COMM_COLUMNS, *VERSION_COLUMNS]
LONG_HEADER = ["tags", *EXP_COLUMNS, *RANK_COLUMNS, *MEM_COLUMNS, *ERR_COLUMNS, *COMM_COLUMNS, *VERSION_COLUMNS]


def neutralise(value: Any) -> Any:
    """Prefix formula-looking TEXT with a quote; numbers, None and booleans pass through unchanged."""
    if isinstance(value, str) and value.startswith(DANGEROUS_PREFIXES):
        return "'" + value
    return value


def _wide_select(filters: dict):
    S = ExperimentSummary
    stmt = (select(*_exp_columns(), *[getattr(S, c) for c in (*MEM_COLUMNS, *ERR_COLUMNS, *COMM_COLUMNS, *VERSION_COLUMNS)])
            .select_from(Experiment).outerjoin(S, S.experiment_id == Experiment.id))
    return _filtered(stmt, **filters).order_by(Experiment.id)


def _long_select(filters: dict):
    R, S = RankResultRow, ExperimentSummary
    rank_cols = [R.rank, R.coords_json.label("coords"), R.steps_timed, R.step_s_median.label("rank_step_s_median"),
                 R.step_s_mean.label("rank_step_s_mean"), R.step_s_min.label("rank_step_s_min"),
                 R.step_s_max.label("rank_step_s_max"), R.tokens_per_s_share, R.rss_bytes]
    stmt = (select(*_exp_columns(), *rank_cols, *[getattr(R, c) for c in (*MEM_COLUMNS, *ERR_COLUMNS, *COMM_COLUMNS)],
                   S.torch_version, S.python_version)
            .select_from(Experiment).outerjoin(R, R.experiment_id == Experiment.id)
            .outerjoin(S, S.experiment_id == Experiment.id))
    return _filtered(stmt, **filters).order_by(Experiment.id, R.rank)


def _exp_columns() -> list:
    """Experiment columns; timestamps as the stored text (converted to ISO 8601 in Python, cheaply)."""
    return [type_coerce(getattr(Experiment, k), String).label(k) if k in TIME_KEYS else getattr(Experiment, k)
            for k in EXP_COLUMNS]


def _iso(value: Any) -> Any:
    if isinstance(value, str):  # SQLite stores naive UTC "YYYY-MM-DD HH:MM:SS.ffffff"
        return value.replace(" ", "T", 1) + "+00:00"
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).isoformat()
    return value


def _rows(engine: Engine, long: bool, filters: dict) -> tuple[list[str], list, dict[int, list[str]]]:
    stmt = _long_select(filters) if long else _wide_select(filters)
    with engine.connect() as conn:
        result = conn.execute(stmt)
        keys = list(result.keys())
        rows = result.all()
        tags = _tags_for(conn, sorted({r[0] for r in rows}))
    return keys, rows, tags


def table(engine: Engine, *, long: bool = False, **filters) -> tuple[list[str], list[dict[str, Any]]]:
    """(header, rows as dicts) with raw values (not neutralised): what the CSV holds, for the dashboard too."""
    keys, rows, tags = _rows(engine, long, filters)
    out = []
    for r in rows:
        d = dict(zip(keys, r))
        d.update({k: _iso(d[k]) for k in TIME_KEYS})
        d["tags"] = tags.get(d["id"], [])
        out.append(d)
    return (LONG_HEADER if long else WIDE_HEADER), out


def export_csv(engine: Engine, out: TextIO | None = None, *, long: bool = False, **filters) -> str | None:
    """Write the CSV to `out`, or return it as a string when out is None."""
    keys, rows, tags = _rows(engine, long, filters)
    text_idx = [i for i, k in enumerate(keys) if k in _TEXT_KEYS]
    time_idx = [i for i, k in enumerate(keys) if k in TIME_KEYS]
    cells: dict[tuple[str, ...], str] = {}
    target = out if out is not None else io.StringIO()
    w = csv.writer(target)  # RFC 4180 CRLF rows, so CR or LF inside a text cell is always quoted
    w.writerow(["tags", *keys])
    for r in rows:
        vals = list(r)
        for i in text_idx:
            v = vals[i]
            if v and v.startswith(DANGEROUS_PREFIXES):
                vals[i] = "'" + v
        for i in time_idx:
            vals[i] = _iso(vals[i])
        t = tags.get(r[0])
        w.writerow([_tag_cell(tuple(t), cells) if t else None, *vals])
    return target.getvalue() if out is None else None


def _tag_cell(tags: tuple[str, ...], cache: dict) -> str:
    """Tags as a JSON list (unambiguous whatever the tags contain); starts with "[" so never a formula."""
    cell = cache.get(tags)
    if cell is None:
        cell = cache[tags] = json.dumps(list(tags), ensure_ascii=False)
    return cell


def _text_keys() -> frozenset[str]:
    cols = [getattr(Experiment, k) for k in EXP_COLUMNS]
    return frozenset([c.key for c in cols if isinstance(c.type, (String, Text))] + ["coords", *VERSION_COLUMNS])


_TEXT_KEYS = _text_keys()
JSON_KEYS = ("id", "name", "status", "sweep_id", "requeue_of", "created_at", "started_at", "finished_at", "worker_id",
             "host", "error", "failing_rank")


def export_json(engine: Engine, out: TextIO | None = None, **filters) -> str | None:
    """Full results as a JSON list; env, spec and result JSON spliced verbatim from the store."""
    cols = [type_coerce(getattr(Experiment, k), String).label(k) if k in TIME_KEYS else getattr(Experiment, k)
            for k in JSON_KEYS]
    stmt = _filtered(select(*cols, Experiment.env_json, Experiment.spec_json, Experiment.result_json), **filters)
    with engine.connect() as conn:
        rows = conn.execute(stmt.order_by(Experiment.id)).all()
        tags = _tags_for(conn, [r[0] for r in rows])
    n = len(JSON_KEYS)
    time_idx = [i for i, k in enumerate(JSON_KEYS) if k in TIME_KEYS]
    pieces = ["["]
    for i, r in enumerate(rows):
        head = list(r[:n])
        for j in time_idx:
            head[j] = _iso(head[j])
        obj = dict(zip(JSON_KEYS, head), tags=tags.get(r[0], []))
        env_json, spec_json, result_json = r[n:]
        pieces += [",\n" if i else "\n", json.dumps(obj, ensure_ascii=False)[:-1], ', "env": ', env_json or "{}",
                   ', "spec": ', spec_json, ', "result": ', result_json or "null", "}"]
    pieces.append("\n]\n")
    if out is None:
        return "".join(pieces)
    out.writelines(pieces)
    return None
