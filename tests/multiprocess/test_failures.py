"""A failing, killed, hung, out-of-memory or cancelled rank ends the whole job, attributed, with no orphans."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from backend.launch.launcher import run_experiment
from backend.result import RunResult, Status
from tests.helpers.launch import assert_no_orphans, job_env
from tests.helpers.specs import tiny_spec

pytestmark = pytest.mark.slow

TIMEOUT_S = 180.0  # generous: a failure must end the job long before this


def _run(tmp_path: Path, fault: str, timeout_s: float = TIMEOUT_S) -> tuple[RunResult, str]:
    env, job_id = job_env(fault)
    res = run_experiment(tiny_spec(timeout_s=timeout_s), workdir=tmp_path, extra_env=env)
    on_disk = RunResult.from_json((tmp_path / "result.json").read_text())
    assert on_disk.status == res.status and on_disk.error == res.error
    assert res.spec.parallel.world_size == 2 and res.log_tail
    assert_no_orphans(res, job_id)
    return res, job_id


HANG_TIMEOUT_S = 45  # the ranks must reach step 1 on a loaded host
HANGS = {"hung": ("hang:rank=1:step=1", "test_hung_collective_times_out"),
         "frozen": ("stop:rank=1:step=1", "test_a_frozen_rank_is_named_when_its_peer_hangs_in_a_collective")}


@pytest.fixture(scope="module", autouse=True)
def hung_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The runs that end only at their timeout (those of the selected tests), started with the module's first test:
    they spend their 45 s asleep in a collective, so waiting them out side by side, and beside the other tests, saves
    a worker 90 s."""
    selected = {item.name for item in request.session.items}
    with ThreadPoolExecutor(len(HANGS)) as pool:
        yield {name: pool.submit(_run, tmp_path_factory.mktemp(name), fault, HANG_TIMEOUT_S)
               for name, (fault, test) in HANGS.items() if test in selected}


def _predicted_memory_kept(res: RunResult) -> None:
    assert [r.rank for r in res.per_rank] == [0, 1]
    assert all(r.predicted.params_bytes > 0 and r.measured.peak_bytes == 0 for r in res.per_rank)


def test_rank_raising_fails_the_job(tmp_path: Path) -> None:
    res, _ = _run(tmp_path, "raise:rank=1:step=1")
    assert res.status == Status.FAILED and res.failing_rank == 1, res.error
    assert "injected fault on rank 1 at step 1" in res.traceback
    assert "injected fault" in res.error and "\n" not in res.error
    assert res.wall_s < TIMEOUT_S / 2
    _predicted_memory_kept(res)


def test_sigkilled_rank_fails_the_job(tmp_path: Path) -> None:
    res, _ = _run(tmp_path, "kill:rank=1:step=1")
    assert res.status == Status.FAILED and res.failing_rank == 1, res.error
    assert "SIGKILL" in res.error
    assert res.wall_s < TIMEOUT_S / 2


def test_out_of_memory_is_reported_as_oom(tmp_path: Path) -> None:
    res, _ = _run(tmp_path, "oom:rank=0:step=1")
    assert res.status == Status.OOM and res.failing_rank == 0, res.error
    assert "MemoryError" in res.traceback


def test_hung_collective_times_out(hung_runs: dict[str, Future]) -> None:
    res, _ = hung_runs["hung"].result()
    assert res.status == Status.TIMEOUT, res.error
    assert "timeout_s=45" in res.error
    # the stacks dumped at the timeout name the rank that never reached the collective
    assert res.failing_rank == 1 and "rank 1 is holding the job up" in res.error, res.error
    assert "maybe_inject" in res.error and "rank 0 inside torch" in res.error, res.error
    assert res.wall_s < 45 + 5 + 15  # timeout + SIGTERM grace + slack for a loaded machine


def test_a_frozen_rank_is_named_when_its_peer_hangs_in_a_collective(hung_runs: dict[str, Future]) -> None:
    """Issue 31: rank 1 frozen (SIGSTOP) at step 1; rank 0 blocks in the step's collective. Both ranks' stacks cannot
    be had (a stopped process does not run its signal handler), so the one that gave none is the culprit."""
    res, _ = hung_runs["frozen"].result()
    assert res.status == Status.TIMEOUT, res.error
    assert res.failing_rank == 1, res.error
    assert "rank 1 is holding the job up (did not answer the stack-dump signal" in res.error
    assert "rank 0 inside torch" in res.error and "rank 1 gave no stack" in res.error, res.error
    assert res.wall_s < 45 + 5 + 15


def test_cancel_mid_run(tmp_path: Path) -> None:
    env, job_id = job_env("hang:rank=0:step=2")  # never finishes on its own
    cancel = threading.Event()
    res = run_experiment(tiny_spec(timeout_s=TIMEOUT_S), workdir=tmp_path, extra_env=env, cancel=cancel,
                         on_progress=lambda event: cancel.set())
    assert res.status == Status.CANCELLED, res.error
    assert res.wall_s < TIMEOUT_S / 2
    assert_no_orphans(res, job_id)
