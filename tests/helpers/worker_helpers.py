"""What the worker tests share: waiting for a condition, a runner that stands in for the launcher, a SLURM spec."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from backend.result import RunResult, Status
from backend.spec import validate_spec
from tests.helpers.store_helpers import fake_result

SLURM_TINY = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16, "vocab_size": 64},
              "train": {"global_batch": 4, "micro_batch": 1, "steps": 2}}


def slurm_spec(world=4, nodes=2, **runtime):
    spec, problems = validate_spec({**SLURM_TINY, "parallel": {"strategy": "ddp", "world_size": world},
                                    "runtime": {"executor": "slurm", "nnodes": nodes, **runtime}})
    assert not problems, problems
    return spec


def wait_for(predicate, timeout_s: float = 60.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {predicate}")


class FakeRunner:
    """Stands in for run_experiment in the fast tests: reports progress, then waits for cancel or release."""

    def __init__(self, *, block: bool = False, raises: Exception | None = None):
        self.block, self.raises = block, raises
        self.calls: list[dict] = []
        self.release = threading.Event()
        self.started = threading.Event()  # set once the run is under way (progress reported)

    def __call__(self, spec, *, workdir, on_progress=None, cancel=None, extra_env=None) -> RunResult:
        self.calls.append({"workdir": Path(workdir), "extra_env": extra_env})
        on_progress({"step": 1, "of": 3, "phase": "timed"})
        self.started.set()
        if self.raises:
            raise self.raises
        if self.block:
            while not cancel.is_set() and not self.release.is_set():
                time.sleep(0.01)
            if cancel.is_set():
                return RunResult(status=Status.CANCELLED, spec=spec, error="cancelled after 0.1 s")
        return fake_result(spec)
