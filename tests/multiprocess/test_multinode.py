"""Two launcher invocations as two torchrun "nodes" on 127.0.0.1 (c10d rendezvous), one rank each.

With the c10d rendezvous torchrun assigns global ranks in rendezvous order (node_rank is only a label),
so global rank 0 - and with it ranks.json and the measurements - lands on one of the two nodes. That
node's launcher returns the full result; the other returns status ok with no per-rank rows, a note
saying where the measurements are, and env.launch.holds_measurements = False.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch

from backend.launch.launcher import run_experiment
from backend.result import RunResult, Status
from backend.spec import ExperimentSpec
from tests.helpers.launch import assert_no_orphans, job_env
from tests.helpers.specs import tiny_spec

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shape(res: RunResult) -> dict:
    data = res.model_dump(mode="json", by_alias=True)
    return {
        "filled": sorted(k for k, v in data.items() if v not in (None, [], {}) and k not in ("env", "wall_s")),
        "per_rank": [sorted(k for k, v in r.items() if v not in (None, [], {})) for r in data["per_rank"]],
        "measured": [sorted(k for k, v in r["measured"].items() if v) for r in data["per_rank"]],
    }


def _standalone(workdir: Path) -> RunResult:
    """The ok path of one standalone run: progress, result.json, spec.json, log.txt, no stale files, no orphans."""
    workdir.mkdir()
    (workdir / "rank-1.error.json").write_text("{}")  # stale file from an earlier run: must be ignored
    env, job_id = job_env()
    events: list[dict] = []
    spec = tiny_spec(timeout_s=150)
    res = run_experiment(spec, workdir=workdir, on_progress=events.append, extra_env=env)
    assert res.status == Status.OK, f"{res.error}\n{res.traceback}\n{res.log_tail}"
    assert [r.rank for r in res.per_rank] == [0, 1]
    assert all(len(r.step_s) == spec.train.steps for r in res.per_rank)
    assert events and all({"step", "of", "phase"} <= e.keys() for e in events)
    assert res.started_at and res.finished_at and res.wall_s > 0
    on_disk = RunResult.from_json((workdir / "result.json").read_text())
    assert on_disk.status == Status.OK and on_disk.spec == spec and on_disk.wall_s == res.wall_s
    assert ExperimentSpec.from_json((workdir / "spec.json").read_text()) == spec
    assert "SHARDLAB_PROGRESS" in (workdir / "log.txt").read_text()
    assert not (workdir / "rank-1.error.json").exists()
    assert_no_orphans(res, job_id)
    return res


def test_two_nodes_match_a_standalone_run(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    results: dict[int, RunResult] = {}
    jobs: dict[int, str] = {}

    def node(rank: int) -> None:
        env, jobs[rank] = job_env()
        spec = tiny_spec(nnodes=2, node_rank=rank, rdzv_endpoint=endpoint, timeout_s=150)
        results[rank] = run_experiment(spec, workdir=tmp_path / f"node{rank}", extra_env=env)

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(results) == {0, 1}
    for r, res in results.items():
        assert res.status == Status.OK, f"node {r}: {res.error}\n{res.traceback}\n{res.log_tail}"
        assert_no_orphans(res, jobs[r])

    holders = [r for r, res in results.items() if res.per_rank]
    assert len(holders) == 1, "exactly one node hosts global rank 0 and holds the measurements"
    full, other = results[holders[0]], results[1 - holders[0]]
    assert (tmp_path / f"node{holders[0]}" / "ranks.json").exists()
    assert other.env["launch"]["holds_measurements"] is False and "global rank 0" in other.notes[0]

    alone = _standalone(tmp_path / "standalone")
    assert _shape(full) == _shape(alone)
    assert [r.rank for r in full.per_rank] == [0, 1]
    if alone.loss:  # same seed and data: the two-node job trains exactly like the one-node job
        torch.testing.assert_close(full.loss, alone.loss)
