"""Issue 32: "will it fit?" is one number and one rule everywhere. New experiment's fit check is
analytic/device.fits_device on the estimate's own fullest moment (so it can never disagree with `estimate
--hardware`'s fit line or Plan, even at the boundary or when the allowance is recalibrated); `plan` and the Plan page
size the device and check the allowance's overrides with the same planner functions (planner/allowance.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest

from backend.analytic import device as D
from backend.analytic.steptime.hardware import get_hardware
from backend.cli.estimate import fit_on
from backend.planner.allowance import FLAGS, allowance_problem, device_bytes_of, reserve_problem
from backend.spec import ExperimentSpec
from dashboard import plan_view
from dashboard import predict_view as pv

LAYOUTS = [({"strategy": "ddp", "dp": 2, "tp": 2, "world_size": 4}, "cuda"),
           ({"strategy": "zero3", "world_size": 4}, "cuda"),
           ({"strategy": "zero1", "dp": 2, "pp": 2, "world_size": 4}, "cuda"),
           ({"strategy": "zero2", "world_size": 2}, "cpu")]


def _spec(parallel: dict, device: str) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "model": {"n_layers": 4, "d_model": 256, "n_heads": 4, "seq_len": 256, "vocab_size": 4096},
        "train": {"global_batch": 8, "micro_batch": 1, "recompute": "full", "precision": "bf16-mixed"},
        "parallel": parallel, "runtime": {"device": device}})


def _worst(est):
    worst = max((r for r, _ in est.distinct_ranks), key=lambda r: (r.fullest_bytes(), -r.rank))
    return worst, est.spec


@pytest.mark.parametrize(("parallel", "device"), LAYOUTS, ids=[f"{p['strategy']}-{d}" for p, d in LAYOUTS])
def test_new_experiment_fit_check_is_fits_device_at_the_boundary(parallel, device):
    """At need - 1 B, need (the largest float below it too) and need + 1 B: New experiment's verdict, its need and
    rank are fits_device's / need_bytes's, and `estimate --hardware`'s fit line (fit_on) says the same."""
    est, rows = pv.predict(_spec(parallel, device))
    worst, spec = _worst(est)
    assert str(spec.runtime.device) == device
    fullest = worst.fullest_bytes()
    need = D.need_bytes(fullest, spec.parallel, device)
    assert (need > fullest) == (device == "cuda")
    hw = get_hardware("h100-sxm")
    for device_bytes in (need - 1, math.nextafter(need, 0), need, need + 1):
        fit = pv.fit_check(rows, device_bytes)
        rule = bool(D.fits_device(fullest, spec.parallel, device, device_bytes))
        line = fit_on(est, dataclasses.replace(hw, memory_bytes=device_bytes))
        assert fit.fits == rule == line["fits"], device_bytes
        assert fit.worst_bytes == line["need_bytes"] == need and fit.worst_rank == line["rank"]
        assert fit.moment == line["moment"] == worst.fullest_moment()
        assert fit.overhead == pytest.approx(line["overhead_bytes"])
    assert not pv.fit_check(rows, need - 1).fits and pv.fit_check(rows, need).fits
    allowance = D.allowance_bytes(fullest, spec.parallel, device)
    without_slack = fullest + allowance["cuda_context"] + allowance["nccl_buffers"]
    below = "Tight" if device == "cuda" else "Does not fit"  # cuda: only the allocator slack is over need - 1
    assert pv.fit_check(rows, need - 1).message().startswith(below) and "Fits" in pv.fit_check(rows, need).message()
    assert pv.fit_check(rows, without_slack - 1).message().startswith("Does not fit")
    for device_bytes, verdict in ((without_slack - 1, D.DOES_NOT_FIT), (need, D.FITS)):
        assert D.fit_verdict(fullest, spec.parallel, device, device_bytes) == verdict
        assert fit_on(est, dataclasses.replace(hw, memory_bytes=device_bytes))["verdict"] == verdict
    if device == "cuda":
        for device_bytes in (without_slack, need - 1):
            assert D.fit_verdict(fullest, spec.parallel, device, device_bytes) == D.TIGHT
            assert pv.fit_check(rows, device_bytes).tight and not pv.fit_check(rows, device_bytes).fits


def test_a_recalibrated_allowance_reaches_new_experiments_verdict(monkeypatch):
    """The page asks the rule when it judges, not an allowance it worked out by hand: recalibrate the allocator slack
    (RuntimeOverhead) and New experiment's verdict moves with fits_device's. Before, fit_check added the allowance the
    rows carried from when they were predicted (0.13), and said "Fits" where fits_device said it does not."""
    est, rows = pv.predict(_spec({"strategy": "zero3", "world_size": 4}, "cuda"))
    worst, spec = _worst(est)
    fullest = worst.fullest_bytes()
    old_need = D.need_bytes(fullest, spec.parallel, "cuda")
    monkeypatch.setattr(D, "RuntimeOverhead", functools.partial(D.RuntimeOverhead, fragmentation_frac=0.5))
    new_need = D.need_bytes(fullest, spec.parallel, "cuda")
    assert new_need > old_need
    for device_bytes in (old_need, (old_need + new_need) / 2, new_need - 1, new_need):
        rule = bool(D.fits_device(fullest, spec.parallel, "cuda", device_bytes))
        assert pv.fit_check(rows, device_bytes).fits == rule, device_bytes
    fit = pv.fit_check(rows, old_need)
    assert not fit.fits and fit.worst_bytes == new_need and fit.overhead["fragmentation"] == 0.5 * fullest


def test_rows_without_a_layout_are_cpu_ranks_without_allowance():
    rows = [{"rank": 0, "total_bytes": 100.0, "fullest_bytes": 120.0, "fullest_moment": "backward"}]
    assert pv.fit_check(rows, 120).fits and not pv.fit_check(rows, 119.5).fits
    assert pv.fit_check(rows, 120).overhead["total"] == 0 and pv.fit_check(rows, 120).worst_bytes == 120


def test_plan_and_its_cli_size_the_device_with_one_function(capsys):
    """`plan --memory-gb` and plan() use device_bytes_of: the profile's memory, or the GB given; the reserve is
    refused at exactly that size and accepted just under it."""
    from backend.cli import main

    hw = get_hardware("h100-sxm")
    assert device_bytes_of(hw) == device_bytes_of(hw, None) == hw.memory_bytes and device_bytes_of(hw, 16e9) == 16e9
    argv = ["plan", "--vocab", "1000", "--hidden", "128", "--layers", "8", "--heads", "8", "--gpus", "8",
            "--gpus-per-node", "8", "--hardware", "h100-sxm", "--global-batch", "16", "--seq", "64", "--top", "2",
            "--json", "--memory-gb", "16"]
    assert main(argv + ["--reserve-gb", "16"]) == 2
    out, err = capsys.readouterr()
    assert not out and "--reserve-gb 16 GB is not less than the 16 GB per GPU of h100-sxm (--memory-gb)" in err
    assert err.strip().endswith(reserve_problem(16, device_bytes_of(hw, 16e9), "h100-sxm", True))
    assert main(argv + ["--reserve-gb", "15.5"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["device_bytes"] == device_bytes_of(hw, 16e9) and d["allowance"]["cuda_context_bytes"] == 15_500_000_000


@pytest.mark.parametrize(("memory_gb", "reserve_gb", "fragmentation", "said"), [
    (0, None, None, "must be > 0 (got 0)"),
    (None, -1, None, "must be >= 0 GB per GPU (got -1)"),
    (None, None, -0.1, "must be between 0 and 1, a fraction of the fullest moment (0.13 adds 13%); got -0.1"),
    (None, None, 1.5, "got 1.5")])
def test_the_cli_and_the_plan_page_refuse_the_same_values_in_the_same_words(memory_gb, reserve_gb, fragmentation,
                                                                             said):
    cli = allowance_problem(memory_gb, reserve_gb, fragmentation)
    page = plan_view.allowance_check("h100-sxm", memory_gb=memory_gb, reserve_gb=reserve_gb,
                                     fragmentation=fragmentation)
    assert cli and page and said in cli and said in page
    for key in FLAGS:  # word for word but the name: the CLI's flag, the page's field
        cli = cli.replace(FLAGS[key], "X")
        page = page.replace(plan_view.FIELD_NAMES[key], "X")
    assert cli == page
    assert allowance_problem(80, 0, 0) is None and allowance_problem(None, None, 1) is None
