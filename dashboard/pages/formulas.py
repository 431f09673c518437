"""Formulas: the analytic model on its own (no run needed), and the seed documents' claims checked."""

from __future__ import annotations

import streamlit as st

from backend.spec.stacks import STACK_CHOICES
from dashboard import formulas_view as fv
from dashboard import published_view as pv
from dashboard import store_access

st.title("Formulas")
st.caption("Explore the analytic model at scales this machine cannot run. Every curve is a formula with its source; "
           "measured runs check them at small scale.")

tab_mem, tab_act, tab_bub, tab_claims, tab_pub = st.tabs(["ZeRO memory vs GPUs", "Activations vs sequence",
                                                          "Pipeline bubble", "Seed claims", "Published runs"])
with tab_mem:
    c1, c2, c3, c4 = st.columns(4)
    psi_b = c1.number_input("Model size (billion parameters)", 0.001, 100_000.0, 70.0, key="fx_psi")
    prec = c2.selectbox("Precision", ["bf16-mixed", "fp16-mixed", "fp32"], key="fx_prec")
    opt = c3.selectbox("Optimizer", ["adamw", "sgd"], key="fx_opt")
    dev = c4.number_input("GPU memory, GB", 1.0, 10_000.0, 80.0, key="fx_dev",
                          help="Decimal GB: 80 = 74.5 GiB (CUDA gives a process 79.1 GiB of an '80 GB' H100); the "
                               "charts are in GiB")
    lo, hi = st.select_slider("GPUs N", options=fv.worlds(1, 4096), value=(8, 1024), key="fx_n")
    st.plotly_chart(fv.zero_memory_fig(psi_b * 1e9, precision=prec, optimizer=opt, ns=fv.worlds(lo, hi), device_gb=dev),
                    key="fx_zero")
    st.caption("ZeRO (Rajbhandari et al. 2020, Sec 3.1 and 5): model states 2Ψ + 2Ψ + KΨ bytes for Ψ parameters: 2 "
               "bytes each of 16-bit parameters and gradients, and K bytes of optimizer state (mixed-precision Adam: "
               "fp32 master copy, momentum and variance, 4 + 4 + 4 = 12), so 16 bytes per parameter without sharding. "
               "Stage 1 shards the KΨ optimizer states, stage 2 also the gradients, stage 3 (= FSDP) also the "
               "parameters. Activations come on top (next tab).")
with tab_act:
    c1, c2, c3, c4 = st.columns(4)
    h = c1.number_input("hidden h", 1, 1_000_000, 8192, key="fx_h")
    a = c2.number_input("heads a", 1, 100_000, 64, key="fx_a")
    layers = c3.number_input("layers L", 1, 10_000, 80, key="fx_L")
    b = c4.number_input("micro-batch b", 1, 100_000, 1, key="fx_b")
    c1, c2 = st.columns(2)
    t = c1.number_input("tensor-parallel t", 1, 1024, 8, key="fx_t")
    sp = c2.checkbox("sequence parallel", True, key="fx_sp")
    try:
        st.plotly_chart(fv.activation_fig(seqs=fv.worlds(512, 131072), b=b, h=h, a=a, layers=layers, t=t, sp=sp),
                        key="fx_act")
        st.caption("Korthikanti et al. 2022, Table 2: per layer s·b·h·(34 + 5·a·s/h) bytes without parallelism; "
                   "selective recompute drops the 5as/h attention term, full recompute keeps only the 2sbh layer "
                   "input.")
    except Exception as e:  # noqa: BLE001
        st.error(f"activation formula unavailable: {e}")
with tab_bub:
    c1, c2 = st.columns(2)
    p = c1.number_input("pipeline stages p", 2, 1024, 8, key="fx_p")
    v = c2.number_input("virtual stages v (interleaved)", 2, 64, 2, key="fx_v")
    try:
        st.plotly_chart(fv.bubble_fig(p=p, ms=list(range(1, 65)), v=v), key="fx_bubble")
        st.caption("GPipe / 1F1B: (p−1)/(m+p−1) of the step is idle (Narayanan et al. 2021 Sec 2.2); interleaving "
                   "divides the bubble by v; zero-bubble schedules split B into input- and weight-gradient passes (Qi "
                   "et al. 2023).")
    except Exception as e:  # noqa: BLE001
        st.error(f"bubble formula unavailable: {e}")
with tab_claims:
    try:
        from backend.analytic.textbook.seeds import seed_claims

        claims = seed_claims()
    except Exception as e:  # noqa: BLE001
        claims = []
        st.error(f"seed claims unavailable: {e}")
    if claims:
        df = fv.claims_frame(claims)
        n_hold = int((df["verdict"] == "holds").sum())
        st.markdown(f"**{n_hold} of {len(df)} claims hold** against the formulas.")
        st.dataframe(df.style.apply(fv.claim_styles, axis=None), hide_index=True, width="stretch")
    st.subheader("Checked on measured runs")
    checks = store_access.measured_checks(store_access.db_url())
    if checks.empty:
        st.info("No measured check yet: run ddp and zero1/zero2/zero3 at the same world size (a sweep on New "
                "experiment), or a pp run, and the comparison appears here.")
    else:
        st.dataframe(checks, hide_index=True, width="stretch")
        if checks["caveat"].astype(bool).any():
            st.caption("Measured bubbles of CPU runs: when the ranks do not each get a core, pipeline stages "
                       "time-share the CPU and cannot overlap, so the measured bubble tends to 1 − 1/pp whatever the "
                       "schedule (see each run's caveat); compare them with the formula on a host with a core per "
                       "rank.")

with tab_pub:
    st.caption("How far the prediction is from what each stack's own published recipes measured: NVIDIA's NeMo / "
               "Megatron-Bridge performance summaries and Megatron-LM's H100 table, torchtitan's benchmark files, "
               "MosaicML's llm-foundry table and the papers'. Each run is predicted through its own spec with its "
               "stack and settings, as estimate prints it; nothing is fitted to these numbers. Error = (predicted - "
               "published) / published: negative = the model is too fast.")
    c1, c2 = st.columns([1, 3])
    pub_stack = c1.selectbox("Stack", ["every stack", *STACK_CHOICES], key="fx_pub_stack",
                             help="The software stack the published run trained with (train.stack).")
    if c2.button("Check the model against published runs", icon=":material/fact_check:", key="fx_pub_go"):
        from backend.analytic.steptime.published_check import check_rows, summaries

        with st.spinner("Predicting every published run (about 15 s)..."):
            checks = check_rows(None if pub_stack == "every stack" else pub_stack)
            st.session_state["fx_pub"] = (pub_stack, checks, summaries(checks))
    if st.session_state.get("fx_pub"):
        shown, checks, sums = st.session_state["fx_pub"]
        if not checks:
            st.info(f"No published run of stack {shown} is on record yet.")
        else:
            st.markdown(f"**{shown}**: {len(checks)} published runs")
            st.dataframe(pv.summary_frame(sums), hide_index=True, width="stretch")
            st.plotly_chart(pv.error_fig(checks), key="fx_pub_fig")
            st.dataframe(pv.rows_frame(checks), hide_index=True, width="stretch",
                         column_config={"link": st.column_config.LinkColumn("link")})
            st.caption("`python -m backend published [--stack S] [--json]` prints the same tables.")

st.subheader("Seed scenarios: planner verdicts")
st.caption("The seeds' cluster scenarios checked with the exact worst-rank memory on CUDA ranks (with the CUDA "
           "context, NCCL buffers and allocator slack: the fit rule of Plan and estimate) and the step-time model on "
           "A100 80GB (b = 1, full recompute, bf16), next to the planner's own best layout for the same model, GPUs "
           "and batch. Computing them takes a minute on this machine.")
if st.button("Compute planner verdicts", icon=":material/travel_explore:", key="fx_verdicts"):
    from dashboard.plan_view import scenario_verdicts

    with st.spinner("Planning the seed scenarios..."):
        st.session_state["fx_verdicts_rows"] = scenario_verdicts()
if st.session_state.get("fx_verdicts_rows"):
    st.dataframe(st.session_state["fx_verdicts_rows"], hide_index=True, width="stretch")
