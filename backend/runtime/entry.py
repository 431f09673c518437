"""The one `main` of every rank program (`python -m backend.engine.rank`, `backend.frameworks.deepspeed.rank`,
`backend.frameworks.jax.run`): `--spec S.json --out DIR`, the rank from torchrun's environment, a stack dump and
a progress file registered for the launcher's timeout diagnosis, and on any failure DIR/rank-<r>.error.json and exit
code 1, so the launcher can always say which rank failed and why (protocol.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path

from backend.runtime.protocol import (
    RankError,
    enable_progress_marks,
    enable_stack_dump,
    mark_finished,
    write_rank_error,
)
from backend.spec import ExperimentSpec

RunRank = Callable[[ExperimentSpec, int, int, int, Path], None]
"""run(spec, rank, world_size, local_rank, out_dir): the rank's whole job; raises on failure."""


def env_ranks() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as torchrun sets them (1 process when unset)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def is_oom(e: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a torch OOM needs torch loaded; a program without it raises none
    candidates = (MemoryError, getattr(torch, "OutOfMemoryError", None),
                  getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None))
    oom_types = tuple(t for t in candidates if isinstance(t, type))
    return isinstance(e, oom_types) or "out of memory" in str(e).lower()


def rank_main(run: RunRank, prog: str, argv: list[str] | None = None, *, one_process: bool = False) -> int:
    """Parse --spec/--out, run, and return the exit code. one_process: the program runs the whole world in
    this process (JAX's virtual devices): it is rank 0 of 1 whatever the environment says."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    rank, world, local_rank = (0, 1, 0) if one_process else env_ranks()
    args.out.mkdir(parents=True, exist_ok=True)
    enable_stack_dump(args.out, rank)  # the launcher asks for the stacks when the job times out
    enable_progress_marks(args.out, rank)  # and reads how far each rank got
    gc.freeze()  # the imported modules are never scanned by a collection: a full one inside the run stays short
    try:
        run(ExperimentSpec.from_json(args.spec.read_text()), rank, world, local_rank, args.out)
        mark_finished()
    except BaseException as e:  # noqa: BLE001 - every failure must leave its error file for the launcher
        if isinstance(e, SystemExit) and not e.code:
            raise
        write_rank_error(args.out, RankError.from_exception(rank, e, oom=is_oom(e)))
        print(f"rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        _leave_process_group()
    return 0


def _leave_process_group() -> None:
    if "torch.distributed" not in sys.modules:  # never joined one (JAX), and importing torch costs seconds
        return
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may already be gone
            pass


def exit_now(code: int) -> None:
    """End the process once everything is written and the process group is gone: skip interpreter teardown
    (seconds under load, where gloo's threads may still release tensors; DeepSpeed processes can SIGABRT in it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
