"""Measure this machine for the step-time model's "cpu" profile: GEMM FLOP/s by size, memory bandwidth,
op launch overhead, and gloo all-reduce α–β between 2 local processes.

  python -m backend.bench.hw_probe            # writes data/hardware_cpu.json (or $SHARDLAB_CPU_PROFILE)
  python -m backend.bench.hw_probe --json     # also prints it

Each rank runs with 1 thread (as the engine's ranks do: OMP_NUM_THREADS=1), so peak_flops is one core's;
more ranks than cores time-share them (steptime.model._timeshare). α–β: least squares of t(S) = α + S/β over
all-reduce sizes (Hockney 1994, "The communication challenge for MPP", Parallel Computing 20: t = α + n/β).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.analytic.steptime.hardware import cpu_profile_path

GEMM_SIZES = (64, 128, 256, 512, 1024)
SAME_MACHINE = 4096
"""Ranks per "node": every local rank shares this machine's loopback (one link tier); cores bound time-sharing."""
AR_BYTES = (4 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def _best(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gemm_curve() -> list[tuple[float, float]]:
    """(FLOPs of one n x n x n fp32 GEMM, achieved FLOP/s) per size."""
    out = []
    for n in GEMM_SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        reps = max(1, int(1e8 // (2 * n**3)))
        t = _best(lambda: [a @ b for _ in range(reps)]) / reps
        out.append((2.0 * n**3, 2.0 * n**3 / t))
    return out


def memory_bytes_per_s() -> float:
    x = torch.empty(16 * 2**20 // 4)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _best(lambda: y.copy_(x))  # read + write


def launch_s() -> float:
    x = torch.zeros(8)
    reps = 2000
    return _best(lambda: [x.add_(1) for _ in range(reps)]) / reps


def _ar_worker(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = []
    for size in AR_BYTES:
        t = torch.zeros(size // 4)
        dist.barrier()
        res.append((size, _best(lambda: dist.all_reduce(t), repeats=5)))
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()


def gloo_alpha_beta() -> tuple[float, float, list]:
    """(α seconds per ring step, β bytes/s) of a 2-rank gloo all-reduce (ring: 2 steps, wire = S)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ar_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(60)
    n = len(res)
    xs, ys = [s for s, _ in res], [t for _, t in res]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha_total = max(my - slope * mx, 1e-7)
    return alpha_total / 2, 1.0 / slope, res  # 2(n-1) = 2 ring steps; wire bytes 2(n-1)/n·S = S


def probe() -> dict:
    torch.set_num_threads(1)
    curve = gemm_curve()
    peak = max(f for _, f in curve)
    # e(F) = F / (F + F_half) at e_max = 1 relative to the best size: F_half from the smallest size's efficiency
    f0, r0 = curve[0]
    e0 = min(0.999, r0 / peak)
    alpha, beta, ar = gloo_alpha_beta()
    return {"name": f"this machine ({socket.gethostname()}, {os.cpu_count()} cores, 1 thread per rank)", "kind": "cpu",
            "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
            "peak_flops": {"fp32": peak, "bf16": peak, "fp16": peak}, "hbm_bytes_per_s": memory_bytes_per_s(),
            "intra_bytes_per_s": beta, "inter_bytes_per_s": beta, "gpus_per_node": SAME_MACHINE,
            "cores": os.cpu_count() or 1,
            "tune": {"gemm_efficiency_max": 1.0, "gemm_half_flops": f0 * (1 - e0) / e0, "memory_efficiency": 1.0,
                     "kernel_launch_s": launch_s(), "intra_efficiency": 1.0, "inter_efficiency": 1.0,
                     "intra_latency_s": alpha, "inter_latency_s": alpha, "attention_flash_efficiency": 1.0},
            "source": f"backend/bench/hw_probe.py at {datetime.now(UTC).isoformat(timespec='seconds')}, torch {torch.__version__}",
            "measured": {"gemm_flops_by_size": curve, "gloo_all_reduce_s_by_bytes": ar}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.hw_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-o", "--output", type=Path, default=None, help="default: $SHARDLAB_CPU_PROFILE or data/hardware_cpu.json")
    args = ap.parse_args(argv)
    prof = probe()
    out = args.output or cpu_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=2))
    print(json.dumps(prof, indent=2) if args.json else f"wrote {out}: peak {prof['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s per core, "
          f"memory {prof['hbm_bytes_per_s'] / 1e9:.1f} GB/s, gloo α {prof['tune']['intra_latency_s'] * 1e6:.1f} µs, "
          f"β {prof['intra_bytes_per_s'] / 1e9:.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
