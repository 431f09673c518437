"""Real browser, issue 21 item 11: names, tags, errors and notes are shown as plain text. A run whose name, tags,
error and notes carry markdown images, links, autolinks, HTML and Streamlit directives pointing at a local
"outside" server is opened on Run detail and on Runs: no request reaches that server (none leaves the browser
for it), no link or image to it is in the page, and the text is shown as typed."""

from __future__ import annotations

import http.server
import threading

import pytest

from tests.e2e.test_browser import CHROME_ARGS, CHROMIUM, _shot, dashboard  # noqa: F401 - the fixture is used by name
from tests.helpers.store_helpers import fake_result

pytestmark = [pytest.mark.browser, pytest.mark.slow]


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.seen.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def outside():
    """An HTTP server standing in for an attacker's: it records every request it gets."""
    _Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"127.0.0.1:{server.server_address[1]}", _Recorder.seen
    server.shutdown()


def _store_hostile_run(db_url: str, host: str) -> tuple[int, str]:
    from backend.spec import ExperimentSpec
    from db import queries as q
    from db.session import open_db

    name = f"![pixel](http://{host}/name.png) [log in](http://{host}/phish) :red[alert]"
    tags = [f"http://{host}/bare-tag", f"![t](http://{host}/tag.png)", f"<img src=http://{host}/html.png>"]
    spec = ExperimentSpec.model_validate({
        "name": name, "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16, "vocab_size": 64},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2}, "parallel": {"strategy": "ddp", "world_size": 2}})
    engine = open_db(db_url)
    eid = q.submit_experiment(engine, spec, tags=tags)
    q.claim_next(engine, "w")
    result = fake_result(spec, "failed")  # with per-rank rows, so the page shows the result and its notes
    result.error = f"rank 0: see ![e](http://{host}/error.png) or www.{host}.example"
    result.notes = [f"note with [a link](http://{host}/note) and ![n](http://{host}/note.png)"]
    q.store_result(engine, eid, result)
    return eid, name


def test_user_text_never_makes_the_browser_fetch_or_link_anything(dashboard, outside):  # noqa: F811 - pytest fixture
    from playwright.sync_api import expect, sync_playwright

    url, db_url, _ = dashboard
    host, seen = outside
    eid, name = _store_hostile_run(db_url, host)
    expect.set_options(timeout=90_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1800})
        page.set_default_timeout(60_000)
        asked: list[str] = []
        page.on("request", lambda r: asked.append(r.url) if host in r.url else None)
        page.goto(f"{url}/detail?run={eid}")
        expect(page.locator("h3").filter(has_text=f"#{eid}")).to_be_visible()
        expect(page.get_by_text("ddp · world 2").first).to_be_visible()
        page.wait_for_timeout(3000)  # time for any image to be fetched
        _shot(page, "hostile_text_run_detail")
        assert asked == [] and seen == [], (asked, seen)
        assert page.locator(f'a[href*="{host}"], img[src*="{host}"]').count() == 0
        expect(page.get_by_text(name, exact=True)).to_be_visible()  # shown as typed
        expect(page.get_by_text("rank 0: see ![e]", exact=False).first).to_be_visible()
        expect(page.get_by_text("note with [a link]", exact=False).first).to_be_visible()
        page.goto(f"{url}/runs")
        expect(page.get_by_text("Showing 1 of 1 runs")).to_be_visible()
        page.wait_for_timeout(3000)
        _shot(page, "hostile_text_runs")
        runs_links = page.locator(f'a[href*="{host}"], img[src*="{host}"]').count()
        browser.close()
    assert asked == [] and seen == [], (asked, seen)
    assert runs_links == 0
