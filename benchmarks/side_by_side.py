"""Rank program: the engine's timed DDP step and the bare loop of `bare_ddp.py` in the SAME processes, in
alternating blocks, so launch-to-launch noise (±10% here) cancels out of the comparison.

  torchrun --standalone --nproc-per-node 2 benchmarks/side_by_side.py --spec S.json --rounds R

The engine side is the engine's own code: `backend.engine.mesh` (process group + device mesh), the ddp
strategy's `prepare`, and `backend.engine.loop.timed_steps` (fenced timing, loss report after the clock) —
exactly what a run's timed steps execute. The bare side is a second, identical
seeded model under plain DDP on the default group. Each round runs spec.train.steps steps per side in
blocks of --block steps that alternate engine/bare, flipping which goes first every block (--block 1
pairs single steps, so a load burst hits both sides alike). Rank 0 prints `SIDE_BY_SIDE {...}` with, for
every block, the slowest rank's wall seconds per step and the largest per-rank process CPU seconds per step.
--null replaces the engine side with a second bare model: an A/A run whose ratios show the noise floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository root, for its packages

from backend.engine import mesh as mesh_mod  # noqa: E402
from backend.engine.data import global_batch  # noqa: E402
from backend.engine.loop import timed_steps  # noqa: E402
from backend.models.gpt import build_model  # noqa: E402
from backend.runtime.entry import env_ranks  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402
from backend.strategies.base import RankContext, local_batch, prepare  # noqa: E402
from benchmarks.bare_ddp import bare_model, bare_steps, slowest  # noqa: E402


def cpu_timed(fn: Callable, cpu_s: list[float]) -> Callable:
    """fn that also appends its process CPU seconds to cpu_s (measured inside the clock, as bare_steps does)."""
    def run(*args):  # type: ignore[no-untyped-def]
        c0 = time.process_time()
        out = fn(*args)
        cpu_s.append(time.process_time() - c0)
        return out
    return run


def block_order(r: int, j: int) -> tuple[str, str]:
    return ("engine", "bare") if (r + j) % 2 == 0 else ("bare", "engine")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=0, help="steps per alternating block (default: spec.train.steps)")
    ap.add_argument("--null", action="store_true", help="A/A: a second bare model stands in for the engine")
    ap.add_argument("--pin", action="store_true", help="pin rank r to CPU core r (less scheduler jitter for both "
                                                       "sides)")
    args = ap.parse_args()
    spec = ExperimentSpec.from_json(args.spec.read_text())
    torch.set_num_threads(1)
    rank, world, local_rank = env_ranks()
    if args.pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {local_rank % (os.cpu_count() or 1)})
    _, device = mesh_mod.init(spec, rank, world, local_rank)
    t = spec.train
    block = args.block or t.steps
    if t.steps % block:
        raise SystemExit(f"--block {block} does not divide the spec's {t.steps} steps")
    block_spec = spec.model_copy(update={"train": t.model_copy(update={"steps": block})})
    ctx = RankContext(spec=block_spec, rank=rank, world_size=world, local_rank=local_rank, device=device,
                      mesh=mesh_mod.build_mesh(spec, device))
    prep = prepare(ctx, build_model(spec.model, seed=t.seed, recompute=t.recompute, device="meta"))
    engine_cpu_s: list[float] = []
    prep.train_step = cpu_timed(prep.train_step, engine_cpu_s)
    model, opt = bare_model(spec)
    twin = bare_model(spec) if args.null else None
    for i in range(t.warmup_steps):  # both warm up on the same steps
        prep.train_step(*local_batch(ctx, *global_batch(spec, i)))
        bare_steps(spec, model, opt, range(i, i + 1))
        if twin:
            bare_steps(spec, *twin, range(i, i + 1))
    timed = range(t.warmup_steps, t.warmup_steps + block)  # the same global steps (batches) as the engine's
    blocks: list[dict] = []
    for r in range(args.rounds):
        for j in range(t.steps // block):
            for which in block_order(r, j):
                cpu_s: list[float] = []
                if which == "engine" and twin:
                    step_s = bare_steps(spec, *twin, timed, cpu_s)
                elif which == "engine":
                    engine_cpu_s.clear()
                    step_s = timed_steps(ctx, prep, [])
                    cpu_s = engine_cpu_s[:]
                else:
                    step_s = bare_steps(spec, model, opt, timed, cpu_s)
                blocks.append({"round": r, "which": which, "step_s": slowest(step_s), "cpu_s": slowest(cpu_s)})
    if rank == 0:
        print("SIDE_BY_SIDE " + json.dumps({"blocks": blocks}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
