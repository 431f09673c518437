"""Meta-device init: every rank's materialized shards are exactly its slice of the single-process model.

Run in one process per (spec, rank) on torch's fake process group (no communication happens during set-up:
each rank cuts its own slice), against an independent slicing of the reference weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from backend.engine import mesh as mesh_mod
from backend.models.gpt import build_model, full_init, init_weights
from backend.spec import ExperimentSpec
from backend.strategies.base import RankContext, prepare
from backend.torch_compat import fake_store

MODEL = dict(vocab_size=250, d_model=48, n_layers=4, n_heads=4, seq_len=16)
CASES = [
    ("zero3", {"strategy": "zero3", "world_size": 4}, {}, 3),
    ("ddp", {"strategy": "ddp", "world_size": 2}, {}, 1),
    ("tp_sp", {"strategy": "tp", "world_size": 2, "sequence_parallel": True}, {}, 1),
    ("fsdp_x_tp", {"strategy": "fsdp", "world_size": 4, "tp": 2}, {}, 3),
    ("pp_interleaved", {"strategy": "pp", "world_size": 2, "pp": 2, "pp_schedule": "interleaved_1f1b",
                        "virtual_stages": 2}, {}, 1),
    ("zero2_x_ep", {"strategy": "zero2", "world_size": 4, "ep": 2}, {"n_experts": 4, "top_k": 2}, 3),
]


def _clean(name: str) -> str:
    for junk in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module."):
        name = name.replace(junk, "")
    return name


def _chunk(t: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    """torch.chunk semantics (what DTensor and FSDP2 shard by): ceil-sized pieces, trailing ranks may be empty."""
    size = math.ceil(t.shape[dim] / n)
    start = min(i * size, t.shape[dim])
    return t.narrow(dim, start, max(0, min(size, t.shape[dim] - start)))


def expected_local(full: torch.Tensor, param: torch.Tensor, coords: dict[str, int]) -> torch.Tensor:
    """Independent of DTensor: TP's shard first (innermost mesh dim), then FSDP's shard of that."""
    if not isinstance(param, DTensor):
        return full
    names = param.device_mesh.mesh_dim_names
    for name, pl in reversed(list(zip(names, param.placements, strict=False))):
        if pl.is_shard() or type(pl).__name__ == "_StridedShard":
            full = _chunk(full, pl.dim, param.device_mesh.size(names.index(name)), coords[name])
    return full


@pytest.mark.parametrize("name,parallel,model,rank", CASES, ids=[c[0] for c in CASES])
def test_local_shards_equal_the_reference_slice(name, parallel, model, rank, monkeypatch):
    s = ExperimentSpec(model={**MODEL, **model}, train={"global_batch": 8, "micro_batch": 1, "seed": 5},
                       parallel=parallel)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=s.parallel.world_size)
    try:
        dev = torch.device("cpu")
        ctx = RankContext(spec=s, rank=rank, world_size=s.parallel.world_size, local_rank=0, device=dev,
                          mesh=mesh_mod.build_mesh(s, dev))
        prep = prepare(ctx, build_model(s.model, seed=s.train.seed, device="meta"))
        coords = {**ctx.coords()}
        compared = 0
        for module in prep.modules:
            for n, p in module.named_parameters():
                full = full_init(_clean(n), p.shape, s.train.seed)
                local = p.to_local() if isinstance(p, DTensor) else p
                torch.testing.assert_close(local.detach(), expected_local(full, p, coords), rtol=0, atol=0, msg=n)
                compared += 1
        assert compared > 0
    finally:
        dist.destroy_process_group()


def test_build_model_is_init_weights_of_a_meta_model():
    """The reference and the engine draw from one definition: full_init per (seed, parameter name)."""
    m = ExperimentSpec(model={**MODEL, "n_experts": 4}).model
    ref = build_model(m, seed=3)
    meta = build_model(m, seed=3, device="meta")
    meta.to_empty(device="cpu")
    init_weights(meta, 3)
    for (n, a), (_, b) in zip(ref.named_parameters(), meta.named_parameters(), strict=False):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_init_threads_draw_the_same_weights_and_refuse_a_bad_value(monkeypatch):
    """SHARDLAB_INIT_THREADS=N (the GPU check sets it on the device) draws N parameters ahead in threads; every
    value is the one-thread value (a generator per parameter), tied weights included."""
    m = ExperimentSpec(model={**MODEL, "tie_embeddings": True}).model
    ref = build_model(m, seed=5)
    monkeypatch.setenv("SHARDLAB_INIT_THREADS", "3")
    threaded = build_model(m, seed=5)
    for (n, a), (_, b) in zip(ref.named_parameters(), threaded.named_parameters(), strict=False):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert threaded.lm_head.weight is threaded.tok_emb.weight
    monkeypatch.setenv("SHARDLAB_INIT_THREADS", "zero")
    with pytest.raises(ValueError, match="SHARDLAB_INIT_THREADS must be a positive integer"):
        build_model(m, seed=5)
