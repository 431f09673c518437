"""Log-in gate for a dashboard served with OIDC (`[auth]` in .streamlit/secrets.toml, see dashboard/serve.py):
until `st.login` succeeds the page shows only a log-in button. Without an [auth] section it does nothing
(local use on 127.0.0.1, or a trusted proxy that authenticates)."""

from __future__ import annotations

import streamlit as st


def auth_configured() -> bool:
    try:
        return "auth" in st.secrets
    except Exception:  # noqa: BLE001 - no secrets file at all
        return False


def require_login() -> None:
    if not auth_configured() or st.user.is_logged_in:
        return
    st.title("ShardLab")
    st.info("This dashboard is shared: log in with your team's identity provider.")
    st.button("Log in", on_click=st.login, type="primary")
    st.stop()


def guard_bind() -> None:
    """Second line behind dashboard/serve.py, for `streamlit run app.py --server.address X` typed by hand: a
    non-loopback address without login or trusted-proxy opt-out shows only the refusal. (None is Streamlit's
    unset default, which the repo's .streamlit/config.toml pins to 127.0.0.1.)"""
    from dashboard.serve import remote_access_problem

    host = st.get_option("server.address")
    problem = None if host is None else remote_access_problem(str(host))
    if problem:
        st.error(problem)
        st.stop()
