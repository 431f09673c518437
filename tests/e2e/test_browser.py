"""Real browser: headless Debian Chromium drives the running dashboard end to end, with a real worker.

Submits a tiny experiment through the form, waits for the worker to finish it, opens the run detail and
checks the measured-vs-predicted plotly chart; saves a screenshot of every page under test-artifacts/.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"dashboard did not answer at {url} within {timeout_s} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def dashboard(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="python playwright is not installed (requirements-test.txt)")
    port = _free_port()
    env = dict(os.environ, SHARDLAB_DB_URL=f"sqlite:///{tmp_path / 'browser.db'}", SHARDLAB_NO_WORKER="1",
               OMP_NUM_THREADS="1")
    app = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.address", "127.0.0.1",
                            "--server.port", str(port),
                            "--server.headless", "true", "--browser.gatherUsageStats", "false"],
                           cwd=ROOT, env=env, stdout=open(tmp_path / "app.log", "wb"), stderr=subprocess.STDOUT,
                           start_new_session=True)
    worker = subprocess.Popen([sys.executable, "-m", "backend", "worker"], cwd=ROOT, env=env,
                              stdout=open(tmp_path / "worker.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}", 90)
        yield f"http://127.0.0.1:{port}", env["SHARDLAB_DB_URL"], tmp_path
    finally:
        _stop(worker)
        _stop(app)


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _wait_finished(db_url: str, eid: int, timeout_s: float) -> dict:
    from db.queries import get_experiment
    from db.session import open_db

    eng = open_db(db_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        e = get_experiment(eng, eid)
        if e and e["status"] not in ("queued", "running"):
            return e
        time.sleep(2)
    raise TimeoutError(f"run #{eid} did not finish within {timeout_s} s")


def test_submit_watch_and_inspect_in_a_real_browser(dashboard):
    from playwright.sync_api import expect, sync_playwright

    url, db_url, tmp = dashboard
    # the first script run imports torch-free but plotly/pandas-heavy modules on a busy CPU
    expect.set_options(timeout=90_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        # Streamlit scrolls inside the page: tall viewport
        page = browser.new_page(viewport={"width": 1500, "height": 2000})
        page.set_default_timeout(60_000)
        page.goto(url)
        expect(page.get_by_text("New experiment").first).to_be_visible()
        expect(page.locator(".js-plotly-plot").first).to_be_visible()  # the live prediction
        name = page.get_by_label("Name (optional)")
        name.fill("browser run")
        name.press("Enter")
        page.wait_for_timeout(1000)
        _shot(page, "1_new_experiment")
        page.get_by_role("button", name="Run this experiment").click()
        expect(page.get_by_text("Queued run #1")).to_be_visible()

        page.goto(f"{url}/runs")
        expect(page.get_by_text("Showing 1 of 1 runs")).to_be_visible()
        expect(page.locator('[data-testid="stDataFrame"]')).to_be_visible()
        page.wait_for_timeout(1500)
        _shot(page, "2_runs_in_progress")
        run = _wait_finished(db_url, 1, 300)
        assert run["status"] == "ok", (run["error"], (tmp / "worker.log").read_text()[-3000:])
        page.reload()
        expect(page.get_by_text("Showing 1 of 1 runs")).to_be_visible()
        expect(page.locator('[data-testid="stDataFrame"]')).to_be_visible()
        page.wait_for_timeout(1500)
        _shot(page, "2_runs_finished")

        page.goto(f"{url}/detail?run=1")
        chart = page.locator(".js-plotly-plot").filter(has_text="measured vs predicted")
        expect(chart).to_be_visible()
        expect(chart).to_contain_text("predicted")
        expect(chart.locator(".xtick").first).to_be_visible()
        assert chart.locator("g.point").count() >= 4  # bars for 2 ranks x (measured, predicted)
        expect(page.get_by_text("Training loss vs single-process reference")).to_be_visible()
        page.wait_for_timeout(1500)
        _shot(page, "3_run_detail")

        page.goto(f"{url}/compare")
        expect(page.get_by_text("Comparing needs at least two runs")).to_be_visible()
        page.wait_for_timeout(1000)
        _shot(page, "4_compare")
        page.goto(f"{url}/formulas")
        expect(page.locator(".js-plotly-plot").first).to_be_visible()
        page.wait_for_timeout(1500)
        _shot(page, "5_formulas")
        browser.close()
