"""Issue 21 item 7: `estimate` no longer grows with the world size. Ranks are predicted once per class of identical
ranks (analytic/rank_classes.py) and expanded per rank only when read; the CLI and the dashboard show a page.
Equality per rank is checked against the prediction at each rank's own position (estimate_rank) on the ranks at
every class boundary of million-rank worlds; speed and memory live in benchmarks/estimate_scale.py."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from backend.analytic.estimate import estimate, estimate_rank
from backend.analytic.rank_classes import chunk_intervals, rank_classes
from backend.cli import main
from backend.spec import ExperimentSpec

LLAMA70B = dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, seq_len=4096,
                norm="rmsnorm", mlp="swiglu", positions="rope", bias="none")
ODD = dict(vocab_size=251, d_model=90, n_layers=5, n_heads=3, seq_len=30, ffn_hidden=333)  # uneven chunks everywhere
MOE = dict(vocab_size=250, d_model=64, n_layers=2, n_heads=4, seq_len=32, n_experts=4, top_k=2)


def big(model: dict, **parallel) -> ExperimentSpec:
    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    dp = parallel["world_size"] // (tp * pp)
    return ExperimentSpec.for_prediction({"model": model, "parallel": parallel,
                                          "train": {"global_batch": dp * pp, "micro_batch": 1}})


def _boundary_ranks(spec: ExperimentSpec) -> list[int]:
    """Every class's first and last rank (the ranks where chunk sizes or shares change), and a few in between."""
    p = spec.parallel
    classes = rank_classes(spec)
    out = set()
    for c in classes.classes.values():
        members = list(c.dp_members())
        for dp in {members[0], members[-1], members[len(members) // 2]}:
            for tp in {c.tp_indices.start, c.tp_indices.stop - 1}:
                out.add((c.pp_rank * p.dp + dp) * p.tp + tp)
    return sorted(out)


@pytest.mark.parametrize("name,spec", [
    ("fsdp 70B x 1,000,000", lambda: big(LLAMA70B, strategy="fsdp", world_size=1_000_000)),
    ("zero1 70B x 1,000,000", lambda: big(LLAMA70B, strategy="zero1", world_size=1_000_000)),
    ("zero2 odd tp3 pp5 x 999,990", lambda: big(ODD, strategy="zero2", world_size=999_990, tp=3, pp=5)),
    ("zero3 moe ep4 x 1,000,000", lambda: big(MOE, strategy="zero3", world_size=1_000_000, ep=4)),
])
def test_million_rank_estimate_equals_each_ranks_own_prediction_at_every_class_boundary(name, spec):
    s = spec()
    est = estimate(s)
    assert len(est.per_rank) == s.parallel.world_size
    assert len(est.rank_classes) <= 200, (name, len(est.rank_classes))
    assert sum(n for _, n in est.distinct_ranks) == s.parallel.world_size
    ranks = _boundary_ranks(s)[:60] + [s.parallel.world_size - 1]
    for rank in ranks:
        assert asdict(est.per_rank[rank]) == asdict(estimate_rank(s, rank)), (name, rank)
    worst = est.worst()
    assert worst.total_bytes == max(r.total_bytes for r, _ in est.distinct_ranks)
    assert asdict(worst) == asdict(estimate_rank(s, worst.rank))


def test_zero1_shares_of_a_million_dp_ranks_are_a_few_distinct_predictions():
    """dp = 1,000,000 > the 70B model's 723 parameter tensors: each tensor's owner gets its own share, every other
    dp index owns nothing (zero optimizer state), and the classes say so without a million rows."""
    s = big(LLAMA70B, strategy="zero1", world_size=1_000_000)
    est = estimate(s)
    by_bytes = {r.optimizer_bytes: n for r, n in est.distinct_ranks}
    assert by_bytes[0] == 1_000_000 - 723
    assert est.per_rank[999_999].optimizer_bytes == 0 and est.per_rank[0].optimizer_bytes > 0


def test_chunk_intervals_group_equal_torch_chunk_sizes():
    from backend.analytic.sharding import chunk_rows

    for dims in ({10}, {5, 7}, {32000, 8192, 28672}, {3, 251, 90, 333}):
        for n in (1, 2, 3, 4, 7, 16, 1000):
            starts = chunk_intervals(dims, n) + [n]
            for a, b in zip(starts, starts[1:], strict=False):
                sizes = {tuple(chunk_rows(d, n, r)[1] for d in sorted(dims)) for r in range(a, b)}
                assert len(sizes) == 1, (dims, n, a, b)


def test_cli_prints_a_page_and_the_classes_of_a_million_ranks(capsys):
    argv = ["estimate", "--strategy", "fsdp", "--world", "1000000", "--global-batch", "1000000", "--micro-batch", "1",
            "--json"]
    assert main(argv + ["--rank-offset", "999990", "--rank-limit", "100"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in d["per_rank"]] == list(range(999_990, 1_000_000))
    assert d["per_rank_page"] == {"offset": 999_990, "ranks": 10, "world_size": 1_000_000}
    assert sum(c["ranks"] for c in d["rank_classes"]) == 1_000_000
    assert main(argv[:-1]) == 0  # the table: the first 1,024 ranks and one line per class
    out = capsys.readouterr().out
    assert "ranks 0..1023 of 1,000,000 shown" in out and "distinct predictions" in out
    assert main(argv + ["--rank-offset", "1000000"]) == 2
    assert "past the last rank (999999)" in capsys.readouterr().err


def test_small_worlds_print_every_rank_as_before(capsys):
    assert main(["estimate", "--strategy", "zero3", "--world", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in d["per_rank"]] == [0, 1, 2, 3] and "per_rank_page" not in d and "rank_classes" not in d


def test_inference_estimate_pages_a_million_ranks():
    from backend.analytic.inference import estimate_inference

    s = big(LLAMA70B, strategy="ddp", world_size=1_000_000)
    out = estimate_inference(s, batch=1, context=4096, offset=5, max_ranks=3)
    assert [r["rank"] for r in out["per_rank"]] == [5, 6, 7]
    assert out["per_rank_page"] == {"offset": 5, "ranks": 3, "world_size": 1_000_000}
    small = big(ODD, strategy="ddp", world_size=6, tp=3)
    full = estimate_inference(small, batch=1, context=30)
    assert [r["rank"] for r in full["per_rank"]] == list(range(6)) and "per_rank_page" not in full


def test_dashboard_prediction_charts_a_page_and_every_distinct_prediction():
    from dashboard.predict_view import PREDICT_PAGE, fit_check, predict

    s = big(LLAMA70B, strategy="fsdp", world_size=1_000_000)
    est, rows = predict(s)
    assert PREDICT_PAGE <= len(rows) < PREDICT_PAGE + 100
    assert [r["rank"] for r in rows[:PREDICT_PAGE]] == list(range(PREDICT_PAGE))
    worst = est.worst()
    fit = fit_check(rows, 1e15)
    assert fit.worst_rank == worst.rank and worst.rank in {r["rank"] for r in rows}
    small = big(ODD, strategy="zero2", world_size=6, tp=3)
    _, rows = predict(small)
    assert [r["rank"] for r in rows] == list(range(6))  # a small world: every rank, in order, as before
