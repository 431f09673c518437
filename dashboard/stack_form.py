"""The Stack select and its settings (an expander), shared by the New-experiment form and the Plan page: widget values
<-> the spec's `train.stack` and stack settings (backend/spec/stacks.py). A setting left at "stack default" is None in
the spec, so the stack's own default (with its source) applies."""

from __future__ import annotations

from typing import Any

from backend.spec.choices import RecomputeModule, Stack
from backend.spec.stacks import SETTING_INFO, SETTINGS, STACK_CHOICES, STACKS, resolve_stack

DEFAULT = "stack default"
BOOLEAN = tuple(name for name, s in SETTING_INFO.items() if s.boolean)
CHOICES: dict[str, list[str]] = {name: [DEFAULT, *(("on", "off") if s.boolean else s.choices)]
                                 for name, s in SETTING_INFO.items()}
LABELS = {name: s.label for name, s in SETTING_INFO.items()}
STACK_HELP = {s.value: STACKS[s].what for s in Stack}
MODULES = "recompute_modules"
MODULE_CHOICES = [m.value for m in RecomputeModule]
MODULES_HELP = ("Megatron-Core's --recompute-modules: what recompute 'selective' checkpoints on the megatron stack. "
                "Empty: Megatron's default, core_attn.")


def to_spec(values: dict[str, Any]) -> dict[str, Any]:
    """Form values -> the train fields: stack and every setting not left at the stack's default."""
    out: dict[str, Any] = {"stack": values.get("stack") or "shardlab"}
    for k in SETTINGS:
        x = values.get(k, DEFAULT)
        if x in (None, DEFAULT):
            continue
        out[k] = {"on": True, "off": False}[x] if k in BOOLEAN else x
    if values.get(MODULES):
        out[MODULES] = list(values[MODULES])
    return out


def to_form(train: Any) -> dict[str, Any]:
    """A spec's train section -> form values."""
    out: dict[str, Any] = {"stack": str(getattr(train, "stack", "shardlab"))}
    for k in SETTINGS:
        x = getattr(train, k, None)
        out[k] = (DEFAULT if x is None else ("on" if x else "off") if k in BOOLEAN
                  else str(x.value if hasattr(x, "value") else x))
    out[MODULES] = [str(m) for m in getattr(train, MODULES, None) or ()]
    return out


def defaults() -> dict[str, Any]:
    return {"stack": "shardlab", **{k: DEFAULT for k in SETTINGS}, MODULES: []}


def resolved_rows(spec: Any, device: str) -> list[dict[str, str]]:
    """One row per setting as it resolves (value, set by, source): the table under the settings."""
    r = resolve_stack(spec, device)
    return [{"setting": k, "value": _word(r.values[k]), "set by": r.set_by[k], "source": r.sources[k]}
            for k in SETTINGS]


def _word(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def render(st: Any, key: str, values: dict[str, Any] | None = None, container: Any = None) -> None:
    """The Stack select and, in an expander, one select per setting (keys `key + name`; `values` seed them)."""
    where = container or st
    for k, v in (values or defaults()).items():
        st.session_state.setdefault(key + k, v)
    where.selectbox("Stack", list(STACK_CHOICES), key=key + "stack", format_func=lambda s: f"{s}: {STACK_HELP[s]}",
                    help="The software stack the job trains with: its kernels, dtypes and overlaps (each setting below "
                         "is the stack's default unless set). How close the prediction comes to each stack's own "
                         "published runs: Formulas, tab Published runs (`python -m backend published`)")
    with where.expander("Stack settings", expanded=False):
        cols = st.columns(2)
        for i, k in enumerate(SETTINGS):
            cols[i % 2].selectbox(LABELS[k], CHOICES[k], key=key + k)
        st.multiselect("Recompute modules (megatron, recompute selective)", MODULE_CHOICES, key=key + MODULES,
                       help=MODULES_HELP)


def read(st: Any, key: str) -> dict[str, Any]:
    """The widget values `render` keeps (for to_spec)."""
    return {**{k: st.session_state.get(key + k, DEFAULT) for k in ("stack", *SETTINGS)},
            MODULES: list(st.session_state.get(key + MODULES, []))}
