"""The dashboard's access to the experiment store: one cached engine, short-TTL cached reads, and writes
that clear the read cache so the next rerun shows them. Every write first checks that the session's user may change
the store (dashboard/access.py `require_operator`: viewers may only read), whatever button or request asked for it."""

from __future__ import annotations

from typing import Any

import streamlit as st

from backend.spec import ExperimentSpec
from dashboard.access import require_operator

LIST_TTL_S = 2.0
DETAIL_TTL_S = 2.0
CHECKS_TTL_S = 30.0
"""The Formulas page's checks read up to 100 results: refreshed at most this often (or after a UI write)."""


def db_url() -> str:
    from db.session import resolve_url

    return resolve_url(None)


def db_url_shown() -> str:
    """The URL without its password (a PostgreSQL team store's URL may carry one)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(db_url()).render_as_string(hide_password=True)
    except ArgumentError:  # not a URL: it is not shown, it may hold a password
        return "(not a database URL)"


@st.cache_resource(show_spinner=False)
def _engine_for(url: str):
    from db.session import open_db

    return open_db(url)


def engine():
    return _engine_for(db_url())


def problem() -> str | None:
    """Why the store cannot be used (its URL, folder or file, or an outage; at open or since), in words; None when it
    answers. A failed open is not cached: the next page run tries again."""
    from backend.worker.store_guard import is_transient, short
    from db.errors import StoreError

    try:
        with engine().connect() as conn:  # a store gone, replaced or down since the dashboard opened it too
            conn.exec_driver_sql("SELECT 1")
    except StoreError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - an outage is said in words; anything else is a bug, raised
        if not is_transient(e):
            raise
        return f"the store is unavailable ({short(e)}); reload the page once it is back"
    return None


@st.cache_data(ttl=LIST_TTL_S, show_spinner=False)
def list_runs(url: str, **filters: Any) -> list[dict[str, Any]]:
    return _list_runs(url, **filters)


def _list_runs(url: str, *, status: tuple[str, ...] = (), strategy: tuple[str, ...] = (), tag: str | None = None,
               search: str | None = None, limit: int = 200, offset: int = 0, order_by: str = "created_at",
               descending: bool = True,
               columns: tuple[str, ...] | None = None, framework: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """list_experiments' plain dicts (no spec/result objects: those come only from get_run)."""
    from db import queries

    return queries.list_experiments(_engine_for(url), status=list(status) or None, strategy=list(strategy) or None,
                                    tag=tag or None, search=search or None, limit=limit, offset=offset,
                                    order_by=order_by, descending=descending, columns=columns,
                                    framework=list(framework) or None)


@st.cache_data(ttl=LIST_TTL_S, show_spinner=False)
def runs_table(url: str, **filters: Any):
    """The Runs-page table for list_runs' filters, cached as a DataFrame (pickles ~10x faster than 10k dicts).
    Reads only the columns the table shows (runs_view.TABLE_KEYS)."""
    from dashboard.runs_view import TABLE_KEYS, table_frame

    return table_frame(_list_runs(url, **filters, columns=TABLE_KEYS))


@st.cache_data(ttl=LIST_TTL_S, show_spinner=False)
def count_runs(url: str, *, status: tuple[str, ...] = (), strategy: tuple[str, ...] = (), tag: str | None = None,
               search: str | None = None, framework: tuple[str, ...] = ()) -> int:
    from db import queries

    return int(queries.count_experiments(_engine_for(url), status=list(status) or None, strategy=list(strategy) or None,
                                         tag=tag or None, search=search or None, framework=list(framework) or None))


@st.cache_data(ttl=DETAIL_TTL_S, show_spinner=False)
def get_run(url: str, experiment_id: int) -> dict[str, Any] | None:
    from db import queries

    return queries.get_experiment(_engine_for(url), int(experiment_id))


def status_now(url: str, experiment_id: int) -> str | None:
    """The run's status, uncached: the live fragments poll it to notice a run ending at once."""
    from db import queries

    return queries.get_status(_engine_for(url), int(experiment_id))


def changed() -> None:
    """Call after any write so cached reads are refreshed on the next rerun."""
    list_runs.clear()
    runs_table.clear()
    count_runs.clear()
    get_run.clear()
    measured_checks.clear()


@st.cache_data(ttl=CHECKS_TTL_S, show_spinner=False)
def measured_checks(url: str, limit: int = 100):
    """The Formulas page's formula-vs-measurement table over the newest `limit` ok runs (one read per TTL)."""
    from dashboard import formulas_view as fv

    ok = list_runs(url, status=("ok",), limit=limit)
    runs = [(r["id"], e["result"]) for r in ok if (e := get_run(url, r["id"])) and e.get("result") is not None]
    return fv.measured_checks(runs)


def submit(spec: ExperimentSpec, *, tags: tuple[str, ...] = (), sweep_id: str | None = None) -> int:
    require_operator("submit runs")
    from db import queries

    kw: dict[str, Any] = {"tags": tags}
    if sweep_id is not None:
        kw["sweep_id"] = sweep_id
    eid = queries.submit_experiment(engine(), spec, **kw)
    changed()
    return int(eid)


def cancel(ids: list[int]) -> dict[int, str]:
    """Cancel each run ({id: "cancelled" | "cancelling" | ...}); caches refreshed."""
    require_operator("cancel runs")
    from db import queries

    out = {int(i): queries.cancel_experiment(engine(), int(i)) for i in ids}
    changed()
    return out


def requeue(ids: list[int]) -> tuple[list[int], list[str]]:
    """Queue each run's spec again as a new run: (new ids, errors)."""
    require_operator("re-run runs")
    from db import queries

    done, errors = [], []
    for i in ids:
        try:
            done.append(int(queries.requeue_experiment(engine(), int(i))))
        except ValueError as e:
            errors.append(str(e))
    changed()
    return done, errors


def set_tags(ids: list[int], text: str) -> None:
    """Replace the tags of each run with the comma-separated `text`."""
    require_operator("tag runs")
    from db import queries

    tags = [t.strip() for t in text.split(",") if t.strip()]
    for i in ids:
        queries.set_tags(engine(), int(i), tags)
    changed()


def delete(ids: list[int]) -> list[str]:
    """Delete each run and its run folder (as `delete` on the CLI); returns the errors (e.g. a run still active)."""
    require_operator("delete runs")
    from backend.worker.cleanup import delete_run, runs_dirs

    errors = []
    for i in ids:
        try:
            delete_run(engine(), int(i), runs_dirs(engine()))
        except ValueError as e:
            errors.append(str(e))
    changed()
    return errors


def start_trace(spec: ExperimentSpec) -> int:
    """Trace the spec at full size as a new run (kind traced); its id."""
    require_operator("start traces")
    from dashboard.trace_view import start_trace as start

    eid = start(spec, db_url())
    changed()
    return eid


def calibrate(**kwargs: Any) -> dict[str, Any]:
    """Fit and store a calibration (backend.calibration.calibrate.calibrate's arguments, on this store)."""
    require_operator("store calibrations")
    from backend.calibration.calibrate import calibrate as fit_and_store

    return fit_and_store(engine(), **kwargs)
