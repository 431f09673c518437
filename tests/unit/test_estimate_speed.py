"""estimate()'s per-class path (`Estimate.per_rank`, expanded from one estimate per class of equivalent ranks) must
equal the prediction computed at each rank's own position (`estimate_rank`) field for field on every rank, and the fp32
dense specs must still give the outputs recorded before the fast path existed (sha256 of Estimate.to_dict() without its
notes)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import pytest

from backend.analytic import sharding as S
from backend.analytic.estimate import estimate, estimate_rank
from backend.spec import ExperimentSpec

T = dict(vocab_size=250, d_model=96, n_layers=5, n_heads=4, seq_len=32)
ODD = dict(vocab_size=251, d_model=90, n_layers=5, n_heads=3, seq_len=30, ffn_hidden=333)  # uneven chunks everywhere
MOE = dict(vocab_size=250, d_model=64, n_layers=2, n_heads=4, seq_len=32, n_experts=4, top_k=2)
L70 = dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, seq_len=4096)
CASES = {
    "ddp2": (T, dict(strategy="ddp", world_size=2), {}),
    "zero1_w3_odd": (ODD, dict(strategy="zero1", world_size=3), dict(global_batch=6, micro_batch=2)),
    "zero1_w7": (T, dict(strategy="zero1", world_size=7), dict(global_batch=7)),
    "zero1_sgd_w5": (ODD, dict(strategy="zero1", world_size=5), dict(global_batch=5, optimizer="sgd")),
    "fsdp_w7_pad": (ODD, dict(strategy="fsdp", world_size=7), dict(global_batch=7)),
    "zero2_w6_bf16": (ODD, dict(strategy="zero2", world_size=6), dict(global_batch=6, precision="bf16-mixed")),
    "zero3_w8": (T, dict(strategy="zero3", world_size=8), {}),
    "tp3_odd": (ODD, dict(strategy="ddp", world_size=3, tp=3), dict(global_batch=2, micro_batch=2)),
    "tp2sp_dp2_zero2": (T, dict(strategy="zero2", world_size=4, tp=2, sequence_parallel=True), dict(global_batch=4)),
    "pp4_interleaved": (dict(T, n_layers=8), dict(strategy="ddp", world_size=4, pp=4, pp_schedule="interleaved_1f1b",
                                                   virtual_stages=2), {}),
    # zbv over FSDP is rejected by the spec (torch drops last-stage grads); cover FSDP padding under PP and zbv apart.
    "pp2_interleaved_fsdp": (ODD, dict(strategy="zero3", world_size=6, pp=2, pp_schedule="interleaved_1f1b",
                                       virtual_stages=2), dict(global_batch=12)),
    "pp2_zbv_ddp": (ODD, dict(strategy="ddp", world_size=6, pp=2, pp_schedule="zbv", virtual_stages=2),
                    dict(global_batch=12)),
    "ep2_moe": (MOE, dict(strategy="ddp", world_size=4, ep=2), dict(global_batch=4)),
    "ep4_moe_zero3": (MOE, dict(strategy="zero3", world_size=4, ep=4), dict(global_batch=4)),
    "ep2_moe_zero2_w6": (MOE, dict(strategy="zero2", world_size=6, ep=2), dict(global_batch=6)),
    "3d_tp3_pp2_dp2_zero2": (ODD, dict(strategy="zero2", world_size=12, tp=3, pp=2),
                             dict(global_batch=12, precision="bf16-mixed", recompute="full")),
    "3d_selective_ddp": (T, dict(strategy="ddp", world_size=12, tp=2, pp=3),
                         dict(global_batch=12, recompute="selective")),
    "70b_fsdp8": (L70, dict(strategy="fsdp", world_size=8), {}),
    "70b_zero1_w16": (L70, dict(strategy="zero1", world_size=16), dict(global_batch=16)),
    "70b_tp8pp8dp4": (L70, dict(strategy="zero2", world_size=256, tp=8, pp=8), dict(global_batch=64)),
}
# Estimate.to_dict() digests (every number, without the `notes` prose) of fp32 dense specs whose activation
# model did not change since the per-rank implementation, before the fast path. First recorded with the notes
# included; re-recorded without them at the commit where those full digests still matched (the notes explain
# measurement gaps and may be reworded; the numbers may not change). Re-recorded once more when `other` became this
# rank's dp slice (estimate.OTHER_IS_DP_SLICE = True): every spec with dp > 1 changed in per_rank other_bytes and
# total_bytes only (checked field by field against the old digests with the flag off); dp = 1 specs kept theirs.
# Re-recorded when RankEstimate gained loss_backward_temp_bytes (the loss-backward moment of the fits check):
# every case's digest without that key equals the digest recorded before it.
# Re-recorded when the prediction counted every pipeline stage's output-gradient receive buffers (issue 32; the per-rank
# key recv_buffer_bytes is left out like the other moments): the cases without pipelining kept their digests; the three
# pipelined ones moved only in activations_bytes and total_bytes (up, by the same bytes) and the moments made of them
# (checked rank by rank against 317d8ac). Before: pp4_interleaved 9b1d4e774b0edd26e874, 3d_selective_ddp
# 178531a58ebab4f28bc8, 70b_tp8pp8dp4 7b6227ee42babdac3941.
BEFORE = {
    "ddp2": "f87759af270f3abb3229",
    "zero1_w7": "8dae5a3133a7d41c0930",
    "zero1_sgd_w5": "ef624bd261ae21711f41",
    "fsdp_w7_pad": "febfd5ac1f6cacfd30bb",
    "zero3_w8": "e54bae6ff08ccb37fd44",
    "tp3_odd": "7e8d6ecbac02168155b4",
    "tp2sp_dp2_zero2": "29f848ef7ac67a18bd21",
    "pp4_interleaved": "051c8c5289853dafa09f",
    "3d_selective_ddp": "354b376fa651e84961be",
    "70b_fsdp8": "5752d16197b9f99996aa",
    "70b_tp8pp8dp4": "39a8f7f601377fb9c7da",
}


def _class_path(spec: ExperimentSpec) -> list:
    return list(estimate(spec).per_rank)


def make(name: str) -> ExperimentSpec:
    m, p, t = CASES[name]
    return ExperimentSpec(model=m, parallel=p, train={"global_batch": 8, "micro_batch": 1, "steps": 1,
                                                      "warmup_steps": 1, **t})


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("70b_tp8")])
def test_fast_path_equals_per_rank_reference(name):
    s = make(name)
    fast = _class_path(s)
    assert [r.rank for r in fast] == list(range(s.parallel.world_size))
    for r in fast:
        assert asdict(r) == asdict(estimate_rank(s, r.rank)), (name, r.rank)


def test_fast_path_equals_reference_on_256_ranks_sampled():
    s = make("70b_tp8pp8dp4")
    fast = _class_path(s)
    for rank in range(0, 256, 7):
        assert asdict(fast[rank]) == asdict(estimate_rank(s, rank))


ISSUE_32_KEYS = frozenset({"loss_backward_bytes", "backward_bytes", "fullest_bytes", "fullest_moment",
                           "recv_buffer_bytes", "late_grads_bytes"})
"""The per-rank moments issue 32 added (RankEstimate): new numbers, left out so the digests still cover every number
that existed before, unchanged (tests/unit/test_estimate_cli.py and test_planner_core.py test the new ones)."""


def _without(keys: frozenset, obj):
    if isinstance(obj, dict):
        return {k: _without(keys, v) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_without(keys, v) for v in obj]
    return obj


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_outputs_unchanged_since_before_fast_path(name):
    numbers = _without(ISSUE_32_KEYS, {k: v for k, v in estimate(make(name)).to_dict().items() if k != "notes"})
    got = hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest()[:20]
    assert got == BEFORE[name]


def test_uneven_specs_really_have_distinct_ranks():
    """The cases above exercise what the class key must keep apart: FSDP tail shards and ZeRO-1 shares."""
    fsdp = _class_path(make("fsdp_w7_pad"))
    assert len({r.params_count for r in fsdp}) > 1
    z1 = _class_path(make("zero1_w7"))
    assert len({r.optimizer_bytes for r in z1}) > 1
    tp = _class_path(make("tp3_odd"))
    assert len({r.params_count for r in tp}) > 1


def test_zero1_partition_heap_matches_linear_scan():
    with_zero = [5, 3, 3, 8, 1, 1, 1, 9, 2, 2, 7, 7, 0, 4]
    positive = [q for q in with_zero if q]  # n >= len: the one-rank-each shortcut
    for numels in (with_zero, positive, with_zero[:3]):
        for n in (1, 2, 3, 5, 13, 14, 16):
            sizes, want = [0] * n, [0] * len(numels)
            for i in sorted(range(len(numels)), key=lambda j: numels[j], reverse=True):
                r = min(range(n), key=lambda k: (sizes[k], k))
                want[i], sizes[r] = r, sizes[r] + numels[i]
            assert S.zero1_partition(numels, n) == want, (numels, n)


def test_first_short_chunk():
    assert S.first_short_chunk({8, 16}, 4) == 4  # all even
    assert S.first_short_chunk({10}, 4) == 3  # chunks 3,3,3,1
    assert S.first_short_chunk({5}, 4) == 2  # chunks 2,2,1,0
    for d in range(1, 40):
        for n in range(1, 9):
            rows = -(-d // n)
            short = [r for r in range(n) if S.chunk_rows(d, n, r)[1] < rows]
            assert S.first_short_chunk({d}, n) == (short[0] if short else n)


@pytest.mark.parametrize("name", ["tp3_odd", "3d_tp3_pp2_dp2_zero2", "ep2_moe_zero2_w6", "pp2_interleaved_fsdp",
                                  "pp2_zbv_ddp"])
def test_inference_estimate_shares_per_position(name):
    from backend.analytic.inference import estimate_inference
    from backend.analytic.textbook.kv_cache import kv_cache_bytes
    from backend.analytic.traffic import compute_bytes

    s = make(name)
    m, p = s.model, s.parallel
    got = estimate_inference(s, batch=2, context=64)["per_rank"]
    assert [row["rank"] for row in got] == list(range(p.world_size))
    for row in got:
        weights = sum(q.local_numel for q in S.local_params(s, row["rank"], dp_shard=False))
        layers = S.rank_layers(s, S.rank_stages(s, row["rank"]))
        kv = kv_cache_bytes(batch=2, context=64, n_layers=len(layers), n_kv_heads=m.kv_heads, head_dim=m.head_dim,
                            dtype_bytes=compute_bytes(s.train.precision), tp=p.tp)
        assert (row["params_count"], row["kv_cache_bytes"]) == (weights, kv)
        assert row["coords"] == p.coords(row["rank"])
