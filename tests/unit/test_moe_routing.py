"""Routing-dependent EP all-to-all and MoE activation bytes (backend/analytic/measured/moe_routing.py): uniform counts
reduce to the uniform formulas, hand-made skewed counts give hand-computed bytes; assemble's notes use them."""

import pytest

from backend.analytic.estimate import estimate
from backend.analytic.measured import moe_routing as MR
from backend.analytic.memory import activations as A
from backend.analytic.memory import moe_bytes
from backend.engine.assemble import routing_notes
from backend.result import MemoryBreakdown, RankResult, RoutingAdjusted, RunResult
from backend.spec import ExperimentSpec


def _spec(**train) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "name": "ep", "model": {"vocab_size": 64, "d_model": 32, "n_layers": 3, "n_heads": 4, "seq_len": 16,
                                "n_experts": 4, "top_k": 2},
        "train": {"global_batch": 8, "micro_batch": 1, "steps": 2} | train,
        "parallel": {"strategy": "ep", "world_size": 2}})


def _routing(spec: ExperimentSpec, received_per_mb_layer) -> dict:
    """A payload like ep.routing_payload: this rank sends N·k/E rows to every expert; received given."""
    m, t = spec.model, spec.train
    n = t.micro_batch * m.seq_len * m.top_k
    recs = [{"microbatch": mb, "layer": str(layer), "sent": [n // m.n_experts] * m.n_experts, "received": rec}
            for mb, layers in enumerate(received_per_mb_layer) for layer, rec in enumerate(layers)]
    return {"ep": 2, "ep_rank": 0, "n_experts": m.n_experts, "top_k": m.top_k, "tokens": t.micro_batch * m.seq_len,
            "records": recs}


def _uniform_a2a(spec, received) -> float:
    ds = MR.uniform_like(MR.dispatches(_routing(spec, received)), tokens=16, top_k=2, n_experts=4, ep=2)
    return MR.all_to_all_bytes(ds, h=32, dtype_bytes=4, n_experts=4)


def _uniform(spec):
    per = spec.train.micro_batch * spec.model.seq_len * spec.model.top_k // spec.model.n_experts
    return [[[per, per], [per, per]] for _ in range(spec.model.n_layers)]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_uniform_counts_reproduce_the_uniform_all_to_all(precision):
    spec = _spec(precision=precision)
    routing = _routing(spec, [_uniform(spec)] * spec.train.microbatches)
    ds = MR.dispatches(routing)
    cb = 4 if precision == "fp32" else 2
    row = moe_bytes.row_bytes(cb, autocast=precision != "fp32")  # autocast: the routed rows are the fp32 ln2 output
    got = MR.all_to_all_bytes(ds, h=spec.model.d_model, dtype_bytes=row, n_experts=spec.model.n_experts)
    assert got == pytest.approx(estimate(spec).per_rank[0].comm_bytes["all_to_all"], rel=1e-12)
    assert MR.uniform_like(ds, tokens=16, top_k=2, n_experts=4, ep=2) == ds
    adj = MR.adjustment(spec, routing)
    assert adj.load == 1.0 and adj.all_to_all_bytes == got
    if precision == "fp32":  # the uniform prediction already holds the all-to-all dispatch's own saved tensors
        assert adj.activations_delta_bytes == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("top_k,dtype_bytes", [(1, 4), (2, 4), (2, 2)])
def test_uniform_counts_reproduce_the_moe_activation_term(top_k, dtype_bytes):
    kw = dict(h=32, ffn=128, n_experts=4, top_k=top_k, dtype_bytes=dtype_bytes)
    got = moe_bytes.ep_moe_layer_bytes(tokens=16, received_rows=16 * top_k, **kw)
    extra = moe_bytes.ep_only_uniform_bytes(tokens=16, h=32, top_k=top_k, dtype_bytes=dtype_bytes)
    assert extra == 16 * top_k * (32 * dtype_bytes + 8)  # the expert outputs index_add keeps + the sort order
    assert got == pytest.approx(A.dense_moe_layer_bytes(s=16, b=1, **kw) + extra, rel=1e-12)
    assert moe_bytes.INDEX_BYTES == A.INDEX_BYTES


@pytest.mark.parametrize("train", [{}, {"precision": "bf16-mixed"}, {"recompute": "selective"}])
def test_the_moe_term_read_off_the_uniform_model_is_the_ep_dispatch_term(train):
    spec = _spec(**train)
    cb = 4 if not train.get("precision") else 2
    ep = moe_bytes.ep_moe_layer_bytes(tokens=16, received_rows=32, h=32, ffn=128, n_experts=4, top_k=2, dtype_bytes=cb,
                               autocast=bool(train.get("precision")))
    assert MR.predicted_moe_layer_bytes(spec) == pytest.approx(ep, rel=1e-12)


def test_skewed_routing_hand_computed():
    # E=4, ep=2, h=4, ffn=16, fp32: this rank sent 2 rows, its 2 experts received 2 + 1 rows from the peers
    d = MR.Dispatch(microbatch=0, layer="0", sent=[1, 1, 0, 0], received=[[2, 0], [1, 0]])
    assert (d.sent_rows, d.received_rows) == (2, 3)
    # counts 8·4 = 32; forward dispatch 2 rows + combine 3 rows, 16 B each = 80; backward the same 80
    assert MR.all_to_all_call_bytes(d, h=4, dtype_bytes=4, n_experts=4) == 32 + 80 + 80
    rec = MR.Dispatch(0, "0", [1, 1, 0, 0], [[2, 0], [1, 0]], recompute=True)
    assert MR.all_to_all_call_bytes(rec, h=4, dtype_bytes=4, n_experts=4) == 32 + 80
    # experts: fc_in input 3x4 + GELU in / fc_out in 2x3x16 + expert output 3x4 = 120 fp32 elements, + 3 int64 rows
    assert moe_bytes.moe_expert_bytes(received_rows=3, h=4, ffn=16, dtype_bytes=4) == 120 * 4 + 3 * 8
    # sender, N=2 tokens, k=1: softmax 2x4 + top-k 2 + sum 2 + returned rows 2x4 + weights 2 + index_add source 2x4
    # = 30 fp32 elements, + top-k ids, sort order, token of each slot (2 int64 each)
    assert moe_bytes.moe_sender_bytes(tokens=2, h=4, n_experts=4, top_k=1, dtype_bytes=4) == 30 * 4 + 6 * 8


def test_autocast_keeps_the_rows_fp32_and_the_expert_linears_16_bit():
    # R=3 rows, h=4, ffn=16, bf16 autocast: fc_in's 16-bit input cast 3x4 + GELU / fc_out inputs 2x3x16 at 2 B,
    # the expert output cast back to the fp32 rows (index_add source) 3x4 at 4 B, 3 int64 row indices
    assert (moe_bytes.moe_expert_bytes(received_rows=3, h=4, ffn=16, dtype_bytes=2, autocast=True)
            == 108 * 2 + 12 * 4 + 24)
    # everything on the sender side is fp32 (softmax output, top-k values, returned rows, weights, products)
    assert moe_bytes.moe_sender_bytes(tokens=2, h=4, n_experts=4, top_k=1, dtype_bytes=2,
                                      autocast=True) == 30 * 4 + 6 * 8
    assert moe_bytes.row_bytes(2, autocast=True) == 4 and moe_bytes.row_bytes(2, autocast=False) == 2


def test_peak_is_the_heaviest_microbatch_and_recompute_is_not_saved():
    ds = [MR.Dispatch(0, "0", [1] * 4, [[1, 1], [1, 1]]), MR.Dispatch(0, "1", [1] * 4, [[1, 1], [1, 1]]),
          MR.Dispatch(1, "0", [1] * 4, [[5, 0], [0, 0]]), MR.Dispatch(1, "1", [1] * 4, [[2, 0], [0, 0]]),
          MR.Dispatch(1, "0", [1] * 4, [[9, 9], [9, 9]], True)]
    kw = dict(tokens=2, h=4, ffn=16, n_experts=4, top_k=2, dtype_bytes=4)
    got, n_layers, mb = MR.peak_microbatch(ds, **kw)
    sender = moe_bytes.moe_sender_bytes(tokens=2, h=4, n_experts=4, top_k=2, dtype_bytes=4)
    one = moe_bytes.moe_expert_bytes(received_rows=1, h=4, ffn=16, dtype_bytes=4)
    # microbatch 0: 4 + 4 rows; microbatch 1: 5 + 2 (its recompute re-run saves nothing more)
    assert (got, n_layers, mb) == (2 * sender + 8 * one, 2, 0)


def test_adjustment_of_a_skewed_rank():
    spec = _spec()  # 2 microbatches x 3 layers, N·k = 32 slots, uniform 32 received per layer
    heavy = [[[12, 8], [10, 10]]] * 3  # 40 received per layer
    light = [[[4, 4], [6, 6]]] * 3  # 20
    adj = MR.adjustment(spec, _routing(spec, [heavy, light]))
    row = 32 * 4
    uniform = _uniform_a2a(spec, [heavy, light])  # the same 6 calls, uniform counts
    # 2 all-to-alls carry R: combine fwd, dispatch bwd
    assert adj.all_to_all_bytes == uniform + 2 * row * (3 * 8 - 3 * 12)
    per_row = (2 * 32 + 2 * 128) * 4 + 8
    # the heavy microbatch (8 rows over uniform per layer) sets the peak
    assert adj.activations_delta_bytes == 3 * 8 * per_row
    assert (adj.received_slots, adj.uniform_slots, adj.peak_microbatch) == (180, 192, 0)


def _rank(rank: int, a2a: float, act: int) -> RankResult:
    from backend.result import CommStat

    return RankResult(rank=rank, measured=MemoryBreakdown(activations_bytes=act),
                      predicted=MemoryBreakdown(activations_bytes=100_000),
                      error_pct={"activations_bytes": (act - 100_000) / 1000},
                      comm={"all_to_all": CommStat(bytes=a2a)}, comm_predicted={"all_to_all": 10_000.0})


def test_full_recompute_has_no_activation_adjustment():
    spec = _spec(recompute="full")
    adj = MR.adjustment(spec, _routing(spec, [[[[12, 8], [10, 10]]] * 3] * 2))
    assert adj.activations_delta_bytes == 0 and adj.all_to_all_bytes > 0


def test_routing_notes_only_where_a_bound_is_missed_and_adjusted_values_set():
    spec = _spec()
    heavy = [[[12, 8], [10, 10]]] * 3
    ranks = [{"extra": {"moe_routing": _routing(spec, [heavy, heavy])}}, {"extra": {}}]
    per_rank = [_rank(0, 12_000.0, 140_000), _rank(1, 10_000.0, 100_000)]
    notes = routing_notes(spec, ranks, per_rank)
    assert len(notes) == 1 and notes[0].startswith("rank 0:") and "1.25× uniform" in notes[0]
    g = per_rank[0].predicted_given_routing
    uniform = _uniform_a2a(spec, [heavy, heavy])
    assert g.all_to_all_bytes == uniform + 2 * 32 * 4 * 8 * 6 and g.received_token_slots == 240
    assert per_rank[1].predicted_given_routing is None


def test_rank_result_field_is_optional_and_round_trips():
    rr = RankResult(rank=0)
    assert rr.predicted_given_routing is None
    rr.predicted_given_routing = RoutingAdjusted(activations_bytes=5, all_to_all_bytes=7.0)
    back = RankResult.model_validate_json(rr.model_dump_json())
    assert back.predicted_given_routing.activations_bytes == 5
    old = RunResult.model_validate({"status": "ok", "spec": _spec().model_dump(), "per_rank": [{"rank": 0}]})
    assert old.per_rank[0].predicted_given_routing is None  # results written before the field still load
