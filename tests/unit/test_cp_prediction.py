"""Context parallelism in the prediction core: what cp divides and what it does not, the ring's K/V traffic, the
step-time terms (ring exposure, imbalance without load balancing, smaller per-rank GEMMs), and the planner's array
path against the single-layout core on layouts with cp.

The memory identity the engine measures (tests/multiprocess/test_cp_accuracy.py): a cp rank holds what a rank of the
same layout without cp holds at seq_len / cp tokens, with the parameters shared by dp x cp ranks."""

from __future__ import annotations

import random

import numpy as np

from backend.analytic.estimate import estimate, worst_rank_bytes
from backend.analytic.memory.rank_memory import worst_rank_memory
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.traffic import cp_traffic
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
