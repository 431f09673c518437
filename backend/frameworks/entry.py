"""The `--spec S --out DIR` entry every in-rank framework module shares (same files as backend/engine/rank.py):
a failing rank writes DIR/rank-<r>.error.json with its traceback and exits 1, so the launcher classifies it."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from backend.atomic_io import write_json_atomic
from backend.engine import mesh as mesh_mod
from backend.engine.rank import is_oom
from backend.launch.stacks import enable_stack_dump
from backend.spec import ExperimentSpec

RunRank = Callable[[ExperimentSpec, int, int, int, Path], None]


def write_error(out: Path, rank: int, e: BaseException) -> None:
    """DIR/rank-<r>.error.json as backend/engine/rank.py writes it, and one line on stderr."""
    write_json_atomic(out / f"rank-{rank}.error.json", {
        "rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
        "kind": "oom" if is_oom(e) else "error", "time_unix": time.time()})
    print(f"rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def rank_main(run: RunRank, prog: str, argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    rank, world, local_rank = mesh_mod.env_ranks()
    args.out.mkdir(parents=True, exist_ok=True)
    enable_stack_dump(args.out, rank)
    try:
        run(ExperimentSpec.from_json(args.spec.read_text()), rank, world, local_rank, args.out)
    except BaseException as e:  # noqa: BLE001 - every failure must leave its error file for the launcher
        if isinstance(e, SystemExit) and not e.code:
            raise
        write_error(args.out, rank, e)
        return 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may already be gone
                pass
    return 0
