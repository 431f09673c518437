"""Who is at the dashboard and what they may do, checked on every page (app.py: `gate`) and in every write the pages
make (dashboard/store_access.py: `require_operator`), not only by disabling buttons.

Where the user comes from:
- OIDC login (`[auth]` in .streamlit/secrets.toml, Streamlit's st.login): st.user's e-mail, once logged in;
- a trusted authenticating proxy (`SHARDLAB_TRUSTED_PROXY=1`): the header it sets ([access] user_header, default
  X-Forwarded-Email) on the request that opened the session;
- neither (the default, 127.0.0.1 only): the person at this machine, an operator.
The [access] allow-list (dashboard/access_policy.py) gives each listed user a role: operators may submit, cancel,
re-run, tag, delete and calibrate; viewers may look. With OIDC a user not on the list, or a dashboard without a list,
is refused; behind a proxy without a list every user the proxy lets through is an operator (the proxy decides).
A weak cookie_secret refuses every page: it signs the login cookie."""

from __future__ import annotations

import os
from dataclasses import dataclass

import streamlit as st

from dashboard.access_policy import Policy, Role, cookie_secret_problem, parse_policy

TRUSTED_PROXY_ENV = "SHARDLAB_TRUSTED_PROXY"


@dataclass(frozen=True)
class Visitor:
    user: str | None
    """The e-mail address or name the identity provider or proxy gave; None for the local user."""
    role: Role | None
    """None: not allowed in (`why` says why)."""
    how: str
    """"oidc", "proxy" or "local"."""
    why: str = ""
    needs_login: bool = False

    @property
    def may_operate(self) -> bool:
        return self.role == Role.OPERATOR

    def label(self) -> str:
        who = self.user or "this machine's user"
        return f"{who} ({self.role or 'no access'}, {self.how})"


def _secrets() -> dict:
    try:
        return {k: st.secrets[k] for k in ("auth", "access") if k in st.secrets}
    except Exception:  # noqa: BLE001 - no secrets file at all
        return {}


def auth_configured() -> bool:
    return "auth" in _secrets()


def _plain(section) -> dict | None:
    """A secrets section as plain dicts and lists (st.secrets hands out AttrDicts)."""
    if section is None:
        return None
    return {k: (_plain(v) if hasattr(v, "items") else list(v) if isinstance(v, (list, tuple)) else v)
            for k, v in section.items()}


def visitor() -> Visitor:
    """The session's user and role, decided afresh on each call from the login, the proxy's header and [access]."""
    secrets = _secrets()
    policy, problems = parse_policy(_plain(secrets.get("access")))
    if problems:
        return Visitor(None, None, "config", "this dashboard's [access] list is wrong: " + "; ".join(problems))
    if "auth" in secrets:
        return _oidc(policy, _plain(secrets["auth"]) or {})
    if os.environ.get(TRUSTED_PROXY_ENV) == "1":
        return _proxy(policy)
    return Visitor(None, Role.OPERATOR, "local", "no login configured: the dashboard serves this machine only")


def _oidc(policy: Policy, auth: dict) -> Visitor:
    if (weak := cookie_secret_problem(auth.get("cookie_secret"))) is not None:
        return Visitor(None, None, "oidc", f"this dashboard's login is not safe: {weak}")
    if not st.user.is_logged_in:
        return Visitor(None, None, "oidc", "log in first", needs_login=True)
    user = st.user.get("email") or st.user.get("preferred_username")
    if not policy.configured:
        return Visitor(user, None, "oidc", "this dashboard lists no one in [access]: OIDC login alone would let in "
                                           "anyone the identity provider accepts")
    role = policy.role(user)
    return Visitor(user, role, "oidc",
                   "" if role else f"{user or 'this account'} is not on this dashboard's [access] list")


def _proxy(policy: Policy) -> Visitor:
    user = (st.context.headers.get(policy.user_header) or "").strip() or None
    if not policy.configured:
        return Visitor(user, Role.OPERATOR, "proxy", "the trusted proxy lets users in; no [access] list narrows it")
    if user is None:
        return Visitor(None, None, "proxy", f"the proxy sent no {policy.user_header} header naming the user")
    role = policy.role(user)
    return Visitor(user, role, "proxy", "" if role else f"{user} is not on this dashboard's [access] list")


def gate() -> Visitor:
    """Every page: show only a log-in button, or the refusal, unless the visitor may look; returns the visitor."""
    v = visitor()
    if v.needs_login:
        st.title("ShardLab")
        st.info("This dashboard is shared: log in with your team's identity provider.")
        st.button("Log in", on_click=st.login, type="primary")
        st.stop()
    if v.role is None:
        st.title("ShardLab")
        st.error("You may not use this dashboard. Ask its operator to add you to its [access] list.",
                 icon=":material/block:")
        st.text(v.why)  # names the account: the identity provider's text, plain
        if v.how == "oidc" and v.user:
            st.button("Log out", on_click=st.logout)
        st.stop()
    return v


def require_operator(action: str) -> None:
    """The backend check of every write the pages make: a visitor who may not change the store gets the reason and
    the script stops before anything is written (a disabled button is only a hint; a crafted request ends here)."""
    v = visitor()
    if v.may_operate:
        return
    st.error(f"Read-only access: you may view runs but not {action}.", icon=":material/lock:")
    st.text(v.label())
    st.stop()


def read_only_reason(v: Visitor) -> str | None:
    """The help text of a disabled write button, or None when the visitor may operate."""
    return None if v.may_operate else "read-only access (viewer): you may look, not change runs"


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
