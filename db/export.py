"""CSV and JSON export of the experiment store (same filters as `db.queries.list_experiments`).

CSV, one row per experiment: the identifying columns first (id, name, status, kind, framework, stack, strategy,
degrees, tags as a JSON list), then model and training columns, the MoE capacity factor, dispatcher and the
token-slots it dropped (`capacity_factor`, `moe_dispatcher`, `tokens_dropped`: read from the stored spec / result
JSON), step time measured and predicted
(`step_time_predicted_s`: RunResult's, from the step-time model at run time; `step_time_error_pct` = (predicted -
step_s_median) / step_s_median x 100), tokens/s, loss parity (`loss_max_abs_diff`, and `loss_parity`: ok / fails
against the precision's bound, backend.result.PARITY_BOUND), bubble fractions, errors
(`diverged`: some loss was NaN or inf; the losses themselves are in the JSON, as "NaN" / "Infinity"),
bookkeeping (`result_error`: where the stored result JSON does not parse, why, as `list` / `show` say it; the
columns read from that JSON are blank, the row and its other columns kept) and timestamps (an imported run:
source_framework, the name of the importer whose log it came from, and the peak allocated / reserved bytes that log
reports; its per-category measured columns are blank, as it measured none), then per memory category the measured
and predicted bytes (max over ranks) and the error % of those maxima, comm bytes (per-rank totals per step, max over
ranks; and per collective), versions.
Fields that do not apply are blank: the schedule and virtual stages without a pipeline (pp = 1), sequence
parallel without tensor parallelism, top-k of a dense model, the K/V rotation and load balancing without context
parallelism (cp = 1).
`long=True` gives one row per (experiment, rank) with that rank's own numbers instead.
The maxima are computed once when a result is stored (experiment_summaries, rank_results.comm_*), so an
export is a plain join: 10,000 experiments in well under a second (benchmarks/export_bench.py). The database
also does the per-cell text work (formula guard, ISO timestamps), so Python hands whole rows to csv.writer;
most of what remains is formatting the numbers. The long CSV reads experiments and rank rows separately and
formats each experiment's cells once for all its ranks.
Text cells starting with = + - @ TAB or CR get a leading single quote so spreadsheets do not run them as
formulas; numbers are never touched (a negative number stays a number).

JSON: a list of {id, name, status, tags, sweep_id, requeue_of, timestamps, worker, error, loss_parity, "env",
"spec", "result"} with the stored env, spec and result JSON spliced in verbatim. A stored JSON text that does not
parse is null instead, with "<key>_error" (why) and "<key>_json" (the text as stored), so the file stays JSON.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, TextIO

from sqlalchemy import Connection, Engine, Float, Integer, String, Text, case, cast, func, literal, select, type_coerce

from backend.result import COLLECTIVES, PARITY_BOUND, PARITY_FAILS, PARITY_OK, parity_bound
from backend.spec.dims import DIMS, not_applicable, placed_columns
from db.degrees import DEGREE_COLUMNS, column
from db.filters import filtered, tags_for
from db.models import Experiment, ExperimentSummary, RankResultRow
from db.queries import read_result, read_spec
from db.result_rows import CATEGORIES, ERROR_CATEGORIES

DANGEROUS_PREFIXES = ("=", "+", "-", "@", "\t", "\r")
EXP_COLUMNS = placed_columns([  # the experiments columns (ROW_KEYS minus queue bookkeeping) in export order, + the
    # predicted step time; the parallel dimensions' columns placed by their table (backend/spec/dims.py)
    "id", "name", "status", "kind", "framework", "stack", "strategy", "world_size", "zero_stage",
    "microbatches", "d_model", "n_layers", "n_heads", "n_kv_heads",
    "ffn", "seq_len", "vocab", "n_experts", "top_k", "capacity_factor", "moe_dispatcher", "tokens_dropped",
    "global_batch", "micro_batch", "steps", "precision", "optimizer",
    "recompute", "source_framework", "step_s_median", "step_time_predicted_s", "step_time_error_pct", "tokens_per_s",
    "mfu", "peak_allocated_bytes", "peak_reserved_bytes", "loss_max_abs_diff", "loss_parity", "diverged",
    "bubble_measured", "bubble_predicted", "wall_s", "error", "result_error", "failing_rank", "sweep_id", "requeue_of",
    "created_at", "started_at", "finished_at", "worker_id", "host"], DIMS)
TAG_POS = EXP_COLUMNS.index("sequence_parallel") + 1
"""The tags column sits after the identifying columns (the select has no tags; rows get the cell inserted here)."""
NOT_APPLICABLE = {**not_applicable(DIMS), "top_k": "n_experts"}
"""Blank unless that column is > 1 (a dimension's options: pp's schedule, tp's sequence parallel, cp's rotation and
balancing) / > 0 (n_experts)."""
MEM_COLUMNS = [f"{kind}_{c}_bytes" for c in CATEGORIES for kind in ("measured", "predicted")]
ERR_COLUMNS = [f"error_pct_{c}" for c in ERROR_CATEGORIES]
COMM_COLUMNS = ["comm_bytes", "comm_wire_bytes", "comm_predicted_bytes", "comm_seconds",
                *[f"comm_{c}_bytes" for c in COLLECTIVES]]
VERSION_COLUMNS = ["torch_version", "python_version"]
TIME_KEYS = ("created_at", "started_at", "finished_at")
RANK_COLUMNS = ["rank", "coords", "steps_timed", "rank_step_s_median", "rank_step_s_mean", "rank_step_s_min",
                "rank_step_s_max", "tokens_per_s_share", "rss_bytes"]
EXP_HEADER = [*EXP_COLUMNS[:TAG_POS], "tags", *EXP_COLUMNS[TAG_POS:]]
WIDE_HEADER = [*EXP_HEADER, *MEM_COLUMNS, *ERR_COLUMNS, *COMM_COLUMNS, *VERSION_COLUMNS]
LONG_HEADER = [*EXP_HEADER, *RANK_COLUMNS, *MEM_COLUMNS, *ERR_COLUMNS, *COMM_COLUMNS, *VERSION_COLUMNS]


def neutralise(value: Any) -> Any:
    """Prefix formula-looking TEXT with a quote; numbers, None and booleans pass through unchanged."""
    if isinstance(value, str) and value.startswith(DANGEROUS_PREFIXES):
        return "'" + value
    return value


def _neutralised_sql(col, key: str):
    """neutralise() as a SQL CASE, so the database does it per cell instead of a Python loop."""
    return case((func.substr(col, 1, 1).in_(DANGEROUS_PREFIXES), literal("'", String) + col), else_=col).label(key)


def _time_sql(col, key: str, dialect: str):
    """A timestamp as ISO 8601 text. SQLite stores naive UTC text "YYYY-MM-DD HH:MM:SS.ffffff", turned into
    "YYYY-MM-DDTHH:MM:SS.ffffff+00:00" in SQL; other databases return datetimes that _iso converts."""
    text = type_coerce(col, String)
    return ((func.replace(text, " ", "T") + literal("+00:00", String)).label(key) if dialect == "sqlite"
            else text.label(key))


def _exp_columns(dialect: str, safe: bool) -> list:
    """Experiment columns (the predicted step time from experiment_summaries); text neutralised in SQL when `safe`
    (CSV), timestamps as text, fields that do not apply blank (NOT_APPLICABLE)."""
    out = []
    for k in EXP_COLUMNS:
        if k == "stack":
            out.append(stack_sql(dialect).label(k))
            continue
        if k in JSON_FIELDS:
            out.append(JSON_FIELDS[k](dialect).label(k))
            continue
        col = DERIVED[k]() if k in DERIVED else column(k)
        if k in NOT_APPLICABLE:
            gate = column(NOT_APPLICABLE[k])
            col = case((gate > (0 if k == "top_k" else 1), col), else_=None)
        out.append(_time_sql(col, k, dialect) if k in TIME_KEYS
                   else _neutralised_sql(col, k) if safe and k in _TEXT_KEYS
                   else col.label(k))
    return out


_PG_JSON_OR_NULL = """CREATE OR REPLACE FUNCTION pg_temp.shardlab_json_or_null(doc text) RETURNS json
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN doc::json;
EXCEPTION WHEN data_exception THEN
    RETURN NULL;
END $$"""
UNREADABLE_RESULT = "the stored result does not read (its JSON does not parse)"


def prepare(conn: Connection) -> None:
    """Before a SELECT that uses json_doc_sql. PostgreSQL 15 has no cast that returns NULL for bad JSON
    (pg_input_is_valid is 16+), so a session-temporary function catches the error; it goes with the transaction."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(_PG_JSON_OR_NULL)


def json_doc_sql(dialect: str, column):
    """A stored JSON text column as JSON the database can read, NULL where the text does not parse: one row corrupted
    or edited by hand must not fail a whole export with "malformed JSON" (PostgreSQL: after prepare())."""
    if dialect == "postgresql":
        return func.pg_temp.shardlab_json_or_null(column)
    return case((func.json_valid(column) == 1, column), else_=None)


def json_unreadable_sql(dialect: str, column):
    """True where the column holds text that does not parse as JSON (NULL and "" are no document, not a bad one)."""
    return (func.coalesce(column, "") != "") & json_doc_sql(dialect, column).is_(None)


def _json_value_sql(dialect: str, column, *path: str):
    doc = json_doc_sql(dialect, column)
    if dialect == "postgresql":
        return func.json_extract_path_text(doc, *path)
    return func.json_extract(doc, "$." + ".".join(path))


def json_text_sql(dialect: str, column, *path: str, default: str):
    """A text value inside a stored JSON column, read in SQL; `default` where absent (specs stored before the field),
    blank where the stored JSON does not parse."""
    value = func.coalesce(_json_value_sql(dialect, column, *path), literal(default, String))
    return case((json_unreadable_sql(dialect, column), None), else_=value)


def stack_sql(dialect: str):
    """The spec's train.stack read from the stored spec JSON in SQL (no column of its own: issue 34), "shardlab" for
    specs stored before stacks existed."""
    return json_text_sql(dialect, Experiment.spec_json, "train", "stack", default="shardlab")


def json_number_sql(dialect: str, column, *path: str, kind=Float):
    """A number inside a stored JSON column, read in SQL (NULL where absent: older runs, or unreadable)."""
    return cast(_json_value_sql(dialect, column, *path), kind)


def dispatcher_sql(dialect: str):
    """A MoE run's model.moe_dispatcher from the stored spec JSON ("alltoall" for specs stored before the field
    existed: the engine's dispatcher), blank for a dense model."""
    value = json_text_sql(dialect, Experiment.spec_json, "model", "moe_dispatcher", default="alltoall")
    return case((Experiment.n_experts > 0, value), else_=None)


JSON_FIELDS = {
    "capacity_factor": lambda dialect: json_number_sql(dialect, Experiment.spec_json, "model", "capacity_factor"),
    "moe_dispatcher": dispatcher_sql,
    "tokens_dropped": lambda dialect: json_number_sql(dialect, Experiment.result_json, "tokens_dropped", kind=Integer),
    "result_error": lambda dialect: case((json_unreadable_sql(dialect, Experiment.result_json),
                                          literal(UNREADABLE_RESULT, String)), else_=None),
}
"""Export columns read from the stored spec / result JSON (issue 35: no column of their own, no migration):
model.capacity_factor (blank = dropless), model.moe_dispatcher (blank for a dense model) and RunResult.tokens_dropped
(blank = nothing could drop); result_error where the stored result JSON does not parse."""


def _step_time_error_pct():
    """(predicted - measured median) / measured median x 100, as Run detail's "% vs measured"; blank without both."""
    predicted, measured = ExperimentSummary.step_time_predicted_s, Experiment.step_s_median
    return case((measured > 0, (predicted - measured) / measured * 100.0), else_=None)


def _loss_parity():
    """backend.result.parity_verdict in SQL: 'fails' over the precision's bound, 'ok' within it, blank without a
    reference. A non-number (NaN) difference is not <= the bound: fails."""
    diff = Experiment.loss_max_abs_diff
    bound = case(*[(Experiment.precision == p, literal(b)) for p, b in PARITY_BOUND.items()],
                 else_=literal(parity_bound("")))
    return case((diff.is_(None), None), (diff <= bound, literal(PARITY_OK, String)),
                else_=literal(PARITY_FAILS, String))


DERIVED = {"step_time_predicted_s": lambda: ExperimentSummary.step_time_predicted_s,
           "step_time_error_pct": _step_time_error_pct, "loss_parity": _loss_parity}
"""Export columns that are not an experiments column: from experiment_summaries, or computed by the database."""


def _safe(col, key: str, safe: bool):
    return _neutralised_sql(col, key) if safe else col.label(key)


def wide_select(dialect: str, safe: bool, filters: dict):
    """The SELECT of the one-row-per-experiment CSV (benchmarks/export_bench.py times a bare CSV of it)."""
    S = ExperimentSummary
    tail = [getattr(S, c) for c in (*MEM_COLUMNS, *ERR_COLUMNS, *COMM_COLUMNS)]
    stmt = (select(*_exp_columns(dialect, safe), *tail, *[_safe(getattr(S, c), c, safe) for c in VERSION_COLUMNS])
            .select_from(Experiment).outerjoin(S, S.experiment_id == Experiment.id))
    return filtered(stmt, **filters).order_by(Experiment.id)


def _rank_columns(safe: bool) -> list:
    R = RankResultRow
    return [R.rank, _safe(R.coords_json, "coords", safe), R.steps_timed, R.step_s_median.label("rank_step_s_median"),
            R.step_s_mean.label("rank_step_s_mean"), R.step_s_min.label("rank_step_s_min"),
            R.step_s_max.label("rank_step_s_max"), R.tokens_per_s_share, R.rss_bytes,
            *[getattr(R, c) for c in (*MEM_COLUMNS, *ERR_COLUMNS, *COMM_COLUMNS)]]


def _ranks_select(safe: bool, filters: dict):
    """The rank rows of the experiments the filters select, by experiment then rank (experiment_id first)."""
    R = RankResultRow
    stmt = (select(R.experiment_id, *_rank_columns(safe)).select_from(R)
            .join(Experiment, Experiment.id == R.experiment_id))
    return filtered(stmt, **filters).order_by(R.experiment_id, R.rank)


def _long_select(dialect: str, filters: dict):
    """One row per (experiment, rank) as a single join (for table(); export_csv joins in Python, see _long_lines)."""
    R, S = RankResultRow, ExperimentSummary
    stmt = (select(*_exp_columns(dialect, False), *_rank_columns(False), S.torch_version, S.python_version)
            .select_from(Experiment).outerjoin(R, R.experiment_id == Experiment.id)
            .outerjoin(S, S.experiment_id == Experiment.id))
    return filtered(stmt, **filters).order_by(Experiment.id, R.rank)


def _iso(value: Any) -> Any:
    if isinstance(value, str):  # SQLite stores naive UTC "YYYY-MM-DD HH:MM:SS.ffffff"
        return value.replace(" ", "T", 1) + "+00:00"
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    return value


def table(engine: Engine, *, long: bool = False, **filters) -> tuple[list[str], list[dict[str, Any]]]:
    """(header, rows as dicts) with raw values (not neutralised): what the CSV holds, for the dashboard too."""
    dialect = engine.dialect.name
    stmt = _long_select(dialect, filters) if long else wide_select(dialect, False, filters)
    with engine.connect() as conn:
        prepare(conn)
        result = conn.execute(stmt)
        keys = list(result.keys())
        rows = result.all()
        tags = tags_for(conn, sorted({r[0] for r in rows}))
    out = []
    for r in rows:
        d = dict(zip(keys, r, strict=False))
        if dialect != "sqlite":  # SQLite gave ISO text already (_time_sql)
            d.update({k: _iso(d[k]) for k in TIME_KEYS})
        d["tags"] = tags.get(d["id"], [])
        out.append(d)
    return (LONG_HEADER if long else WIDE_HEADER), out


def export_csv(engine: Engine, out: TextIO | None = None, *, long: bool = False, **filters) -> str | None:
    """Write the CSV to `out`, or return it as a string when out is None.

    The database neutralises text and formats timestamps (SQL CASE / replace), so Python only hands whole
    rows to csv.writer; the long CSV formats each experiment's columns once, not once per rank."""
    dialect = engine.dialect.name
    target = out if out is not None else io.StringIO()
    with engine.connect() as conn:
        prepare(conn)
        exp_rows = conn.execute(wide_select(dialect, True, filters) if not long
                                else _long_exp_select(dialect, filters)).all()
        tags = tags_for(conn, [r[0] for r in exp_rows])
        rank_rows = conn.execute(_ranks_select(True, filters)).all() if long else None
    if dialect != "sqlite":
        exp_rows = [_iso_row(r) for r in exp_rows]
    cells: dict[tuple[str, ...], str] = {}
    w = csv.writer(target)  # RFC 4180 CRLF rows, so CR or LF inside a text cell is always quoted
    if long:
        w.writerow(LONG_HEADER)
        target.writelines(_long_lines(exp_rows, rank_rows, tags, cells))
    else:
        w.writerow(WIDE_HEADER)
        w.writerows((*r[:TAG_POS], _tag_cell(tags.get(r[0]), cells), *r[TAG_POS:]) for r in exp_rows)
    return target.getvalue() if out is None else None


def _long_exp_select(dialect: str, filters: dict):
    """Experiment columns then the versions, one row per experiment (the rank rows come separately)."""
    S = ExperimentSummary
    stmt = (select(*_exp_columns(dialect, True), *[_neutralised_sql(getattr(S, c), c) for c in VERSION_COLUMNS])
            .select_from(Experiment).outerjoin(S, S.experiment_id == Experiment.id))
    return filtered(stmt, **filters).order_by(Experiment.id)


class _Line:
    """A file whose write() returns the text, so csv.writer.writerow returns the formatted row."""

    @staticmethod
    def write(text: str) -> str:
        return text


def _long_lines(exp_rows: list, rank_rows: list, tags: dict[int, list[str]], cells: dict) -> Iterator[str]:
    """CSV lines of the long export: each experiment's cells formatted once and joined to each of its rank rows'
    cells (rows without ranks keep one line with empty rank cells, like an outer join)."""
    line = csv.writer(_Line()).writerow  # returns the row with its CRLF, so CR/LF in a cell are still quoted
    by_exp: dict[int, list[str]] = {}
    for r in rank_rows:
        by_exp.setdefault(r[0], []).append(line(r[1:])[:-2])
    no_rank = ("," * (len(RANK_COLUMNS) + len(MEM_COLUMNS) + len(ERR_COLUMNS) + len(COMM_COLUMNS) - 1),)
    n_exp = len(EXP_COLUMNS)
    for r in exp_rows:
        head = line((*r[:TAG_POS], _tag_cell(tags.get(r[0]), cells), *r[TAG_POS:n_exp]))[:-2]
        tail = line(r[n_exp:])
        for mid in by_exp.get(r[0], no_rank):
            yield f"{head},{mid},{tail}"


def _iso_row(row) -> tuple:
    return tuple(_iso(v) if i in _TIME_IDX else v for i, v in enumerate(row))


def _tag_cell(tags: list[str] | None, cache: dict) -> str | None:
    """Tags as a JSON list (unambiguous whatever the tags contain); starts with "[" so never a formula."""
    if not tags:
        return None
    key = tuple(tags)
    cell = cache.get(key)
    if cell is None:
        cell = cache[key] = _JSON.encode(tags)
    return cell


def _text_keys() -> frozenset[str]:
    cols = {k: column(k) for k in EXP_COLUMNS if k in DEGREE_COLUMNS or hasattr(Experiment, k)}
    return frozenset([k for k, c in cols.items() if isinstance(c.type, (String, Text))] + ["coords", *VERSION_COLUMNS])


_TEXT_KEYS = _text_keys()
_TIME_IDX = frozenset(i for i, k in enumerate(EXP_COLUMNS) if k in TIME_KEYS)
_JSON = json.JSONEncoder(ensure_ascii=False)  # == json.dumps(..., ensure_ascii=False), built once not per row
JSON_KEYS = ("id", "name", "status", "kind", "sweep_id", "requeue_of", "created_at", "started_at", "finished_at",
             "worker_id", "host", "error", "failing_rank", "loss_parity", "log_tail", "traceback")
"""The run's columns beside its env, spec and result: kind (measured, traced, imported), and the log tail and rank
traceback the run stored, which an interrupted run (no result) has only here."""


def export_json(engine: Engine, out: TextIO | None = None, **filters) -> str | None:
    """Full results as a JSON list; env, spec and result JSON spliced verbatim from the store (a text that does not
    parse: null, with its reason and the text as stored, see _unreadable_doc)."""
    dialect = engine.dialect.name
    cols = [_time_sql(getattr(Experiment, k), k, dialect) if k in TIME_KEYS else
            DERIVED[k]().label(k) if k in DERIVED else getattr(Experiment, k) for k in JSON_KEYS]
    docs = [Experiment.env_json, Experiment.spec_json, Experiment.result_json]
    stmt = filtered(select(*cols, *docs, *[json_unreadable_sql(dialect, d) for d in docs]), **filters)
    with engine.connect() as conn:
        prepare(conn)
        rows = conn.execute(stmt.order_by(Experiment.id)).all()
        tags = tags_for(conn, [r[0] for r in rows])
    n = len(JSON_KEYS)
    time_idx = [i for i, k in enumerate(JSON_KEYS) if k in TIME_KEYS] if dialect != "sqlite" else []
    encode = _JSON.encode
    pieces = ["["]
    for i, r in enumerate(rows):
        head = list(r[:n])
        for j in time_idx:
            head[j] = _iso(head[j])
        obj = dict(zip(JSON_KEYS, head, strict=False), tags=tags.get(r[0], []))
        env_json, spec_json, result_json = r[n:n + 3]
        if any(r[n + 3:]):
            env_json, spec_json, result_json = _unreadable_docs(obj, r[n:n + 3], r[n + 3:])
        pieces += [",\n" if i else "\n", encode(obj)[:-1], ', "env": ', env_json or "{}",
                   ', "spec": ', spec_json, ', "result": ', result_json or "null", "}"]
    pieces.append("\n]\n")
    if out is None:
        return "".join(pieces)
    out.writelines(pieces)
    return None


def _unreadable_docs(obj: dict[str, Any], texts: tuple, unreadable: tuple) -> list[str | None]:
    """The env, spec and result texts to splice, "null" for one that does not parse; its reason ("<key>_error", as
    `show` gives it) and its text as stored ("<key>_json": nothing is lost) go into obj."""
    out = []
    for key, text, bad in zip(("env", "spec", "result"), texts, unreadable, strict=True):
        if not bad:
            out.append(text)
            continue
        obj[f"{key}_error"] = _why_unreadable(key, text)
        obj[f"{key}_json"] = text
        out.append("null")
    return out


def _why_unreadable(key: str, text: str) -> str:
    if key == "result":
        return read_result(text)[1] or UNREADABLE_RESULT
    if key == "spec":
        return read_spec(text)[1] or "the stored spec does not parse"
    return "the stored environment JSON does not parse"
