"""Exact parameter counts and per-rank sharding against the real model and torch's own sharders."""

from __future__ import annotations

import pytest
import torch

from backend.analytic import params as P
from backend.analytic import sharding as S
from backend.models.gpt import build_model
from backend.spec import ExperimentSpec, ModelSpec

SHAPES = {
    "dense": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=32),
    "gqa": dict(vocab_size=97, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, seq_len=17),
    "moe": dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, seq_len=8, n_experts=4, top_k=2),
    "odd": dict(vocab_size=31, d_model=15, n_layers=1, n_heads=3, ffn_hidden=7, seq_len=5),
    "moe_odd": dict(vocab_size=13, d_model=6, n_layers=3, n_heads=2, ffn_hidden=11, seq_len=3, n_experts=3, top_k=1),
}


@pytest.fixture(params=sorted(SHAPES))
def shape(request):
    m = ModelSpec(**SHAPES[request.param])
    return m, build_model(m, seed=0)


def test_total_equals_model_numel(shape):
    m, model = shape
    assert P.count_params(m) == sum(p.numel() for p in model.parameters())


def test_param_list_mirrors_named_parameters(shape):
    m, model = shape
    got = [(p.name, p.shape) for p in P.param_list(m)]
    want = [(n, tuple(t.shape)) for n, t in model.named_parameters()]
    assert got == want
    assert sum(p.numel for p in P.param_list(m)) == P.count_params(m)


def test_breakdown_sums_to_total(shape):
    m, _ = shape
    assert sum(P.breakdown(m).values()) == P.count_params(m)


def test_active_params_moe():
    m = ModelSpec(**SHAPES["moe"])
    expert = 2 * 32 * 128 + 128 + 32
    assert P.count_params(m) - P.active_params(m) == m.n_layers * (m.n_experts - m.top_k) * expert
    dense = ModelSpec(**SHAPES["dense"])
    assert P.active_params(dense) == P.count_params(dense)


def test_closed_form_known_value():
    # h=64, V=256, s=32, L=2, MHA, f=256: hand-expanded formula
    h, V, s, f = 64, 256, 32, 256
    block = 4 * h + (4 * h * h + 4 * h) + (2 * h * f + f + h)
    assert P.count_params(ModelSpec(**SHAPES["dense"])) == V * h + s * h + 2 * block + 2 * h + h * V


def test_layer_split_uneven_front_loaded():
    assert [len(r) for r in S.layer_split(7, 3)] == [3, 2, 2]
    assert [list(r) for r in S.layer_split(4, 4)] == [[0], [1], [2], [3]]


def test_stages_of_rank():
    assert S.stages_of_rank(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert S.stages_of_rank(0, 2, 2, "zbv") == [0, 3]
    assert S.stages_of_rank(1, 2, 2, "zbv") == [1, 2]
    assert S.stages_of_rank(3, 4, 1, "1f1b") == [3]
    assert S.stages_of_rank(0, 1, 1, "zbv") == [0]  # pp = 1: the schedule field is ignored


def _spec(**parallel) -> ExperimentSpec:
    m = dict(SHAPES["dense"], n_layers=4)
    parallel.setdefault("world_size", None)
    return ExperimentSpec(model=m, train=dict(global_batch=8, micro_batch=1), parallel=parallel)


def test_pp_partitions_every_param_once():
    for sched, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)):
        spec = _spec(strategy="pp", pp=2, pp_schedule=sched, virtual_stages=v)
        names = [q.name for r in range(2) for q in S.local_params(spec, r)]
        assert sorted(names) == sorted(p.name for p in P.param_list(spec.model))
    spec = _spec(strategy="pp", pp=2)
    r0 = {q.name.split(".")[0] for q in S.local_params(spec, 0)}
    r1 = {q.name.split(".")[0] for q in S.local_params(spec, 1)}
    assert r0 == {"tok_emb", "pos_emb", "layers"} and r1 == {"layers", "norm", "lm_head"}


def test_tp_split_sums_to_full():
    spec = _spec(strategy="tp", tp=4)
    total = P.count_params(spec.model)
    replicated = sum(p.numel for p in P.param_list(spec.model) if S.tp_local_shape(p, 4, 0) == p.shape)
    sharded = sum(q.local_numel for r in range(4) for q in S.local_params(spec, r)) - 3 * replicated
    assert sharded == total
    q = {x.name: x.local_shape for x in S.local_params(spec, 1)}
    assert q["layers.0.attn.q.weight"] == (16, 64) and q["layers.0.attn.o.weight"] == (64, 16)
    assert q["layers.0.attn.o.bias"] == (64,) and q["layers.0.mlp.fc_in.bias"] == (64,)


def test_ep_splits_experts():
    m = dict(SHAPES["moe"])
    spec = ExperimentSpec(model=m, train=dict(global_batch=8, micro_batch=1),
                          parallel=dict(strategy="ep", ep=2, world_size=2))
    e0 = {S.expert_of(q.name) for q in S.local_params(spec, 0)} - {None}
    e1 = {S.expert_of(q.name) for q in S.local_params(spec, 1)} - {None}
    assert e0 == {0, 1} and e1 == {2, 3}


# ---- against torch's own sharders, in one process over the "fake" process group ----

@pytest.fixture
def fake_pg():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_zero1_partition_matches_torch(fake_pg, world):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    m = ModelSpec(**SHAPES["gqa"])
    fake_pg(0, world)
    model = build_model(m, seed=0)
    zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    names = {id(t): n for n, t in model.named_parameters()}
    want = [sorted(names[id(t)] for g in zro._partition_parameters()[r] for t in g["params"]) for r in range(world)]
    owner = S.zero1_partition([p.numel for p in P.param_list(m)], world)
    got = [sorted(p.name for p, o in zip(P.param_list(m), owner, strict=False) if o == r) for r in range(world)]
    assert got == want


@pytest.mark.parametrize("world,rank", [(2, 1), (3, 2), (4, 3)])
def test_fsdp2_storage_matches_torch(fake_pg, world, rank):
    from torch.distributed.fsdp import fully_shard

    spec_d = dict(model=SHAPES["odd"], train=dict(global_batch=world, micro_batch=1),
                  parallel=dict(strategy="zero3", world_size=world))
    spec = ExperimentSpec(**spec_d)
    fake_pg(rank, world)
    model = build_model(spec.model, seed=0)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    got = {n: (t._local_tensor.untyped_storage().nbytes() // 4, t._local_tensor.numel())
           for n, t in model.named_parameters()}
    want = {q.name: (q.storage_numel, q.real_numel) for q in S.local_params(spec, rank)}
    assert got == want
