"""Run detail: spec and environment, measured vs predicted by rank and category, comm, loss, PP timeline, failures."""

from __future__ import annotations

import streamlit as st

from backend.number_format import fmt_frac
from backend.result import PARITY_FAILS, parity_failure_text, parity_verdict
from dashboard import access, store_access, trace_view
from dashboard import detail_view as dv
from dashboard import runs_view as rv
from dashboard import spec_form as sf
from dashboard import timeline_view as tv
from dashboard.import_view import banner as import_banner
from dashboard.theme import STATUS_ICON
from db.filters import id_in


def _selected_id(url: str) -> int | None:
    q = st.query_params.get("run")
    if q and (asked := id_in(q)) is not None:
        st.session_state["run_id"] = asked
    elif q:  # a typed or pasted address: an id too long for the store or not a number was a traceback
        st.warning("The address names no run id (`?run=` takes a run's number); pick a run below.")
    recent = store_access.list_runs(url, limit=200)
    if not recent and st.session_state.get("run_id") is None:
        return None
    options = [r["id"] for r in recent]
    current = st.session_state.get("run_id")
    if current is not None and current not in options:
        options.insert(0, current)
    labels = {r["id"]: rv.run_label(r) for r in recent}
    idx = options.index(current) if current in options else 0
    rid = st.selectbox("Run", options, index=idx, format_func=lambda i: labels.get(i, f"#{i}"),
                       key=f"detail_pick_{current}")
    if rid != current:
        st.session_state["run_id"] = rid
    st.query_params["run"] = str(rid)
    return rid


@st.fragment(run_every=2.0)
def _live(url: str, rid: int) -> None:
    if store_access.status_now(url, rid) not in rv.ACTIVE:
        store_access.changed()  # the picker's label and the page must not show the cached 'running'
        st.rerun(scope="app")
    e = store_access.get_run(url, rid)
    if e is None:
        st.rerun(scope="app")
    st.progress(rv.progress_fraction(e) or 0.0, text=f"{STATUS_ICON.get(e['status'], '')} {e['status']}")
    st.text(rv.progress_text(e))  # a rank's or SLURM's words: plain text


def _failure(e: dict) -> None:
    res = e.get("result")
    st.error(f"**{e['status']}**")
    st.text(e.get("error") or (res.error if res else "") or "no error message recorded")
    rank = e.get("failing_rank") if e.get("failing_rank") is not None else (res.failing_rank if res else None)
    if rank is not None:
        st.markdown(f"Failing rank: **{rank}**")
    tb = e.get("traceback") or (res.traceback if res else None)
    if tb:
        with st.expander("Traceback of the failing rank", expanded=True):
            st.code(tb, language="python")
    from backend.run_folders import default_runs_dir

    tail, where = dv.log_tail_of(e, default_runs_dir(store_access.engine()))
    with st.expander("Log tail", expanded=not tb):
        if tail:
            st.caption(where)
            st.code(tail, language="text")
        else:
            st.text(f"No log output: {where}. The job printed nothing before it ended (or never launched).")


def _timeline(res) -> None:
    p = res.spec.parallel
    if p.pp <= 1:
        return
    st.subheader("Pipeline timeline")
    measured = tv.normalize(res.timeline) if res.timeline else []
    ideal = tv.ideal_events(measured or None, schedule=str(p.pp_schedule), p=p.pp, m=res.spec.train.microbatches or 1)
    c1, c2, c3 = st.columns(3)
    c1.metric("bubble measured", fmt_frac(res.bubble_measured if res.bubble_measured is not None
                                          else tv.bubble_of(measured)))
    c2.metric("bubble predicted (formula)", fmt_frac(res.bubble_predicted))
    c3.metric("bubble of the ideal replay", fmt_frac(tv.bubble_of(ideal)))
    left, right = st.columns(2)
    if measured:
        left.plotly_chart(tv.gantt_fig(measured, title=f"Measured: {p.pp_schedule}, p={p.pp}, "
                                                       f"m={res.spec.train.microbatches}"), key="gantt_measured")
    else:
        left.info("This run recorded no per-microbatch timeline.")
    right.plotly_chart(tv.gantt_fig(ideal, title="Ideal schedule (unit costs F=1, B=2; dependencies only)",
                                    time_unit="units"), key="gantt_ideal")


def _step_prediction(res) -> None:
    from dashboard import steptime_view

    try:
        pred, why = steptime_view.run_comparison(res, store_access.engine())
    except Exception as e:  # noqa: BLE001 - the run page still renders
        pred, why = None, f"the step-time model failed: {e}"
    if pred is None:
        st.text(f"No step-time comparison: {why}")
        return
    c1, c2, c3 = st.columns(3)
    c1.metric("step time measured (min over steps)", f"{pred['measured_s']:.3f} s")
    c2.metric("step time predicted", f"{pred['predicted_s']:.3f} s", f"{pred['error_pct']:+.1f}% vs measured",
              delta_color="off")
    c3.metric("prediction interval", f"{pred['low_s']:.3f} – {pred['high_s']:.3f} s",
              "measured inside" if pred["inside"] else "measured outside",
              delta_color="normal" if pred["inside"] else "inverse")
    cal = (f"calibration {pred['calibration']}" if pred["calibration"]
           else "no calibration yet (`python -m backend calibrate`): ±20% band")
    st.caption(f"Step-time model on the '{pred['hardware']}' profile, {cal}."
               + (" Extrapolation: " + "; ".join(pred["extrapolation"]) if pred["extrapolation"] else ""))


def _imported(res, rid: int) -> None:
    """Issue 25: a run measured elsewhere (its framework's log) against ShardLab's predictions."""
    from dashboard import import_view as iv

    f = res.imported
    head = {"step time measured (median)": f"{res.step_s_median:.3f} s", "tokens / s": f"{res.tokens_per_s:,.0f}",
            "MFU (ShardLab)": "–" if res.mfu is None else f"{res.mfu:.1%}"}
    for col, (k, v) in zip(st.columns(3), head.items(), strict=False):
        col.metric(k, v)
    st.subheader("Step time: predicted vs measured")
    try:
        cmp, why = iv.step_comparison(res, store_access.engine(), rid)
    except Exception as e:  # noqa: BLE001 - the page still renders
        cmp, why = None, f"the step-time model failed: {e}"
    if cmp is None:
        st.text(f"No step-time comparison: {why}")
    else:
        c1, c2, c3 = st.columns(3)
        c1.metric("measured (median after warm-up)", f"{cmp['measured_s']:.3f} s")
        c2.metric("predicted", f"{cmp['predicted_s']:.3f} s", f"{cmp['error_pct']:+.1f}% vs measured",
                  delta_color="off")
        c3.metric("prediction interval", f"{cmp['low_s']:.3f} – {cmp['high_s']:.3f} s",
                  "measured inside" if cmp["inside"] else "measured outside",
                  delta_color="normal" if cmp["inside"] else "inverse")
        st.plotly_chart(iv.step_fig(cmp), key="imp_step")
        if cmp["calibration"]:
            mape = "–" if cmp["loo_mape"] is None else f"{cmp['loo_mape']:.1f}%"
            st.caption(f"Profile '{cmp['hardware']}' with calibration {cmp['calibration']}"
                       + (f" ('{cmp['calibration_name']}')" if cmp["calibration_name"] else "")
                       + f", leave-one-out error {mape}" + (" — this run is in that calibration's fit set, so the "
                                                            "comparison is in-sample" if cmp["in_fit"] else "") + ".")
        else:
            st.caption(f"Profile '{cmp['hardware']}', uncalibrated (±20% band): `python -m backend calibrate` fits "
                       "one.")
        for x in cmp["extrapolation"]:
            st.caption(f"Extrapolation: {x}")
    st.subheader("Memory: predicted categories beside the log's peaks")
    st.caption(iv.MEMORY_LABEL)
    st.dataframe(iv.memory_frame(res), hide_index=True, width="stretch", placeholder="–", column_config={
        c: st.column_config.NumberColumn(c, format="%.2f" if "%" not in c else "%+.1f")
        for c in iv.memory_frame(res).columns
        if c != "rank"})
    for line in iv.facts_lines(res):
        st.text(line)
    if f.unmapped:
        st.markdown("**Config fields the prediction ignores** (the spec cannot hold them)")
        st.dataframe(iv.fields_frame(f.unmapped), hide_index=True, width="stretch")
    with st.expander(f"Config fields ignored ({len(f.ignored)}): no effect on memory or step time"):
        st.dataframe(iv.fields_frame(f.ignored), hide_index=True, width="stretch")
    lf = dv.loss_fig(res)
    if lf is not None:
        st.plotly_chart(lf, key="imp_loss")
    for n in res.notes:
        st.text(f"ⓘ {n}")


def _result(res) -> None:
    if not res.loss and not dv.measured_anything(res):
        if res.per_rank:  # a run that failed before measuring: its prediction is kept, nothing to compare it with
            st.caption("Nothing was measured before the run ended, so there is no measured-vs-predicted comparison; "
                       "the prediction is kept in result.json below.")
        return
    head = dv.headline(res)
    cols = [c for _ in range(-(-len(head) // 3)) for c in st.columns(3)]  # rows of 3 (fp16 runs add one metric)
    for col, (k, v) in zip(cols, head.items(), strict=False):
        col.metric(k, v, help=dv.HEADLINE_HELP.get(k))
    _step_prediction(res)
    if res.per_rank:
        st.plotly_chart(dv.measured_vs_predicted_fig(res), key="mvp")
        st.markdown("**Error per category** — (measured − predicted) / predicted")
        st.dataframe(dv.memory_error_frame(res), hide_index=True, width="stretch")
        _framework_panels(res)
        routing = dv.routing_frame(res)
        if not routing.empty:
            st.markdown("**Expert routing** — the uniform-routing formula vs the same formula fed the token counts "
                        "this run's router produced (backend/analytic/measured/moe_routing.py)")
            st.dataframe(routing, hide_index=True, width="stretch")
        st.subheader("Communication per step")
        comm = dv.comm_frame(res)
        if comm.empty:
            st.caption("No collectives were counted (single rank).")
        else:
            st.dataframe(comm, hide_index=True, width="stretch", placeholder="–")
            st.caption(dv.comm_caption(res))
    c1, c2 = st.columns(2)
    lf, sf_ = dv.loss_fig(res), dv.step_time_fig(res)
    if lf is not None:
        c1.plotly_chart(lf, key="loss")
    if sf_ is not None:
        c2.plotly_chart(sf_, key="steps")
    _timeline(res)
    for n in res.notes:
        st.text(f"ⓘ {n}")


def _framework_panels(res) -> None:
    """Issue 14: the framework's own estimate, model states for its layout, offload split, XLA collectives."""
    from dashboard import framework_view as fv

    ms = fv.model_state_frame(res)
    if not ms.empty:
        st.markdown("**Model states** — resident after the step, measured vs ShardLab's prediction for the "
                    f"framework's layout, with {fv.ESTIMATE_COLUMN} as an extra column")
        st.dataframe(ms, hide_index=True, width="stretch")
    off = fv.offload_frame(res)
    if not off.empty:
        st.markdown("**CPU offload** — host- vs device-resident bytes at the activation peak")
        st.dataframe(off, hide_index=True, width="stretch")
    xla = fv.xla_collectives_frame(res)
    if not xla.empty:
        st.markdown("**XLA collectives** — from the compiled HLO")
        st.dataframe(xla, hide_index=True, width="stretch")
    cfg = (res.framework_facts or {}).get("ds_config")
    if cfg:
        with st.expander("ds_config this run used"):
            st.json(cfg)


st.title("Run detail")
url = store_access.db_url()
rid = _selected_id(url)
if rid is None:
    st.info("No runs yet. Submit one on the **New experiment** page; its measurements appear here.")
    st.page_link("dashboard/pages/new_experiment.py", label="New experiment", icon=":material/science:")
    st.stop()
e = store_access.get_run(url, rid)
if e is None:
    st.warning(f"Run #{rid} does not exist (deleted?). Pick another run above.")
    st.stop()
spec, res = e["spec"], e.get("result")
# User text (name, tags, errors, notes) goes into st.text: markdown would render a name's ![image](url) (the browser
# fetches it) and turn any URL into a link, even backslash-escaped (issue 21).
precision = str(spec.train.precision) if spec is not None else e.get("precision")
parity = parity_verdict(precision, res.loss_max_abs_diff) if res is not None else None
icon = ":material/warning:" if parity == PARITY_FAILS else STATUS_ICON.get(e["status"], "")
st.markdown(f"### {icon} #{rid}")
if parity == PARITY_FAILS:  # a wrong training step is not "ok": said at the top, not only in a note at the bottom
    st.warning(parity_failure_text(precision, res.loss_max_abs_diff), icon=":material/warning:")
if e.get("name"):
    st.text(e["name"])
if spec is not None:
    st.caption(sf.describe(spec))
else:
    st.error("This run's spec cannot be read by this version; the run is kept, with its spec as stored below.",
             icon=":material/error:")
    st.text(e["spec_error"])
if e.get("tags"):
    st.text("tags: " + ", ".join(e["tags"]))
if e["status"] in rv.ACTIVE:
    _live(url, rid)
    read_only = access.read_only_reason(access.visitor())
    if st.button("Cancel this run", icon=":material/cancel:", key="detail_cancel", disabled=bool(read_only),
                 help=read_only):
        st.toast(f"#{rid}: {store_access.cancel([rid])[rid]}")
elif e["status"] != "ok":
    _failure(e)
if e.get("result_error"):
    st.error("This run's stored result cannot be shown; the run is kept, with its spec below.", icon=":material/error:")
    st.text(e["result_error"])
if res is not None and (where := res.divergence()) is not None:
    st.warning(f"Diverged: {where}. Memory and step time were measured as usual; the loss chart has gaps where the "
               "loss is not a number.", icon=":material/trending_up:")
if res is not None and (line := trace_view.banner(res)):
    st.info(line, icon=":material/memory:")
if res is not None and getattr(res, "imported", None) is not None:
    st.info(f"Imported run ({res.imported.framework}): measured on another cluster, read from its log; the numbers "
            "below compare it with ShardLab's prediction.", icon=":material/upload_file:")
    st.text(import_banner(res))  # file and device names are the user's text: shown, never rendered
    _imported(res, rid)
elif res is not None and e["status"] not in rv.ACTIVE:
    _result(res)
with st.expander("Spec"):
    st.json(spec.model_dump(mode="json")) if spec is not None else st.text(e.get("spec_json") or "")
with st.expander("Environment"):
    env = res.env if res is not None and res.env else e.get("env") or {}
    st.json(env) if env else st.caption("No environment recorded yet.")
if res is not None:
    st.download_button("result.json", icon=":material/download:", data=res.to_json(),
                       file_name=f"shardlab_run_{rid}.json", mime="application/json", key="dl_result")
