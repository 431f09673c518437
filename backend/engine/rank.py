"""One rank of a ShardLab run: `python -m backend.engine.rank --spec S.json --out DIR` under torchrun.

The model is built on the meta device and parallelized before any weight exists; each rank then
materializes only its own shards (backend/strategies/parallelize.py). Rank 0 gathers every rank's payload,
frees the training state, runs the single-process loss reference in a CPU process of its own
(engine/reference.py: skipped with a note when it would not fit) and writes DIR/ranks.json; a failing rank
writes DIR/rank-<r>.error.json and exits 1 (backend/runtime: the protocol and the shared `rank_main`).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from backend.bench.env import rank_env
from backend.engine import mesh as mesh_mod
from backend.engine.loop import run_loop
from backend.engine.reference import run_isolated
from backend.models.gpt import build_model
from backend.runtime.entry import exit_now, rank_main
from backend.runtime.protocol import PAYLOAD_VERSION, RankPayload, RanksFile, write_ranks
from backend.spec import ExperimentSpec
from backend.strategies.base import RankContext, prepare


def run_rank(spec: ExperimentSpec, rank: int, world: int, local_rank: int, out: Path) -> None:
    if world != spec.parallel.world_size:
        raise RuntimeError(f"torchrun started {world} ranks but the spec needs world_size={spec.parallel.world_size}")
    torch.set_num_threads(1)
    backend, device = mesh_mod.init(spec, rank, world, local_rank)
    ctx = RankContext(spec=spec, rank=rank, world_size=world, local_rank=local_rank, device=device,
                      mesh=mesh_mod.build_mesh(spec, device))
    model = build_model(spec.model, seed=spec.train.seed, recompute=spec.train.recompute, device="meta")
    prep = prepare(ctx, model)
    del model
    measured = run_loop(ctx, prep)
    payload = RankPayload(rank=rank, coords=ctx.coords(), strategy_module=spec.parallel.strategy_module,
                          env=rank_env(backend, device), notes=list(prep.notes), timeline=list(prep.timeline),
                          extra=dict(prep.extra), **measured)
    del prep
    gc.collect()  # the training state's cycles freed before the reference is forked (it inherits this memory;
    # its budget reads the host's available memory) and before empty_cache; the farm collects again after the job
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    if rank == 0:
        ref, note = run_isolated(spec)
        ranks = sorted(gathered, key=lambda p: p.rank)
        if note:
            ranks[0].notes.append(note)
        write_ranks(out, RanksFile(version=PAYLOAD_VERSION, world_size=world, backend=backend, ranks=ranks,
                                   loss_reference=ref))


def main(argv: list[str] | None = None) -> int:
    return rank_main(run_rank, "python -m backend.engine.rank", argv)


if __name__ == "__main__":
    exit_now(main())
