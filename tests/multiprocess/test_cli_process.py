"""The CLI as a process (issue 31 item 9): a reader that closes the pipe early (`show 1 | head`) gets no traceback from
any command that prints, and the commands that only queue or read never import torch (~7 CPU-s and ~275 MB each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from db.session import REPO

TINY = ["--world", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--vocab", "64",
        "--global-batch", "4", "--micro-batch", "2", "--steps", "2"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store holding one queued run (#1)."""
    from backend.cli import main

    url = f"sqlite:///{tmp_path_factory.mktemp('cli') / 'cli.db'}"
    assert main(["submit", "--db", url, *TINY]) == 0
    return url


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("command", [["show", "1"], ["show", "1", "--json"], ["list"], ["list", "--json"], ["export"],
                                     ["export", "--format", "json"], ["estimate", *TINY], ["hardware"]],
                         ids=lambda c: " ".join(c[:3]))
def test_a_reader_that_closes_the_pipe_gets_no_traceback(store, command):
    """stdout's read end is closed before the command writes, so its first write meets EPIPE, as under `| head` on a
    long output (before: `BrokenPipeError` and a traceback on stderr, exit 1)."""
    db = ["--db", store] if command[0] in ("show", "list", "export") else []
    proc = subprocess.Popen([sys.executable, "-m", "backend", *command, *db], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


LIGHT = """
import json, sys
from backend.cli import main
url = sys.argv[1]
tiny = json.loads(sys.argv[2])
codes = [main(["submit", "--db", url, *tiny, "--tag", "light"]), main(["list", "--db", url]),
         main(["show", "1", "--db", url]), main(["export", "--db", url]),
         main(["export", "--db", url, "--format", "json"]), main(["estimate", *tiny]),
         main(["estimate", "--preset", "llama-3-8b", "--world", "8", "--global-batch", "16", "--hardware", "h100-sxm"])]
print(json.dumps({"codes": codes,
                  "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:5]}),
      file=sys.stderr)
"""


def test_submit_list_show_export_and_estimate_never_import_torch(store):
    """All in one process: a queue insert and the reads need the spec and the store, not torch."""
    done = subprocess.run([sys.executable, "-c", LIGHT, store, json.dumps(TINY)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report == {"codes": [0] * 7, "torch": []}, done.stderr[-2000:]


def test_the_submit_entry_point_imports_no_torch(store):
    """`python -m backend submit` itself (the entry point and every module it loads), read off -X importtime."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "backend", "submit", "--db", store, *TINY],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "backend.cli.spec_flags" in imported and "db.queries" in imported  # (the list is read right)
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
