"""Rank program: the engine's timed DDP step and the bare loop of `bare_ddp.py` in the SAME processes, in
alternating blocks, so launch-to-launch noise (±10% here) cancels out of the comparison.

  torchrun --standalone --nproc-per-node 2 benchmarks/side_by_side.py --spec S.json --rounds R

The engine side is the engine's own code: `backend.engine.mesh` (process group + device mesh), the ddp
strategy's `prepare`, and `backend.engine.loop.timed_steps` (comm-counting hooks, fenced timing, loss
report after the clock) — exactly what a run's timed steps execute. The bare side is a second, identical
seeded model under plain DDP on the default group. Each block runs spec.train.steps steps; blocks
alternate engine/bare, flipping the order every round. Rank 0 prints `SIDE_BY_SIDE {...}` with the slowest
rank's seconds per step of every block.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bare_ddp import bare_model, bare_steps, slowest  # noqa: E402

from backend.engine import mesh as mesh_mod  # noqa: E402
from backend.engine.data import global_batch  # noqa: E402
from backend.engine.loop import timed_steps  # noqa: E402
from backend.models.gpt import build_model  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402
from backend.strategies.base import RankContext, prepare  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--pin", action="store_true", help="pin rank r to CPU core r (less scheduler jitter for both sides)")
    args = ap.parse_args()
    spec = ExperimentSpec.from_json(args.spec.read_text())
    torch.set_num_threads(1)
    rank, world, local_rank = mesh_mod.env_ranks()
    if args.pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {local_rank % (os.cpu_count() or 1)})
    _, device = mesh_mod.init(spec, rank, world, local_rank)
    ctx = RankContext(spec=spec, rank=rank, world_size=world, local_rank=local_rank, device=device,
                      mesh=mesh_mod.build_mesh(spec, device))
    prep = prepare(ctx, build_model(spec.model, seed=spec.train.seed, recompute=spec.train.recompute))
    model, opt = bare_model(spec)
    t = spec.train
    for i in range(t.warmup_steps):  # both warm up on the same steps
        prep.train_step(*global_batch(spec, i))
        bare_steps(spec, model, opt, range(i, i + 1))
    blocks: list[dict] = []
    for r in range(args.rounds):
        order = ("engine", "bare") if r % 2 == 0 else ("bare", "engine")
        for which in order:
            if which == "engine":
                step_s, _ = timed_steps(ctx, prep, [])
            else:
                step_s = bare_steps(spec, model, opt, range(t.warmup_steps, t.warmup_steps + t.steps))
            blocks.append({"round": r, "which": which, "step_s": slowest(step_s)})
    if rank == 0:
        print("SIDE_BY_SIDE " + json.dumps({"blocks": blocks}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
