"""`make run` as a user starts it (dashboard.serve), with a real browser session (issue 20 items 7, 8 and 11): the idle
dashboard watches no files, no metric on the home page is cut off, and the worker it started stops when the
dashboard stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.e2e.test_browser import CHROME_ARGS, CHROMIUM, ROOT, _free_port, _wait_http

pytestmark = [pytest.mark.browser, pytest.mark.slow]


CUT_OFF = """() => Array.from(document.querySelectorAll('[data-testid="stMetric"] *'))
    .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)"""
"""Text inside a metric that overflows its box (Streamlit cuts it off with an ellipsis: "527.00 …")."""


def inotify_watches(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                n += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            continue
    return n


def _workers_of(db_url: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline())
            if "backend" in cmd and " worker" in cmd and p.environ().get("SHARDLAB_DB_URL") == db_url \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def test_make_run_watches_no_files_and_its_worker_stops_with_it(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium")
    pytest.importorskip("playwright.sync_api", reason="python playwright is not installed (requirements-test.txt)")
    from playwright.sync_api import sync_playwright

    port, db_url = _free_port(), f"sqlite:///{tmp_path / 'life.db'}"
    env = {k: v for k, v in os.environ.items() if k != "SHARDLAB_NO_WORKER"}  # as `make run`: the dashboard starts one
    env.update(SHARDLAB_DB_URL=db_url, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    app = subprocess.Popen([sys.executable, "-m", "dashboard.serve", "--port", str(port)], cwd=ROOT, env=env,
                           stdout=open(tmp_path / "app.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}", 90)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}")
            page.get_by_text("it stops when the dashboard stops").first.wait_for(timeout=90_000)
            page.get_by_text("flash saves").first.wait_for(timeout=90_000)  # the last metric of the prediction
            assert page.evaluate(CUT_OFF) == [], "metric labels and values cut off with an ellipsis"
            assert inotify_watches(app.pid) == 0, "the dashboard must not watch the checkout (Streamlit file watcher)"
            workers = _workers_of(db_url)
            assert len(workers) == 1, "the dashboard started its worker"
            browser.close()
        os.killpg(app.pid, signal.SIGINT)  # Ctrl-C in the terminal of `make run`
        app.wait(30)
        gone, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive, "the worker the dashboard started outlived it"
    finally:
        if app.poll() is None:
            os.killpg(app.pid, signal.SIGKILL)
        for w in _workers_of(db_url):
            w.kill()
