"""Context parallelism's engine set-up in one process (fake process group): a CUDA rank takes torch's
_ContextParallel, a CPU rank the hand-written ring. The torchrun parity runs: tests/multiprocess/test_cp_engine.py."""

from tests.helpers.mp_launch import tiny
from tests.multiprocess.test_cp_engine import FLASH


def test_cuda_ranks_use_torchs_context_parallel(monkeypatch):
    """By construction (no GPU here): a CUDA rank's ContextShard wraps an SDPA core module with torch's
    _ContextParallel and sets torch's rotation and load balancing from the spec; a CPU rank gets the hand-written ring."""
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
