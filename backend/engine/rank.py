"""One rank of a ShardLab run: `python -m backend.engine.rank --spec S.json --out DIR` under torchrun.

The model is built on the meta device and parallelized before any weight exists; each rank then
materializes only its own shards (backend/strategies/parallelize.py). Rank 0 gathers every rank's payload,
frees the training state, runs the single-process loss reference in a CPU process of its own
(engine/reference.py: skipped with a note when it would not fit) and writes DIR/ranks.json atomically; a
failing rank writes DIR/rank-<r>.error.json and exits 1.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from backend.atomic_io import write_json_atomic
from backend.bench.env import rank_env
from backend.engine import mesh as mesh_mod
from backend.engine.loop import run_loop
from backend.engine.reference import run_isolated
from backend.launch.stacks import enable_stack_dump
from backend.models.gpt import build_model
from backend.spec import ExperimentSpec
from backend.strategies.base import RankContext, module_name_for, prepare

PAYLOAD_VERSION = 1


def is_oom(e: BaseException) -> bool:
    oom_types = tuple(t for t in (MemoryError, getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if isinstance(t, type))
    return isinstance(e, oom_types) or "out of memory" in str(e).lower()


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
    payload = run_loop(ctx, prep)
    payload.update(rank=rank, coords=ctx.coords(), env=rank_env(backend, device), notes=list(prep.notes),
                   timeline=list(prep.timeline), strategy_module=module_name_for(spec), extra=dict(prep.extra))
    del prep
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    if rank == 0:
        ref, note = run_isolated(spec)
        ranks = sorted(gathered, key=lambda p: p["rank"])
        if note:
            ranks[0]["notes"].append(note)
        write_json_atomic(out / "ranks.json", {"version": PAYLOAD_VERSION, "world_size": world, "backend": backend,
                                               "ranks": ranks, "loss_reference": ref})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.engine.rank")
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    rank, world, local_rank = mesh_mod.env_ranks()
    args.out.mkdir(parents=True, exist_ok=True)
    enable_stack_dump(args.out, rank)  # the launcher asks for the stacks when the job times out
    try:
        spec = ExperimentSpec.from_json(args.spec.read_text())
        run_rank(spec, rank, world, local_rank, args.out)
    except BaseException as e:  # noqa: BLE001 - every failure must leave its error file for the launcher
        if isinstance(e, SystemExit) and not e.code:
            raise
        write_json_atomic(args.out / f"rank-{rank}.error.json", {
            "rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
            "kind": "oom" if is_oom(e) else "error", "time_unix": time.time()})
        print(f"rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may already be gone
                pass
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and the process group is gone: skip interpreter teardown (seconds under load).
    os._exit(code)
