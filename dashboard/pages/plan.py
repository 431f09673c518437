"""Plan: which layout for this model on this cluster? Searches the parallel layouts, keeps what fits, ranks them
by predicted step time (backend/planner; `python -m backend plan` is the scriptable twin)."""

from __future__ import annotations

import streamlit as st

from dashboard import access, import_box, messages, stack_form, store_access
from dashboard import plan_view as pv
from dashboard import spec_form as sf

DEFAULTS = {"pl_source": "preset", "pl_seq": 4096, "pl_preset": sf.preset_label("llama-3-70b"), "pl_hw": "h100-sxm",
            "pl_gpus": 64, "pl_node": 8, "pl_batch": 256, "pl_mem": 0.0, "pl_top": 15,
            "pl_attention": pv.DEFAULT_KERNEL,
            "pl_precision": "bf16-mixed", "pl_predicted": False, "pl_reserve": None, "pl_slack": pv.DEFAULT_SLACK}
# Streamlit drops a page's widget values when another page runs, while the results stay in session state: restore
# the inputs that go with them, so coming back shows both (an uploaded config.json cannot be restored; the
# results then say what they were for).
for k, v in DEFAULTS.items():
    st.session_state[k] = st.session_state.get(k, st.session_state.get("pl_saved", {}).get(k, v))

def _plan_columns() -> dict:
    """Number formats (no raw floats) and a plain-words tooltip on every column that needs one."""
    from dashboard.glossary import HELP

    formats = {"memory GiB": "%.1f", "needs GiB": "%.1f", "step s": "%.3f", "step s (low)": "%.3f",
               "step s (high)": "%.3f", "tokens/s": "localized", "TFLOP/s per GPU": "%.0f", "MFU %": "%.1f",
               "dropped %": "%.1f"}
    cols = {k: st.column_config.NumberColumn(k, format=f, help=HELP.get(k)) for k, f in formats.items()}
    cols.update({k: st.column_config.Column(k, help=HELP[k])
                 for k in ("fullest at", "schedule", "virtual stages", "sequence parallel", "runs", "extrapolation",
                           "capacity factor")})
    return cols


def _verifying(tag: str) -> bool:
    """A verification run of this layout is still queued or running."""
    return bool(store_access.list_runs(store_access.db_url(), status=("queued", "running"), tag=tag, limit=1))


def _verify_table(tag: str, active: bool) -> None:
    """The verification runs of the verified layout, re-read every 2 s while one is queued or running (a run goes
    queued -> running -> ok here, no click); once they have ended the page reruns once and nothing re-runs while
    idle."""
    from backend.bench import cpu_profile

    if active and not _verifying(tag):
        store_access.changed()
        st.rerun(scope="app")

    df = pv.verify_frame(store_access.engine(), tag)
    st.dataframe(df, hide_index=True, placeholder="–", column_config={
        "measured s": st.column_config.NumberColumn(format="%.3f"),
        "predicted s": st.column_config.NumberColumn(format="%.3f"),
        "error %": st.column_config.NumberColumn(format="%+.1f")})
    if not cpu_profile.exists():
        st.caption(cpu_profile.MISSING)


def _load_imported(imported) -> None:
    """The Import box's button callback: the imported model, GPUs, batch and sequence length become the search's
    inputs."""
    spec = imported.spec
    values = {"pl_source": "imported config", "pl_seq": spec["model"]["seq_len"], "pl_gpus": imported.gpus or
              spec["parallel"]["world_size"], "pl_batch": spec["train"]["global_batch"],
              "pl_precision": str(spec["train"].get("precision") or "bf16-mixed")}
    st.session_state.update(values)
    st.session_state["pl_saved"] = {**st.session_state.get("pl_saved", {}), **values}
    # its training settings too (planner/held.py): precision (the select above, preset to it), recompute policy, fp8
    st.session_state["pl_imported"] = (dict(spec["model"]), imported.framework, spec["name"], dict(spec["train"]))
    # and its stack with the settings it states (issue 34): the Stack select and its settings, preset to them
    from backend.spec.train_spec import TrainSpec

    st.session_state.update({STACK_KEY + k: v for k, v in stack_form.to_form(TrainSpec(**{
        k: v for k, v in spec["train"].items() if k in TrainSpec.model_fields})).items()})


STACK_KEY = "pl_stack_"

st.title("Plan")
st.caption("Search dp × tp × pp × ep × cp × ZeRO stage × micro-batch × recompute × schedule × virtual stages × SP on a "
           "cluster you describe; only layouts this engine runs are ranked unless you include the prediction-only "
           "ones.")

import_box.box("pl_", _load_imported, load_label="Plan this model")
c1, c2, c3 = st.columns(3)
sources = ["preset", "config.json"] + (["imported config"] if st.session_state.get("pl_imported") else [])
if st.session_state.get("pl_source") not in sources:
    st.session_state["pl_source"] = "preset"
source = c1.radio("Model", sources, horizontal=True, key="pl_source")
seq = c3.number_input("Sequence length", 1, 10_000_000, key="pl_seq")
model, problem, model_name = None, None, "config.json"
if source == "preset":
    name = model_name = c2.selectbox("Preset", list(sf.PRESETS), key="pl_preset")
    shape = {k: v for k, v in sf.PRESETS[name].items() if v or k not in sf.ZERO_MEANS_NONE}
    shape = {k: (None if k in ("n_kv_heads", "ffn_hidden") and not v else v) for k, v in shape.items()}
    try:
        model = pv.ModelSpec(**{**shape, "seq_len": seq})
    except ValueError as e:
        problem = str(e)
elif source == "imported config":
    shape, framework, model_name, imported_train = st.session_state["pl_imported"]
    c2.text(f"from the {framework} config: {model_name}")
    try:
        model = pv.ModelSpec(**{**shape, "seq_len": seq})
    except ValueError as e:
        problem = str(e)
else:
    up = c2.file_uploader("Hugging Face config.json", type=["json"], key="pl_cfg")
    if up is not None:
        model_name = up.name
        try:
            model = pv.model_from_config(up.getvalue(), seq)
        except ValueError as e:
            problem = str(e)

def _calibration_box() -> None:
    """Fit a profile of your cluster from tagged runs (imported and own): `python -m backend calibrate` on a button."""
    from backend.calibration.records import latest_named
    from dashboard import calibration_view as cv

    with st.expander("Calibrated profiles of your cluster (leave-one-out error)", expanded=False):
        engine = store_access.engine()
        df = cv.profiles_frame(engine)
        if df.empty:
            st.caption("None yet. Import runs (`python -m backend import-run --tag ourcluster ...`), then calibrate "
                       "below.")
        else:
            st.dataframe(df, hide_index=True, width="stretch", placeholder="–")
            pick = st.selectbox("Runs of profile", list(df["profile"]), key="pl_cal_pick")
            st.dataframe(cv.runs_frame(latest_named(engine, pick)), hide_index=True, width="stretch", placeholder="–")
        c1, c2, c3 = st.columns(3)
        tag = c1.text_input("Runs tagged", key="pl_cal_tag", placeholder="ourcluster")
        base = c2.selectbox("Device profile", [k for k in pv.hardware_options() if k != "cpu"] + ["cpu"],
                            key="pl_cal_hw")
        name = c3.text_input("Profile name", key="pl_cal_name", placeholder="h100-ourcluster")
        read_only = access.read_only_reason(access.visitor())
        if st.button("Calibrate", disabled=not tag or not name or bool(read_only), key="pl_cal_go",
                     icon=":material/tune:", help=read_only):
            with st.spinner("Fitting (a fit, then one refit per run left out)..."):
                try:
                    out = store_access.calibrate(hardware=base, tag=tag, name=name)
                except ValueError as e:
                    st.error("Nothing stored:")
                    st.text(str(e))
                else:
                    mape = "–" if out["loo_mape"] is None else f"{out['loo_mape']:.1f}%"
                    st.success(f"Calibration {out['id']} stored on {len(out['fit_runs'])} runs, leave-one-out error "
                               f"{mape}; pick it under Hardware.")
                    for n in out["notes"]:
                        st.text(n)


_calibration_box()
c1, c2, c3, c4, c5 = st.columns(5)
hw_options = pv.hardware_options(store_access.engine())
if st.session_state.get("pl_hw") not in hw_options:
    st.session_state["pl_hw"] = "h100-sxm"
hardware = c1.selectbox("Hardware", hw_options, key="pl_hw",
                        help="A published profile, or a calibrated profile of your cluster (`python -m backend "
                             "calibrate --name`, fitted on your imported and own runs)")
gpus = c2.number_input("GPUs", 1, 1_000_000, key="pl_gpus")
node = c3.number_input("GPUs per node", 1, 1024, key="pl_node")
batch = c4.number_input("Global batch (sequences)", 1, 100_000_000, key="pl_batch")
mem = c5.number_input("GPU memory, GB (0 = the profile's)", 0.0, 10_000.0, key="pl_mem",
                      help="Decimal GB (80 here = 74.5 GiB). 0 = the profile's figure, what CUDA "
                           "reports (an '80 GB' H100: 79.1 GiB). Every result on this page is in GiB.")
c1, c2 = st.columns(2)  # the fit rule's allowance, as `plan --reserve-gb / --fragmentation` override it
reserve = c1.number_input(pv.RESERVE_LABEL, value=None, step=0.5, format="%.2f", key="pl_reserve",
                          help="A fixed amount per GPU outside the tensors, in place of the CUDA context (527 MiB, "
                               "measured on the H200) and NCCL buffers (64 MiB per communicator): `plan --reserve-gb`.")
slack = c2.number_input(pv.SLACK_LABEL, step=0.01, format="%.3f", key="pl_slack",
                        help="The caching allocator's reserved - allocated, as a fraction of the fullest moment (0.13 "
                             "measured on the H200; 0.13 adds 13%): `plan --fragmentation`.")
allowance_problem = pv.allowance_check(hardware, memory_gb=mem or None, reserve_gb=reserve, fragmentation=slack,
                                       db_url=store_access.db_url())
c1, c2, c3 = st.columns([1, 1, 2])
kernel, kernel_why = pv.planned_kernel(model, hardware, st.session_state.get("pl_attention"), store_access.db_url())
attention = c1.selectbox("Attention kernel", pv.KERNEL_CHOICES, key="pl_attention",
                         format_func=lambda k: f"{kernel} (default)" if k == pv.DEFAULT_KERNEL else k,
                         help="Default: flash on a GPU profile (what GPU training runs; context parallelism is "
                              "searched with flash only, since ring attention merges flash blocks), the model's own "
                              "elsewhere or with attention sinks. math: the explicit softmax, its s x s scores saved.")
precision = c2.selectbox("Precision", pv.PRECISIONS, key="pl_precision",
                         help="What every layout trains in (fp8: float8 linears, bf16 elsewhere). A loaded config sets "
                              "it to its own.")
top = c3.slider("Layouts to show", 1, 50, key="pl_top")
capacity = None
if model is not None and model.is_moe:  # the capacity factors to search (`plan --capacity-factors`)
    options = pv.capacity_options(model)
    saved = st.session_state.get("pl_saved", {}).get("pl_capacity", [])  # restored as DEFAULTS' are
    picked = [f for f in st.session_state.get("pl_capacity", saved) if f in options]
    st.session_state["pl_capacity"] = picked or [model.capacity_factor]
    capacity = pv.capacity_choice(model, st.multiselect(
        "Capacity factors", options, key="pl_capacity", format_func=pv.capacity_label,
        help="MoE: the expert capacity factors to search (`plan --capacity-factors`); the model's own by default. A "
             "factor caps each expert's tokens per rank and drops the rest: a change to what the model learns, not "
             "only to its speed (the table shows each layout's factor and its predicted dropped share)."))
    own = (model_name, str(model.moe_dispatcher))  # another model (an imported flex config): its own dispatcher again
    if st.session_state.get("pl_dispatcher_of") != own:
        st.session_state["pl_dispatcher_of"], st.session_state["pl_dispatcher"] = own, own[1]
    saved = st.session_state.get("pl_saved", {}).get("pl_dispatcher")
    st.session_state["pl_dispatcher"] = st.session_state.get("pl_dispatcher", saved or own[1])
    model = pv.with_dispatcher(model, st.selectbox(
        "MoE dispatcher", pv.DISPATCHERS, key="pl_dispatcher",
        help="Megatron-Core's token dispatcher (`plan --moe-dispatcher`): alltoall sends the routed rows, allgather "
             "every token of the tp x ep group, flex (DeepEP / HybridEP) a token once per rank holding its experts "
             "and once per such node across nodes. This engine runs alltoall; the others are predicted only."))
stack_form.render(st, STACK_KEY)  # issue 34: every layout trains with this stack (its kernels and overlaps)
chosen = stack_form.to_spec(stack_form.read(st, STACK_KEY))
held = pv.held_training(precision, st.session_state["pl_imported"] if source == "imported config" else None)
held = held.with_stack(chosen.pop("stack"), chosen)
st.markdown(f"**Planned with {kernel} attention**")  # kernel: flash or math; the reasons below are plain text
st.text(f"{kernel_why[0].upper()}{kernel_why[1:]}. Every layout trains with {held.words()}.")
include_predicted = st.toggle("Include prediction-only layouts", key="pl_predicted",
                              help="Also rank layouts this machine's engine cannot run (each row says why); by default "
                                   "only layouts that train correctly here are ranked.")

st.session_state["pl_saved"] = {k: st.session_state[k] for k in DEFAULTS} | (
    {"pl_capacity": list(st.session_state["pl_capacity"])} if "pl_capacity" in st.session_state else {}) | (
    {"pl_dispatcher": st.session_state["pl_dispatcher"]} if "pl_dispatcher" in st.session_state else {})
inputs = pv.search_label(model_name, model, gpus=int(gpus), hardware=hardware, global_batch=int(batch),
                         memory_gb=mem or None) \
    + f", {kernel} attention, {held.words()}" + (" incl. prediction-only" if include_predicted else "") \
    + (f", reserve {reserve:g} GB per GPU" if reserve is not None else "") + f", allocator slack {slack:g}" \
    + (f", capacity factors {', '.join(map(pv.capacity_label, capacity))}" if capacity else "") \
    + (f", {model.moe_dispatcher} dispatcher" if model is not None and model.is_moe else "")
if problem:  # names the config's keys and values: the user's text
    messages.box("error", "This model cannot be planned:", [problem])
if allowance_problem:  # plan's own check and words (planner/allowance.py); may name a calibrated profile: user text
    messages.box("error", "These memory settings cannot describe a GPU:", [allowance_problem])
if st.button("Search", type="primary", disabled=model is None or bool(allowance_problem),
             icon=":material/travel_explore:", key="pl_go") and not allowance_problem:
    with st.spinner("Searching layouts..."):
        st.session_state["pl_result"] = pv.run_plan(model, gpus=int(gpus), gpus_per_node=int(node), hardware=hardware,
                                                    global_batch=int(batch), memory_gb=mem or None, top=int(top),
                                                    db_url=store_access.db_url(),
                                                    include_predicted=bool(include_predicted),
                                                    attention=None if attention == pv.DEFAULT_KERNEL else attention,
                                                    held=held, reserve_gb=reserve, fragmentation=slack,
                                                    capacity_factors=capacity)
        st.session_state["pl_result_for"] = inputs
        st.session_state["pl_result_hw"] = (hardware, int(node))
        st.session_state["pl_serial"] = st.session_state.get("pl_serial", 0) + 1

res = st.session_state.get("pl_result")
if res is not None:
    if st.session_state.get("pl_result_for") != inputs:
        messages.box("warning", "Press Search for the inputs above:",  # the label holds a file name: the user's text
                     [f"These results are for {st.session_state.get('pl_result_for')}."])
    used = getattr(res, "profile_used", None)
    if used is not None:
        (st.info if used["profile"]["calibration"] else st.caption)(used["line"][0].upper() + used["line"][1:] + ".")
    st.info(pv.planned_line(res))
    for line in pv.warning_notes(res):
        st.warning(line)
    st.write(f"Searched **{res.searched:,}** layouts in {res.seconds:.2f} s ({res.screened_per_s:,.0f}/s searched): "
             f"**{res.feasible:,}** fit (worst-rank memory of every layout); the {res.confirmed} fastest re-timed "
             "with the step-time model, the shown ones' memory confirmed with the exact estimator.")
    st.caption(pv.fit_rule_line(res))
    left_out = getattr(res, "predicted_only_left_out", 0)
    why_left_out = ", ".join(f"{label}: {n:,}" for label, n in getattr(res, "predicted_only_by_rule", {}).items())
    if left_out and res.configs:
        st.caption(f"{left_out:,} fitting layouts this engine cannot run are left out of the ranking ({why_left_out}); "
                   "turn on 'Include prediction-only layouts' to rank them too, marked.")
    if res.untimed:
        st.warning(f"None of the {res.feasible:,} layouts that fit can be ranked here: {res.untimed}.")
    elif not res.configs and left_out:
        st.warning(f"Every one of the {left_out:,} fitting layouts is prediction-only here ({why_left_out}): turn on "
                   "'Include prediction-only layouts' to rank them, marked with the reason.")
    elif not res.configs:
        st.warning(pv.nothing_ranked(res))
    else:
        df = pv.results_frame(res)
        if (why := pv.why_fastest(res)) is not None:
            st.markdown(why)
        # one widget per search: a row position is only read against the layouts it was ticked on
        event = st.dataframe(df, hide_index=True, on_select="rerun", selection_mode="single-row", placeholder="–",
                             key=f"pl_table_{st.session_state.get('pl_serial', 0)}", column_config=_plan_columns())
        rows = [i for i in (event.selection.rows if event and event.selection else []) if i < len(res.configs)]
        if note := pv.capacity_note(res):  # dropped tokens are a quality change: said under the table
            st.caption(note)
        if notes := pv.prediction_only_notes(res):
            with st.expander(f"Prediction only ({sum(n.count('#') for n in notes)} of {len(res.configs)} layouts): "
                             "this engine can predict them but not run them; why"):
                for note in notes:
                    st.caption(note)
        b1, b2 = st.columns(2)
        if b1.button("Open in New experiment", disabled=not rows, icon=":material/science:", key="pl_open",
                     help="load the selected layout into the New-experiment form (the form says if it can run here)"):
            st.session_state["clone_spec"] = pv.spec_for_form(res, rows[0])
            st.session_state["clone_hardware"] = st.session_state.get("pl_result_hw")  # its step time on the same GPUs
            st.switch_page("dashboard/pages/new_experiment.py")
        read_only = access.read_only_reason(access.visitor())
        if b2.button("Verify scaled-down", disabled=not rows or bool(read_only), icon=":material/fact_check:",
                     key="pl_verify",
                     help=read_only or "queue a scaled-down CPU run of the same parallel family (<= 4 ranks, small "
                                       "model) and compare its measured step time with the prediction"):
            scaled_down, why = pv.scaled_down_spec(res.configs[rows[0]])
            if scaled_down is None:
                st.error("This family cannot run on this machine: " + "; ".join(why))
            else:
                tag = pv.verify_tag(res.configs[rows[0]])
                eid = store_access.submit(scaled_down, tags=(tag, "verify-plan"))
                st.session_state["pl_verify_tag"] = tag
                st.success(f"Queued verification run #{eid} ({scaled_down.parallel.world_size} ranks), tag {tag}.")
        if st.session_state.get("pl_verify_tag"):
            st.markdown("**Scaled-down verification** (runs on CPU: measured vs predicted on the 'cpu' profile)")
            tag = st.session_state["pl_verify_tag"]
            active = _verifying(tag)
            st.fragment(_verify_table, run_every=2.0 if active else None)(tag, active)
        c1, c2 = st.columns(2)
        c1.plotly_chart(pv.pareto_fig(res), key="pl_pareto")
        c2.plotly_chart(pv.breakdown_fig(res), key="pl_breakdown")
    for n in pv.other_notes(res):
        st.caption(n)
