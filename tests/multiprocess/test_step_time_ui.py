"""The worker measures this host (the cpu profile, in a child process) once, before its first local run."""

from __future__ import annotations

import pytest

from backend.bench import cpu_profile
from tests.helpers.store_helpers import fake_result, spec


@pytest.mark.slow
def test_worker_measures_this_host_once_before_its_first_local_run(tmp_path, monkeypatch):
    """The real probe (hw_probe in a child process, ~10 s) writes the profile the step-time model loads as 'cpu'."""
    from backend.analytic.steptime.hardware import get_hardware
    from backend.worker.service import Worker
    from db import queries as q
    from db.session import open_db

    path = tmp_path / "hardware_cpu.json"
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(path))
    monkeypatch.setenv(cpu_profile.AUTO_ENV, "1")
    engine = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    ids = [q.submit_experiment(engine, spec(name)) for name in ("first", "second")]
    seen = []

    def runner(s, **kw):
        seen.append(path.exists())
        return fake_result(s)

    Worker(engine, runs_dir=tmp_path / "runs", runner=runner).serve(drain=True)
    assert seen == [True, True] and all(q.get_status(engine, i) == "ok" for i in ids)
    assert get_hardware("cpu").kind == "cpu"
