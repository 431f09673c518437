"""`make run` (dashboard/serve.py) as a program: a non-loopback bind is refused, the trusted-proxy opt-out starts it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from db.session import REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_run_refuses_to_start_on_all_interfaces(tmp_path):
    port = _free_port()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SHARDLAB_NO_WORKER": "1"}
    done = subprocess.run(["make", "-s", "-o", ".venv/.installed", "run", "HOST=0.0.0.0", f"PORT={port}", f"PY={sys.executable}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "refusing to serve the dashboard on 0.0.0.0" in done.stderr, done.stderr
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "something listens: the dashboard started anyway"


@pytest.mark.slow
def test_the_trusted_proxy_opt_out_starts_the_dashboard(tmp_path):
    port = _free_port()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SHARDLAB_NO_WORKER": "1", "SHARDLAB_TRUSTED_PROXY": "1",
           "SHARDLAB_DB_URL": f"sqlite:///{tmp_path / 'ui.db'}"}
    proc = subprocess.Popen([sys.executable, "-m", "dashboard.serve", "--host", "0.0.0.0", "--port", str(port)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, ok = time.monotonic() + 120, False
        while time.monotonic() < deadline and not ok and proc.poll() is None:
            try:
                ok = urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok"
            except OSError:
                time.sleep(0.5)
        assert ok, proc.stdout.read1().decode() if proc.poll() is not None else "no health answer"
    finally:
        proc.terminate()
        proc.wait(30)
