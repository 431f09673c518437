"""One rank of hw_probe's 2-process gloo measurement (backend/bench/hw_probe.gloo_alpha_beta), a process of its own:

  python -m backend.bench.gloo_probe_rank RANK INIT_FILE RESULT_JSON

It joins the group through a file rendezvous (no port to race for), times every collective by size and one DTensor
operator, and rank 0 writes {"collectives": {name: [[bytes, s], ...]}, "dtensor_op_s": s} to RESULT_JSON. A child
started with `python -m` runs nothing of its parent's `__main__` (multiprocessing's spawn re-ran the parent's main
script: a Streamlit page, when the probe ran in a process that had run one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from backend.atomic_io import write_atomic
from backend.bench.hw_probe import COLLECTIVES, collective_times, dtensor_op_s


def main(argv: list[str] | None = None) -> int:
    rank, init_file, result = (argv or sys.argv[1:])[:3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=2)
    times = {c: collective_times(c) for c in COLLECTIVES}
    op_s = dtensor_op_s()
    if int(rank) == 0:
        write_atomic(Path(result), json.dumps({"collectives": times, "dtensor_op_s": op_s}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
