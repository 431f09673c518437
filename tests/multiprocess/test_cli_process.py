"""The CLI as a process (issue 31 item 9): a reader that closes the pipe early (`show 1 | head`) gets no traceback from
any command that prints, the commands that only queue or read never import torch (~7 CPU-s and ~275 MB each), nor
does the launcher around the ranks of a CPU run."""

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


LAUNCHER_SIDE = """
import json, shutil, sys
from pathlib import Path
from backend.launch.launcher import assembled_result, preflight
from backend.spec import ExperimentSpec
spec = ExperimentSpec.model_validate(json.loads(sys.argv[1]))
work = Path(sys.argv[2])
shutil.copy(sys.argv[3], work / "ranks.json")
result = assembled_result(spec, work, None, {}, "")
print(json.dumps({"preflight": preflight(spec), "status": str(result.status), "step_s": result.step_s_median,
                  "predicted_step_s": result.step_time_predicted_s,
                  "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:5]}),
      file=sys.stderr)
"""


def test_the_launcher_side_of_a_run_imports_no_torch(tmp_path):
    """What a worker or `run` does around the ranks of a CPU run: the preflight of an `auto` device on this CPU-only
    torch, and the result assembled from the ranks' file (before: torch and the strategies were imported for the
    cuda check and a strategy's name, ~3 CPU-s a run)."""
    from tests.unit.test_protocol import OLD_RUNS, OLD_SPECS
    from tests.unit.test_protocol import TINY as SPEC

    spec = {**SPEC, **OLD_SPECS["torch_ddp"], "runtime": {"timeout_s": 120}}
    profile = tmp_path / "hardware_cpu.json"  # the step-time prediction's (a fresh clone has not probed this host yet)
    profile.write_text(json.dumps({"name": "test host", "kind": "cpu", "peak_flops": {"fp32": 5e10},
                                   "hbm_bytes_per_s": 1e10, "intra_bytes_per_s": 1e9, "inter_bytes_per_s": 1e9,
                                   "cores": 2}))
    done = subprocess.run([sys.executable, "-c", LAUNCHER_SIDE, json.dumps(spec), str(tmp_path),
                           str(OLD_RUNS / "torch_ddp.json")], cwd=REPO,
                          env={**_env(), "SHARDLAB_CPU_PROFILE": str(profile)}, capture_output=True, text=True,
                          timeout=120)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["preflight"] is None and report["status"] == "ok" and report["step_s"] > 0, done.stderr[-2000:]
    assert report["predicted_step_s"] is not None and report["torch"] == [], done.stderr[-2000:]
