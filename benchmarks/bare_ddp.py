"""A bare, hand-written torch DDP training loop: the baseline `engine_vs_bare.py` compares the engine with.

  torchrun --standalone --nproc-per-node 2 benchmarks/bare_ddp.py --spec S.json

Same model (seeded GPT), same synthetic data and the same microbatch accumulation as the engine's DDP
strategy, but no engine: no comm counting, no memory tracking, no result assembly. Each timed step
starts at a barrier (as the engine's do); rank 0 prints `BARE_STEP_S [...]`, the slowest rank's time
per step. `bare_model` / `bare_steps` are also run inside the engine's processes by `side_by_side.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backend.engine.data import global_batch  # noqa: E402
from backend.models.gpt import build_model, loss_fn  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402


def bare_model(spec: ExperimentSpec) -> tuple[DDP, torch.optim.Optimizer]:
    model = DDP(build_model(spec.model, seed=spec.train.seed), gradient_as_bucket_view=True)
    return model, torch.optim.AdamW(model.parameters(), lr=spec.train.lr)


def bare_steps(spec: ExperimentSpec, model: DDP, opt: torch.optim.Optimizer, steps: range,
               cpu_s: list[float] | None = None) -> list[float]:
    """Seconds of each step in `steps` on this rank (each starts at a barrier); with `cpu_s`, also appends each
    step's process CPU seconds (all threads of this rank, gloo's included) to it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = spec.train
    per, mb, n = t.global_batch // world, t.micro_batch, t.microbatches
    step_s = []
    for step in steps:
        x, y = global_batch(spec, step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=False)
        for i in range(n):
            with model.no_sync() if i < n - 1 else nullcontext():
                loss = loss_fn(model(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb]) / n
                loss.backward()
        opt.step()
        if cpu_s is not None:
            cpu_s.append(time.process_time() - c0)
        step_s.append(time.perf_counter() - t0)
    return step_s


def slowest(step_s: list[float]) -> list[float]:
    """Per step, the slowest rank's seconds (a step ends when its last rank does)."""
    timed = torch.tensor(step_s, dtype=torch.float64)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)
    return timed.tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", type=Path, required=True)
    spec = ExperimentSpec.from_json(ap.parse_args().spec.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t = spec.train
    model, opt = bare_model(spec)
    step_s = bare_steps(spec, model, opt, range(t.warmup_steps + t.steps))
    timed = slowest(step_s[t.warmup_steps:])
    if dist.get_rank() == 0:
        print("BARE_STEP_S " + json.dumps(timed), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
