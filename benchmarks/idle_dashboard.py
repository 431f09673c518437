"""What an idle dashboard costs: one real Chromium tab left open on a page, nothing queued or running.

Starts the dashboard (`streamlit run app.py`, no worker, a scratch SQLite store), opens the page in headless Chromium,
lets it settle, then for --seconds measures, side by side with the same tab on about:blank:
  - the server's CPU (psutil cpu_times of the Streamlit process, user + system) as % of one core,
  - Chromium's CPU (every process of the browser playwright started) as % of one core,
  - the reruns the tab asked for: websocket frames the browser sent (each is a BackMsg: a fragment's timer, a rerun).
Issue 30: one tab open for 120 s cost the server 7.8% of a core and Chromium 4.7% (about:blank: 0.6%): the worker
badge's fragment re-ran every 5 s on every page. The goal is under 1% for the server, and 0 reruns while idle.

Run: .venv/bin/python benchmarks/idle_dashboard.py [--seconds 60] [--settle-s 10] [--page /] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]
SERVER_TARGET_PCT = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_dashboard(db_url: str, port: int, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`streamlit run app.py` on 127.0.0.1:port with no worker; returns once /_stcore/health answers."""
    env = {**os.environ, "SHARDLAB_DB_URL": db_url, "SHARDLAB_NO_WORKER": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.address", "127.0.0.1",
                             "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats",
                             "false", "--server.fileWatcherType", "none"], cwd=ROOT, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"the dashboard did not answer within 120 s (log: {log})")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def browser_processes() -> list[psutil.Process]:
    """The Chromium processes under this one (playwright's driver starts the browser)."""
    return [p for p in psutil.Process().children(recursive=True) if "chrom" in p.name().lower()]


class FrameCounter:
    """Websocket frames the page sends (each a BackMsg: a rerun request, a fragment timer's rerun)."""

    def __init__(self, page) -> None:
        self.sent = 0
        page.on("websocket", lambda ws: ws.on("framesent", self._sent))

    def _sent(self, _payload) -> None:
        self.sent += 1


def measure(page, server: psutil.Process, frames: FrameCounter, seconds: float) -> dict[str, float]:
    """Server and browser CPU (% of one core) and frames sent over `seconds` of doing nothing."""
    browser = browser_processes()
    s0, b0, f0, t0 = cpu_s([server]), cpu_s(browser), frames.sent, time.monotonic()
    page.wait_for_timeout(seconds * 1000)
    dt = time.monotonic() - t0
    return {"seconds": round(dt, 1), "server_cpu_pct": round(100 * (cpu_s([server]) - s0) / dt, 2),
            "chromium_cpu_pct": round(100 * (cpu_s(browser) - b0) / dt, 2), "frames_sent": frames.sent - f0}


def wait_script_done(page) -> None:
    """Until the page's script run has ended (Streamlit's stApp data-test-script-state): on a busy host the first run
    of a page takes seconds, and its "running" indicator animates the whole time (which is not idle)."""
    page.locator('[data-testid="stApp"][data-test-script-state="notRunning"]').wait_for()


def open_idle_tab(url: str, *, settle_s: float, headers: dict[str, str] | None = None):
    """(playwright, browser, page, frame counter) with `url` loaded and settled."""
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": 1200}, extra_http_headers=headers)
    page.set_default_timeout(120_000)
    frames = FrameCounter(page)
    page.goto(url)
    page.locator('[data-testid="stSidebar"]').get_by_text("ShardLab", exact=True).wait_for()
    page.locator("h1").first.wait_for()
    wait_script_done(page)
    page.wait_for_timeout(settle_s * 1000)
    return pw, browser, page, frames


def run(seconds: float, settle_s: float, path: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = start_dashboard(f"sqlite:///{Path(tmp) / 'idle.db'}", port, Path(tmp) / "app.log")
        try:
            server = psutil.Process(proc.pid)
            pw, browser, page, frames = open_idle_tab(f"http://127.0.0.1:{port}{path}", settle_s=settle_s)
            try:
                on_page = measure(page, server, frames, seconds)
                page.goto("about:blank")
                page.wait_for_timeout(settle_s * 1000)
                blank = measure(page, server, frames, seconds)
            finally:
                browser.close()
                pw.stop()
        finally:
            stop(proc)
    return {"page": path, "tab_on_page": on_page, "tab_on_about_blank": blank, "load_avg_1m": os.getloadavg()[0],
            "cores": os.cpu_count(), "server_target_pct": SERVER_TARGET_PCT,
            "verdict": "meets" if on_page["server_cpu_pct"] < SERVER_TARGET_PCT and on_page["frames_sent"] == 0
            else "misses"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--settle-s", type=float, default=10.0)
    ap.add_argument("--page", default="/", help="path of the page left open (/, /runs, /detail, /compare, /plan)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = run(args.seconds, args.settle_s, args.page)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for phase in ("tab_on_page", "tab_on_about_blank"):
            m = out[phase]
            print(f"{phase:>18}: server {m['server_cpu_pct']:.2f}% of a core, chromium {m['chromium_cpu_pct']:.2f}%, "
                  f"{m['frames_sent']} frames sent in {m['seconds']:.0f} s")
        print(f"load average {out['load_avg_1m']:.2f} on {out['cores']} cores; server target < {SERVER_TARGET_PCT}% "
              f"with no rerun while idle: {out['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
