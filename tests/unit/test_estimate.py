"""estimate(spec): per-rank memory / comm predictions, checked by hand arithmetic and against the real
engine path (strategies + MemTracker + comm counter) run in one process on torch's "fake" process group,
or on 2 real gloo ranks for DDP-based strategies (slow)."""

from __future__ import annotations

import json
import math

import pytest

from backend.analytic import sharding as S
from backend.analytic.estimate import estimate, estimate_raw, zero_textbook
from backend.analytic.inference import estimate_inference
from backend.analytic.params import count_params, param_list
from backend.spec import ExperimentSpec
from tests.helpers.engine_measure import on_fake_pg
from tests.helpers.farm import program_job, uses

GB = 1e9
MODEL = dict(vocab_size=250, d_model=96, n_layers=3, n_heads=4, seq_len=32)


def spec(parallel: dict, model: dict | None = None, **train) -> ExperimentSpec:
    train = {"global_batch": 8, "micro_batch": 1, "steps": 1, "warmup_steps": 1, **train}
    return ExperimentSpec(model=model or MODEL, train=train, parallel=parallel)


def test_zero_paper_numbers():
    # Rajbhandari et al. 2020, Fig 1: Ψ = 7.5B, N = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB per device
    want = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in want.items():
        got = estimate_raw(params=7.5e9, dp=64, zero_stage=stage, precision="fp16-mixed")["total_bytes"] / GB
        assert round(got, 1) == gb


def test_ddp_replicates_everything():
    s = spec({"strategy": "ddp", "world_size": 2})
    psi, n = count_params(s.model), len(param_list(s.model))
    e = estimate(s)
    for r in e.per_rank:
        assert (r.params_bytes, r.grads_bytes) == (4 * psi, 4 * psi)
        assert r.optimizer_bytes == 8 * psi + 4 * n  # AdamW m, v + a 0-dim fp32 step per tensor
        assert r.comm_bytes == {"all_reduce": 4 * psi}  # once per step (no_sync on earlier microbatches)
        assert r.comm_wire_bytes["all_reduce"] == pytest.approx(2 * (2 - 1) / 2 * 4 * psi)
    assert e.bubble_fraction is None and e.params_total == psi


def test_zero1_partitions_optimizer_whole_params():
    s = spec({"strategy": "zero1", "world_size": 3}, global_batch=6)
    psi, n = count_params(s.model), len(param_list(s.model))
    ranks = estimate(s).per_rank
    assert sum(r.optimizer_bytes for r in ranks) == 8 * psi + 4 * n
    assert len({r.optimizer_bytes for r in ranks}) > 1  # whole parameters: uneven
    assert all(r.params_bytes == 4 * psi for r in ranks)
    assert ranks[0].comm_bytes == {"all_reduce": 4 * psi, "broadcast": 4 * psi}


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp"])
def test_fsdp_padding_and_totals(strategy):
    world = 3
    s = spec({"strategy": strategy, "world_size": world}, global_batch=6)
    padded = sum(math.ceil(p.shape[0] / world) * p.numel // p.shape[0] for p in param_list(s.model))
    ranks = estimate(s).per_rank
    for r in ranks:
        unsharded = 4 * world * padded if strategy == "zero2" else 0
        assert r.params_bytes == 4 * padded + unsharded
        assert r.grads_bytes == 4 * padded
    assert sum(r.params_count for r in ranks) == count_params(s.model)  # real elements, no padding
    gathers = 1 if strategy == "zero2" else 2
    assert ranks[0].comm_bytes["all_gather"] == gathers * s.train.microbatches * 4 * world * padded
    assert ranks[0].comm_bytes["reduce_scatter"] == s.train.microbatches * 4 * world * padded


def test_tp_splits_and_activation_comm():
    s = spec({"strategy": "tp", "world_size": 2}, global_batch=2)
    r = estimate(s).per_rank[0]
    local = sum(q.local_numel for q in S.local_params(s, 0))
    assert r.params_bytes == 4 * local < 4 * count_params(s.model)
    b, sq, h, V, L, m = 1, 32, 96, 250, 3, 2
    bsh = b * sq * h * 4
    # 4 per layer + embeddings (tok (b,s,h) + pos (s,h)) fwd + lm_head input grad bwd; logits all-gathered
    assert r.comm_bytes["all_reduce"] == m * (4 * L * bsh + bsh + sq * h * 4 + bsh)
    assert r.comm_bytes["all_gather"] == m * b * sq * V * 4


def test_pp_stages_bubble_and_p2p():
    s = spec({"strategy": "pp", "world_size": 2, "pp_schedule": "1f1b"}, model=dict(MODEL, n_layers=4))
    e = estimate(s)
    m = s.train.microbatches
    assert e.bubble_fraction == pytest.approx((2 - 1) / (m + 2 - 1))
    r0, r1 = e.per_rank
    assert (r0.layers, r1.layers) == ([0, 1], [2, 3])
    act = 1 * 32 * 96 * 4
    assert r0.comm_bytes == {"send": m * act, "recv": m * act}
    assert r0.params_bytes + r1.params_bytes == 4 * count_params(s.model)


def test_zbv_rank_holds_v_shape_stages():
    s = spec({"strategy": "pp", "world_size": 2, "pp_schedule": "zbv", "virtual_stages": 2},
             model=dict(MODEL, n_layers=4), global_batch=4)
    r0, r1 = estimate(s).per_rank
    assert (r0.stages, r1.stages) == ([0, 3], [1, 2])
    # stages 1 and 2 share rank 1: that boundary is local (no send/recv)
    act = 1 * 32 * 96 * 4 * s.train.microbatches
    assert r1.comm_bytes == {"send": 2 * act, "recv": 2 * act}


def test_ep_splits_experts():
    moe = dict(MODEL, n_experts=4, top_k=2)
    s = spec({"strategy": "ep", "world_size": 2}, model=moe, global_batch=2)
    r = estimate(s).per_rank[0]
    expert = 2 * 96 * 384 + 384 + 96
    assert r.params_bytes == 4 * (count_params(s.model) - 3 * 2 * expert)  # 2 of 4 experts per layer
    assert "all_to_all" in r.comm_bytes


def test_mixed_precision_note_and_textbook():
    s = spec({"strategy": "zero3", "world_size": 2}, precision="bf16-mixed")
    e = estimate(s)
    assert e.zero_textbook["k"] == 12 and e.zero_textbook["param_bytes"] == 2
    assert any("fp32" in n for n in e.notes)
    z = zero_textbook(1e6, dp=4, stage=3, precision="fp32")
    assert z["total_bytes"] == pytest.approx(16e6 / 4)


def test_to_dict_json_contract():
    d = json.loads(json.dumps(estimate(spec({"strategy": "zero3", "world_size": 2})).to_dict()))
    for key in ("per_rank", "comm_bytes_per_step", "comm_wire_bytes_per_step", "bubble_fraction", "flops_per_step",
                "tokens_per_step", "params_total", "zero_textbook", "notes"):
        assert key in d
    row = d["per_rank"][1]
    for key in ("rank", "coords", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                "other_bytes", "total_bytes", "comm_bytes", "comm_wire_bytes"):
        assert key in row
    parts = sum(row[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes"))
    assert row["total_bytes"] == parts


GRID = [
    {"strategy": "ddp", "world_size": 4}, {"strategy": "zero2", "world_size": 4, "tp": 2},
    {"strategy": "fsdp", "world_size": 8, "tp": 2, "pp": 2},
    {"strategy": "pp", "world_size": 4, "pp_schedule": "gpipe"},
    {"strategy": "pp", "world_size": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2},
    {"strategy": "pp", "world_size": 2, "pp_schedule": "zero_bubble", "virtual_stages": 2},
    {"strategy": "tp", "world_size": 4, "sequence_parallel": True},
]


@pytest.mark.parametrize("parallel", GRID)
def test_every_rank_gets_an_estimate(parallel):
    s = spec(parallel, model=dict(MODEL, n_layers=4, n_heads=4), global_batch=16)
    e = estimate(s)
    assert [r.rank for r in e.per_rank] == list(range(s.parallel.world_size))
    assert all(r.total_bytes > 0 for r in e.per_rank) and e.flops_per_step > 0


def test_inference_weights_and_kv_cache():
    s = spec({"strategy": "tp", "world_size": 2}, precision="bf16-mixed")
    d = estimate_inference(s, batch=4, context=128)
    kv = 2 * 4 * 128 * 3 * (4 // 2) * (96 // 4) * 2  # K and V, heads split over tp, 2 B values
    assert d["kv_cache_bytes"] == kv
    assert d["per_rank"][0]["weights_bytes"] == 2 * sum(q.local_numel for q in S.local_params(s, 0))


# ---- against the real engine path ----

CATS = ("params_bytes", "grads_bytes", "optimizer_bytes", "other_bytes")


def _check(s: ExperimentSpec, rank: int, got: dict, comm_keys: tuple[str, ...]) -> None:
    pred = estimate(s).per_rank[rank]
    for k in CATS:
        assert got["memory"][k] == getattr(pred, k), k
    assert got["memory"]["activations_bytes"] == pytest.approx(pred.activations_bytes, rel=0.01)
    for k in comm_keys:
        assert got["comm"][k] == pred.comm_bytes[k], k


@pytest.mark.parametrize("strategy,rank", [("zero3", 3), ("zero2", 1)])
@pytest.mark.heavy
def test_fsdp_matches_engine_on_fake_pg(strategy, rank, monkeypatch):
    from backend.engine import loop

    monkeypatch.setattr(loop, "progress", lambda *a, **k: None)
    # vocab 250 over 4 ranks: padded dim-0 shards; seq 64 keeps the activation peak at the end of forward
    s = spec({"strategy": strategy, "world_size": 4}, model=dict(MODEL, seq_len=64))
    _check(s, rank, on_fake_pg(s, rank), ("all_gather", "reduce_scatter"))


@pytest.mark.heavy
def test_tp_sp_matches_engine_on_fake_pg(monkeypatch):
    from backend.engine import loop

    monkeypatch.setattr(loop, "progress", lambda *a, **k: None)
    s = spec({"strategy": "tp", "world_size": 2, "sequence_parallel": True}, global_batch=1)
    got = on_fake_pg(s, 1)
    pred = estimate(s).per_rank[1]
    for k in ("params_bytes", "optimizer_bytes", "other_bytes"):
        assert got["memory"][k] == getattr(pred, k), k
    assert got["memory"]["activations_bytes"] == pytest.approx(pred.activations_bytes, rel=0.01)
    assert got["comm"] == pytest.approx(pred.comm_bytes)


@pytest.mark.parametrize("strategy", ["ddp"])
def test_tp_dp_mix_matches_engine_on_fake_pg(strategy, monkeypatch):
    """2D mesh (dp 2 x tp 2): `replicate` (ddp) keeps 2x params / grads. (zero3 x tp is left out: its measured
    activation peak falls inside the root's forward, during the TP logits all-gather, while the root is unsharded.)"""
    from backend.engine import loop

    monkeypatch.setattr(loop, "progress", lambda *a, **k: None)
    s = spec({"strategy": strategy, "world_size": 4, "tp": 2}, model=dict(MODEL, n_layers=2, seq_len=64),
             global_batch=2)
    got = on_fake_pg(s, 3)
    pred = estimate(s).per_rank[3]
    for k in CATS:
        assert got["memory"][k] == getattr(pred, k), k
    assert got["comm"] == pytest.approx(pred.comm_bytes)


# ---- on 2 real gloo ranks (a farm job) ----

TINY = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, seq_len=16)
GLOO_SPECS = [spec({"strategy": st, "world_size": 2}, model=TINY, global_batch=4) for st in ("ddp", "zero1", "pp")]
GLOO = program_job("engine_measure", 2, specs=[s.to_json() for s in GLOO_SPECS])


@pytest.mark.slow
@uses(GLOO)
def test_gloo_ddp_zero1_pp_match_engine(farm):
    """One 2-rank gloo launch runs ddp, zero1 and pp (1F1B) through the real engine path."""
    specs = GLOO_SPECS
    got = {int(r): runs for r, runs in farm.result(GLOO).items()}
    for r in range(2):
        _check(specs[0], r, got[r][0], ("all_reduce",))
        _check(specs[1], r, got[r][1], ("all_reduce", "broadcast"))
        # pipelining: activations are not exact (stage buffers), states and p2p are
        pred = estimate(specs[2]).per_rank[r]
        for k in ("params_bytes", "optimizer_bytes"):
            assert got[r][2]["memory"][k] == getattr(pred, k), (r, k)
        assert got[r][2]["comm"] == pytest.approx(pred.comm_bytes)
