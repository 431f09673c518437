"""Host memory of set-up (model build + sharding) per rank, as a ratio of the full fp32 parameter bytes.

  python benchmarks/setup_memory.py [--world 2] [--strategy zero3] [--legacy]

Launches `world` gloo ranks (torchrun). Each rank resets its peak RSS (/proc/self/clear_refs), builds the
GPT on the meta device and runs the engine's `prepare` (parallelize, then materialize only its shards), and
reports peak RSS growth over the RSS before the build. --legacy also measures, in the same ranks afterwards,
the old path (full fp32 model built on the host, then sharded) for comparison. Target (issue 11): with
zero3 at world 2 and ~400M parameters, growth <= 0.6 x full fp32 parameter bytes on every rank.
Prints one line `SETUP_MEMORY {json}` from rank 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from backend.analytic.params import count_params  # noqa: E402
from backend.engine import mesh as mesh_mod  # noqa: E402
from backend.models.gpt import build_model  # noqa: E402
from backend.runtime.entry import env_ranks  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402
from backend.strategies.base import RankContext, prepare  # noqa: E402

TARGET = 0.6
MODEL = dict(vocab_size=32000, d_model=1024, n_layers=27, n_heads=16, seq_len=128)
"""~406M parameters: 27 blocks of 12·h² + vocab 32000 embedding and head (largest single tensor 131 MB)."""


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def measure(spec: ExperimentSpec, ctx: RankContext, *, meta: bool) -> int:
    """Peak RSS growth (bytes) over build + prepare."""
    gc.collect()
    _reset_peak()
    before = _status_kib("VmRSS")
    model = build_model(spec.model, seed=spec.train.seed, device="meta" if meta else "cpu")
    prep = prepare(ctx, model)
    growth = (_status_kib("VmHWM") - before) * 1024
    del model, prep
    gc.collect()
    return growth


def rank_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    spec = ExperimentSpec(model=MODEL, train={"global_batch": 2, "micro_batch": 1},
                          parallel={"strategy": args.strategy, "world_size": args.world})
    rank, world, local_rank = env_ranks()
    backend, device = mesh_mod.init(spec, rank, world, local_rank)
    ctx = RankContext(spec=spec, rank=rank, world_size=world, local_rank=local_rank, device=device,
                      mesh=mesh_mod.build_mesh(spec, device))
    full_bytes = 4 * count_params(spec.model)
    row = {"rank": rank, "meta_growth_bytes": measure(spec, ctx, meta=True)}
    if args.legacy:
        row["legacy_growth_bytes"] = measure(spec, ctx, meta=False)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        for r in rows:
            r["meta_ratio"] = round(r["meta_growth_bytes"] / full_bytes, 3)
            if "legacy_growth_bytes" in r:
                r["legacy_ratio"] = round(r["legacy_growth_bytes"] / full_bytes, 3)
        worst = max(r["meta_ratio"] for r in rows)
        print("SETUP_MEMORY " + json.dumps({"params": count_params(spec.model), "full_fp32_bytes": full_bytes,
                                            "strategy": args.strategy, "world": world, "per_rank": rows,
                                            "worst_meta_ratio": worst, "target": TARGET, "ok": worst <= TARGET}),
              flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--legacy", action="store_true", help="also measure the old build-everything path")
    ap.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.as_rank:
        rank_main(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
           __file__, "--as-rank", "--world", str(args.world), "--strategy", args.strategy]
    if args.legacy:
        cmd.append("--legacy")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    sys.exit(subprocess.run(cmd, env=env, cwd=ROOT).returncode)


if __name__ == "__main__":
    main()
