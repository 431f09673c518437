"""ShardLab dashboard entry point: `streamlit run app.py` (see `make run`)."""

from __future__ import annotations

import streamlit as st

from dashboard import access, store_access, worker_ctl

st.set_page_config(page_title="ShardLab", page_icon=":material/grid_view:", layout="wide")
access.guard_bind()
visitor = access.gate()  # every page: log in, then only the [access] list's users (dashboard/access.py)

# In the workflow's order (dashboard/workflow.py: Plan -> New experiment -> Run -> Compare); New experiment stays home.
PAGES = [
    st.Page("dashboard/pages/plan.py", title="Plan", icon=":material/travel_explore:", url_path="plan"),
    st.Page("dashboard/pages/new_experiment.py", title="New experiment", icon=":material/science:", url_path="home",
            default=True),
    st.Page("dashboard/pages/runs.py", title="Runs", icon=":material/list:", url_path="runs"),
    st.Page("dashboard/pages/run_detail.py", title="Run detail", icon=":material/search:", url_path="detail"),
    st.Page("dashboard/pages/compare.py", title="Compare", icon=":material/bar_chart:", url_path="compare"),
    st.Page("dashboard/pages/formulas.py", title="Formulas", icon=":material/functions:", url_path="formulas"),
    # The default page is served at "/" whatever its url_path, so a bookmarked /new needs its own (hidden) entry.
    st.Page("dashboard/pages/new_experiment.py", title="New experiment", icon=":material/science:", url_path="new",
            visibility="hidden"),
]
# Page files live in dashboard/pages/, not pages/: Streamlit treats a pages/ directory next to the entry script as
# legacy multipage navigation and serves a bookmarked /runs from it alone, before app.py (and this st.navigation)
# ever ran.
nav = st.navigation(PAGES)
if (store_problem := store_access.problem()) is not None:  # a bad URL, folder or missing file: words, no traceback
    st.error(f"The experiment store cannot be used: {store_problem}", icon=":material/database:")
    st.caption(f"Store: `{store_access.db_url_shown()}`")
    st.stop()

WORKER_REFRESH_S = 5.0


def _worker_status() -> worker_ctl.WorkerStatus:
    try:
        status = worker_ctl.ensure_worker(store_access.engine(), store_access.db_url())
        if status.started_now:
            st.toast("Started a background worker for queued runs")
    except Exception as e:  # noqa: BLE001 - the sidebar reports it; pages still render
        status = worker_ctl.WorkerStatus(False, f"worker check failed: {e}")
    return status


def _active_runs() -> bool:
    return bool(store_access.list_runs(store_access.db_url(), status=("queued", "running"), limit=1))


def _worker_panel(active: bool) -> None:
    """The worker's state (idle, running #N). While a run is queued or running it is re-read every few seconds; when
    the last one ends the whole page reruns once, and the badge stops re-running: an idle tab costs nothing (issue
    30: a 5 s timer on every page kept the server at 7.8% of a core). Any click re-reads it."""
    if active and not _active_runs():
        st.rerun(scope="app")  # the last run ended: render the page again, without the timer
    ws = _worker_status()
    if ws.alive:
        st.success(f"Worker: {ws.detail}", icon=":material/settings:")
    else:
        st.warning("No worker running: queued runs wait. Start one with `make worker`.", icon=":material/settings:")
        st.caption(ws.detail)


with st.sidebar:
    st.markdown("### ShardLab")
    st.caption("Measure and predict sharded training: DDP, ZeRO, FSDP, TP, PP, EP on real torch.distributed ranks.")
    busy = _active_runs()
    st.fragment(_worker_panel, run_every=WORKER_REFRESH_S if busy else None)(busy)
    if visitor.how != "local":
        st.text(f"Signed in: {visitor.label()}")  # the identity provider's text: plain
        if visitor.how == "oidc":
            st.button("Log out", on_click=st.logout, key="logout")
    st.caption(f"Database: `{store_access.db_url_shown()}`")

nav.run()
