"""Diagnosis of the step-time gap: one timed step of the check's runs under torch.profiler, at world 1, with the
product's own set-up (build on meta, backend.strategies.base.prepare, the strategy's train_step) in this process's
world-1 process group (NCCL on CUDA, gloo on the CPU). No engine code changes: the engine's rank does the same
calls between its own timers.

  python -m backend.gpucheck.step_profile --device cuda|cpu --runs ddp,zero3 --out FILE [--warmup N] [--unprofiled N]

Per run: `--warmup` steps, `--unprofiled` fenced steps (backend.bench.timing.timed, the engine's timer: their
median is the step time the engine would report), then ONE profiled step (CPU + CUDA activities), summarised by
backend/gpucheck/kernel_categories.py. FILE is rewritten after every run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profile_run(name: str, device_type: str, warmup: int, unprofiled: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from backend.bench.timing import fence, timed
    from backend.engine import mesh as mesh_mod
    from backend.engine.data import global_batch
    from backend.gpucheck.kernel_categories import summarize
    from backend.gpucheck.specs import runs_for, spec_for
    from backend.models.gpt import build_model
    from backend.strategies.base import RankContext, prepare
    from backend.strategies.context import local_batch

    (run,) = runs_for(1, [name])
    spec = spec_for(run, device=device_type, nproc=1, timeout_s=300.0)
    t0 = time.perf_counter()
    backend, device = mesh_mod.init(spec, 0, 1, 0)
    ctx = RankContext(spec=spec, rank=0, world_size=1, local_rank=0, device=device,
                      mesh=mesh_mod.build_mesh(spec, device))
    group_s = time.perf_counter() - t0
    prep = prepare(ctx, build_model(spec.model, seed=spec.train.seed, recompute=spec.train.recompute, device="meta"))
    setup_s = {"process_group_s": group_s, "prepare_s": time.perf_counter() - t0 - group_s,
               "init_threads": os.environ.get("SHARDLAB_INIT_THREADS", "1")}
    batch = local_batch(ctx, *global_batch(spec, 0))
    t1 = time.perf_counter()
    for _ in range(warmup):
        prep.train_step(*batch)
    fence(device)
    setup_s["warmup_s"] = time.perf_counter() - t1
    # noqa below: each lambda runs inside the comprehension, long before the `del prep` at the end
    step_s = [timed(lambda: prep.train_step(*batch), device)[1] for _ in range(unprofiled)]  # noqa: F821
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fence(device)
    with profile(activities=activities) as prof:
        t1 = time.perf_counter()
        prep.train_step(*batch)
        fence(device)
        wall = time.perf_counter() - t1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    out = {"run": name, "status": "ok", "backend": backend, "setup_s": setup_s,
           "unprofiled_step_s": step_s, "unprofiled_step_s_median": statistics.median(step_s) if step_s else None,
           "profiled_step_wall_s": wall, **summarize(trace, wall)}
    del prep, prof, trace
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.gpucheck.step_profile")
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--runs", default="ddp,zero3")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--unprofiled", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as the engine's rank does
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    results: list[dict[str, Any]] = []
    for name in [r.strip() for r in args.runs.split(",") if r.strip()]:
        try:
            results.append(profile_run(name, args.device, args.warmup, args.unprofiled))
        except Exception as e:  # noqa: BLE001 - one run failing is its entry; the next still runs
            results.append({"run": name, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:1500]}",
                            "traceback_tail": traceback.format_exc()[-2000:]})
        args.out.write_text(json.dumps(results))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
