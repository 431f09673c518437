"""`python -m backend run` measures the 'cpu' step-time profile before the first local run, as the worker does
(bench/cpu_profile.ensure), so a run's result carries step_time_predicted_s whichever path launched it; it was
measured by the worker only, and a `run` on a fresh checkout stored none."""

from __future__ import annotations

import pytest

from backend.cli import main
from backend.result import RunResult

pytestmark = pytest.mark.unit

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--experts", "4", "--top-k", "2", "--strategy", "ep",
         "--world", "2", "--steps", "2"]


def test_run_measures_the_cpu_profile_before_launching(monkeypatch, capsys, tmp_path):
    from backend.bench import cpu_profile
    from backend.launch import launcher

    order: list[str] = []

    def ensure(on_progress=None):
        order.append("profile")
        on_progress({"phase": cpu_profile.PHASE})
        return "measured this host for the 'cpu' step-time profile: wrote it"

    def run_experiment(spec, **kw):
        order.append("launch")
        return RunResult.of_spec(spec, status="ok")

    monkeypatch.setattr(cpu_profile, "ensure", ensure)
    monkeypatch.setattr(launcher, "run_experiment", run_experiment)
    assert main(["run", *SMALL, "--workdir", str(tmp_path / "w"), "--json"]) == 0
    assert order == ["profile", "launch"]
    err = capsys.readouterr().err
    assert cpu_profile.PHASE in err and "step None" not in err and "measured this host" in err
