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
