"""Compare: runs side by side, and scaling with world size (measured points over analytic curves)."""

from __future__ import annotations

import streamlit as st

from dashboard import compare_view as cv
from dashboard import runs_view as rv
from dashboard import selection, store_access

st.title("Compare runs")
url = store_access.db_url()
recent = store_access.list_runs(url, limit=cv.RECENT_RUNS)
if store_access.count_runs(url) < 2:
    st.info("Comparing needs at least two runs. Submit a sweep on **New experiment** (e.g. ddp, zero1, zero2, zero3 at "
            "world 2 and 4).")
    st.page_link("dashboard/pages/new_experiment.py", label="New experiment", icon=":material/science:")
    st.stop()
labels = {r["id"]: rv.run_label(r) for r in recent}
if "compare_ids" in st.session_state:  # from the Runs page: those ids, whether or not they are among the recent ones
    st.session_state["compare_pick"] = st.session_state.pop("compare_ids")
if "compare_pick" not in st.session_state:
    st.session_state["compare_pick"] = [r["id"] for r in recent if r["status"] == "ok"][:4]
chosen = {i: store_access.get_run(url, i) for i in st.session_state["compare_pick"] if i not in labels}
labels.update({i: rv.run_label(e) for i, e in chosen.items() if e is not None})
kept, gone = selection.split_in_view(st.session_state["compare_pick"], labels)
st.session_state["compare_pick"] = kept
if gone:
    st.warning(selection.dropped_message(gone, "no such run (deleted?)"))
ids = st.multiselect("Runs to compare", list(labels), key="compare_pick", format_func=labels.get)
if len(ids) < 2:
    st.info("Pick two or more runs.")
    st.stop()
runs = [e for e in (store_access.get_run(url, i) for i in ids) if e is not None]
if unread := [f"#{e['id']}: {e['spec_error']}" for e in runs if e["spec"] is None]:
    st.warning("Left out, their specs cannot be read by this version: " + "; ".join(unread))
    runs = [e for e in runs if e["spec"] is not None]
df = cv.compare_frame(runs)
st.markdown("**Side by side** — cells that differ from the first run are highlighted")
st.dataframe(df.style.apply(lambda _: cv.highlight_differences(df), axis=None), width="stretch",
             height=35 * (len(df) + 1) + 3,
             placeholder="–", column_config={"_index": st.column_config.TextColumn("property", width="large")})
ok = [e for e in runs if e.get("result") is not None and e["status"] == "ok"]
if not ok:
    st.info("None of these runs has finished successfully yet: scaling plots appear once they have measurements.")
    st.stop()
c1, c2 = st.columns(2)
try:
    c1.plotly_chart(cv.memory_scaling_fig(runs), key="cmp_mem")
except Exception as e:  # noqa: BLE001
    c1.error(f"Memory scaling plot failed: {e}")
c2.plotly_chart(cv.throughput_fig(runs), key="cmp_tput")
st.caption("Dashed curves: the analytic model for the same model shape and per-rank batch at other world sizes. "
           "Filled markers: measured memory of the fullest rank of each selected run (hover for the run id).")

# Issue 14: same model, same strategy, three frameworks.
fw_runs = [(e["id"], e["result"]) for e in ok]
if len({str(r.spec.framework) for _, r in fw_runs}) > 1:
    from dashboard import framework_view as fv

    st.subheader("Frameworks side by side")
    if (why := fv.same_model_and_strategy(fw_runs)) is not None:
        st.warning(why)
    st.plotly_chart(fv.three_frameworks_fig(fw_runs), key="cmp_frameworks")
    st.dataframe(fv.three_frameworks_frame(fw_runs), width="stretch")
    st.caption("JAX step time is the whole process (N virtual devices on this host's cores); its activations are XLA's "
               "temp buffer (activations + gradients + workspace). DeepSpeed and torch are per rank over gloo.")
