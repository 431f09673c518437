"""The "Import config" box of New experiment and Plan (issue 25): upload a torchtitan / Megatron-LM / NeMo / DeepSpeed
config, see the spec it becomes and every field it could not map, and load it into the page (`on_load(imported)`,
called from the button's callback, before the page's widgets are built again). `python -m backend import-config` is
its scriptable twin. Errors and field names are the user's text: st.text and dataframes only, never markdown.

What an import needs from the person (`ImportOutcome.needs`: the vocabulary size a Megatron script leaves to its
tokenizer) is asked here in the page's words, with a field, as the CLI asks for `--vocab` (issue 30)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import streamlit as st

from backend.importers.import_result import VOCAB_SIZE
from dashboard import import_view as iv


def box(prefix: str, on_load: Callable[[Any], None], *, load_label: str) -> None:
    with st.expander(f"Import config — {iv.frameworks_text()}", expanded=False):
        st.caption(f"The file is read as data, never run. {iv.reads_text()}.")
        up = st.file_uploader("Framework config", key=f"{prefix}imp_cfg")
        c1, c2 = st.columns(2)
        formats = iv.formats()
        fmt = c1.selectbox("Format", list(formats), key=f"{prefix}imp_fmt")
        gpus = c2.number_input("GPUs (0 = what the config says)", 0, 1_000_000, 0, key=f"{prefix}imp_gpus",
                               help="Resolves degrees written as -1 or auto (torchtitan's dp_shard, Megatron's dp), "
                                    "and replaces a node count a launch script takes from its environment")
        model = st.file_uploader("Model config.json (optional)", type=["json"], key=f"{prefix}imp_model",
                                 help=iv.model_file_help())
        if st.button("Import", disabled=up is None, key=f"{prefix}imp_go", icon=":material/upload_file:"):
            request = iv.ImportRequest(up.getvalue(), up.name, fmt=formats.get(fmt), gpus=int(gpus) or None,
                                       model_config=model.getvalue() if model is not None else None)
            _run(prefix, request)
        _ask(prefix)
        _show(prefix, on_load, load_label)


def _run(prefix: str, request: iv.ImportRequest) -> None:
    outcome = iv.import_request(request)
    st.session_state[f"{prefix}imp_request"] = request
    st.session_state[f"{prefix}imp_outcome"] = outcome
    st.session_state[f"{prefix}imp_result"] = outcome.imported
    st.session_state[f"{prefix}imp_problems"] = outcome.shown_problems()


def _ask(prefix: str) -> None:
    """The question an import left open, in the page's words: the vocabulary size of a Megatron-LM / NeMo config."""
    outcome = st.session_state.get(f"{prefix}imp_outcome")
    request = st.session_state.get(f"{prefix}imp_request")
    if outcome is None or request is None or VOCAB_SIZE not in outcome.needs:
        return
    st.warning("This config does not say its vocabulary size: Megatron-LM and NeMo read it from the tokenizer, which "
               "the config only names. Enter the tokenizer's vocabulary size (the model's vocab_size, e.g. 32000 for "
               "Llama 2, 128256 for Llama 3), or upload the model's config.json above and import again.",
               icon=":material/help:")
    c1, c2 = st.columns([2, 1], vertical_alignment="bottom")
    c1.number_input("Vocabulary size", min_value=1, max_value=10_000_000, value=None, step=1,
                    key=f"{prefix}imp_vocab", placeholder="tokens in the tokenizer")
    c2.button("Import with this vocabulary", key=f"{prefix}imp_vocab_go", on_click=_import_with_vocab, args=(prefix,),
              disabled=not st.session_state.get(f"{prefix}imp_vocab"))


def _import_with_vocab(prefix: str) -> None:
    vocab = st.session_state.get(f"{prefix}imp_vocab")
    request = st.session_state.get(f"{prefix}imp_request")
    if vocab and request is not None:
        _run(prefix, replace(request, vocab_size=int(vocab)))


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
