"""Real browser, issue 30 item 7: an idle tab asks the server for nothing. Counted as the websocket frames Chromium
sends (each a BackMsg: a fragment timer's rerun, any rerun): 0 over 12 s on an idle page (before: the worker badge's
5 s timer, on every page). While a run is queued the Runs page follows it; once it has ended the tab goes quiet again.
The CPU this saves is measured by benchmarks/idle_dashboard.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from benchmarks.idle_dashboard import CHROMIUM, free_port, open_idle_tab, start_dashboard, stop
from db import queries as q
from db.session import open_db
from tests.helpers.store_helpers import fake_result, spec

pytestmark = [pytest.mark.browser, pytest.mark.slow]
QUIET_S = 12


def test_an_idle_tab_sends_nothing_and_a_finished_run_ends_the_polling():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium")
    pytest.importorskip("playwright.sync_api", reason="python playwright is not installed (requirements-test.txt)")
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'idle.db'}"
        engine = open_db(url)
        port = free_port()
        proc = start_dashboard(url, port, Path(tmp) / "app.log")
        try:
            pw, browser, page, frames = open_idle_tab(f"http://127.0.0.1:{port}/", settle_s=3)
            try:
                before = frames.sent
                page.wait_for_timeout(QUIET_S * 1000)
                assert frames.sent == before, f"{frames.sent - before} reruns in {QUIET_S} s of an idle New experiment"
                eid = q.submit_experiment(engine, spec("waits"))
                page.goto(f"http://127.0.0.1:{port}/runs")
                page.get_by_text("In progress").wait_for()
                before = frames.sent
                page.wait_for_timeout(5000)
                assert frames.sent - before >= 2  # the live progress (2 s) and the badge (5 s) follow the queued run
                q.claim_next(engine, "w")
                q.store_result(engine, eid, fake_result(spec("waits")))
                page.get_by_text("In progress").wait_for(state="detached", timeout=60_000)  # the page noticed
                page.wait_for_timeout(3000)
                before = frames.sent
                page.wait_for_timeout(QUIET_S * 1000)
                assert frames.sent == before, f"{frames.sent - before} reruns in {QUIET_S} s after the run ended"
            finally:
                browser.close()
                pw.stop()
        finally:
            stop(proc)
