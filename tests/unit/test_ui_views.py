"""Dashboard logic without Streamlit: form <-> spec, sweeps, figures, tables, schedules, worker auto-start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from backend.number_format import fmt_bytes, fmt_pct, fmt_seconds
from backend.result import MemoryBreakdown, RankResult, RunResult, Status, TimelineEvent
from backend.spec import validate_spec
from dashboard import compare_view as cv
from dashboard import detail_view as dv
from dashboard import formulas_view as fv
from dashboard import predict_view as pv
from dashboard import runs_view as rv
from dashboard import spec_form as sf
from dashboard import timeline_view as tv
from dashboard import worker_ctl
from dashboard.sweep_form import expand_sweep


def test_formatting():
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(3 * 2**20) == "3.00 MiB"
    assert fmt_bytes(None) == "–"
    assert fmt_seconds(0.0123) == "12.3 ms"
    assert fmt_pct(-2.5) == "-2.5 %"


def test_default_form_is_a_valid_spec_and_round_trips():
    spec, problems = sf.form_to_spec(sf.default_form())
    assert problems == [] and spec is not None
    assert spec.parallel.world_size == 2 and spec.parallel.dp == 2
    again, problems = sf.form_to_spec(sf.spec_to_form(spec))
    assert problems == []
    assert again.model_dump() == spec.model_dump()


@pytest.mark.parametrize("strategy, world", [("tp", 2), ("pp", 2), ("zero3", 4)])
def test_round_trip_keeps_derived_degrees(strategy, world):
    v = dict(sf.default_form(), strategy=strategy, world_size=world, global_batch=8, micro_batch=1)
    spec, problems = sf.form_to_spec(v)
    assert problems == [], problems
    back, problems = sf.form_to_spec(sf.spec_to_form(spec))
    assert problems == [] and back.parallel == spec.parallel


def test_invalid_form_reports_the_arithmetic():
    v = dict(sf.default_form(), world_size=3, tp=2)
    spec, problems = sf.form_to_spec(v)
    assert spec is None
    assert any("3" in p and "tp(2)" in p for p in problems), problems
    v = dict(sf.default_form(), global_batch=6, micro_batch=4)
    _, problems = sf.form_to_spec(v)
    assert any("not divisible" in p and "4 * dp 2 = 8" in p for p in problems), problems


def test_presets_fill_the_model_fields():
    v = dict(sf.default_form(), **sf.PRESETS[sf.preset_label("llama-2-70b")])  # was the "LLaMA-70B-like (GQA 8)" shape
    spec, problems = sf.form_to_spec(v)
    assert problems == []
    assert spec.model.kv_heads == 8 and spec.model.ffn == 28672
    assert sf.preset_of(sf.spec_to_form(spec)) == sf.preset_label("llama-2-70b")


def test_sweep_grid_expands_and_lists_invalid_points():
    base = dict(sf.default_form(), micro_batch=1)
    specs, problems = expand_sweep(base, strategies=["ddp", "zero2", "tp"], worlds=[2, 3], microbatches=[2, 4])
    assert len(specs) + len(problems) == 12
    # tp=3 does not divide 4 heads: both microbatch counts of (tp, 3) are rejected with the reason.
    assert sum("tp world=3" in p for p in problems) == 2
    assert all("does not divide n_heads" in p for p in problems if "tp world=3" in p)
    for s in specs:
        assert s.train.microbatches in (2, 4)
        assert s.train.global_batch == s.train.micro_batch * s.parallel.dp * s.train.microbatches


def _estimate_like():
    mk = lambda r, p: {"rank": r, "coords": {"dp": r}, "params_bytes": p, "grads_bytes": p,  # noqa: E731
                       "optimizer_bytes": 2 * p, "activations_bytes": 100, "other_bytes": 0, "total_bytes": 4 * p + 100,
                       "comm_bytes": {"all_reduce": 4.0 * p}, "comm_wire_bytes": {"all_reduce": 4.0 * p}}
    return [mk(0, 2**20), mk(1, 2**21)]


def test_prediction_figure_and_fit():
    rows = pv.rank_rows(_estimate_like())
    fig = pv.per_rank_memory_fig(rows, device_mem_bytes=9 * 2**20)
    names = [t.name for t in fig.data]
    assert names == ["parameters", "gradients", "optimizer state", "activations"]
    assert fig.layout.yaxis.title.text == "memory per rank (MiB)"
    assert fig.data[0].y[1] == pytest.approx(2.0)
    fit = pv.fit_check(rows, 8 * 2**20)
    assert not fit.fits and fit.worst_rank == 1 and "short by 100 B" in fit.message()
    assert pv.fit_check(rows, 9 * 2**20).fits
    comm = pv.comm_frame(_estimate_like())
    assert list(comm["collective"]) == ["all_reduce"]


def test_fit_reads_the_estimates_fullest_moment_and_names_it():
    """Issue 32: the New-experiment fit message reads each rank's `fullest_bytes` / `fullest_moment` from the
    estimate (JSON or RankEstimate), never recomputes them, and says which moment it is; the issue's zero3 + full
    recompute layout is short inside backward where the activation peak alone would fit."""
    from backend.analytic.estimate import estimate
    from backend.spec import ExperimentSpec

    rows = pv.rank_rows([r | {"fullest_bytes": r["total_bytes"] + 2**20, "fullest_moment": "backward"}
                         for r in _estimate_like()])
    fit = pv.fit_check(rows, 9 * 2**20)
    assert not fit.fits and fit.moment == "backward" and "inside backward" in fit.message()
    s = ExperimentSpec.model_validate({"model": {"n_layers": 4, "d_model": 256, "n_heads": 4, "seq_len": 256},
                                       "train": {"global_batch": 4, "micro_batch": 1, "recompute": "full",
                                                 "precision": "bf16-mixed"},
                                       "parallel": {"strategy": "zero3", "world_size": 4}})
    est = estimate(s)
    rows = pv.rank_rows(est.per_rank)
    worst = est.worst()
    assert rows[0]["fullest_bytes"] == worst.fullest_bytes() > worst.total_bytes
    assert not pv.fit_check(rows, worst.total_bytes + 1).fits
    assert (pv.fit_check(rows, worst.fullest_bytes()).fits
            and pv.fit_check(rows, worst.fullest_bytes()).moment == "backward")


def test_real_estimate_feeds_the_figure():
    spec, _ = sf.form_to_spec(dict(sf.default_form(), strategy="zero3", world_size=4, global_batch=8, micro_batch=1))
    est, rows = pv.predict(spec)
    assert len(rows) == 4
    fig = pv.per_rank_memory_fig(rows)
    total = sum(sum(t.y) for t in fig.data)
    assert total > 0
    assert set(pv.headline(est)) >= {"parameters", "comm / step"}


@pytest.mark.parametrize("schedule, p, m", [(s, p, m) for s in ("gpipe", "1f1b")
                                            for p, m in ((2, 2), (4, 4), (4, 8))] + [("gpipe", 8, 3)])
def test_ideal_schedule_bubble_matches_the_formula(schedule, p, m):
    from backend.analytic.textbook.pipeline import bubble_fraction

    ev = tv.ideal_events(None, schedule=schedule, p=p, m=m)
    assert len(ev) == 2 * p * m
    assert tv.bubble_of(ev) == pytest.approx(bubble_fraction(schedule, p=p, m=m))


def test_ideal_replay_of_a_measured_order_and_gantt():
    # A measured GPipe-ordered trace with uneven times: the replay keeps the order, not the noise.
    events = [TimelineEvent(rank=r, stage=r, microbatch=i, **{"pass": ps}, start_s=10 + k, end_s=10.5 + k)
              for r in range(2) for k, (ps, i) in enumerate([("F", 0), ("F", 1), ("B", 0), ("B", 1)])]
    norm = tv.normalize(events)
    assert min(e["start_s"] for e in norm) == 0
    ideal = tv.ideal_events(norm, schedule="gpipe", p=2, m=2)
    assert tv.bubble_of(ideal) == pytest.approx(1 / 3)
    fig = tv.gantt_fig(norm, title="t")
    assert {t.name for t in fig.data} == {"forward", "backward"}
    assert fig.layout.xaxis.title.text == "time (ms)"


def _synthetic_failed() -> RunResult:
    spec, _ = validate_spec({"parallel": {"strategy": "ddp", "world_size": 2}})
    return RunResult(status=Status.FAILED, error="RuntimeError: injected", failing_rank=1, log_tail="boom", spec=spec)


def test_detail_views_tolerate_a_failed_run_without_measurements():
    res = _synthetic_failed()
    assert dv.loss_fig(res) is None and dv.step_time_fig(res) is None
    assert dv.comm_frame(res).empty
    assert dv.headline(res)["step time (median)"] == "–"


def test_a_timed_out_run_s_memory_table_leaves_the_unmeasured_cells_blank():
    """A run that timed out after some steps has losses but measured no memory category: its zeros mean unknown
    (RunResult.memory_measured), so the table shows the prediction and blanks, not 0 B measured and -100 %."""
    spec, _ = validate_spec({"parallel": {"strategy": "ddp", "world_size": 2}})
    rank = RankResult(rank=0, predicted=MemoryBreakdown(params_bytes=1000, peak_bytes=1000))
    res = RunResult(status=Status.TIMEOUT, spec=spec, per_rank=[rank], loss=[2.0])
    row = dv.memory_error_frame(res).loc[0]
    assert (row["parameters measured"], row["parameters error"], row["peak measured"]) == ("–", "–", "–")
    assert row["parameters predicted"] != "–"


def test_measured_vs_predicted_figure_shape():
    spec, _ = validate_spec({"parallel": {"strategy": "ddp", "world_size": 2}})
    ranks = [RankResult(rank=r, measured=MemoryBreakdown(params_bytes=1000, grads_bytes=1000, activations_bytes=50,
                                                         peak_bytes=2050),
                        predicted=MemoryBreakdown(params_bytes=1000, grads_bytes=900, activations_bytes=0))
             for r in range(2)]
    res = RunResult(status=Status.OK, spec=spec, per_rank=ranks)  # synthetic: only the rendering is under test
    fig = dv.measured_vs_predicted_fig(res)
    grads = next(t for t in fig.data if t.name == "gradients")
    assert list(grads.x[1]) == ["measured", "predicted"] * 2
    assert grads.customdata[0][1] == "+11.1 %"
    df = dv.memory_error_frame(res)
    assert df.loc[0, "activations error"] == "–"


def test_routing_frame_shows_uniform_and_measured_routing_errors():
    from backend.result import CommStat, RoutingAdjusted

    spec, _ = validate_spec({"model": {"n_experts": 4}, "parallel": {"strategy": "ep", "world_size": 2}})
    rr = RankResult(rank=1, measured=MemoryBreakdown(activations_bytes=1200),
                    predicted=MemoryBreakdown(activations_bytes=1000),
                    comm={"all_to_all": CommStat(calls=4, bytes=1100.0)}, comm_predicted={"all_to_all": 1000.0},
                    predicted_given_routing=RoutingAdjusted(activations_bytes=1200, all_to_all_bytes=1100.0,
                                                            received_token_slots=584, uniform_token_slots=512))
    df = dv.routing_frame(RunResult(status=Status.OK, spec=spec, per_rank=[rr]))  # synthetic: rendering only
    row = df.iloc[0]
    assert row["token-slots received"] == "584 (1.14× uniform)"
    assert (row["vs uniform routing"], row["vs measured routing"]) == ("+20.0 %", "+0.0 %")
    assert (row["a2a vs uniform"], row["a2a vs measured routing"]) == ("+10.0 %", "+0.0 %")
    assert dv.routing_frame(_synthetic_failed()).empty


def test_runs_table():
    rows = [
        {"id": 2, "status": "running", "progress_step": 3, "progress_total": 5, "progress_phase": "timed", "name": "a",
         "strategy": "zero2", "world_size": 4, "dp": 4, "tp": 1, "pp": 1, "ep": 1, "tags": ["x", "y"],
         "step_s_median": None},
        {"id": 1, "status": "failed", "error": "RuntimeError: boom", "name": "", "strategy": "pp", "world_size": 2,
         "dp": 1, "tp": 1, "pp": 2, "ep": 1, "schedule": "1f1b", "microbatches": 4, "tags": [], "step_s_median": 0.5,
         "peak_bytes_max": 2**20},
    ]
    df = rv.table_frame(rows)
    assert list(df["progress"]) == ["step 3/5 (timed)", "RuntimeError: boom"]
    assert list(df["degrees"]) == ["dp4", "dp1×pp2"]
    assert df.loc[1, "step time (ms)"] == 500.0 and df.loc[1, "peak (MiB)"] == 1.0
    assert rv.progress_fraction(rows[0]) == pytest.approx(0.6)
    assert rv.any_active(rows)
    assert rv.run_label(rows[0]) == "#2 a · world 4 · running"


def test_compare_highlights_differences():
    import pandas as pd

    df = pd.DataFrame({"#1": ["ddp", "2"], "#2": ["zero2", "2"]}, index=["strategy", "world"])
    st = cv.highlight_differences(df)
    assert st.loc["strategy", "#2"] and not st.loc["world", "#2"]


def test_formula_figures():
    fig = fv.zero_memory_fig(70e9, precision="bf16-mixed", optimizer="adamw", ns=[8, 64, 1024], device_gb=80)
    by = {t.name: list(t.y) for t in fig.data}
    assert by["DDP (ZeRO-0)"][0] == pytest.approx(16 * 70e9 / 2**30)  # 2+2+12 bytes per parameter, no sharding (GiB)
    assert by["ZeRO-3 / FSDP (P_os+g+p)"][0] == pytest.approx(16 * 70e9 / 2**30 / 8)
    assert fig.layout.xaxis.type == "log"
    act = fv.activation_fig(seqs=[1024, 2048], b=1, h=8192, a=64, layers=80, t=8, sp=True)
    full = next(t for t in act.data if t.name == "recompute=full")
    assert full.y[1] == pytest.approx(2 * full.y[0])
    bub = fv.bubble_fig(p=4, ms=[4, 8], v=2)
    gpipe = next(t for t in bub.data if t.name == "gpipe")
    assert gpipe.y[0] == pytest.approx(3 / 7 * 100)


def test_claims_frame_marks_verdicts():
    claims = [{"id": "a", "source": "s", "text": "t", "claimed_value": 140, "unit": "GB", "formula_value": 140.0,
               "formula": "2Ψ", "holds": True, "tolerance": 0.05, "explanation": "e"},
              {"id": "b", "source": "s", "text": "t", "claimed_value": 810, "unit": "GB", "formula_value": 810.0,
               "formula": "2Ψ", "holds": False, "tolerance": 0.05, "explanation": "e"}]
    df = fv.claims_frame(claims)
    assert list(df["verdict"]) == ["holds", "does NOT hold"]
    assert df.loc[0, "claimed"] == "140 GB"


def test_worker_autostart_is_off_in_tests(monkeypatch, tmp_path):
    from db.session import open_db

    url = f"sqlite:///{tmp_path / 'w.db'}"
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    monkeypatch.setattr(worker_ctl, "_spawn", lambda *a: pytest.fail("must not spawn"))
    st = worker_ctl.ensure_worker(open_db(url), url)
    assert not st.alive and "SHARDLAB_NO_WORKER" in st.detail


def test_worker_autostart_starts_exactly_one(monkeypatch, tmp_path):
    from db.session import open_db

    url = f"sqlite:///{tmp_path / 'w.db'}"
    monkeypatch.delenv("SHARDLAB_NO_WORKER", raising=False)
    spawned = []

    def fake_spawn(url, log):
        # A stand-in process whose command line looks like a worker's.
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "backend", "worker"])
        spawned.append(p)
        return p.pid

    monkeypatch.setattr(worker_ctl, "_spawn", fake_spawn)
    eng = open_db(url)
    try:
        first = worker_ctl.ensure_worker(eng, url)
        second = worker_ctl.ensure_worker(eng, url)
        assert first.started_now and not second.started_now
        assert len(spawned) == 1 and "starting" in second.detail
    finally:
        for p in spawned:
            p.kill()
            p.wait()
    third = worker_ctl.ensure_worker(eng, url)  # our worker died: start another
    assert third.started_now and len(spawned) == 2
    spawned[-1].kill()
    spawned[-1].wait()
    assert os.environ.get("SHARDLAB_NO_WORKER") is None
