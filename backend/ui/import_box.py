"""The "Import config" box of New experiment and Plan (issue 25): upload a torchtitan / Megatron-LM / NeMo / DeepSpeed
config, see the spec it becomes and every field it could not map, and load it into the page (`on_load(imported)`,
called from the button's callback, before the page's widgets are built again). `python -m backend import-config` is
its scriptable twin. Errors and field names are the user's text: st.text and dataframes only, never markdown."""

from __future__ import annotations

from typing import Any, Callable

import streamlit as st

from backend.ui import import_view as iv


def box(prefix: str, on_load: Callable[[Any], None], *, load_label: str) -> None:
    with st.expander("Import config — torchtitan, Megatron-LM / NeMo, DeepSpeed", expanded=False):
        st.caption("The file is read as data, never run: a torchtitan job .toml or Trainer.Config dump (or the log "
                   "that prints it), pretrain_gpt.py arguments or a Megatron log, a NeMo .yaml, a ds_config.json.")
        up = st.file_uploader("Framework config", key=f"{prefix}imp_cfg")
        c1, c2 = st.columns(2)
        fmt = c1.selectbox("Format", list(iv.FORMATS), key=f"{prefix}imp_fmt")
        gpus = c2.number_input("GPUs (0 = what the config says)", 0, 1_000_000, 0, key=f"{prefix}imp_gpus",
                               help="Resolves degrees written as -1 or auto (torchtitan's dp_shard, Megatron's dp)")
        model = st.file_uploader("Model config.json (DeepSpeed needs it; it replaces a torchtitan flavor)", type=["json"],
                                 key=f"{prefix}imp_model")
        if st.button("Import", disabled=up is None, key=f"{prefix}imp_go", icon=":material/upload_file:"):
            imported, problems = iv.import_uploaded(up.getvalue(), up.name, fmt=iv.FORMATS[fmt], gpus=int(gpus) or None,
                                                    model_config=model.getvalue() if model is not None else None)
            st.session_state[f"{prefix}imp_result"], st.session_state[f"{prefix}imp_problems"] = imported, problems
        _show(prefix, on_load, load_label)


def _show(prefix: str, on_load: Callable[[Any], None], load_label: str) -> None:
    problems = st.session_state.get(f"{prefix}imp_problems")
    if problems:
        st.error("This config cannot become a ShardLab spec:")
        for p in problems:
            st.text(p)
    imported = st.session_state.get(f"{prefix}imp_result")
    if imported is None:
        return
    st.text(iv.summary_line(imported))
    for note in imported.notes:
        st.text(f"ⓘ {note}")
    if imported.unmapped:
        st.markdown(f"**Not in the spec ({len(imported.unmapped)})** — the prediction ignores these fields")
        st.dataframe(iv.fields_frame(imported.unmapped), hide_index=True, width="stretch")
    with st.expander(f"Ignored ({len(imported.ignored)}): no effect on memory or step time"):
        st.dataframe(iv.fields_frame(imported.ignored), hide_index=True, width="stretch")
    st.button(load_label, key=f"{prefix}imp_load", type="primary", on_click=on_load, args=(imported,))
