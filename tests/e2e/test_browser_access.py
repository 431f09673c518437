"""Real browser, issue 31 item 8: who may use a shared dashboard, and with which rights. The dashboard runs in
trusted-proxy mode (SHARDLAB_TRUSTED_PROXY=1), where an authenticating proxy names the user in X-Forwarded-Email;
Chromium sends that header itself, standing in for the proxy (st.login's OIDC cannot run offline; the same [access]
list and roles are checked for OIDC users in tests/unit/test_access_control.py). An operator submits and may cancel,
a viewer sees the pages with every write disabled, anyone else, or a request without the header, sees only the
refusal, on every page."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.test_browser import CHROME_ARGS, CHROMIUM, ROOT, _free_port, _shot, _stop, _wait_http

pytestmark = [pytest.mark.browser, pytest.mark.slow]
SECRETS = """[access]
operators = ["alice@example.com"]
viewers = ["@example.com"]
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium")
    pytest.importorskip("playwright.sync_api", reason="python playwright is not installed (requirements-test.txt)")
    tmp = tmp_path_factory.mktemp("access")
    (tmp / "secrets.toml").write_text(SECRETS)
    url = f"sqlite:///{tmp / 'ui.db'}"
    port = _free_port()
    env = dict(os.environ, SHARDLAB_DB_URL=url, SHARDLAB_NO_WORKER="1", OMP_NUM_THREADS="1", SHARDLAB_TRUSTED_PROXY="1")
    app = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.address", "127.0.0.1",
                            "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats",
                            "false", "--secrets.files", str(tmp / "secrets.toml")],
                           cwd=ROOT, env=env, stdout=open(tmp / "app.log", "wb"), stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}", 90)
        yield f"http://127.0.0.1:{port}", url
    finally:
        _stop(app)


@pytest.fixture(scope="module")
def chromium():
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=90_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        yield browser
        browser.close()


def _as(chromium, user: str | None):
    """A page whose every request (the websocket's included) names `user` as the proxy would."""
    context = chromium.new_context(viewport={"width": 1500, "height": 1600},
                                   extra_http_headers={"X-Forwarded-Email": user} if user else None)
    page = context.new_page()
    page.set_default_timeout(60_000)
    return page


def test_an_operator_submits_and_may_cancel_a_viewer_may_only_look(served, chromium):
    from playwright.sync_api import expect

    from db import queries as q
    from db.session import open_db

    url, db_url = served
    alice = _as(chromium, "alice@example.com")
    alice.goto(url)
    expect(alice.get_by_text("Signed in: alice@example.com (operator, proxy)")).to_be_visible()
    run = alice.get_by_role("button", name="Run this experiment")
    expect(run).to_be_enabled()
    run.click()
    expect(alice.get_by_text("Queued run #1")).to_be_visible()
    assert [r["id"] for r in q.list_experiments(open_db(db_url))] == [1]
    alice.goto(f"{url}/detail?run=1")
    expect(alice.get_by_role("button", name="Cancel this run")).to_be_enabled()

    bob = _as(chromium, "bob@example.com")
    bob.goto(url)
    expect(bob.get_by_text("Signed in: bob@example.com (viewer, proxy)")).to_be_visible()
    expect(bob.locator(".js-plotly-plot").first).to_be_visible()  # the prediction: viewers see the pages
    expect(bob.get_by_role("button", name="Run this experiment")).to_be_disabled()
    expect(bob.get_by_role("button", name="Trace at full size")).to_be_disabled()
    _shot(bob, "access_viewer_new_experiment")
    bob.goto(f"{url}/detail?run=1")
    expect(bob.locator("h3").filter(has_text="#1")).to_be_visible()
    expect(bob.get_by_role("button", name="Cancel this run")).to_be_disabled()
    bob.goto(f"{url}/runs")
    expect(bob.get_by_text("Showing 1 of 1 runs")).to_be_visible()
    for name in ("Re-run", "Apply tags", "Delete"):
        expect(bob.get_by_role("button", name=name)).to_be_disabled()
    assert q.get_experiment(open_db(db_url), 1)["status"] == "queued"


@pytest.mark.parametrize("user, why", [("mallory@evil-example.com",
                                        "mallory@evil-example.com is not on this dashboard's [access] list"),
                                       (None, "the proxy sent no X-Forwarded-Email header naming the user")])
def test_anyone_else_sees_only_the_refusal_on_every_page(served, chromium, user, why):
    from playwright.sync_api import expect

    url, _ = served
    page = _as(chromium, user)
    for path in ("", "/runs", "/detail?run=1", "/compare", "/formulas", "/plan", "/new"):
        page.goto(f"{url}{path}")
        expect(page.get_by_text("You may not use this dashboard")).to_be_visible()
        expect(page.get_by_text(why)).to_be_visible()
        assert page.locator(".js-plotly-plot, [data-testid='stDataFrame']").count() == 0, path
        assert page.get_by_role("button", name="Run this experiment").count() == 0
    _shot(page, f"access_refused_{'no_header' if user is None else 'outsider'}")
