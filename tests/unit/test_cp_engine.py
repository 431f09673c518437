"""Context parallelism through the engine's parallelize(). In one process (fake process group): a CUDA rank takes
torch's _ContextParallel, a CPU rank the hand-written ring. In the farm's ranks: loss and final parameters equal the
single-process reference at world 2 (cp alone, both K/V rotations and chunk layouts) and at world 4 (cp alone,
cp x fsdp, cp x tp with SP, cp x pp, cp x ep)."""

import pytest

from tests.helpers.farm import assert_parity, params, parity_job
from tests.helpers.specs import tiny

FLASH = {"attention": "flash"}


def test_cuda_ranks_use_torchs_context_parallel(monkeypatch):
    """By construction (no GPU here): a CUDA rank's ContextShard wraps an SDPA core module with torch's
    _ContextParallel and sets torch's rotation and load balancing from the spec; a CPU rank gets the hand-written
    ring."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental import _attention as cp_attention

    from backend.engine.mesh import build_mesh
    from backend.strategies.context import RankContext
    from backend.strategies.cp import ContextShard
    from backend.torch_compat import fake_store

    spec = tiny("cuda_cp", model=FLASH, world_size=4, cp=2, cp_rotate="alltoall", cp_load_balance=False)
    saved = (cp_attention._cp_options.rotate_method, cp_attention._cp_options.enable_load_balance)
    dist.init_process_group("fake", store=fake_store(), rank=3, world_size=4)
    try:
        mesh = build_mesh(spec, torch.device("cpu"))
        gpu = ContextShard(RankContext(spec, 3, 4, 0, torch.device("cuda", 0), mesh))
        assert gpu.ring is None and gpu.core._forward_pre_hooks and gpu.core._forward_hooks
        assert cp_attention._cp_options.rotate_method == cp_attention._RotateMethod.ALL_TO_ALL
        assert cp_attention._cp_options.enable_load_balance is False
        cpu = ContextShard(RankContext(spec, 3, 4, 0, torch.device("cpu"), mesh))
        assert cpu.core is None and (cpu.ring.size, cpu.ring.rank, cpu.ring.rotate) == (2, 1, "alltoall")
        assert cpu.positions(8, torch.device("cpu")).tolist() == list(range(8, 16))  # contiguous: the second half
    finally:
        cp_attention._disable_context_parallel_dispatcher()
        cp_attention._cp_options.rotate_method, cp_attention._cp_options.enable_load_balance = saved
        dist.destroy_process_group()


WORLD2 = {s.name: parity_job(s) for s in [
    tiny("cp2", model=FLASH, world_size=2, cp=2),
    tiny("cp2_alltoall_contiguous_rope", model=FLASH | {"positions": "rope", "norm": "rmsnorm", "mlp": "swiglu"},
         world_size=2, cp=2, cp_rotate="alltoall", cp_load_balance=False),
]}
WORLD4 = {s.name: parity_job(s, timeout_s=500) for s in [
    tiny("cp4", model=FLASH, world_size=4, cp=4),
    tiny("cp2_x_fsdp2", model=FLASH, strategy="fsdp", world_size=4, cp=2),
    tiny("cp2_x_tp2_sp", model=FLASH, strategy="tp", world_size=4, cp=2, tp=2, sequence_parallel=True),
    tiny("cp2_x_pp2", model=FLASH, world_size=4, cp=2, pp=2),
    tiny("cp2_x_ep2", model=FLASH | {"n_experts": 4, "top_k": 2}, strategy="ep", world_size=4, cp=2, ep=2,
         train={"optimizer": "sgd", "lr": 0.5}),
]}


@pytest.mark.slow
@pytest.mark.parametrize("name", params(WORLD2))
def test_cp_parity_world2(farm, name):
    result = farm.result(WORLD2[name])
    assert_parity(result)
    assert any(n.startswith("CP: each sequence split over cp=2") for n in result["notes"])


@pytest.mark.slow
@pytest.mark.parametrize("name", params(WORLD4))
def test_cp_parity_world4(farm, name):
    assert_parity(farm.result(WORLD4[name]))
