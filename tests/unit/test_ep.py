"""Expert parallelism in one process: experts sharded under their global names, the expert grad sync's buckets."""

from backend.models.gpt import build_model
from backend.strategies.moe_dispatch import shard_experts
from tests.helpers.mp_launch import tiny

MOE = {"n_experts": 4, "top_k": 2}


def test_shard_experts_keeps_global_names():
    spec = tiny("names", model=MOE, strategy="ep", world_size=2)
    moe = build_model(spec.model, seed=0).layers["0"].mlp
    assert shard_experts(moe, ep=2, ep_rank=1) == [2, 3]
    assert sorted(n.split(".")[1] for n, _ in moe.named_parameters() if n.startswith("experts.")) == ["2"] * 4 + ["3"] * 4


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
