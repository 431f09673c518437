"""Calibration: on synthetic measurements made by the model itself with known parameters, the fit recovers them
(LOO error ~0) and stores a calibration that estimate --calibration applies; extrapolation is flagged."""

from __future__ import annotations

import json

import pytest

from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.calibration import fit as F
from backend.calibration import records
from backend.cli import main
from backend.result import RunResult
from backend.spec import ExperimentSpec
from db import queries as q
from db.session import open_db

BASE = {"model": {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 64},
        "train": {"global_batch": 8, "micro_batch": 2}}
LAYOUTS = [("ddp", {}), ("zero1", {}), ("zero2", {}), ("zero3", {}), ("tp", {}), ("pp", {"pp_schedule": "gpipe"}),
           ("pp", {"pp_schedule": "1f1b"}), ("ddp", {"d_model": 256}), ("zero3", {"d_model": 256}),
           ("tp", {"d_model": 256})]
TRUE = {"gemm_efficiency_max": 0.4, "kernel_launch_s": 2e-5, "step_overhead_s": 0.01}


def _spec(strategy, extra, world=2) -> ExperimentSpec:
    model = {**BASE["model"], **{k: v for k, v in extra.items() if k == "d_model"}}
    par = {"strategy": strategy, "world_size": world, **{k: v for k, v in extra.items() if k != "d_model"}}
    return ExperimentSpec.model_validate({"model": model, "train": BASE["train"], "parallel": par})


def _store_synthetic(engine, hw, world=2, tag="syn"):
    truth = hw.with_tunables(**TRUE)
    for strategy, extra in LAYOUTS:
        s = _spec(strategy, extra, world)
        t = step_time(s, truth).summary["step_s"]
        res = RunResult.model_validate({"status": "ok", "spec": s.model_dump(mode="json"), "step_s_median": t,
                                        "per_rank": [{"rank": r, "step_s": [t, t * 1.3]} for r in range(world)]})
        (eid,) = q.submit_experiments(engine, [s], tags=[tag])
        q.store_result(engine, eid, res)


@pytest.mark.slow
def test_fit_recovers_synthetic_parameters_and_cli_applies_it(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'cal.db'}"
    engine = open_db(url)
    hw = get_hardware("a100-80gb-sxm")
    _store_synthetic(engine, hw)
    samples, problems = records.samples(engine, tag="syn")
    assert len(samples) == len(LAYOUTS) and not problems
    result = F.fit(hw, samples, iters=200)
    assert result.loo_mape is not None and result.loo_mape < 3.0, result.loo
    assert main(["calibrate", "--tag", "syn", "--hardware", "a100-80gb-sxm", "--db", url, "--no-loo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert ({"id", "hardware", "params", "fit_runs", "loo_mape", "notes"} <= set(out)
            and len(out["fit_runs"]) == len(LAYOUTS))
    est = ["estimate", "--strategy", "ddp", "--world", "4", "--layers", "4", "--hidden", "128", "--heads", "4", "--seq",
           "64", "--vocab", "256", "--calibration", str(out["id"]), "--db", url, "--json"]
    assert main(est) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["step_time_detail"]["calibration"] == out["id"]
    assert any("world_size 4 outside measured 2..2" in x for x in d["step_time_detail"]["extrapolation"])


def test_calibrate_rejects_unknown_ids(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'cal.db'}"
    open_db(url)
    assert main(["calibrate", "--ids", "5,6", "--hardware", "a100-80gb-sxm", "--db", url]) == 2
    assert "run 5 does not exist" in capsys.readouterr().err
