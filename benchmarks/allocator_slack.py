"""The caching allocator's slack (reserved - allocated) against the 0.13 of the fullest moment that
analytic/device.RuntimeOverhead.fragmentation_frac assumes (issue 32): per row, what the published or measured
peak reserved implies, reserved / predicted fullest - 1, next to 0.13. Printed, never fitted: the constant stays
what the H200 runs set it to.

Rows:
- every published row with a peak reserved (backend/analytic/steptime/published_gpu.json: torchtitan's Llama 3.1
  benchmarks of 2024-12 at 9dec370 on H100 96 GB and of 2025-06 on H200, "Memory(GiB)" = the training log's
  `memory:` = torch.cuda max_memory_reserved, the maximum over GPUs), predicted through the row's own spec with its
  stack and settings (compile, the compiled loss, float8, loss parallel, async TP), as benchmarks/published_gpu.py
  predicts it. Multi-rank FSDP2: the all-gather and reduce-scatter buffers churn the pool.
- ShardLab's own H200 runs (benchmarks/results/gpu/2026-11-26-h200-run{1,2}: world 1, reserved and allocated
  measured), where the constant came from.
Multi-rank FSDP traces (`python -m backend trace`) run on fake tensors: they give allocated bytes, not the allocator's
reserve, so they cannot test the slack; the rows above are the multi-rank evidence.

    .venv/bin/python benchmarks/allocator_slack.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.analytic.device import RuntimeOverhead  # noqa: E402
from backend.analytic.estimate import estimate  # noqa: E402
from backend.analytic.steptime.published_gpu import published_rows  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402

GIB = 2**30
GPU_RESULTS = Path(__file__).resolve().parent / "results" / "gpu"


def fullest(spec: ExperimentSpec) -> tuple[int, str]:
    worst = estimate(spec, device="cuda").worst()
    return worst.fullest_bytes(), worst.fullest_moment()


def rows() -> list[dict[str, Any]]:
    out, frac = [], RuntimeOverhead().fragmentation_frac
    for row in published_rows():
        if not row.memory_gib:
            continue
        need, moment = fullest(ExperimentSpec.for_prediction(row.spec | {"runtime": {"device": "cuda"}}))
        out.append({"source": f"published {row.hardware}", "row": row.id, "predicted_fullest_gib": need / GIB,
                    "moment": moment, "reserved_gib": row.memory_gib,
                    "implied_slack": row.memory_gib * GIB / need - 1.0, "assumed_slack": frac,
                    "flags": str(row.spec["train"].get("stack", "shardlab"))})
    for run_dir in sorted(GPU_RESULTS.glob("2026-11-26-h200-run*")):
        report = json.loads((run_dir / "report.json").read_text())
        for run in report["runs"]:
            if run.get("status") != "ok":
                continue
            rank = run["per_rank"][0]
            spec = ExperimentSpec.model_validate(run["spec"])
            need, moment = fullest(spec)
            reserved = rank["cuda_max_reserved_bytes"]
            out.append({"source": f"ShardLab {run_dir.name}", "row": f"{run['gpu_check']['run']} (world 1)",
                        "predicted_fullest_gib": need / GIB, "moment": moment, "reserved_gib": reserved / GIB,
                        "allocated_gib": rank["cuda_max_allocated_bytes"] / GIB,
                        "implied_slack": reserved / need - 1.0, "assumed_slack": frac, "flags": ""})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    table = rows()
    print(f"{'source':<32} {'row':<52} {'fullest GiB':>11} {'moment':<15} {'reserved GiB':>12} {'implied':>8} "
          f"{'assumed':>7} flags")
    for r in table:
        print(f"{r['source']:<32} {r['row']:<52} {r['predicted_fullest_gib']:>11.2f} {r['moment']:<15} "
              f"{r['reserved_gib']:>12.2f} {r['implied_slack']:>+8.1%} {r['assumed_slack']:>7.0%} {r['flags']}")
    print("published rows: backend/analytic/steptime/published_gpu.json; implied = reserved / predicted fullest - 1 "
          "(the allocator's reserve over what the tensors need, plus whatever the prediction misses); the constant is "
          "not fitted to these rows")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
