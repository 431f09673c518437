"""The model against the published runs, as a person sees it (backend/analytic/steptime/published_check.py,
`python -m backend published`, the Formulas page's "Published runs" tab): per row the same numbers estimate prints,
per stack and GPU the errors against issue 34's targets."""

from __future__ import annotations

import json

import pytest

import backend.analytic.steptime.published_check as pc
from backend.analytic.estimate import estimate
from backend.analytic.steptime.published_check import (
    ErrorStats,
    MemoryCheck,
    RowCheck,
    check_row,
    check_rows,
    summaries,
)
from backend.analytic.steptime.published_gpu import PublishedRow, published_rows
from backend.cli import main
from dashboard import published_view as pv

TITAN_T4 = "titan-202412-t4-70b-2d"  # a published peak reserved (71.9 GiB) on the 96 GB / 500 W profile
NEMO_8B = "nemo2407-h100-llama3-8b-g8"


def _row(rid: str) -> PublishedRow:
    return next(r for r in published_rows() if r.id == rid)


def _fake(rid: str, stack: str, group: str, hardware: str, published: float, predicted: float,
          verdict: str = "fits", memory_gib: float | None = None, reserved: float = 10.0) -> RowCheck:
    row = PublishedRow(id=rid, group=group, hardware=hardware, source="s", url="u", quote="q", layout="l",
                       spec={"train": {"stack": stack}}, step_s=published, derivation="d", memory_gib=memory_gib)
    return RowCheck(row, predicted, MemoryCheck(reserved / 1.13, "m", reserved, verdict))


@pytest.fixture(scope="module")
def t4() -> RowCheck:
    return check_row(_row(TITAN_T4))


def test_a_row_is_predicted_as_estimate_prints_it(t4):
    """The step is step_time on the row's own spec; the memory the fullest rank's fullest moment of `estimate` on
    CUDA ranks, the reserved that plus the allocator's slack."""
    row = t4.row
    assert t4.predicted_step_s == pytest.approx(pc.predicted_step_s(row.spec, row.hardware))
    assert t4.step_error_pct == pytest.approx((t4.predicted_step_s - row.step_s) / row.step_s * 100)
    spec = pc.with_device(pc.ExperimentSpec.for_prediction(row.spec), "cuda")
    assert t4.memory.fullest_gib == pytest.approx(estimate(spec).worst().fullest_bytes() / 2**30)
    assert t4.memory.fullest_gib < t4.memory.reserved_gib
    assert t4.memory_error_pct == pytest.approx((t4.memory.reserved_gib - 71.9) / 71.9 * 100)
    assert t4.fullest_under_published is (t4.memory.fullest_gib <= 71.9)


def test_a_row_without_a_published_peak_still_gets_its_fit_verdict():
    c = check_row(_row(NEMO_8B))
    assert c.row.memory_gib is None and c.memory_error_pct is None and c.fullest_under_published is None
    assert c.memory.verdict in ("fits", "tight", "does not fit")


def test_summaries_per_stack_and_gpu_against_the_targets():
    checks = [_fake("a", "megatron", "H100", "h100-sxm", 1.0, 1.05),  # +5%
              _fake("b", "megatron", "H100", "h100-sxm", 1.0, 0.90, verdict="tight"),  # -10%
              _fake("c", "megatron", "A100", "a100-80gb-sxm", 2.0, 2.6),  # +30%: no target on A100
              _fake("d", "megatron", "H100 MoE", "h100-sxm", 1.0, 0.5),  # MoE: apart, no target
              _fake("e", "torchtitan", "H100", "h100-96gb-hbm2e-500w", 1.0, 0.7, memory_gib=10.0, reserved=11.0)]
    by = {(s.stack, s.hardware, s.moe): s for s in summaries(checks)}
    h100 = by[("megatron", "h100-sxm", False)]
    assert h100.step == ErrorStats(2, pytest.approx(7.5), pytest.approx(-2.5), pytest.approx(10.0))
    assert h100.step_target_met is True and (h100.fits, h100.tight, h100.fit_rows) == (1, 1, 2)
    assert by[("megatron", "a100-80gb-sxm", False)].step_target_met is None
    moe = by[("megatron", "h100-sxm", True)]
    assert moe.step.rows == 1 and moe.step_target_met is None
    titan = by[("torchtitan", "h100-96gb-hbm2e-500w", False)]
    assert titan.step_target_met is False  # -30%
    assert titan.reserved == ErrorStats(1, pytest.approx(10.0), pytest.approx(10.0), pytest.approx(10.0))
    assert titan.fullest_under_published == 1
    assert not any(s.hardware == "all H100" for s in by.values())  # one H100 profile per stack: no duplicate line


def test_every_h100_row_of_a_stack_is_summed_up_when_it_ran_on_two_profiles():
    checks = [_fake("a", "shardlab", "H100", "h100-sxm", 1.0, 1.2),
              _fake("b", "shardlab", "H100", "h100-pcie", 1.0, 1.0)]
    whole = next(s for s in summaries(checks) if s.hardware == "all H100")
    assert whole.step == ErrorStats(2, pytest.approx(10.0), pytest.approx(10.0), pytest.approx(20.0))
    assert whole.step_target_met is False


def test_a_stack_without_published_runs_has_none(two_rows):
    assert check_rows("deepspeed") == [] and summaries([]) == []  # two_rows: a torchtitan and a megatron row only


@pytest.fixture
def two_rows(monkeypatch):
    rows = (_row(TITAN_T4), _row(NEMO_8B))
    monkeypatch.setattr(pc, "published_rows", lambda: rows)
    return rows


def test_cli_prints_rows_and_summaries_as_json(two_rows, capsys):
    assert main(["published", "--stack", "torchtitan", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in out["rows"]] == [TITAN_T4]
    r = out["rows"][0]
    assert r["published_memory_gib"] == 71.9 and r["fit_verdict"] == "fits"
    assert r["step_error_pct"] == pytest.approx((r["predicted_step_s"] - r["published_step_s"])
                                                / r["published_step_s"] * 100)
    s = out["summaries"][0]
    assert (s["stack"], s["hardware"], s["step"]["rows"]) == ("torchtitan", "h100-96gb-hbm2e-500w", 1)
    assert s["step_target_met"] == (abs(r["step_error_pct"]) <= 8.0)
    assert out["targets"]["step_mean_abs_pct"] == 8.0 and out["targets"]["step_worst_pct"] == 15.0


def test_cli_table_names_each_row_and_the_target(two_rows, capsys):
    assert main(["published"]) == 0
    out = capsys.readouterr().out
    assert TITAN_T4 in out and NEMO_8B in out and "71.9 /" in out and "mean |error| <= 8%" in out
    assert main(["published", "--summary"]) == 0
    assert TITAN_T4 not in capsys.readouterr().out
    assert main(["published", "--stack", "deepspeed"]) == 0
    assert capsys.readouterr().out.startswith("no published run of stack deepspeed is on record")


def test_dashboard_frames_and_figure(two_rows):
    checks = check_rows()
    rows = pv.rows_frame(checks)
    assert list(rows["run"]) == [TITAN_T4, NEMO_8B]
    assert rows.loc[0, "published peak GiB"] == 71.9 and rows.loc[0, "link"].startswith("https://")
    summary = pv.summary_frame(summaries(checks))
    assert set(summary["stack"]) == {"torchtitan", "megatron"}
    fig = pv.error_fig(checks)
    names = [t.name for t in fig.data]
    assert names[:2] == ["torchtitan", "megatron"] and "predicted = published" in names
    assert fig.data[0].x[0] == pytest.approx(checks[0].row.step_s)


@pytest.mark.parametrize("rid", [TITAN_T4, NEMO_8B, "mpt-h100-7b-s2048-g8"])
def test_estimate_on_the_rows_spec_prints_the_same_step_and_fit(rid, tmp_path, capsys):
    """No private knob: the row's spec written to a file and `estimate --spec --hardware` on it give the step and the
    fit the published check shows (one row per stack)."""
    c = check_row(_row(rid))
    path = tmp_path / "row.json"
    path.write_text(json.dumps(c.row.spec))
    assert main(["estimate", "--spec", str(path), "--hardware", c.row.hardware, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time"]["step_s"] == pytest.approx(c.predicted_step_s, rel=1e-12)
    assert out["fit"]["verdict"] == c.memory.verdict
    assert out["fit"]["fullest_bytes"] / 2**30 == pytest.approx(c.memory.fullest_gib, rel=1e-12)


ROWWISE = "titan-asynctp-2506-8b-rowwise-vanilla"  # torchao rowwise fp8: no measured rowwise GEMM table on its profile


def test_a_row_says_what_its_step_time_assumes_in_the_cli_and_on_the_page(monkeypatch, capsys):
    rows = (_row(ROWWISE), _row(NEMO_8B))
    monkeypatch.setattr(pc, "published_rows", lambda: rows)
    checks = check_rows()
    assumed = pc.predicted_step(rows[0].spec, rows[0].hardware).caveats
    assert assumed and checks[0].caveats == tuple(assumed) and "fp8_recipe rowwise" in assumed[0]
    assert checks[1].caveats == ()
    assert main(["published", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["caveats"] for r in out["rows"]] == [list(assumed), []]
    assert main(["published"]) == 0
    assert f"{ROWWISE}: step time assumes: {assumed[0]}" in capsys.readouterr().out.splitlines()
    frame = pv.rows_frame(checks)
    assert list(frame["step time assumes"]) == ["; ".join(assumed), ""]
