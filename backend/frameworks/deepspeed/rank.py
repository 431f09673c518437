"""One rank of a DeepSpeed run: `python -m backend.frameworks.deepspeed.rank --spec S.json --out DIR` under torchrun.

Writes the same files as backend/engine/rank.py (backend/runtime: DIR/ranks.json from rank 0,
DIR/rank-<r>.error.json on failure), so the launcher, assembly and storage treat it like any torch run. Rank 0
also writes DIR/ds_config.json and puts the config and DeepSpeed's own estimate into ranks.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from backend.atomic_io import write_json_atomic
from backend.bench.env import rank_env
from backend.engine import comm_payload, comm_steps, global_batch, init_distributed, progress, run_isolated, timed_steps
from backend.frameworks.deepspeed import engine as ds_engine
from backend.frameworks.deepspeed.measure import memory_step
from backend.models.gpt import build_model
from backend.runtime.entry import exit_now, rank_main
from backend.runtime.faults import maybe_inject
from backend.runtime.protocol import PAYLOAD_VERSION, RankPayload, RanksFile, write_ranks
from backend.spec import ExperimentSpec
from backend.strategies.base import RankContext, global_mean_loss
from backend.strategies.context import local_batch

COMM_STEPS = 2


def run_rank(spec: ExperimentSpec, rank: int, world: int, local_rank: int, out: Path) -> None:
    if world != spec.parallel.world_size:
        raise RuntimeError(f"torchrun started {world} ranks but the spec needs world_size={spec.parallel.world_size}")
    torch.set_num_threads(1)
    backend, device = init_distributed(spec, rank, world, local_rank)
    ctx = RankContext(spec=spec, rank=rank, world_size=world, local_rank=local_rank, device=device)
    model = build_model(spec.model, seed=spec.train.seed, recompute=spec.train.recompute, device=device)
    prep, engine = ds_engine.prepare(ctx, model)
    measured = _loop(ctx, prep, engine)
    payload = RankPayload(rank=rank, coords=ctx.coords(), strategy_module="deepspeed",
                          env={**rank_env(backend, device), "deepspeed": _ds_version()}, notes=list(prep.notes),
                          timeline=[], extra=dict(prep.extra), **measured)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    if rank == 0:
        from backend.frameworks.deepspeed.own_estimator import deepspeed_estimate

        write_json_atomic(out / "ds_config.json", prep.extra["ds_config"])
        ref, note = run_isolated(spec)  # its own CPU process, never on this rank's device (engine/rank.py)
        if note:
            gathered[0].notes.append(note)
        write_ranks(out, RanksFile(version=PAYLOAD_VERSION, world_size=world, backend=backend, framework="deepspeed",
                                   ds_config=prep.extra["ds_config"], framework_estimate=deepspeed_estimate(spec),
                                   ranks=sorted(gathered, key=lambda p: p.rank), loss_reference=ref))


def _loop(ctx: RankContext, prep: Any, engine: Any) -> dict[str, Any]:
    """Warm-up, timed steps, one memory-tracked step and comm-timing steps, as backend/engine/loop.py."""
    t = ctx.spec.train
    losses: list[float] = []
    for i in range(t.warmup_steps):
        maybe_inject(ctx.rank, i)
        losses.append(global_mean_loss(*prep.train_step(*local_batch(ctx, *global_batch(ctx.spec, i)))))
        progress(ctx, i + 1, t.warmup_steps, "warmup")
    step_s = timed_steps(ctx, prep, losses)
    mem, full = memory_step(ctx, prep, engine, t.warmup_steps + t.steps)
    n_comm = min(COMM_STEPS, t.steps)
    counted = comm_steps(ctx, prep, t.warmup_steps + t.steps + 1, n_comm)
    return {"losses": losses, "step_s": step_s, **comm_payload(full, counted, n_comm), "memory": mem}


def _ds_version() -> str:
    import deepspeed

    return deepspeed.__version__


def main(argv: list[str] | None = None) -> int:
    return rank_main(run_rank, "python -m backend.frameworks.deepspeed.rank", argv)


if __name__ == "__main__":
    exit_now(main())  # DeepSpeed processes can SIGABRT in interpreter teardown: skip it
