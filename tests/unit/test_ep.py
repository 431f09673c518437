"""Expert parallelism: in one process, experts sharded under their global names and the expert grad sync's buckets;
at world 2 (ep = dp = 2, the farm's ranks), the all-to-all dispatch trains exactly like the dense MoE, and the
routing-adjusted prediction meets the bounds."""

import pytest

from backend.models.gpt import build_model
from backend.strategies.moe_dispatch import shard_experts
from tests.helpers.farm import assert_parity, engine_job, parity_job, uses
from tests.helpers.specs import tiny

MOE = {"n_experts": 4, "top_k": 2}


def test_shard_experts_keeps_global_names():
    spec = tiny("names", model=MOE, strategy="ep", world_size=2)
    moe = build_model(spec.model, seed=0).layers["0"].mlp
    assert shard_experts(moe, ep=2, ep_rank=1) == [2, 3]
    assert (sorted(n.split(".")[1] for n, _ in moe.named_parameters() if n.startswith("experts."))
            == ["2"] * 4 + ["3"] * 4)


def test_expert_grad_sync_buckets_and_skips_without_replicas(monkeypatch):
    """Expert grads are all-reduced in 25 MB buckets (a lone tensor in place), the flags in the last bucket; with
    no replica group nothing is flattened. Single-process gloo group as the replica group: sum over 1 = identity."""
    import torch
    import torch.distributed as dist

    from backend.strategies import ep as EP

    t = [torch.ones(4), torch.ones(3), torch.ones(10), torch.ones(1)]
    assert [[x.numel() for x in b] for b in EP._buckets(t, 7 * 4)] == [[4, 3], [10], [1]]
    assert EP._buckets([], 8) == [[]]
    flattened = []
    real_flatten = EP.flatten_dense_tensors
    monkeypatch.setattr(EP, "flatten_dense_tensors", lambda ts: flattened.append(len(ts)) or real_flatten(ts))

    def params():
        ps = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 3, 10)]
        for k, q in enumerate(ps[:2]):
            q.grad = torch.full_like(q, 2.0 * (k + 1))
        return ps  # the third never got a gradient (no token reached it)

    ps = params()
    assert EP.sync_expert_grads(ps, [1.0, 1.0, 0.0], None, 2, torch.device("cpu")) == [1.0, 1.0, 0.0]
    assert flattened == [] and [q.grad.tolist() for q in ps] == [[1.0] * 4, [2.0] * 3, [0.0] * 10]
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setattr(EP, "EXPERT_BUCKET_BYTES", 7 * 4)
        ps = params()
        assert EP.sync_expert_grads(ps, [1.0, 1.0, 0.0], dist.group.WORLD, 2, torch.device("cpu")) == [1.0, 1.0, 0.0]
        assert flattened == [2, 2]  # [4, 3], then [10] + the flags (a lone grad alone would be reduced in place)
        assert [q.grad.tolist() for q in ps] == [[1.0] * 4, [2.0] * 3, [0.0] * 10]
        monkeypatch.setattr(EP, "EXPERT_BUCKET_BYTES", 1)  # every grad alone: in place, but the last with the flags
        flattened.clear()
        EP.sync_expert_grads(params(), [1.0, 1.0, 0.0], dist.group.WORLD, 2, torch.device("cpu"))
        assert flattened == [2]
    finally:
        dist.destroy_process_group()


# ---- at world 2 (the farm) --------------------------------------------------------------------------------------

PARITY = [parity_job(tiny("ep", model=MOE, strategy="ep", world_size=2)),
          # a large SGD step makes any wrong gradient scale visible in the parameters (Adam would normalise it)
          parity_job(tiny("ep_top1_sgd", model=MOE | {"top_k": 1}, train={"optimizer": "sgd", "lr": 0.5}, strategy="ep",
                          world_size=2))]


@pytest.mark.slow
@uses(*PARITY)
def test_ep_world2_parity(farm):
    res = {job.name: farm.result(job) for job in PARITY}
    for r in res.values():
        assert_parity(r)
    assert res["ep"]["loss"][1] < res["ep"]["loss"][0]


TOP1_ADAMW = parity_job(tiny("ep_top1_adamw", model={"n_experts": 4, "top_k": 1, "n_layers": 4, "d_model": 64,
                                                     "n_heads": 4, "vocab_size": 256, "seq_len": 32},
                             train={"micro_batch": 2, "optimizer": "adamw"}, strategy="ep", world_size=2, ep=2),
                        steps=4)


@pytest.mark.slow
@uses(TOP1_ADAMW)
def test_ep_top1_adamw_parity_issue20(farm):
    """Issue 20 item 6, the exact case: `run --strategy ep --world 2 --steps 3 --layers 4 --hidden 64 --heads 4
    --vocab 256 --seq 32 --micro-batch 2 --ep 2 --experts 4 --top-k 1` (AdamW), 4 steps as warm-up + timed. Top-1's
    renormalised weight is exactly 1, so the router's gradient must be exactly 0: its rounding noise (~1e-10, different
    in the all-to-all and the dense dispatch) was scaled up by Adam and drifted the loss by 6.6e-4 from step 2."""
    res = farm.result(TOP1_ADAMW)
    assert len(res["loss"]) == 4
    assert res["loss_max_abs_diff"] <= 1e-6, (res["loss"], res["loss_reference"])
    assert_parity(res)  # parameters: 1e-4, as every parity test (Adam scales float-order noise on tiny gradients)


ROUTING = [engine_job(tiny(name, model=MOE | {"n_layers": 4}, train={"micro_batch": 1, "warmup_steps": 1}, **parallel))
           for name, parallel in (("ep_ddp", {"strategy": "ep", "world_size": 2}),
                                  ("ep_fsdp", {"strategy": "fsdp", "ep": 2, "world_size": 2}))]


@pytest.mark.slow
@uses(*ROUTING)
def test_ep_routing_adjusted_prediction_world2(farm):
    """The measured routing travels in the rank payload; the routing-adjusted prediction meets the bounds on
    every rank (all_to_all within 5%, activations within 15%) and every rank the uniform one misses gets a note."""
    from backend.engine.assemble import BOUNDS_PCT, COMM_BOUND_PCT
    from backend.result import error_pct

    runs = {job.name: farm.result(job) for job in ROUTING}
    for name, run in runs.items():
        res, payloads = run["result"], run["ranks"]
        s = res.spec
        for rr, payload in zip(res.per_rank, payloads, strict=False):
            assert "extra" in payload, "backend/engine/rank.py must put Prepared.extra in the rank payload"
            records = payload["extra"]["moe_routing"]["records"]
            assert len(records) == 4 * s.train.microbatches  # every MoE layer of every microbatch, once
            assert all(sum(r["sent"]) == 16 * 2 for r in records)  # droppless: N·k rows leave every rank
            g = rr.predicted_given_routing
            assert abs(error_pct(rr.comm["all_to_all"].bytes, g.all_to_all_bytes)) <= COMM_BOUND_PCT
            # the routing and the comm counter describe the same (memory-tracked) step: equal to the byte
            assert rr.comm["all_to_all"].bytes == pytest.approx(g.all_to_all_bytes, rel=1e-9), (name, rr.rank)
            assert abs(error_pct(rr.measured.activations_bytes, g.activations_bytes)) <= BOUNDS_PCT["activations_bytes"]
            uniform_misses = (abs(error_pct(rr.comm["all_to_all"].bytes,
                                            rr.comm_predicted["all_to_all"])) > COMM_BOUND_PCT
                              or abs(rr.error_pct["activations_bytes"]) > BOUNDS_PCT["activations_bytes"])
            noted = any(n.startswith(f"rank {rr.rank}: the prediction assumes uniform expert routing")
                        for n in res.notes)
            assert noted == uniform_misses, (name, rr.rank, res.notes)
        # token-slots are conserved over the ep group: what one rank's experts miss, the other's receive
        assert sum(rr.predicted_given_routing.received_token_slots for rr in res.per_rank) == sum(
            rr.predicted_given_routing.uniform_token_slots for rr in res.per_rank)
    assert any("uniform expert routing" in n for n in runs["ep_ddp"]["result"].notes)  # this data's routing is skewed
