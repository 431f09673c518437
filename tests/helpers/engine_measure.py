"""The engine's path measured on a rank, without the rank program around it: strategies' prepare, then
backend/engine/loop.run_loop (MemTracker + comm counter): {"memory": categories, "comm": {kind: bytes}}.

`on_fake_pg(spec, rank)` measures one rank in this process over torch's fake process group; `run_job` is the farm's
job (tests/helpers/farm.py, `program_job("engine_measure", world, specs=[...])`) on real gloo ranks, its value
{rank: [one measurement per spec]}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from backend.spec import ExperimentSpec


def measure(s: ExperimentSpec, rank: int) -> dict[str, Any]:
    """This rank's measurement; the process group is already there."""
    from backend.engine import loop, mesh
    from backend.models.gpt import build_model
    from backend.strategies.base import RankContext, prepare

    torch.set_num_threads(1)
    dev = torch.device("cpu")
    ctx = RankContext(spec=s, rank=rank, world_size=s.parallel.world_size, local_rank=0, device=dev,
                      mesh=mesh.build_mesh(s, dev))
    prep = prepare(ctx, build_model(s.model, seed=0, recompute=s.train.recompute))
    out = loop.run_loop(ctx, prep)
    return {"memory": out["memory"]["categories"], "comm": {k: v["bytes"] for k, v in out["comm"].items()}}


def on_fake_pg(s: ExperimentSpec, rank: int) -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=s.parallel.world_size)
    try:
        return measure(s, rank)
    finally:
        dist.destroy_process_group()


def run_job(payload: dict, out: Path) -> dict[int, list[dict[str, Any]]]:
    mine = [measure(ExperimentSpec.from_json(js), dist.get_rank()) for js in payload["specs"]]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return dict(enumerate(everyone))


def block_saved_bytes_on_fake_pg(s: ExperimentSpec, rank: int, block: str = "0") -> int:
    """What one of this rank's blocks keeps for backward once the strategy has placed it (TP's DTensors, SP's
    sequence shards), over torch's fake process group: the block's input is caught on a forward of the whole model,
    then the block runs again under saved_tensors_hooks. Each local storage once, parameters and autocast's weight
    casts left out (every 2-D weight of a dense block is cast once)."""
    import contextlib

    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from backend.analytic.layout import Layout
    from backend.engine import mesh
    from backend.models.gpt import build_model
    from backend.strategies.base import RankContext, prepare

    def local(t: torch.Tensor) -> torch.Tensor:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=s.parallel.world_size)
    try:
        dev = torch.device("cpu")
        ctx = RankContext(spec=s, rank=rank, world_size=s.parallel.world_size, local_rank=0, device=dev,
                          mesh=mesh.build_mesh(s, dev))
        model = prepare(ctx, build_model(s.model, seed=0, recompute=s.train.recompute)).modules[0]
        target = model.layers[block]
        caught: list[torch.Tensor] = []
        hook = target.register_forward_pre_hook(lambda _m, args: None if caught else caught.append(args[0].detach()))
        autocast = Layout.of(s).uses_autocast
        region = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
        with region():
            model(torch.randint(0, s.model.vocab_size, (s.train.micro_batch, s.model.seq_len)))
        hook.remove()
        params = {local(p).untyped_storage().data_ptr() for p in target.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = local(t).untyped_storage()
            if storage.data_ptr() not in params and t.dim() > 0:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with region(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            target(caught[0].requires_grad_(True))
        casts = 2 * sum(local(p).numel() for p in target.parameters() if p.dim() == 2) if autocast else 0
        return sum(saved.values()) - casts
    finally:
        dist.destroy_process_group()
