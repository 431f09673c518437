"""Runs: the history of experiments, live progress, and actions on the selected runs."""

from __future__ import annotations

import streamlit as st

from backend.result import Status
from backend.spec import Framework, Strategy
from dashboard import access, messages, selection, store_access
from dashboard import runs_view as rv
from db import export

ORDER = {"created": "created_at", "id": "id", "status": "status", "strategy": "strategy", "world size": "world_size",
         "step time": "step_s_median", "tokens/s": "tokens_per_s", "peak memory": "peak_bytes_max"}
PAGE_SIZES = (200, 1000, 10000)
PICKER_ROWS = 200


def _labels(df, ids: list[int]) -> dict[int, str]:
    """Picker labels for just these ids (a pandas row lookup per option costs ~1 ms each)."""
    sub = df[df["id"].isin(ids)]
    return {int(i): f"#{i} {n or s} · world {w} · {st}"
            for i, n, s, w, st in zip(sub["id"], sub["name"], sub["strategy"], sub["world"], sub["status"],
                                      strict=False)}


def _filters() -> dict:
    c1, c2, c3, c4 = st.columns([2, 2, 2, 2])
    status = c1.multiselect("Status", [s.value for s in Status], key="runs_status")
    strategy = c2.multiselect("Strategy", [s.value for s in Strategy], key="runs_strategy")
    tag = c3.text_input("Tag", key="runs_tag", placeholder="exact tag")
    search = c4.text_input("Search", key="runs_search", placeholder="name, error, tag or id")
    c1, c2, c3, c4 = st.columns([2, 1, 1, 2])
    framework = c4.multiselect("Framework", [f.value for f in Framework], key="runs_framework")
    order = c1.selectbox("Sort by", list(ORDER), key="runs_order")
    desc = c2.toggle("Descending", value=True, key="runs_desc")
    size = c3.selectbox("Rows", PAGE_SIZES, key="runs_page_size")
    return dict(status=tuple(status), strategy=tuple(strategy), tag=tag.strip() or None, search=search.strip() or None,
                order_by=ORDER[order], descending=desc, limit=size, framework=tuple(framework))


@st.fragment(run_every=2.0)
def _live_progress(url: str, active_ids: list[int]) -> None:
    """Progress bars of queued/running runs, refreshed every 2 s; a finished run reloads the whole page."""
    rows = store_access.list_runs(url, status=("queued", "running"), limit=50)
    if {r["id"] for r in rows} != set(active_ids):
        store_access.changed()  # the table below must not show the cached 'running' of a run that ended
        st.rerun(scope="app")
    for r in rows:  # a progress bar's text is markdown: the name and a rank's or SLURM's words go to st.text
        st.text(f"#{r['id']} {r.get('name') or r['strategy']} (world {r['world_size']}): {rv.progress_text(r)}")
        st.progress(rv.progress_fraction(r) or 0.0)


def _actions(url: str, selected: list[int], rows_by_id: dict[int, dict]) -> None:
    ro = access.read_only_reason(access.visitor())  # a hint; store_access refuses a viewer's write whatever asks
    c1, c2, c3, c4, c5 = st.columns(5)
    if c1.button("Open detail", icon=":material/search:", disabled=len(selected) != 1, key="act_open"):
        st.session_state["run_id"] = selected[0]
        st.switch_page("dashboard/pages/run_detail.py", query_params={"run": str(selected[0])})
    if c2.button("Compare", icon=":material/bar_chart:", disabled=len(selected) < 2, key="act_compare"):
        st.session_state["compare_ids"] = list(selected)
        st.switch_page("dashboard/pages/compare.py")
    if c3.button("Cancel", icon=":material/cancel:",
                 disabled=bool(ro) or not any(rows_by_id[i]["status"] in rv.ACTIVE for i in selected),
                 key="act_cancel", help=ro):
        out = store_access.cancel([i for i in selected if rows_by_id[i]["status"] in rv.ACTIVE])
        st.toast("; ".join(f"#{i}: {s}" for i, s in out.items()))
    if c4.button("Re-run", icon=":material/replay:", disabled=bool(ro) or not selected, key="act_rerun",
                 help=ro or "queue the same spec again as a new run"):
        done, errs = store_access.requeue(selected)
        if done:
            st.toast(f"Queued {', '.join(f'#{d}' for d in done)}")
        if errs:
            messages.box("warning", "Not queued again:", errs)
    if c5.button("Edit as new", icon=":material/edit:", disabled=len(selected) != 1, key="act_clone",
                 help="load the spec into the New-experiment form"):
        run = store_access.get_run(url, selected[0])
        if run is None or run["spec"] is None:  # before, the form opened unchanged, without a word
            messages.box("warning", f"Run #{selected[0]} cannot be loaded into the form:",
                         [run["spec_error"] if run else "it no longer exists (deleted?)"])
        else:
            st.session_state["clone_spec"] = run["spec"]
            st.switch_page("dashboard/pages/new_experiment.py")
    c1, c2 = st.columns([3, 2])
    tags = c1.text_input("Set tags on the selected runs (comma-separated; replaces their tags)", key="act_tags")
    if c1.button("Apply tags", icon=":material/sell:", disabled=bool(ro) or not selected, key="act_tag_apply", help=ro):
        store_access.set_tags(selected, tags)
        st.rerun()
    if st.session_state.get("_act_delete_for") != selected:  # a confirmation holds for the runs it was given for:
        st.session_state["act_delete_confirm"] = False  # before, it stayed ticked for the next selection and delete
    st.session_state["_act_delete_for"] = list(selected)
    confirm = c2.checkbox("Yes, delete the selected runs", key="act_delete_confirm")
    if c2.button("Delete", icon=":material/delete:", disabled=bool(ro) or not (selected and confirm), key="act_delete",
                 help=ro):
        if errs := store_access.delete(selected):
            messages.box("warning", "Not deleted:", errs)
        st.session_state.pop("runs_selected", None)
        store_access.changed()
        st.rerun()


st.title("Runs")
url = store_access.db_url()
f = _filters()
total = store_access.count_runs(url, status=f["status"], strategy=f["strategy"], tag=f["tag"], search=f["search"],
                         framework=f["framework"])
pages = max(1, -(-total // f["limit"]))
page = st.number_input(f"Page (of {pages})", 1, pages, 1, key="runs_page") if pages > 1 else 1
df = store_access.runs_table(url, **f, offset=(page - 1) * f["limit"])
active = store_access.list_runs(url, status=("queued", "running"), limit=50)
if active:
    st.subheader("In progress")
    _live_progress(url, [r["id"] for r in active])
if df.empty:
    if total == 0 and not any([f["status"], f["strategy"], f["tag"], f["search"], f["framework"]]):
        st.info("No runs yet. Design one on the **New experiment** page and press *Run this experiment*.")
        st.page_link("dashboard/pages/new_experiment.py", label="New experiment", icon=":material/science:")
    else:
        st.info("No run matches these filters. Clear a filter to see more.")
    st.stop()
st.caption(f"Showing {len(df)} of {total} runs. Click rows to select them (or use the picker below), then act on them.")
ids_in_view = [int(i) for i in df["id"]]
table_key = selection.view_key("runs_table", ids_in_view)  # a new view is a new widget: positions never re-point
event = st.dataframe(df, hide_index=True, width="stretch", on_select="rerun", selection_mode="multi-row", key=table_key,
                     placeholder="–",  # not measured (yet): a dash, not "None"
                     column_config={"id": st.column_config.NumberColumn("id", format="%d")})
by_id = df.set_index("id", drop=False)
picked = selection.picked_ids(event.selection.rows if event and event.selection else [], ids_in_view)
last_key, last_pick = st.session_state.get("_runs_last_pick", (None, []))
if table_key == last_key and picked != last_pick:  # a click in this same view: the table's ticks are the selection
    st.session_state["runs_selected"] = picked
st.session_state["_runs_last_pick"] = (table_key, picked)
kept, dropped = selection.split_in_view(st.session_state.get("runs_selected", []), ids_in_view)
st.session_state["runs_selected"] = kept
if dropped:
    st.warning(selection.dropped_message(dropped, "not in this view (filter, sort or page changed); actions apply only "
                                                  "to the runs listed under Selected runs"),
               icon=":material/filter_alt:")
# The picker offers the selected runs and the first rows of this view (a 10,000-option widget would be slow).
options = list(dict.fromkeys(st.session_state["runs_selected"] + df["id"].head(PICKER_ROWS).tolist()))
labels = _labels(df, options)
selected = st.multiselect("Selected runs", options, key="runs_selected", format_func=lambda i: labels.get(i, f"#{i}"))
_actions(url, selected, {i: {"status": by_id.at[i, "status"]} for i in selected})
c1, c2 = st.columns(2)
filters = dict(status=list(f["status"]) or None, strategy=list(f["strategy"]) or None, tag=f["tag"], search=f["search"],
               framework=list(f["framework"]) or None)
c1.download_button("CSV of this filtered view", icon=":material/download:",
                   data=lambda: export.export_csv(store_access.engine(), **filters),
                   file_name="shardlab_runs.csv", mime="text/csv", key="dl_csv",
                   help="one row per run: measured and predicted bytes per category, comm, timing")
c2.download_button("JSON of this filtered view", icon=":material/download:",
                   data=lambda: export.export_json(store_access.engine(), **filters),
                   file_name="shardlab_runs.json", mime="application/json", key="dl_json",
                   help="full spec and result of every run")
