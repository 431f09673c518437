"""Expert parallelism at world 2 (ep = dp = 2): the all-to-all dispatch trains exactly like the dense MoE."""

import pytest

from backend.models.gpt import build_model
from backend.strategies.moe_dispatch import shard_experts
from tests.fixtures.mp_launch import assert_parity, run_specs, tiny

MOE = {"n_experts": 4, "top_k": 2}


@pytest.mark.slow
def test_ep_world2_parity(tmp_path):
    specs = [tiny("ep", model=MOE, strategy="ep", world_size=2),
             # a large SGD step makes any wrong gradient scale visible in the parameters (Adam would normalise it)
             tiny("ep_top1_sgd", model=MOE | {"top_k": 1}, train={"optimizer": "sgd", "lr": 0.5}, strategy="ep", world_size=2)]
    res = run_specs(2, specs, tmp_path)
    for s in specs:
        assert_parity(res[s.name])
    assert res["ep"]["loss"][1] < res["ep"]["loss"][0]


def test_shard_experts_keeps_global_names():
    spec = tiny("names", model=MOE, strategy="ep", world_size=2)
    moe = build_model(spec.model, seed=0).layers["0"].mlp
    assert shard_experts(moe, ep=2, ep_rank=1) == [2, 3]
    assert sorted(n.split(".")[1] for n, _ in moe.named_parameters() if n.startswith("experts.")) == ["2"] * 4 + ["3"] * 4
