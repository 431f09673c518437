"""Who may use a shared dashboard (issue 31 item 8): anyone the identity provider accepted got in, and cookie_secret =
"a" was accepted. Now an [access] allow-list of users or @domains is checked on every page; operators may submit,
cancel, re-run, tag, delete and calibrate, viewers only look, and the store refuses a viewer's write in the backend
call itself (dashboard/store_access.py), whatever asked for it; a weak cookie secret is refused with the reason.
OIDC login is seeded through AppTest.user (st.login cannot run offline); the browser test
(tests/e2e/test_browser_access.py) drives the trusted-proxy mode, whose identity header Chromium can send."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard.access_policy import Role, cookie_secret_problem, matches, parse_policy
from dashboard.serve import remote_access_problem
from db import queries as q
from db.session import open_db
from tests.helpers.store_helpers import fake_result, spec

APP = str(Path(__file__).resolve().parents[2] / "app.py")
PAGES = ("dashboard/pages/new_experiment.py", "dashboard/pages/runs.py", "dashboard/pages/run_detail.py",
         "dashboard/pages/compare.py", "dashboard/pages/formulas.py", "dashboard/pages/plan.py")
STRONG = secrets.token_hex(32)
AUTH = {"redirect_uri": "https://shardlab.example.com/oauth2callback", "cookie_secret": STRONG, "client_id": "shardlab",
        "client_secret": "s3cret", "server_metadata_url": "https://idp.example.com/.well-known/openid-configuration"}
ACCESS = {"operators": ["alice@example.com"], "viewers": ["@example.com"]}


def test_entries_match_users_and_exact_domains():
    policy, problems = parse_policy({"operators": ["Alice@Example.com"], "viewers": ["@example.com"]})
    assert problems == []
    assert policy.role("alice@example.com") == Role.OPERATOR and policy.role("bob@EXAMPLE.com") == Role.VIEWER
    for outsider in ("mallory@evil-example.com", "eve@sub.example.com", "@example.com", "example.com", "", None,
                     "a@b@example.com"):
        assert policy.role(outsider) is None, outsider
    assert matches("@example.com", "x@example.com") and not matches("@example.com", "x@example.com.evil")


@pytest.mark.parametrize("section, says", [({"viewers": ["*"]}, "no wildcards"),
                                           ({"operators": "alice@x.com"}, "a list"),
                                           ({"viewers": ["@localhost"]}, "not an @domain"),
                                           ({"operator": ["a@x.com"]}, "unknown keys operator")])
def test_a_wrong_list_says_what_is_wrong(section, says):
    _, problems = parse_policy(section)
    assert problems and says in problems[0]


@pytest.mark.parametrize("secret, says", [("a", "is 1 character long"), ("a" * 40, "only 1 different characters"),
                                          ("0123456789abcdef" * 2 + "0123", "repeats '0123456789abcdef'"),
                                          ("1234567890" * 3 + "98765432", "about 126 bits")])
def test_weak_cookie_secrets_are_refused_with_the_reason(secret, says):
    problem = cookie_secret_problem(secret)
    assert problem and says in problem and "token_hex(32)" in problem


def test_random_secrets_pass():
    assert (cookie_secret_problem(secrets.token_hex(16)) is None
            and cookie_secret_problem(secrets.token_urlsafe(32)) is None)


def _toml(auth: dict | None, access: dict | None) -> str:
    out = []
    for name, section in (("auth", auth), ("access", access)):
        if section is not None:
            out.append(f"[{name}]\n" + "".join(f"{k} = {_value(v)}\n" for k, v in section.items()))
    return "\n".join(out)


def _value(v) -> str:
    return "[" + ", ".join(f'"{x}"' for x in v) + "]" if isinstance(v, list) else f'"{v}"'


def test_a_remote_bind_needs_a_strong_secret_and_an_allow_list(tmp_path):
    path = tmp_path / "secrets.toml"
    path.write_text(_toml({**AUTH, "cookie_secret": "a"}, ACCESS))
    assert "cookie_secret is 1 character long" in remote_access_problem("0.0.0.0", env={}, paths=[path])
    path.write_text(_toml(AUTH, None))
    assert "lets in anyone your identity provider accepts" in remote_access_problem("0.0.0.0", env={}, paths=[path])
    path.write_text(_toml(AUTH, {"viewers": ["*"]}))
    assert "no wildcards" in remote_access_problem("0.0.0.0", env={}, paths=[path])
    path.write_text(_toml(AUTH, ACCESS))
    assert remote_access_problem("0.0.0.0", env={}, paths=[path]) is None
    proxy = {"SHARDLAB_TRUSTED_PROXY": "1"}
    assert remote_access_problem("0.0.0.0", env=proxy, paths=[]) is None  # the proxy decides who gets in
    path.write_text(_toml(None, {"viewers": "everyone"}))
    assert "must be a list" in remote_access_problem("0.0.0.0", env=proxy, paths=[path])


@pytest.fixture
def store(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'ui.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    monkeypatch.delenv("SHARDLAB_TRUSTED_PROXY", raising=False)
    import streamlit as st

    st.cache_data.clear()
    engine = open_db(url)
    eid = q.submit_experiment(engine, spec("finished"))
    q.claim_next(engine, "w")
    q.store_result(engine, eid, fake_result(spec("finished")))
    return engine


def _app(user: dict | None, auth: dict | None = AUTH, access: dict | None = ACCESS,
         script: str | None = None) -> AppTest:
    at = AppTest.from_string(script, default_timeout=60) if script else AppTest.from_file(APP, default_timeout=60)
    if auth is not None:
        at.secrets["auth"] = auth
    if access is not None:
        at.secrets["access"] = access
    if user is not None:
        at.user = user
    return at


def _texts(at: AppTest) -> str:
    return "\n".join(str(e.value) for kind in ("error", "info", "text", "markdown", "title") for e in at.get(kind))


def test_every_page_refuses_a_user_the_list_does_not_name(store):
    at = _app({"is_logged_in": True, "email": "mallory@evil-example.com"}).run()
    assert not at.exception
    for page in PAGES:
        at.switch_page(page).run()
        assert not at.exception, page
        assert "You may not use this dashboard" in _texts(at), page
        assert "mallory@evil-example.com is not on this dashboard's [access] list" in _texts(at)
        assert not at.get("plotly_chart") and not at.dataframe and not [b for b in at.button if b.key != "FormSubmitter"
                                                                         and b.label != "Log out"], page


def test_login_first_then_a_list_is_needed_and_a_weak_secret_refuses_everyone(store):
    at = _app({"is_logged_in": False}).run()
    assert [b.label for b in at.button] == ["Log in"] and not at.get("plotly_chart")
    at = _app({"is_logged_in": True, "email": "alice@example.com"}, access=None).run()
    assert "OIDC login alone would let in anyone" in _texts(at) and not at.get("plotly_chart")
    at = _app({"is_logged_in": True, "email": "alice@example.com"}, auth={**AUTH, "cookie_secret": "a"}).run()
    assert "cookie_secret is 1 character long" in _texts(at) and not at.get("plotly_chart")


def test_a_viewer_looks_and_every_write_button_is_disabled(store):
    at = _app({"is_logged_in": True, "email": "bob@example.com"}).run()
    assert not at.exception and at.get("plotly_chart")  # the prediction: viewers see every page
    assert at.button(key="submit_one").disabled and at.button(key="trace_full").disabled
    assert "bob@example.com (viewer, oidc)" in _texts(at)
    at.switch_page("dashboard/pages/runs.py").run()
    assert len(at.dataframe[0].value) == 1
    at.multiselect(key="runs_selected").set_value([1]).run()
    for key in ("act_rerun", "act_tag_apply", "act_delete", "act_cancel"):
        assert at.button(key=key).disabled, key
    assert not at.button(key="act_open").disabled  # looking is allowed


def test_an_operator_submits(store):
    at = _app({"is_logged_in": True, "email": "ALICE@example.com"}).run()
    assert not at.button(key="submit_one").disabled
    at.button(key="submit_one").click().run()
    assert not at.exception and any("Queued run #2" in s.value for s in at.success)
    assert [r["id"] for r in q.list_experiments(store)] == [2, 1]


WRITES = """
import streamlit as st
from dashboard import store_access
from tests.helpers.store_helpers import spec

write = {"submit": lambda: store_access.submit(spec("forged")), "cancel": lambda: store_access.cancel([1]),
         "requeue": lambda: store_access.requeue([1]), "tag": lambda: store_access.set_tags([1], "forged"),
         "delete": lambda: store_access.delete([1]), "trace": lambda: store_access.start_trace(spec("forged")),
         "calibrate": lambda: store_access.calibrate(hardware="cpu", tag="x", name="forged")}
write[st.session_state["write"]]()
st.text("WRITTEN")
"""


@pytest.mark.parametrize("write", ["submit", "cancel", "requeue", "tag", "delete", "trace", "calibrate"])
@pytest.mark.heavy
def test_the_store_refuses_a_viewers_write_whatever_asked_for_it(store, write):
    """The backend call itself refuses (a forged request, another page's button, a future one), not only the button."""
    before = q.list_experiments(store)
    at = _app({"is_logged_in": True, "email": "bob@example.com"}, script=WRITES)
    at.session_state["write"] = write
    at.run()
    assert not at.exception and "WRITTEN" not in _texts(at)
    assert any("Read-only access: you may view runs but not" in e.value for e in at.error)
    assert q.list_experiments(store) == before and q.get_experiment(store, 1)["tags"] == []


def test_the_trusted_proxy_without_a_list_lets_its_users_operate(store, monkeypatch):
    monkeypatch.setenv("SHARDLAB_TRUSTED_PROXY", "1")
    at = _app(None, auth=None, access=None, script=WRITES)
    at.session_state["write"] = "tag"
    at.run()
    assert "WRITTEN" in _texts(at) and q.get_experiment(store, 1)["tags"] == ["forged"]
