"""Megatron-Core's three MoE token dispatchers (model.moe_dispatcher; analytic/ep_dispatch.py, steptime/ep_comm.py):
alltoall, allgather over the tp x ep group, and flex (DeepEP / HybridEP: one send per rank holding a token's experts,
one per such node across nodes). The flex counts are checked against every routing of a small model, the times
against the all-to-all where the two must agree, and the screen against the step-time model."""

from __future__ import annotations

import json
from itertools import combinations

import numpy as np
import pytest

from backend.analytic.ep_dispatch import allgather_bytes, flex_rows
from backend.analytic.layout import Layout
from backend.analytic.steptime.ep_comm import dispatcher_bandwidth_s
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.traffic import model_parallel_traffic
from backend.spec import ExperimentSpec, ModelSpec, validate_spec
from tests.unit.test_ep_dispatch import qwen3_row

H100 = get_hardware("h100-sxm")


def moe(n_experts: int, top_k: int) -> ModelSpec:
    return ModelSpec.model_validate({"n_experts": n_experts, "top_k": top_k, "d_model": 64, "n_layers": 2,
                                     "n_heads": 4, "vocab_size": 256, "seq_len": 32})


def brute_force_rows(n_experts: int, top_k: int, group: int, on_node: int) -> tuple[float, float]:
    """(NVLink, across) sends of one token of rank 0 averaged over every top_k choice: rank r holds experts
    [r E/g, (r+1) E/g), node j the ranks [j on_node, (j+1) on_node); a remote node's copy lands on the rank with rank
    0's local index, which forwards it to the node's other ranks that hold one of the token's experts."""
    per_rank, nodes = n_experts // group, group // on_node
    inside = across = 0
    choices = list(combinations(range(n_experts), top_k))
    for experts in choices:
        hit = {e // per_rank for e in experts}
        for node in range(nodes):
            ranks = set(range(node * on_node, (node + 1) * on_node))
            landing = node * on_node  # rank 0's local index on that node
            if node and hit & ranks:
                across += 1
            inside += len((hit & ranks) - {landing})
    return inside / len(choices), across / len(choices)


@pytest.mark.parametrize(("n_experts", "top_k", "group", "on_node"),
                         [(8, 2, 4, 2), (8, 3, 8, 4), (12, 2, 6, 3), (8, 2, 4, 4), (6, 1, 6, 2)])
def test_flex_rows_are_the_average_over_every_routing(n_experts, top_k, group, on_node):
    want = brute_force_rows(n_experts, top_k, group, on_node)
    assert flex_rows(moe(n_experts, top_k), group, on_node, 1) == pytest.approx(want)


def test_flex_rows_of_a_table_are_each_layouts_own():
    m = moe(128, 8)
    got = flex_rows(m, np.array([16, 8, 64]), np.array([8, 8, 8]), np.array([1, 1, 1]))
    for i, (g, k) in enumerate([(16, 8), (8, 8), (64, 8)]):
        assert (got[0][i], got[1][i]) == pytest.approx(flex_rows(m, g, k, 1))


def layout_of(spec: ExperimentSpec, dispatcher: str) -> tuple[ModelSpec, Layout]:
    model = spec.model.model_copy(update={"moe_dispatcher": dispatcher})
    return model, Layout.of(spec)


def test_one_expert_per_rank_top1_inside_a_node_moves_what_the_all_to_all_moves():
    """k = 1 and one expert per rank: each token goes to one rank, no deduplication left, one node: flex = alltoall."""
    spec = ExperimentSpec.for_prediction({"model": {"n_experts": 8, "top_k": 1, "d_model": 1024, "n_layers": 2,
                                                    "n_heads": 8, "vocab_size": 1024, "seq_len": 512},
                                          "train": {"global_batch": 16, "micro_batch": 1, "precision": "bf16-mixed"},
                                          "parallel": {"strategy": "ep", "world_size": 8, "ep": 8}})
    payload, kw = 4e9, {"sent_tokens": 512, "passes": 2}
    times = {d: dispatcher_bandwidth_s(*layout_of(spec, d), H100, 8, payload=payload, **kw)
             for d in ("alltoall", "flex")}
    assert times["flex"] == pytest.approx(times["alltoall"])


def test_flex_sends_a_token_across_once_per_node_where_the_all_to_all_sends_each_row():
    """Qwen3-30B-A3B's recipe layout (128 experts, top 8, ep 16 over two nodes): the all-to-all sends 8 x 8/16 = 4 rows
    of a token through the NIC, flex one per remote node holding any of its experts (1 - C(64,8)/C(128,8) of one)."""
    spec = qwen3_row()
    model, layout = layout_of(spec, "flex")
    inside, across = flex_rows(model, 16, 8, 1)
    assert across == pytest.approx(1 - np.prod([(64 - i) / (128 - i) for i in range(8)]))
    payload, kw = 4e9, {"sent_tokens": 4096, "passes": 1}
    a2a = dispatcher_bandwidth_s(*layout_of(spec, "alltoall"), H100, 8, payload=payload, **kw)
    flex = dispatcher_bandwidth_s(model, layout, H100, 8, payload=payload, **kw)
    nic = H100.inter_bytes_per_s * H100.tune.inter_efficiency
    assert flex == pytest.approx(max(across * payload / 8 / nic,
                                     inside * payload / 8 / (H100.intra_bytes_per_s * H100.tune.intra_efficiency)))
    assert flex < 0.3 * a2a


def test_allgather_gathers_the_whole_tp_ep_group_and_scatters_it_back():
    """Megatron's allgather dispatcher: per MoE block and microbatch an all-gather of the group's hidden states and a
    reduce-scatter of the experts' output, each again in backward (token_dispatcher.py l. 281-367)."""
    spec = qwen3_row("allgather")
    m, t = spec.model, spec.train
    each = allgather_bytes(m, t.micro_batch * m.seq_len, 2, 16)
    assert each == t.micro_batch * m.seq_len * 16 * m.d_model * 2
    traffic = {kind: (b, n) for kind, b, n in model_parallel_traffic(spec, [0], [0])}
    assert traffic["all_gather"] == traffic["reduce_scatter"] == (2 * t.microbatches * each, 16)
    assert "all_to_all" not in traffic
    kinds = step_time(spec, H100).per_rank[0].comm_by_collective_s
    assert kinds["all_gather"] > 0 and kinds["reduce_scatter"] > 0 and "all_to_all" not in kinds


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "flex"])
def test_the_screen_prices_each_dispatcher_like_the_model(dispatcher):
    """The planner's screen times the EP dispatch as the step-time model does, but for the model's ring latency (4
    collectives per layer and microbatch, 15 ring steps over the 16 ranks across two nodes); and the three differ."""
    from backend.analytic.steptime.screen import step_screen

    spec = qwen3_row(dispatcher)
    model_ep_s = step_time(spec, H100, gpus_per_node=8).per_rank[0].comm_s["ep"]
    screen = step_screen(spec.model, Layout.of(spec), H100, gpus_per_node=8)
    latency_s = 4 * spec.model.n_layers * spec.train.microbatches * 15 * H100.tune.inter_latency_s
    assert float(screen.ep_comm_s) + latency_s == pytest.approx(model_ep_s, rel=1e-3)
    others = {d: step_time(qwen3_row(d), H100).per_rank[0].comm_s["ep"] for d in ("alltoall", "allgather", "flex")}
    assert len({round(v, 6) for v in others.values()}) == 3


def test_the_engine_runs_the_all_to_all_only_and_says_so():
    model = {"n_experts": 4, "top_k": 2, "d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "seq_len": 32}
    for dispatcher in ("allgather", "flex"):
        data = {"model": model | {"moe_dispatcher": dispatcher}, "parallel": {"strategy": "ep", "world_size": 2,
                                                                                "ep": 2}}
        spec, problems = validate_spec(data)
        assert spec is None and any(f"moe_dispatcher={dispatcher} with ep=2" in p and "all-to-all only" in p
                                    for p in problems), problems
        assert validate_spec(data, predict_only=True)[1] == []
        notes = step_time(ExperimentSpec.for_prediction(data), H100).notes
        assert notes is not None
    dense_dp = {"model": model | {"moe_dispatcher": "flex"}, "parallel": {"strategy": "ddp", "world_size": 2}}
    assert validate_spec(dense_dp)[1] == []  # ep 1: nothing is dispatched, the engine runs it


def test_plan_cli_plans_every_layout_with_the_given_dispatcher(capsys):
    from backend.cli import main

    argv = ["plan", "--preset", "qwen1.5-moe-a2.7b", "--seq", "1024", "--gpus", "8", "--global-batch", "16",
            "--hardware", "h100-sxm", "--top", "3", "--include-predicted", "--json"]
    assert main([*argv, "--moe-dispatcher", "flex"]) == 0
    configs = json.loads(capsys.readouterr().out)["configs"]
    assert configs and {c["spec"]["model"]["moe_dispatcher"] for c in configs} == {"flex"}
    assert any("moe_dispatcher=flex" in (c.get("why_not") or "") for c in configs if c["spec"]["parallel"]["ep"] > 1)
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal, with the choices
        main([*argv, "--moe-dispatcher", "ring"])
    assert refused.value.code == 2 and "choose from 'alltoall', 'allgather', 'flex'" in capsys.readouterr().err


def test_allgather_keeps_its_gather_buffer_at_every_moment():
    """Megatron's allgather dispatcher gathers into the global "mpu" buffer (use_global_buffer=True), which stays for
    the process's life: every moment of every rank holds tokens x (etp x ep) x h x 2 bytes more than on the
    all-to-all; flex and alltoall hold none."""
    from backend.analytic.estimate import estimate

    by = {d: estimate(qwen3_row(d)).per_rank[0] for d in ("alltoall", "allgather", "flex")}
    m = qwen3_row().model
    buffer = m.seq_len * 16 * m.d_model * 2
    assert by["allgather"].other_bytes - by["alltoall"].other_bytes == buffer
    assert by["flex"].other_bytes == by["alltoall"].other_bytes
    moments = {d: r.moments() for d, r in by.items()}
    for name, value in moments["alltoall"].items():
        if value:
            assert moments["allgather"][name] - value == buffer, name
