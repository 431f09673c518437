"""New experiment: design a spec, see the analytic prediction live, submit one run or a sweep."""

from __future__ import annotations

import json

import streamlit as st

from backend.analytic.units import GB
from backend.hf.config import HFConfigError, parse_hf_config
from backend.number_format import fmt_bytes_short
from backend.recompute_policy import WITH_LAYERS
from backend.spec import ExperimentSpec, dims
from backend.spec.checks import run_blockers
from dashboard import family_form, import_box, kept_fields, messages, run_panel, stack_form, store_access, workflow
from dashboard import predict_view as pv
from dashboard import spec_form as sf
from dashboard.glossary import HELP

P = "f_"  # widget key prefix


def _init_state() -> None:
    clone = st.session_state.pop("clone_spec", None)
    values = sf.spec_to_form(clone) if clone is not None else None
    for k, v in sf.default_form().items():
        if values is not None:
            st.session_state[P + k] = values[k]
        else:
            # Re-assigning keeps widget values when the user visits another page and comes back.
            st.session_state[P + k] = st.session_state.get(P + k, v)
    if clone is not None:
        st.toast("Loaded the spec into the form")  # not its name: a toast renders markdown, and names are user text
    hardware = st.session_state.pop("clone_hardware", None)  # from Plan: the step time on the planned GPUs
    if hardware:
        st.session_state[P + "step_hw"], st.session_state["step_gpn"] = hardware
    from dashboard.steptime_view import profile_options

    if st.session_state.get(P + "step_hw") not in profile_options():
        st.session_state[P + "step_hw"] = "cpu"
    st.session_state[P + "step_hw"] = st.session_state[P + "step_hw"]  # keeps it across page visits


def _apply_preset() -> None:
    label = st.session_state[P + "preset"]
    if label in sf.PRESETS:
        for k, v in sf.apply_preset(label).items():
            st.session_state[P + k] = v
        st.session_state[P + "kept"] = kept_fields.without(st.session_state.get(P + "kept"), "model")


def _apply_upload() -> None:
    up = st.session_state.get("hf_upload")
    if up is None:
        return
    try:
        values, notes = sf.apply_hf_config(parse_hf_config(up.getvalue(), name=up.name), file=up.name)
    except HFConfigError as e:  # names the refused, missing or unreadable field
        st.session_state["hf_error"], st.session_state["hf_notes"] = f"{up.name}: {e}", []
        return
    kept = kept_fields.without(st.session_state.get(P + "kept"), "model") | values.pop("kept")
    for k, v in values.items():
        st.session_state[P + k] = v
    st.session_state[P + "kept"] = kept
    st.session_state["hf_error"], st.session_state["hf_notes"] = None, notes


def _model_inputs() -> None:
    st.selectbox("Model preset", list(sf.PRESETS) + ["custom"], key=P + "preset", on_change=_apply_preset,
                 help="Published shapes count their published parameters exactly; edit any dimension below")
    st.file_uploader("…or a Hugging Face config.json (llama, mistral, mixtral, qwen2, qwen2_moe, gpt2, gpt_neox, "
                     "deepseek_v3, deepseek_v2, qwen3, qwen3_moe, gpt_oss, gemma3_text, llama4_text)",
                     type=["json"], key="hf_upload", on_change=_apply_upload)
    if st.session_state.get("hf_error"):  # the file's name and its keys: the user's text
        messages.box("error", "This config.json cannot be used:", [st.session_state["hf_error"]])
    for note in st.session_state.get("hf_notes") or []:
        messages.note(note)
    src = st.session_state.get(P + "source")
    if src:
        label = src.get("preset") or src.get("file") or "config.json"
        line = (f"Model source: {label}" + (" (edited)" if sf.model_source(_values()) != src else "")
                + " — stored with the run.")
        (st.caption if src.get("preset") else st.text)(line)  # an uploaded file's name is the user's text: plain
    st.toggle("Run it here (scaled down for CPU ranks)", key=P + "run_here",
              help="Off: the full model, for prediction. On: what this machine's CPU ranks will run: the same block "
                   "type (norm, MLP, positions, MoE), fewer and narrower layers.")
    if st.session_state[P + "run_here"]:
        st.caption("What runs here (the prediction and the run use this shape; the fields below keep the full size):")
        st.dataframe(sf.run_here_rows(_values()), hide_index=True, width="stretch")
        if note := sf.gqa_note(_values()):
            st.caption(note)
    with st.expander("Model family", expanded=False):
        c1, c2, c3 = st.columns(3)
        for col, k, label in ((c1, "norm", "norm"), (c2, "mlp", "MLP"), (c3, "positions", "positions"),
                              (c1, "bias", "biases"), (c2, "attention", "attention kernel")):
            col.selectbox(label, sf.FAMILY_CHOICES[k], key=P + k)
        c3.checkbox("tied embeddings", key=P + "tie_embeddings")
        c1.number_input("expert hidden (0 = MLP hidden)", 0, 16_000_000, key=P + "expert_ffn_hidden")
        c2.number_input("shared experts", 0, 1024, key=P + "n_shared_experts")
        c3.number_input("shared expert hidden (0 = expert)", 0, 16_000_000, key=P + "shared_ffn_hidden")
        c1.checkbox("shared expert gate", key=P + "shared_expert_gate")
        family_form.family_2026_inputs(P)
    with st.expander("Model shape (full size)" if st.session_state[P + "run_here"] else "Model shape", expanded=False):
        c1, c2, c3 = st.columns(3)
        c1.number_input("hidden size h (d_model)", 1, 1_000_000, key=P + "d_model")
        c2.number_input("layers L", 1, 10_000, key=P + "n_layers")
        c3.number_input("attention heads a", 1, 1_000_000, key=P + "n_heads")
        c1.number_input("KV heads (0 = a)", 0, 1_000_000, key=P + "n_kv_heads")
        c2.number_input("MLP hidden (0 = 4h)", 0, 16_000_000, key=P + "ffn_hidden")
        c3.number_input("sequence length s", 1, 10_000_000, key=P + "seq_len")
        c1.number_input("vocabulary V", 2, 10_000_000, key=P + "vocab_size")
        c2.number_input("MoE experts (0 = dense)", 0, 100_000, key=P + "n_experts")
        c3.number_input("experts per token (top-k)", 1, 100_000, key=P + "top_k")


def _parallel_inputs() -> None:
    st.selectbox("Strategy", sf.STRATEGIES, key=P + "strategy", format_func=lambda s: sf.STRATEGY_HELP.get(s, s))
    degrees = [d.degree for d in dims.DIMS if d.degree.widget]  # one row: the world, then each degree
    cols = st.columns(1 + len(degrees))
    cols[0].number_input("World size", 1, 1_000_000, key=P + "world_size", help="Ranks (processes) in the job")
    for col, f in zip(cols[1:], degrees, strict=False):
        _dim_widget(col, f)
    for d in dims.DIMS:  # a row per dimension with options: pp's schedule and stages, cp's rotation and balancing
        options = [f for f in d.options if f.widget]
        for col, f in zip(st.columns(max(2, len(options))) if options else (), options, strict=False):
            _dim_widget(col, f)
    st.selectbox("Framework", sf.FRAMEWORKS, key=P + "framework", format_func=lambda s: sf.FRAMEWORK_HELP.get(s, s))
    st.selectbox("Offload to CPU", sf.OFFLOADS, key=P + "offload", format_func=lambda s: sf.OFFLOAD_HELP.get(s, s))
    c1, c2 = st.columns(2)
    c1.radio("Run on", list(sf.RUN_ON), key=P + "executor", format_func=sf.RUN_ON.get, horizontal=True)
    if st.session_state[P + "executor"] == "slurm":
        c2.number_input("Nodes", 1, 100_000, key=P + "nnodes", help="ranks per node = world size / nodes")
        c2.caption(sf.placement({k: st.session_state[P + k] for k in ("executor", "nnodes", "world_size")}))


def _dim_widget(col, f: dims.SpecField) -> None:
    """A parallel dimension's field as its table entry describes it (backend/spec/dims.py)."""
    w = f.widget
    tip = HELP[w.glossary] if w.glossary else w.help
    if f.kind is bool:
        col.checkbox(w.label, key=P + f.name, help=tip)
    elif f.kind is int:
        col.number_input(w.label, f.ge or 0, f.le or dims.MAX_WORLD, key=P + f.name, help=tip)
    else:
        col.selectbox(w.label, [v.value for v in f.kind], key=P + f.name, format_func=lambda s: w.words.get(s, s),
                      help=tip)


def _train_inputs() -> None:
    c1, c2, c3 = st.columns(3)
    c1.number_input("Global batch (sequences)", 1, 100_000_000, key=P + "global_batch")
    c2.number_input("Micro-batch (sequences)", 1, 100_000_000, key=P + "micro_batch")
    c3.number_input("Microbatches (0 = derive)", 0, 100_000_000, key=P + "microbatches",
                    help="global batch / (micro-batch × dp); set it to check your arithmetic")
    c1.number_input("Timed steps", 1, 1_000_000, key=P + "steps")
    c2.number_input("Warm-up steps", 0, 1_000_000, key=P + "warmup_steps")
    c3.number_input("Seed", 0, 2**31 - 1, key=P + "seed")
    c1.selectbox("Precision", sf.PRECISIONS, key=P + "precision",
                 help="fp8: torchao float8 linears (bf16 elsewhere); FSDP2 all-gathers their weights in fp8 "
                      "(tensorwise)")
    if st.session_state[P + "precision"] == "fp8":
        c1.selectbox("FP8 scaling", ["tensorwise", "rowwise"], key=P + "fp8_recipe")
    c2.selectbox("Optimizer", sf.OPTIMIZERS, key=P + "optimizer")
    c2.number_input("Learning rate", 0.0, 10.0, key=P + "lr", step=1e-4, format="%g")
    c1.number_input("Timeout (s)", 0.0, sf.MAX_TIMEOUT_S, key=P + "timeout_s", step=60.0,
                    help="The job is killed and stored as timeout after this long (set-up and reference included)")
    c3.selectbox("Activation recompute", sf.RECOMPUTES, key=P + "recompute",
                 help="none, selective (attention core), full (every block), op (torchtitan's op-level SAC), layers "
                      "(every K-th block, torchtitan), block / uniform (Megatron's methods with N layers)")
    stack_form.render(st, P)  # issue 34: the stack the job trains with, and its settings
    if kept := kept_fields.lines(st.session_state.get(P + "kept"), st.session_state[P + "recompute"],
                                  st.session_state[P + "run_here"]):
        st.caption("Kept from the loaded spec (no field above sets them): " + "; ".join(kept))
    if st.session_state[P + "recompute"] in WITH_LAYERS:
        c3.number_input("K / N blocks", 1, 100_000, key=P + "recompute_layers",
                        help="layers: checkpoint every K-th block; block: the first N blocks of each stage; uniform: "
                             "groups of N blocks")


def _values() -> dict:
    return {k: st.session_state[P + k] for k in sf.default_form()}


@st.cache_data(max_entries=64, show_spinner="Predicting…")
def _predict(spec_json: str):
    return pv.predict(ExperimentSpec.for_prediction(json.loads(spec_json)))  # prediction-only layouts too


def _framework_prediction(spec) -> None:
    """Issue 14: what ShardLab predicts for DeepSpeed's / XLA's own layout (the panels below are torch's)."""
    if str(spec.framework) == "deepspeed":
        from backend.analytic.frameworks.deepspeed_layout import deepspeed_rank
        from backend.frameworks.deepspeed.ds_config import BUCKET_ELEMENTS, PERSISTENCE_THRESHOLD

        r = deepspeed_rank(spec, bucket_elements=BUCKET_ELEMENTS, persistence_threshold=PERSISTENCE_THRESHOLD)
        st.info(f"DeepSpeed layout per rank: params {r.params_bytes:,} B + fp32 master {r.master_bytes:,} B + "
                f"optimizer state {r.optimizer_state_bytes:,} B = {r.model_state_bytes:,} B of model states; reduce "
                f"bucket {BUCKET_ELEMENTS:.0e} elements. The run also shows DeepSpeed's own estimate beside it.")
    elif str(spec.framework) == "jax":
        from backend.analytic.frameworks.gspmd import mode, predicted_bytes

        b = predicted_bytes(spec)
        st.info(f"JAX GSPMD {mode(spec)} per device: params {b['params_bytes']:,} B + optimizer "
                f"{b['optimizer_bytes']:,} B + data {b['data_bytes']:,} B = XLA argument bytes {b['argument_bytes']:,} "
                "B (checked against compiled.memory_analysis()).")


@st.cache_data(max_entries=64, ttl=30, show_spinner=False)
def _step_time(spec_json: str, hardware: str, gpus_per_node: int | None):
    from dashboard import steptime_view

    return steptime_view.predict(ExperimentSpec.for_prediction(json.loads(spec_json)), hardware, store_access.engine(),
                                 gpus_per_node=gpus_per_node)


def _step_time_panel(spec) -> None:
    from dashboard import steptime_view

    c1, c2 = st.columns([2, 3])
    hardware = c1.selectbox("Step time on", steptime_view.profile_options(), key=P + "step_hw",
                            help="cpu: this host's measured profile (what a local run uses); the others: published GPU "
                                 "profiles (Plan's hardware when the layout came from Plan)")
    gpn = st.session_state.get("step_gpn") if hardware != "cpu" else None
    try:
        pred, why = _step_time(spec.to_json(), hardware, gpn)
    except Exception as e:  # noqa: BLE001 - a gap in the step-time model is shown, not raised
        pred, why = None, f"the step-time model cannot time this spec: {e}"
    if pred is None:
        c2.info(why)
        return
    c2.metric("step time (predicted)", f"{pred['step_s']:.3g} s",
              help=f"interval {pred['low_s']:.3g} – {pred['high_s']:.3g} s; {steptime_view.band_text(pred)}")
    with st.expander(f"Stack {spec.train.stack} as resolved on {hardware}", expanded=False):
        st.dataframe(stack_form.resolved_rows(spec, steptime_view.device_class(hardware)), hide_index=True)
    st.caption(f"{pred['step_s']:.3g} s {steptime_view.breakdown_text(pred)}; {pred['tokens_per_s']:,.0f} tokens/s, "
               f"MFU {pred['mfu']:.1%} on the {steptime_view.band_text(pred)}.")
    for caveat in pred.get("caveats", []):
        st.caption(f"Step time assumes: {caveat}")


def _prediction(spec, device_gb: float) -> None:
    _framework_prediction(spec)
    try:
        est, rows = _predict(spec.to_json())
    except Exception as e:  # noqa: BLE001 - a formula gap is shown, not raised
        messages.box("error", "The analytic model cannot predict this spec:", [str(e)])
        return
    cols = st.columns(3) + st.columns(3)
    for col, (k, v) in zip(cols, pv.headline(est).items(), strict=False):
        col.metric(k, v, help=pv.HEADLINE_HELP.get(k))
    _step_time_panel(spec)
    fit = pv.fit_check(rows, device_gb * GB)
    (st.success if fit.fits else st.warning if fit.tight else st.error)(fit.message())
    st.plotly_chart(pv.per_rank_memory_fig(rows, device_mem_bytes=device_gb * GB), key="pred_mem")
    if len(rows) < spec.parallel.world_size:
        st.caption(f"Ranks 0-{pv.PREDICT_PAGE - 1} of {spec.parallel.world_size:,}, then one rank of every other class "
                   "of identical ranks (the fullest rank is always shown).")
    comm = pv.comm_frame(pv.shown_ranks(est))
    st.markdown("**Communication per step (analytic, bytes per step)**")
    if comm.empty:
        st.caption("No collectives: a single rank, or nothing to synchronise.")
    else:
        st.dataframe(comm, hide_index=True, width="stretch", column_config={
            c: st.column_config.TextColumn(c, help=HELP["payload"]) for c in comm.columns if c.startswith("payload")}
            | {pv.WIRE_COLUMN: st.column_config.TextColumn(pv.WIRE_COLUMN, help=HELP["wire"])})
    cmp = sf.attention_comparison(spec)
    if cmp:
        st.markdown("**Activations of the fullest rank, by attention kernel**")
        c1, c2, c3 = st.columns(3)
        c1.metric("math attention", fmt_bytes_short(cmp["math"]),
                  help="Activations of the fullest rank with the explicit softmax(QK^T)V attention")
        c2.metric("flash attention", fmt_bytes_short(cmp["flash"]),
                  help="Activations of the fullest rank with the fused (flash) attention kernel")
        label, value, why = pv.flash_saving(cmp, str(spec.train.recompute))
        c3.metric(label, value, help=why)
    for note in getattr(est, "notes", []) or []:  # may quote the model's source (a config's keys)
        messages.note(note)


def _load_imported(imported) -> None:
    """The Import box's button callback: the imported spec fills the form on the next run (as a cloned run does)."""
    st.session_state["clone_spec"] = ExperimentSpec.for_prediction(imported.spec)


_init_state()
st.title("New experiment")
st.caption("Design a sharded training run. The prediction on the right updates as you type; validation errors show the "
           "arithmetic.")
workflow.steps()
left, right = st.columns([5, 6], gap="large")
with left:
    import_box.box("ne_", _load_imported, load_label="Load into the form")
    st.text_input("Name (optional)", key=P + "name", placeholder="e.g. zero2 vs ddp, tiny model")
    _model_inputs()
    st.subheader("Parallelism")
    _parallel_inputs()
    st.subheader("Training")
    _train_inputs()
values = _values()
spec, problems = sf.form_to_spec(values, predict_only=True)
blockers = run_blockers(spec) if spec is not None else []
with right:
    st.subheader("Prediction")
    device_gb = st.number_input("GPU memory to check against, GB", 0.1, 100_000.0, key=P + "device_mem_gb",
                                step=8.0,
                                help="Decimal GB (80 here = 74.5 GiB; CUDA gives a process 79.1 GiB = 84.9 GB of an "
                                     "'80 GB' H100, the h100-sxm profile's figure); the charts and checks below use "
                                     "GiB. A local CPU run is checked against this host's RAM under Run it.")
    if spec is not None and spec.runtime.executor == "slurm":
        from backend.cluster.submit import cluster_problem

        if (problem := cluster_problem(spec)) is not None:
            spec, problems = None, [problem]
    if problems:  # a problem quotes the value it refuses: a name is shown as typed, never as markdown
        messages.box("error", "This spec cannot run:", problems)
    else:
        if blockers:
            st.warning("Prediction only: " + "; ".join(blockers), icon=":material/visibility:")
        st.caption(sf.describe(spec))
        _prediction(spec, device_gb)
st.divider()
if spec is not None:
    run_panel.section(spec, blockers, values)
else:
    st.info("Fix the problems above to submit.")
