"""Issue 25 calibration: imported runs (and ShardLab's own) fit a named profile ("h100-ourcluster") through the one
fitting function (calibration/profile_fit.fit_profile); calibrate --json reports residuals, leave-one-out errors and
the run set; estimate / plan take the name and flag extrapolation; runs from another device or whose prediction
ignores a pending field are left out with the reason (every issue-26 field is wired now: the test makes cp_rotate
pending for the Megatron import)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.analytic.steptime.hardware import get_hardware
from backend.calibration.profile_fit import fit_profile, fitted_parameters, gpu_order
from backend.cli import main
from backend.importers.fields import SPEC_FIELDS, Pending
from backend.importers.runs import import_run
from db.session import open_db

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"


@pytest.fixture()
def store(tmp_path: Path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'cal.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    engine = open_db(url)
    tt = import_run(engine, config=FIX / "torchtitan_llama3_8b.toml", log=FIX / "torchtitan_llama3_8b.log", gpus=8,
                    tags=["ourcluster"])
    ds = import_run(engine, config=FIX / "deepspeed_zero3.json", model_config=FIX / "llama2_7b_config.json",
                    log=FIX / "deepspeed_zero3.log", hardware="h100-sxm", tags=["ourcluster"])
    with monkeypatch.context() as patch:  # a field the spec would not hold: its prediction ignores the value
        patch.setitem(SPEC_FIELDS, "cp_rotate", Pending("a stand-in pending feature", "parallel.cp_rotate"))
        mg = import_run(engine, config=FIX / "megatron_llama2_70b.sh", log=FIX / "megatron_llama2_70b.log",
                        hardware="h100-sxm", tags=["ourcluster"])
    return url, engine, (tt, ds, mg)


def test_calibrate_named_profile_from_imported_runs(store, capsys):
    url, engine, (tt, ds, mg) = store
    assert main(["calibrate", "--tag", "ourcluster", "--hardware", "h100-sxm", "--name", "h100-ourcluster",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "h100-ourcluster" and out["hardware"] == "h100-sxm"
    assert sorted(out["fit_runs"]) == [tt, ds] and out["kinds"] == {"imported": 2}
    assert any(f"run {mg} left out" in n and "--cp-comm-type" in n for n in out["notes"])
    assert list(out["params"]) == list(gpu_order(get_hardware("h100-sxm"))[:1])  # 2 runs support 1 parameter
    assert {r["run_id"] for r in out["residuals"]} == {tt, ds} and {r["run_id"] for r in out["loo"]} == {tt, ds}
    assert out["loo_mape"] == pytest.approx(sum(abs(r["error_pct"]) for r in out["loo"]) / 2)
    for row in out["residuals"]:
        assert row["residual_pct"] == pytest.approx((row["predicted_s"] - row["measured_s"]) / row["measured_s"] * 100)

    spec = json.loads(_capture(capsys, ["import-config", str(FIX / "torchtitan_llama3_8b.toml"), "--gpus", "8",
                                        "--json"]))
    path = Path(url.removeprefix("sqlite:///")).with_name("s.json")
    path.write_text(json.dumps(spec))
    est = json.loads(_capture(capsys, ["estimate", "--spec", str(path), "--hardware", "h100-ourcluster", "--json"]))
    assert (est["step_time_detail"]["hardware"] == "h100-ourcluster"
            and est["step_time_detail"]["calibration"] == out["id"])
    plan = json.loads(_capture(capsys, ["plan", "--preset", "llama-3-70b", "--gpus", "64", "--global-batch", "64",
                                        "--seq", "8192", "--hardware", "h100-ourcluster", "--top", "2", "--json"]))
    assert plan["profile"]["calibration"] == out["id"] and plan["profile"]["loo_mape"] == pytest.approx(out["loo_mape"])
    assert all("world_size 64 outside measured 8..16" in c["extrapolation"] for c in plan["configs"])


def _capture(capsys, argv: list[str]) -> str:
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_runs_of_another_device_are_left_out(store, capsys):
    url, engine, (tt, ds, mg) = store
    assert main(["calibrate", "--ids", f"{tt},{ds}", "--hardware", "a100-80gb-sxm"]) == 2
    assert f"run {tt} ran on 'h100-sxm', not 'a100-80gb-sxm'" in capsys.readouterr().err


def test_fit_profile_is_the_one_fitting_function(store):
    from backend.calibration import records as cal_store

    _, engine, (tt, ds, _) = store
    samples, _ = cal_store.samples(engine, ids=[tt, ds], hardware="h100-sxm")
    hw = get_hardware("h100-sxm")
    result = fit_profile(hw, samples)
    assert set(result.params) == {"gemm_scale"} and len(result.loo) == 2
    assert (fitted_parameters(hw, 20) == gpu_order(hw)
            and fitted_parameters(get_hardware("h100-sxm"), 3) == gpu_order(hw)[:2])
    with pytest.raises(ValueError, match="need at least 2 runs"):
        fit_profile(hw, samples[:1])


def test_calibration_names_are_checked(store, capsys):
    assert main(["calibrate", "--tag", "ourcluster", "--hardware", "h100-sxm", "--name", "h100-sxm"]) == 2
    assert "is a shipped hardware profile" in capsys.readouterr().err
    assert main(["calibrate", "--tag", "ourcluster", "--hardware", "h100-sxm", "--name", "a b;$(x)"]) == 2
    assert main(["estimate", "--preset", "gpt2", "--hardware", "no-such-cluster"]) == 2
    assert "calibrated profiles come from" in capsys.readouterr().err


def test_hardware_lists_a_calibrated_profile_that_hardware_flags_accept(store, capsys):
    """`calibrate --name` makes a profile --hardware accepts; `hardware` lists it (table and JSON, with its fitted
    parameters) beside the shipped ones, so the name a user just stored is where they look for profiles."""
    assert main(["calibrate", "--tag", "ourcluster", "--hardware", "h100-sxm", "--name", "h100-ourcluster",
                 "--json"]) == 0
    cal = json.loads(capsys.readouterr().out)
    table = _capture(capsys, ["hardware"])
    assert "h100-ourcluster" in table and f"calibration {cal['id']}" in table
    d = json.loads(_capture(capsys, ["hardware", "--json"]))
    assert "h100-sxm" in d and d["h100-ourcluster"]["calibration_id"] == cal["id"]
    assert d["h100-ourcluster"]["key"] == "h100-ourcluster"


def test_calibrate_shows_the_profiles_own_error_and_says_when_the_fit_is_worse(store, capsys):
    """The runs' error on the profile before any fit is reported beside the fit's, and a calibration whose
    leave-one-out error is worse than the uncalibrated profile's says so (it would be stored and used silently)."""
    from backend.analytic.steptime.model import step_time
    from db import queries as q

    url, engine, (tt, ds, mg) = store
    assert main(["calibrate", "--tag", "ourcluster", "--hardware", "h100-sxm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    before = {r["run_id"]: r for r in out["uncalibrated"]}
    assert set(before) == set(out["fit_runs"])
    spec = q.get_experiment(engine, tt)["result"].spec
    assert before[tt]["predicted_s"] == pytest.approx(step_time(spec, get_hardware("h100-sxm")).summary["step_s"])
    assert out["uncalibrated_mape"] == pytest.approx(sum(abs(r["error_pct"]) for r in before.values()) / len(before))
    assert out["loo_mape"] > out["uncalibrated_mape"]  # these two runs: the stock profile is closer than the fit
    assert any(f"leave-one-out MAPE {out['loo_mape']:.1f}% is worse than profile 'h100-sxm' uncalibrated" in n
               for n in out["notes"])
    table = _capture(capsys, ["calibrate", "--tag", "ourcluster", "--hardware", "h100-sxm"])
    assert f"(uncalibrated {out['uncalibrated_mape']:.1f}%)" in table
    b = before[tt]
    assert f"run {tt}: measured {b['measured_s']:.3f} s, uncalibrated {b['predicted_s']:.3f} s" in table


def test_an_unknown_hardware_name_creates_no_store(tmp_path, monkeypatch, capsys):
    """Looking --hardware up among the calibrated profiles must not create the store file (data/shardlab.db in the
    checkout by default) when there is none: a typo is refused, and nothing is left behind."""
    db = tmp_path / "none.db"
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{db}")
    assert main(["estimate", "--world", "2", "--hardware", "tpu-v9"]) == 2
    assert "unknown hardware 'tpu-v9'" in capsys.readouterr().err
    assert main(["hardware"]) == 0
    assert not db.exists()
