"""Context parallelism in the prediction core: what cp divides and what it does not, the ring's K/V traffic, the
step-time terms (ring exposure, imbalance without load balancing, smaller per-rank GEMMs), and the planner's array
path against the single-layout core on layouts with cp.

The memory identity the engine measures (tests/multiprocess/test_cp_accuracy.py): a cp rank holds what a rank of the
same layout without cp holds at seq_len / cp tokens, with the parameters shared by dp x cp ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from backend.analytic.estimate import estimate, worst_rank_bytes
from backend.analytic.layout import Layout
from backend.analytic.memory.rank_memory import worst_rank_memory
from backend.analytic.steptime.compute import attention_pass
from backend.analytic.steptime.cp_ring import ring_time
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.ops import attention_time
from backend.analytic.steptime.ring_compute import ring_blocks_time, ring_merge
from backend.analytic.steptime.stack_knobs import stack_knobs
from backend.analytic.traffic import cp_kv_bytes, cp_traffic
from backend.planner.space import Limits, enumerate_layouts
from backend.spec import ExperimentSpec, ModelSpec

LLAMA = dict(norm="rmsnorm", mlp="swiglu", positions="rope", bias="none", attention="flash")
SMALL = {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 256,
         "seq_len": 256, **LLAMA}
# Llama-3-8B (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3: 32 layers, d_model 4096, 32 heads, 8 KV
# heads, FFN 14336, vocab 128256)
LLAMA3_8B = ModelSpec(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                      seq_len=32768, **LLAMA)


def _spec(model: dict, **parallel) -> ExperimentSpec:
    train = parallel.pop("train", {})
    return ExperimentSpec.for_prediction({"model": model, "train": {"global_batch": 8, "micro_batch": 1, **train},
                                          "parallel": parallel})


def test_cp_rank_is_the_same_layout_at_seq_over_cp_with_dp_times_cp_sharing_the_parameters():
    for flavour, extra in (("fsdp", {}), ("ddp", {"tp": 2, "sequence_parallel": True}), ("zero1", {}),
                           ("zero2", {"pp": 2})):
        for precision in ("fp32", "bf16-mixed"):
            train = {"precision": precision}
            with_cp = estimate(_spec(SMALL, strategy=flavour, dp=2, cp=4, train=train, **extra))
            without = estimate(_spec({**SMALL, "seq_len": SMALL["seq_len"] // 4}, strategy=flavour, dp=8,
                                     train={"precision": precision, "global_batch": 32}, **extra))
            assert len(with_cp.distinct_ranks) == len(without.distinct_ranks)
            # other: 4 rows x 64 tokens in both
            for a, b in zip(with_cp.distinct_ranks, without.distinct_ranks, strict=False):
                for cat in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes"):
                    assert getattr(a[0], cat) == getattr(b[0], cat), (flavour, precision, cat)


def test_activations_divide_by_cp_and_model_states_do_not_under_ddp():
    one, four = (estimate(_spec(SMALL, dp=1, cp=cp)).worst() for cp in (1, 4))
    assert four.params_bytes == one.params_bytes and four.optimizer_bytes == one.optimizer_bytes
    assert four.activations_bytes < one.activations_bytes / 3.5  # s/4 tokens; the (s, d) RoPE tables too
    sharded = estimate(_spec(SMALL, strategy="fsdp", dp=1, cp=4)).worst()
    assert sharded.optimizer_bytes < one.optimizer_bytes / 3.5  # FSDP shards over the dp x cp ranks
    (note,) = [n for n in estimate(_spec(SMALL, dp=1, cp=4)).notes if n.startswith("CP:")]
    assert "seq_len / cp = 64 tokens" in note and "not divided (replicated on the dp x cp ranks)" in note


def test_ring_traffic_per_layer_and_microbatch():
    """b=1, s/cp = 64, a = 8 heads of 16 (GQA K/V repeated to 8 heads before the core), fp32: K+V = 2*64*8*16*4 =
    65,536 B per call; dK/dV the same in fp32. 4 layers x 8 microbatches = 32 calls."""
    spec = _spec(SMALL, dp=1, cp=4, cp_rotate="allgather")
    kv = 2 * 64 * 8 * 16 * 4
    assert cp_traffic(spec, 4) == [("all_gather", 2 * 32 * 4 * kv, 4), ("all_to_all", 32 * 4 * kv, 4)]
    spec = _spec(SMALL, dp=1, cp=4, cp_rotate="alltoall", train={"recompute": "full"})
    assert cp_traffic(spec, 4) == [("all_to_all", 3 * 32 * 3 * kv + 32 * 4 * kv, 4)]
    est = estimate(_spec(SMALL, dp=1, cp=4))
    assert est.comm_bytes_per_step["all_gather"] == 2 * 32 * 4 * kv


def test_megatron_ring_moves_gqa_kv_and_bf16_grads_as_transformer_engine_does():
    """TE's ring (traffic.TE_RING_SOURCE): K/V at the 2 GQA heads, dK/dV in bf16; p2p = cp - 1 hops of K/V each way
    and cp - 1 of dK/dV; all_gather = the gathers and one reduce-scatter of cp x dK/dV. torch's: 8 heads, fp32 dK/dV."""
    bf16 = {"precision": "bf16-mixed"}
    torch_kv, torch_dkv = cp_kv_bytes(_spec(SMALL, dp=1, cp=4, train=bf16))
    te = _spec(SMALL, strategy="zero1", dp=1, cp=4, cp_rotate="alltoall", train={**bf16, "stack": "megatron"})
    kv, dkv = cp_kv_bytes(te)
    assert (kv, dkv) == (2 * 64 * 2 * 16 * 2, 2 * 64 * 2 * 16 * 2)
    assert (torch_kv, torch_dkv) == (2 * 64 * 8 * 16 * 2, 2 * 64 * 8 * 16 * 4)
    assert cp_traffic(te, 4) == [("all_to_all", 2 * 32 * 3 * kv + 32 * 3 * dkv, 4)]
    gather = _spec(SMALL, strategy="zero1", dp=1, cp=4, cp_rotate="allgather", train={**bf16, "stack": "megatron"})
    assert cp_traffic(gather, 4) == [("all_gather", 2 * 32 * 4 * kv, 4), ("reduce_scatter", 32 * 4 * dkv, 4)]


def test_megatron_ring_hides_behind_the_blocks_where_torchs_does_not():
    """Llama-3.1-405B's Megatron-Bridge layout (tp 8 fills a node, cp 2 across nodes): TE's p2p sends 1 of 128 heads'
    K/V per tp rank, hidden behind the attention blocks; torch's ring sends all 16 and exposes most of it."""
    model = {**LLAMA, "vocab_size": 128256, "d_model": 16384, "n_layers": 16, "n_heads": 128, "n_kv_heads": 8,
             "ffn_hidden": 53248, "seq_len": 8192}
    hw = get_hardware("h100-sxm")
    layout = dict(strategy="zero1", dp=1, cp=2, tp=8, sequence_parallel=True, cp_rotate="alltoall")
    te = step_time(_spec(model, **layout, train={"precision": "bf16-mixed", "stack": "megatron"}), hw,
                   gpus_per_node=8).per_rank[0]
    torch_ring = step_time(_spec(model, **layout, train={"precision": "bf16-mixed"}), hw, gpus_per_node=8).per_rank[0]
    assert te.exposed_by_dim_s["cp"] < 0.01 * te.comm_s["cp"] + 1e-9
    assert torch_ring.exposed_by_dim_s["cp"] > 0.5 * torch_ring.comm_s["cp"]
    assert torch_ring.comm_s["cp"] > 16 * te.comm_s["cp"]


def test_ring_blocks_are_timed_at_their_own_shapes_and_sum_to_the_causal_work():
    """Without a measured attention table (h100-pcie: one efficiency) the ring's blocks add up to 1/cp of the full
    causal call (head-tail) or (2cp - 1)/cp of that (contiguous, the last rank); with one (h100-sxm) the local causal
    block is timed at s/cp and the others unmasked, at their own efficiencies."""
    model = ModelSpec(**{**SMALL, "seq_len": 8192, "n_heads": 32, "d_model": 4096})
    for key in ("h100-pcie", "h100-sxm"):
        hw = get_hardware(key)
        full_f, full_b = attention_time(hw, "bf16-mixed", "flash", 1, 32, 8192, 128, causal=True)
        for balanced in (True, False):
            layout = Layout.of(_spec(model.model_dump(), dp=1, cp=4, cp_load_balance=balanced,
                                     train={"precision": "bf16-mixed"}))
            fwd, bwd = ring_blocks_time(hw, layout, "flash", 1, 32, 2048, 128)
            work = 1.0 if balanced else 7 / 4
            if key == "h100-pcie":
                assert fwd == pytest.approx(work * full_f / 4) and bwd == pytest.approx(work * full_b / 4)
            else:
                diag_f, _ = attention_time(hw, "bf16-mixed", "flash", 1, 32, 2048, 128, causal=True)
                open_f, _ = attention_time(hw, "bf16-mixed", "flash", 1, 32, 2048, 128, causal=False)
                assert fwd == pytest.approx(diag_f + (1.5 if balanced else 3) * open_f)
                assert fwd != pytest.approx(work * full_f / 4)


def test_ring_merge_bytes_follow_each_rings_source():
    """One call on SMALL at cp 4 (64 tokens per rank, 8 heads of 16, 2 KV heads): torch's merger in fp32 (cast up 6,
    3 x 38 per later block, cast down 6) and the bf16 K/V cat before each of the 3 sends (4 B); backward 10 B per fp32
    add of dQ and the repeated dK, dV per block + the casts down, the accumulators' zeros (4 B), 3 K/V cats (4 B), 4
    fp32 dK/dV cats (8 B) and 3 `_partial_update` surpluses (3 B) on the last rank; without load balancing no
    surplus. TE's in bf16 (4 + 3 x 6; backward copy 4 + 3 adds of 6 over dQ and the GQA-width dK, dV). cp 1:
    nothing."""
    bf16 = {"precision": "bf16-mixed"}
    out = 64 * 8 * 16
    kv = 2 * out  # K and V repeated to the 8 query heads
    torch_merge = ring_merge(ModelSpec(**SMALL), Layout.of(_spec(SMALL, dp=1, cp=4, train=bf16)))
    assert torch_merge.fwd_bytes == (6 + 6 + 3 * 38) * out + 3 * 4 * kv
    copies = 4 * (out + kv) + 3 * 4 * kv + 4 * 8 * kv
    assert torch_merge.bwd_bytes == 4 * 10 * (out + kv) + 6 * (out + kv) + copies + 3 * 3 * kv
    assert (torch_merge.fwd_kernels, torch_merge.bwd_kernels) == (2 + 3 * 5, 3 * 4 + 3 + 3 + 3 + 4 + 2 * 3)
    skewed = ring_merge(ModelSpec(**SMALL), Layout.of(_spec(SMALL, dp=1, cp=4, cp_load_balance=False, train=bf16)))
    assert skewed.bwd_bytes == 4 * 10 * (out + kv) + 6 * (out + kv) + copies
    te = Layout.of(_spec(SMALL, strategy="zero1", dp=1, cp=4, cp_rotate="alltoall",
                         train={**bf16, "stack": "megatron"}))
    te_merge, te_kv = ring_merge(ModelSpec(**SMALL), te), 2 * 64 * 2 * 16
    assert te_merge.fwd_bytes == (4 + 3 * 6) * out
    assert te_merge.bwd_bytes == 4 * (out + te_kv) + 3 * 6 * (out + te_kv)
    none = ring_merge(ModelSpec(**SMALL), Layout.of(_spec(SMALL, dp=4, cp=1, train=bf16)))
    assert none.fwd_bytes == none.bwd_bytes == 0 and none.fwd_kernels == none.bwd_kernels == 0


def test_step_time_has_the_cp_terms():
    hw = get_hardware("h100-sxm")
    base = dict(strategy="fsdp", dp=1, train={"global_batch": 1, "precision": "bf16-mixed"})
    balanced = step_time(_spec(LLAMA3_8B.model_dump(), cp=8, **base), hw, gpus_per_node=8)
    skewed = step_time(_spec(LLAMA3_8B.model_dump(), cp=8, cp_load_balance=False, **base), hw, gpus_per_node=8)
    r = balanced.per_rank[0]
    assert r.comm_s["cp"] > 0 and "cp" in r.exposed_by_dim_s
    assert r.comm_by_collective_s["all_gather"] > 0 and r.comm_by_collective_s["all_to_all"] > 0
    # without load balancing the ring waits for the busiest rank: (2cp - 1)/cp = 15/8 of the attention
    assert skewed.summary["compute_s"] > balanced.summary["compute_s"]
    # over slow links the ring cannot hide behind the blocks
    slow = step_time(_spec(LLAMA3_8B.model_dump(), cp=8, **base), hw, gpus_per_node=1)
    assert slow.per_rank[0].exposed_by_dim_s["cp"] > r.exposed_by_dim_s["cp"]
    # smaller per-rank GEMMs: 8 ranks of cp take more than 1/8 of one rank's GEMM time at the same total tokens
    one = step_time(_spec(LLAMA3_8B.model_dump(), cp=1,
                          **{**base, "train": {"global_batch": 1, "precision": "bf16-mixed"}}), hw, gpus_per_node=8)
    assert balanced.summary["compute_s"] > one.summary["compute_s"] / 8



def test_torch_ring_inside_torch_compile_hides_no_transfer():
    """torchtitan compiles each block whole (fullgraph), so its ring's functional collectives are traced and waited
    for where they are issued (cp_ring.py): every transfer exposed, forward, backward and the re-run forward; eager
    blocks keep the overlap."""
    hw = get_hardware("h100-sxm")
    for rotate in ("allgather", "alltoall"):
        for recompute in ("none", "full"):
            train = {"global_batch": 1, "precision": "bf16-mixed", "stack": "torchtitan", "recompute": recompute}
            compiled = _spec(LLAMA3_8B.model_dump(), strategy="fsdp", dp=1, cp=8, cp_rotate=rotate,
                             train={**train, "elementwise": "compiled"})
            eager = _spec(LLAMA3_8B.model_dump(), strategy="fsdp", dp=1, cp=8, cp_rotate=rotate,
                          train={**train, "elementwise": "eager"})
            assert not stack_knobs(compiled, hw).cp_ring_overlap and stack_knobs(eager, hw).cp_ring_overlap
            layout = Layout.of(compiled)
            attention = attention_pass(compiled.model, layout, hw, "flash")
            traced, hidden = (ring_time(compiled.model, layout, hw, attention, rotate=rotate, gpus_per_node=8,
                                        overlap=o) for o in (False, True))
            assert traced.fwd_exposed_s + traced.bwd_exposed_s == pytest.approx(traced.comm_s)
            assert traced.comm_s == hidden.comm_s
            assert hidden.fwd_exposed_s + hidden.bwd_exposed_s < traced.comm_s
            exposed = [step_time(s, hw, gpus_per_node=8).per_rank[0].exposed_by_dim_s["cp"] for s in (compiled, eager)]
            assert exposed[0] > exposed[1]

def test_planner_searches_cp_and_its_arrays_agree_with_one_layout():
    model = ModelSpec(**SMALL)
    layouts = enumerate_layouts(model, gpus=16, gpus_per_node=8, global_batch=16, limits=Limits(max_cp=8))
    assert set(np.unique(layouts.cp).tolist()) == {1, 2, 4, 8}
    fast, _ = worst_rank_memory(model, layouts)
    with_cp = [i for i in range(len(layouts)) if layouts.cp[i] > 1]
    for i in random.Random(5).sample(with_cp, 150):
        spec = ExperimentSpec.for_prediction(layouts.take(i).spec_dict(model))
        assert spec.parallel.cp == layouts.cp[i]
        assert fast[i] == worst_rank_bytes(spec)[0] == max(r.fullest_bytes() for r, _ in estimate(spec).distinct_ranks)
    math = ModelSpec(**{**SMALL, "attention": "math"})
    assert set(enumerate_layouts(math, gpus=16, gpus_per_node=8, global_batch=16).cp.tolist()) == {1}
