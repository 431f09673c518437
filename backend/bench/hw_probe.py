"""Measure this machine for the step-time model's "cpu" profile: GEMM FLOP/s by size, memory bandwidth,
op launch overhead, gloo all-reduce α–β between 2 local processes, gloo all-gather / reduce-scatter bandwidth
relative to it, and the host cost of one DTensor operator.

  python -m backend.bench.hw_probe            # writes data/hardware_cpu.json (or $SHARDLAB_CPU_PROFILE)
  python -m backend.bench.hw_probe --json     # also prints it
  python -m backend.bench.hw_probe --device cuda -o gpu.json [--budget-s 80]
      # the operation tables of this GPU (backend/bench/op_probe.py) as one hardware.json profile, written as
      # {"profiles": {"measured-<device>": entry}}: pass the file as SHARDLAB_HARDWARE, then
      # `estimate --hardware measured-<device>`. `--device cpu --tables --sizes tiny` runs the same code on the CPU.

Each rank runs with 1 thread (as the engine's ranks do: OMP_NUM_THREADS=1), so peak_flops is one core's;
more ranks than cores time-share them (steptime.model._timeshare). α–β: least squares of t(S) = α + S/β over
all-reduce sizes (Hockney 1994, "The communication challenge for MPP", Parallel Computing 20: t = α + n/β).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

from backend.analytic.steptime.hardware import cpu_profile_path
from backend.atomic_io import write_atomic

GEMM_SIZES = (64, 128, 256, 512, 1024)
SAME_MACHINE = 4096
"""Ranks per "node": every local rank shares this machine's loopback (one link tier); cores bound time-sharing."""
AR_BYTES = (4 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
REPO = Path(__file__).resolve().parents[2]
RANK_TIMEOUT_S = 300.0


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
        t = _best(lambda: [a @ b for _ in range(reps)]) / reps  # noqa: B023 - _best calls it here
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


def collective_times(collective: str) -> list[tuple[int, float]]:
    """(payload bytes, seconds) per size: the full (unsharded) tensor, as the step-time model counts payloads."""
    out = []
    for size in AR_BYTES:
        full = torch.zeros(size // 4)
        shard = torch.zeros(full.numel() // 2)
        # the closures run in this iteration (_best below), so the loop variables are the current ones
        fn = {"all_reduce": lambda: dist.all_reduce(full),  # noqa: B023
              "all_gather": lambda: dist.all_gather_into_tensor(full, shard),  # noqa: B023
              "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}[collective]  # noqa: B023
        dist.barrier()
        out.append((size, _best(fn, repeats=5)))
    return out


def dtensor_op_s() -> float:
    """Seconds of one in-place DTensor operator on a 2-rank mesh (dispatch + sharding propagation + tiny kernel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    x = distribute_tensor(torch.zeros(64), init_device_mesh("cpu", (2,)), [Shard(0)])
    reps = 200
    return _best(lambda: [x.mul_(0.5).add_(1.0) for _ in range(reps)]) / (2 * reps)


def _fit(res: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t(S) = a + S·slope (Hockney 1994): (a, slope)."""
    n = len(res)
    xs, ys = [s for s, _ in res], [t for _, t in res]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def gloo_alpha_beta() -> tuple[float, float, dict[str, float], float, dict]:
    """(α seconds per ring step, β bytes/s) of a 2-rank gloo all-reduce (ring: 2 steps, wire = S); all-gather and
    reduce-scatter bandwidth as a fraction of β (their ring wire is S/2 at 2 ranks: efficiency = 1 / (2·slope·β));
    seconds of one DTensor operator; the raw timings. The ranks are processes of their own
    (backend/bench/gloo_probe_rank.py); one that fails ends the probe with its exit code and stderr."""
    with tempfile.TemporaryDirectory(prefix="shardlab-gloo-probe-") as tmp:
        folder = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        logs = [(folder / f"rank{r}.err").open("w") for r in range(2)]
        with logs[0], logs[1]:
            procs = [subprocess.Popen([sys.executable, "-m", "backend.bench.gloo_probe_rank", str(r),
                                       str(folder / "pg"), str(folder / "result.json")], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=logs[r]) for r in range(2)]
            wait_ranks(procs, folder)
        data = json.loads((folder / "result.json").read_text())
    res, dtensor_s = data["collectives"], data["dtensor_op_s"]
    intercept, slope = _fit(res["all_reduce"])
    beta = 1.0 / slope  # 2(n-1) = 2 ring steps; wire bytes 2(n-1)/n·S = S
    eff = {c: 1.0 / (2 * max(_fit(res[c])[1], 1e-15) * beta) for c in ("all_gather", "reduce_scatter")}
    return max(intercept, 1e-7) / 2, beta, eff, dtensor_s, res


def wait_ranks(procs: list[subprocess.Popen], folder: Path) -> None:
    """Wait for both ranks; the first that fails (or the time limit) kills the other, whose rendezvous would wait."""
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll()]
        if failed or time.monotonic() > deadline:
            for p in procs:
                p.kill()
                p.wait()
            break
        time.sleep(0.05)
    errors = [f"rank {r} exited {p.returncode}: {(folder / f'rank{r}.err').read_text()[-2000:]}"
              for r, p in enumerate(procs) if p.returncode]
    if errors:
        raise RuntimeError(f"gloo probe failed (limit {RANK_TIMEOUT_S:.0f} s): " + "; ".join(errors))


def probe() -> dict:
    torch.set_num_threads(1)
    curve = gemm_curve()
    peak = max(f for _, f in curve)
    # e(F) = F / (F + F_half) at e_max = 1 relative to the best size: F_half from the smallest size's efficiency
    f0, r0 = curve[0]
    e0 = min(0.999, r0 / peak)
    alpha, beta, eff, dtensor_s, coll = gloo_alpha_beta()
    return {"name": f"this machine ({socket.gethostname()}, {os.cpu_count()} cores, 1 thread per rank)", "kind": "cpu",
            "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
            "peak_flops": {"fp32": peak, "bf16": peak, "fp16": peak}, "hbm_bytes_per_s": memory_bytes_per_s(),
            "intra_bytes_per_s": beta, "inter_bytes_per_s": beta, "gpus_per_node": SAME_MACHINE,
            "cores": os.cpu_count() or 1,
            "tune": {"gemm_efficiency_max": 1.0, "gemm_half_flops": f0 * (1 - e0) / e0, "memory_efficiency": 1.0,
                     "kernel_launch_s": launch_s(), "intra_efficiency": 1.0, "inter_efficiency": 1.0,
                     "intra_latency_s": alpha, "inter_latency_s": alpha, "attention_flash_efficiency": 1.0,
                     "dtensor_op_s": dtensor_s, "all_gather_efficiency": eff["all_gather"],
                     "reduce_scatter_efficiency": eff["reduce_scatter"]},
            "source": f"backend/bench/hw_probe.py at {datetime.now(UTC).isoformat(timespec='seconds')}, torch "
                      f"{torch.__version__}",
            "measured": {"gemm_flops_by_size": curve, "gloo_all_reduce_s_by_bytes": coll["all_reduce"],
                         "gloo_all_gather_s_by_bytes": coll["all_gather"],
                         "gloo_reduce_scatter_s_by_bytes": coll["reduce_scatter"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench.hw_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-o", "--output", type=Path, default=None, help="default: $SHARDLAB_CPU_PROFILE or "
                                                                    "data/hardware_cpu.json")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the GPU operation tables (implies --tables); cpu (default): this machine's CPU profile")
    ap.add_argument("--tables", action="store_true", help="the operation tables instead of the CPU profile")
    ap.add_argument("--sizes", choices=("full", "tiny"), default=None, help="grid of the tables (default: full on "
                    "cuda, tiny on cpu)")
    ap.add_argument("--budget-s", type=float, default=80.0, help="time for all tables (each stops at its share)")
    args = ap.parse_args(argv)
    if args.device == "cuda" or args.tables:
        return _tables_main(args)
    prof = probe()
    out = args.output or cpu_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(prof, indent=2))  # a page or worker reading it never sees half a profile
    print(json.dumps(prof, indent=2) if args.json else f"wrote {out}: peak {prof['peak_flops']['fp32'] / 1e9:.1f} "
          f"GFLOP/s per core, memory {prof['hbm_bytes_per_s'] / 1e9:.1f} GB/s, gloo α "
          f"{prof['tune']['intra_latency_s'] * 1e6:.1f} µs, β {prof['intra_bytes_per_s'] / 1e9:.2f} GB/s")
    return 0


def _tables_main(args: argparse.Namespace) -> int:
    from backend.bench.op_probe import FULL, TINY
    from backend.bench.op_profile import probe_profile

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"error: --device cuda but torch.cuda.is_available() is False (torch {torch.__version__}, "
              f"CUDA {torch.version.cuda})", file=sys.stderr)
        return 2
    if not args.budget_s > 0:
        print(f"error: --budget-s must be > 0 (got {args.budget_s})", file=sys.stderr)
        return 2
    sizes = {"full": FULL, "tiny": TINY}[args.sizes or ("full" if args.device == "cuda" else "tiny")]
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    progress = lambda name, s: print(f"hw_probe: {name} {s:.1f} s", file=sys.stderr, flush=True)  # noqa: E731
    key, entry = probe_profile(device, sizes, args.budget_s, on_table=progress)
    out = args.output or Path(f"hardware_{key}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"profiles": {key: entry}}, indent=1))
    tune = entry["tune"]
    print(json.dumps({key: entry}, indent=1) if args.json else
          f"wrote {out}: profile {key!r}, GEMM efficiency max {tune.get('gemm_efficiency_max')}, flash attention "
          f"{tune.get('attention_flash_efficiency')}, memory {tune.get('memory_efficiency')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
