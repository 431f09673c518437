"""New experiment's "Run it" section: this host's capacity, the Run button (disabled with the reason), Trace at full
size and the sweep grid."""

from __future__ import annotations

import uuid
from typing import Any

import streamlit as st

from dashboard import access, store_access
from dashboard import spec_form as sf
from dashboard.sweep_form import expand_sweep


def section(spec: Any, blockers: list[str], values: dict) -> None:
    st.subheader("Run it")
    st.caption("Runs execute on CPU ranks (gloo) in the background worker; small shapes finish in seconds to a minute.")
    submit_one(spec, blockers)
    trace(spec, blockers)
    sweep(values)


def _host_check(spec) -> Any:
    """This host's capacity for the run (local runs; SLURM runs are bounded by the cluster config)."""
    from backend.launch import capacity

    verdict = capacity.check(spec)
    if verdict.need_bytes is not None:
        host = capacity.Host.this()
        st.text(f"This host: {host.cores} cores, {capacity.gib(verdict.usable_bytes)} of RAM usable; the run's "
                f"{spec.parallel.world_size // spec.runtime.nnodes} ranks need {capacity.gib(verdict.need_bytes)}.")
    for problem in verdict.problems:
        st.error(f"Cannot run on this host: {problem}", icon=":material/block:")
    for warning in verdict.warnings:
        st.warning(warning, icon=":material/warning:")
    return verdict


def submit_one(spec, blockers: list[str]) -> None:
    read_only = access.read_only_reason(access.visitor())
    if blockers:
        st.info("This layout is for prediction only: this engine cannot run it (" + "; ".join(blockers) + ").",
                icon=":material/visibility:")
        why = "prediction only: " + "; ".join(blockers)
    else:
        verdict = _host_check(spec)
        why = verdict.refusal()
    why = read_only or why
    c1, c2 = st.columns([2, 1])
    c1.text_input("Tags (comma-separated; a sweep's runs get them too)", key="submit_tags",
                  placeholder="e.g. baseline, zero-study")
    if c2.button("Run this experiment", icon=":material/play_arrow:", type="primary", key="submit_one",
                 disabled=bool(why), help=why or None):
        eid = store_access.submit(spec, tags=_tags())  # checks rights
        st.session_state["run_id"] = eid
        st.success(f"Queued run #{eid}. Follow it on the Runs page or open its detail.")
        st.page_link("dashboard/pages/run_detail.py", label=f"Open run #{eid}", icon=":material/search:",
                     query_params={"run": str(eid)})


def _tags() -> tuple[str, ...]:
    """The Tags field's tags (comma-separated), for one run or a sweep."""
    return tuple(t.strip() for t in str(st.session_state.get("submit_tags") or "").split(",") if t.strip())


def trace(spec, blockers: list[str]) -> None:
    st.caption("Or trace its memory at full size: the real set-up and train step on fake tensors (no allocation), "
               "for shapes this machine could never run. One rank per class of equivalent ranks; minutes at 7B scale.")
    why = access.read_only_reason(access.visitor()) or ("prediction only: " + "; ".join(blockers) if blockers else None)
    if why is None and str(spec.framework) != "torch":  # the trace runs the torch engine only
        from backend.trace.trace_spec import framework_reason

        why = framework_reason(str(spec.framework))
    if st.button("Trace at full size", icon=":material/memory:", key="trace_full", disabled=bool(why), help=why):
        eid = store_access.start_trace(spec)
        st.session_state["run_id"] = eid
        st.success(f"Tracing as run #{eid} (kind traced); it appears on the Runs page.")
        st.page_link("dashboard/pages/run_detail.py", label=f"Open run #{eid}", icon=":material/search:",
                     query_params={"run": str(eid)})


def sweep(v: dict) -> None:
    with st.expander("Sweep: submit a grid of runs"):
        c1, c2, c3 = st.columns(3)
        strategies = c1.multiselect("Strategies", sf.STRATEGIES, default=[v["strategy"]], key="sweep_strategies")
        worlds = c2.multiselect("World sizes", [1, 2, 3, 4, 6, 8],
                                default=[v["world_size"]] if v["world_size"] in (1, 2, 3, 4, 6, 8) else [2],
                                key="sweep_worlds")
        mbs = c3.multiselect("Microbatches (empty = from the batch)", [1, 2, 4, 8, 16], default=[], key="sweep_mbs")
        specs, problems = expand_sweep(v, strategies=strategies, worlds=worlds, microbatches=mbs)
        st.write(f"**{len(specs)} valid runs** in the grid"
                 + (f", {len(problems)} combinations skipped:" if problems else "."))
        for p in problems:  # a problem may quote the spec's name
            st.text(f"⊘ {p}")
        read_only = access.read_only_reason(access.visitor())
        if st.button(f"Submit sweep of {len(specs)} runs", disabled=not specs or bool(read_only), key="submit_sweep",
                     help=read_only):
            sweep_id = uuid.uuid4().hex[:12]
            tags = tuple(dict.fromkeys(("sweep", *_tags())))  # the user's tags were dropped before
            ids = [store_access.submit(s, tags=tags, sweep_id=sweep_id) for s in specs]
            st.success(f"Queued {len(ids)} runs (sweep {sweep_id}): #{ids[0]}–#{ids[-1]}.")
