"""3D parallelism PP×DP×TP = 2×2×2 at world 8 (too slow for CI on 2 cores), run through the real engine,
plus optional smaller mixes. Prints loss parity, per-rank measured vs predicted memory and comm, bubble.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mp_3d.py [--flavour fsdp|ddp|zero2] [--sp] [--schedule 1f1b]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.launch.launcher import run_experiment  # noqa: E402
from backend.result import MEMORY_CATEGORIES, RunResult  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402


def spec_3d(flavour: str, sp: bool, schedule: str, layers: int) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "name": f"3d-{flavour}{'-sp' if sp else ''}-{schedule}",
        "model": {"vocab_size": 128, "d_model": 64, "n_layers": layers, "n_heads": 4, "seq_len": 32},
        "train": {"global_batch": 8, "micro_batch": 2, "steps": 2, "warmup_steps": 1},
        "parallel": {"strategy": flavour, "world_size": 8, "pp": 2, "tp": 2, "sequence_parallel": sp,
                     "pp_schedule": schedule,
                     "virtual_stages": 2 if schedule in ("interleaved_1f1b", "zero_bubble", "zbv") else 1},
        "runtime": {"timeout_s": 900},
    })


def report(r: RunResult) -> int:
    print(f"{r.spec.name}: status {r.status} {r.error or ''}")
    if r.status != "ok":
        print(r.traceback or r.log_tail or "")
        return 1
    print(f"loss {r.loss} reference {r.loss_reference} max|diff| {r.loss_max_abs_diff:.2e}")
    print(f"bubble measured {r.bubble_measured} predicted {r.bubble_predicted}; step median {r.step_s_median:.3f} s")
    for rr in r.per_rank:
        mem = " ".join(f"{c.split('_')[0]} {getattr(rr.measured, c)}/{getattr(rr.predicted, c)}"
                       f" ({(rr.error_pct.get(c) or 0):+.1f}%)" for c in MEMORY_CATEGORIES)
        comm = " ".join(f"{k} {rr.comm[k].bytes:.0f}/{rr.comm_predicted.get(k, 0):.0f}"
                        for k in sorted(set(rr.comm) | set(rr.comm_predicted)) if k in rr.comm)
        print(f"rank {rr.rank} {rr.coords}: {mem} | comm measured/predicted {comm}")
    for n in r.notes:
        print("note:", n)
    return 0 if r.loss_max_abs_diff is not None and r.loss_max_abs_diff <= 1e-4 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavour", default="fsdp", choices=["fsdp", "zero3", "zero2", "ddp"])
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    spec = spec_3d(args.flavour, args.sp, args.schedule, args.layers)
    with tempfile.TemporaryDirectory(prefix="mp3d-") as d:
        return report(run_experiment(spec, workdir=Path(d)))


if __name__ == "__main__":
    raise SystemExit(main())
