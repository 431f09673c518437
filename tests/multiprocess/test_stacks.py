"""A real faulthandler dump of another process, read back by the launcher's stack reader."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from backend.runtime.protocol import parse_dump, stack_path


def test_faulthandler_dump_round_trips(tmp_path):
    """A real process registered with enable_stack_dump writes a dump parse_dump understands."""
    code = ("import time\n"
            "from backend.runtime.protocol import enable_stack_dump\n"
            f"enable_stack_dump({str(tmp_path)!r}, 3)\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGUSR1)
        for _ in range(50):  # faulthandler writes from the signal handler, asynchronously
            if "<module>" in stack_path(tmp_path, 3).read_text():
                break
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    threads = parse_dump(stack_path(tmp_path, 3).read_text())
    assert any(f[2] == "<module>" for t in threads for f in t)
