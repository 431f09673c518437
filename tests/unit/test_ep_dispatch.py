"""Issue 35: what EP's all-to-alls carry by stack (analytic/ep_dispatch.py) and how long an all-to-all over nodes takes
(steptime/collectives.all_to_all_bandwidth_s), in the step-time model and the planner's screen alike."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backend.analytic.ep_dispatch import Dispatch
from backend.analytic.layout import Layout
from backend.analytic.steptime.collectives import all_to_all_bandwidth_s, bandwidth_s
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.published_gpu import published_rows
from backend.analytic.traffic import model_parallel_traffic
from backend.spec import ExperimentSpec

H100 = get_hardware("h100-sxm")


def qwen3_row(dispatcher: str = "alltoall") -> ExperimentSpec:
    """Megatron-Bridge's Qwen3-30B-A3B on 16 H100s: ep 16 over two nodes, tp 1, FP8, the megatron stack, with the
    alltoall dispatcher these tests are about (the recipe's flex dispatcher: tests/unit/test_moe_dispatchers.py)."""
    row = next(r for r in published_rows() if r.id == "bridge260401-h100-qwen3-30b-a3b-g16")
    data = dict(row.spec, model=dict(row.spec["model"], moe_dispatcher=dispatcher))
    return ExperimentSpec.for_prediction(data)


def with_(spec: ExperimentSpec, train: dict | None = None, parallel: dict | None = None) -> ExperimentSpec:
    data = spec.model_dump(mode="json")
    data["train"].update(train or {})
    data["parallel"].update(parallel or {})
    return ExperimentSpec.for_prediction(data)


def ep_payload(spec: ExperimentSpec) -> float:
    traffic = model_parallel_traffic(spec, [0], [0])
    return sum(b for kind, b, n in traffic if kind == "all_to_all" and n == spec.parallel.ep)


@pytest.mark.parametrize("n", [2, 8, 16, 64])
def test_an_all_to_all_inside_one_node_or_one_member_per_node_is_the_ring_term(n):
    payload = 3e9
    one_node = bandwidth_s(H100, True, "all_to_all", payload, n)
    spread = bandwidth_s(H100, False, "all_to_all", payload, n)
    assert all_to_all_bandwidth_s(H100, payload, n, n) == pytest.approx(one_node)
    assert all_to_all_bandwidth_s(H100, payload, n, 1) == pytest.approx(spread)


def test_over_nodes_only_the_peers_on_other_nodes_go_through_the_nic():
    """ep 16 over two nodes of 8: 8 of the 16 slices leave the node (the ring term sent 15 of 16 at the NIC's speed)."""
    payload, t = 4e9, H100.tune
    nic = payload * 8 / 16 / (H100.inter_bytes_per_s * t.inter_efficiency)
    assert all_to_all_bandwidth_s(H100, payload, 16, 8) == pytest.approx(nic)
    assert all_to_all_bandwidth_s(H100, payload, 16, 8) < 0.6 * bandwidth_s(H100, False, "all_to_all", payload, 16)
    arrays = all_to_all_bandwidth_s(H100, np.array([payload] * 3), np.array([16, 16, 1]), np.array([8, 16, 1]))
    assert arrays.tolist() == pytest.approx([nic, bandwidth_s(H100, True, "all_to_all", payload, 16), 0.0])


def test_each_stack_dispatches_its_own_rows():
    """The engine: fp32 autocast rows of the whole (b, s/cp) sequence; Megatron: 16-bit rows of its sequence-parallel
    shard (token_dispatcher.py), fp8 included; torchtitan: 16-bit rows of the whole sequence."""
    spec = qwen3_row()
    m, tokens = spec.model, spec.train.micro_batch * spec.model.seq_len
    rows = 4 * m.top_k * m.d_model * spec.train.microbatches  # dispatch + combine, forward + backward
    counts = 8 * m.n_experts * spec.train.microbatches
    assert ep_payload(spec) == rows * tokens * 2 + counts  # megatron, fp8: bf16 rows
    assert ep_payload(with_(spec, {"stack": "shardlab", "precision": "bf16-mixed"})) == rows * tokens * 4 + counts
    assert ep_payload(with_(spec, {"stack": "torchtitan", "precision": "bf16-mixed"})) == rows * tokens * 2 + counts
    assert ep_payload(with_(spec, {"precision": "fp32"})) == rows * tokens * 4 + counts
    sp = with_(spec, parallel={"tp": 2, "sequence_parallel": True, "world_size": 32})
    assert ep_payload(sp) == rows * tokens // 2 * 2 + counts
    assert ep_payload(with_(sp, {"stack": "torchtitan"})) == rows * tokens * 2 + counts
    assert Dispatch.of_spec(with_(spec, {"stack": "shardlab"})) == Dispatch(engine=True, megatron=False)


def test_the_screen_prices_ep_like_the_model():
    """The planner's screen times EP with the same rows, bytes and node split as steptime.model (one term each)."""
    from backend.analytic.steptime.screen import screen_step_s

    spec = qwen3_row()
    layout = Layout.of(spec)
    assert Dispatch.of_layout(layout) == Dispatch.of_spec(spec) == Dispatch(engine=False, megatron=True)
    model_ep_s = step_time(spec, H100).per_rank[0].comm_s["ep"]
    engine = with_(spec, {"stack": "shardlab", "precision": "bf16-mixed"})
    assert step_time(engine, H100).per_rank[0].comm_s["ep"] > 1.9 * model_ep_s  # fp32 rows: twice the bytes
    fast = screen_step_s(spec.model, layout, H100, gpus_per_node=8)
    slow = screen_step_s(spec.model, dataclasses.replace(layout, stack=None), H100, gpus_per_node=8)
    assert float(np.asarray(slow).ravel()[0]) > float(np.asarray(fast).ravel()[0])


def test_megatrons_qwen3_moe_recipe_is_no_longer_dominated_by_the_all_to_all():
    """Before: 68.1 s of EP all-to-all in an 86.0 s step (published 29.3 s): fp32 rows, and 15 of 16 slices at the
    NIC's speed. Now the rows are bf16 and half the peers share the node: the EP term is 4 x smaller."""
    st = step_time(qwen3_row(), H100)
    ep_s = st.per_rank[0].comm_s["ep"]
    assert ep_s < 0.3 * 68.147


def grok_row(stack: str = "megatron") -> ExperimentSpec:
    """dgxc-benchmarking's Grok-1 (bf16): tp 4, expert tp 4, ep 8, sequence parallel, gated GELU experts."""
    row = next(r for r in published_rows() if r.id == "dgxc2504-h100-grok1-314b-g512-bf16")
    return with_(ExperimentSpec.for_prediction(row.spec), train={"stack": stack})



def test_megatrons_expert_tp_gathers_before_the_experts_and_scatters_after():
    """Megatron's alltoall dispatcher all-gathers the all-to-all's output over the expert tp group and reduce-scatters
    the experts' output (token_dispatcher.py dispatch_postprocess / combine_preprocess): per MoE block and microbatch,
    forward and backward, one all-gather and one reduce-scatter of the received rows x etp, 16-bit. The engine's
    DTensor experts all-reduce each GEMM instead (3 for gated experts)."""
    spec = grok_row()
    m, t, p = spec.model, spec.train, spec.parallel
    sent = t.micro_batch * m.seq_len // p.cp // p.tp  # Megatron dispatches its sequence-parallel shard
    gathered = 2 * t.microbatches * sent * m.top_k * p.etp * m.d_model * 2
    traffic = model_parallel_traffic(spec, [0], [1])
    sp_block = 4 * t.micro_batch * (m.seq_len // p.cp) * m.d_model * 2 * t.microbatches  # the block's own SP gathers
    assert ("all_gather", gathered, p.etp) in traffic and ("reduce_scatter", gathered, p.etp) in traffic
    assert not [e for e in traffic if e[0] == "all_reduce" and e[2] == p.etp and e[1] > sp_block]
    engine = model_parallel_traffic(with_(spec, train={"stack": "shardlab"}), [0], [1])
    per_gemm = t.micro_batch * (m.seq_len // p.cp) * m.d_model * 2 * m.top_k * t.microbatches
    assert ("all_reduce", 3 * per_gemm, p.etp) in engine
    # the same wire bytes as 2 all-reduces of one gathered tensor, not the engine's 3
    assert gathered == 2 * per_gemm


def deepseek_row(dispatcher: str = "alltoall") -> ExperimentSpec:
    """Megatron-Bridge's DeepSeek-V3 on 1,024 H100s: tp 2, etp 1, ep 64, pp 8, with the alltoall dispatcher these
    tests are about (the recipe's flex: tests/unit/test_moe_dispatchers.py)."""
    row = next(r for r in published_rows() if r.id == "bridge2509-h100-deepseek-v3-g1024")
    return ExperimentSpec.for_prediction(dict(row.spec, model=dict(row.spec["model"], moe_dispatcher=dispatcher)))


def test_megatrons_ep_group_folds_over_tp_when_etp_is_below_tp():
    """Megatron's expert mesh puts etp innermost, then ep (parallel_state.py's expert RankGenerator, order
    tp-cp-ep-dp-pp with tp = etp): at tp 2, etp 1 an EP group is 64 consecutive ranks, 8 on each node. This engine
    carves ep out of dp x cp, strided by tp: 4 on each node. More members on a node send fewer rows through the NIC."""
    from backend.analytic.steptime.collectives import members_per_node

    spec = deepseek_row()
    engine = with_(spec, train={"stack": "shardlab", "recompute_modules": None, "ep_overlap": None})  # Megatron's own
    assert members_per_node(spec, "ep", 64, 8) == 8 and members_per_node(engine, "ep", 64, 8) == 4
    megatron_s = step_time(spec, H100).per_rank[0].comm_s["ep"]
    strided_s = step_time(with_(spec, parallel={"etp": 2}), H100).per_rank[0].comm_s["ep"]
    # etp = tp: Megatron's groups are strided by tp as well (4 a node); the rows each rank sends are the same
    assert megatron_s == pytest.approx(strided_s * (64 - 8) / (64 - 4), rel=0.02)
