"""The farm's rank program (tests/helpers/farm.py): `python -m tests.helpers.farm_rank PLAN.json`, under torchrun or
(the trace jobs) as one plain process.

PLAN.json: {"torchrun": bool, "jobs": [{"key", "kind", "payload", "timeout_s", "dir"}]}. One gloo process group for
the launch; each job runs its function (JOBS) with stdout and stderr in DIR/rank-<r>.log, then every rank meets at a
barrier and rank 0 writes DIR/outcome.json {"status": "ok", "value", "rank0_cpu_s", "wall_s"} (rank 0's CPU seconds for
the job, its own and its reaped children's: where the suite's farm time goes). A job that raises on a rank writes that
rank's error file (backend/runtime/protocol.py, as every rank program does) and ends the process with exit code 1: its
peers fail at their next collective, torchrun ends the launch, and the driver launches the jobs after it again.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

JOBS = {
    "engine": "tests.helpers.farm_rank:engine",
    "jax": "tests.helpers.farm_rank:engine",
    "parity": "tests.helpers.mp_harness:run_job",
    "fp16_inject": "tests.helpers.fp16_inject:run_job",
    "ring_attention": "tests.helpers.cp_ring_check:run_job",
    "tp_saved_tensors": "tests.helpers.tp_saved_tensors:run_job",
    "engine_measure": "tests.helpers.engine_measure:run_job",
    "trace": "tests.helpers.farm_rank:trace",
    "selftest": "tests.helpers.farm_rank:selftest",
}
"""kind -> "module:function(payload: dict, out: Path) -> JSON value" (rank 0's value is the job's)."""


def engine(payload: dict[str, Any], out: Path) -> None:
    """The spec's rank program as the launcher picks it (backend/launch/torchrun.rank_module_for: the engine's
    backend.engine.rank, or DeepSpeed's or JAX's), its `run_rank` called as its `python -m` main calls it; rank 0
    writes out/ranks.json."""
    from backend.launch.torchrun import rank_module_for
    from backend.runtime.entry import env_ranks
    from backend.runtime.protocol import enable_progress_marks, mark_finished
    from backend.spec import ExperimentSpec

    spec = ExperimentSpec.model_validate(payload)
    rank, world, local_rank = env_ranks()  # JAX: rank 0 of 1, its world in virtual devices
    enable_progress_marks(out, rank)
    importlib.import_module(rank_module_for(spec)).run_rank(spec, rank, world, local_rank, out)
    mark_finished()


def trace(payload: dict[str, Any], out: Path) -> dict[str, Any]:
    """backend.trace.trace_spec with each rank traced in this process (backend.trace.rank.main, then its fake
    process group left), not one process per rank."""
    from backend.spec import ExperimentSpec
    from backend.trace.trace_spec import trace_spec

    return trace_spec(ExperimentSpec.from_json(payload["spec"]), ranks=payload["ranks"], rank_runner=_trace_rank)


def _trace_rank(spec_path: Path, rank: int, out: Path, timeout_s: float, device: str) -> dict[str, Any]:
    from backend.trace.rank import main
    from backend.trace.torch_private import leave_fake_pg

    try:
        main(["--spec", str(spec_path), "--rank", str(rank), "--out", str(out), "--device", device])
    finally:
        leave_fake_pg()  # the next spec is traced in this process
    return json.loads(out.read_text())


def selftest(payload: dict[str, Any], out: Path) -> int:
    """The farm's own test (tests/multiprocess/test_farm.py): an all-reduce, or a raise / hang on one rank."""
    import time

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if payload.get("raise_on") == rank:
        raise RuntimeError(f"selftest raised on rank {rank}")
    if payload.get("hang_on") == rank:
        time.sleep(3600)
    x = torch.ones(1) * (rank + 1)
    dist.all_reduce(x)
    return int(x.item())


def _function(kind: str):
    module, name = JOBS[kind].split(":")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors 1 and 2: children and C++ too) into `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def _cpu_s() -> float:
    """This process's CPU seconds so far, user and system, with its reaped children's (a job's reference fork)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from backend.atomic_io import write_json_atomic
    from backend.runtime.entry import env_ranks, is_oom
    from backend.runtime.protocol import RankError, enable_stack_dump, write_rank_error

    plan = json.loads(Path(argv[0]).read_text())
    rank = env_ranks()[0]
    torch.set_num_threads(1)
    if plan["torchrun"]:
        longest = max(j["timeout_s"] for j in plan["jobs"])
        dist.init_process_group("gloo", timeout=timedelta(seconds=longest + 60))
    pristine_linear = torch.nn.functional.linear
    for job in plan["jobs"]:
        # DeepSpeed's ZeRO-3 swaps F.linear for its own autograd Function for the rest of the process ("This will
        # persist unless manually reset", deepspeed/runtime/zero/partition_parameters.py _enable_mem_efficient_linear).
        # A rank program runs one job; here the next job's linears would run DeepSpeed's, which saves other tensors
        # (the world-2 grid's op-SAC layouts measured 3.5-4.8% above their prediction after a ds zero3 job).
        torch.nn.functional.linear = pristine_linear
        out = Path(job["dir"])
        out.mkdir(parents=True, exist_ok=True)
        enable_stack_dump(out, rank)  # the driver asks for the stacks when the job runs past its timeout
        cpu_s, started = _cpu_s(), time.monotonic()
        with _output_to(out / f"rank-{rank}.log"):
            try:
                value = _function(job["kind"])(json.loads(job["payload"]), out)
                if plan["torchrun"]:
                    dist.barrier()  # every rank finished this job
            except BaseException as e:  # noqa: BLE001 - every failure is this job's, with its rank's record
                write_rank_error(out, RankError.from_exception(rank, e, oom=is_oom(e)))
                traceback.print_exc()
                return 1
        if rank == 0:
            write_json_atomic(out / "outcome.json", {"status": "ok", "value": value, "rank0_cpu_s": _cpu_s() - cpu_s,
                                                     "wall_s": time.monotonic() - started})
        # not the engine's collection again (run_rank's precedes its reference fork): what died as the job returned,
        # ~100 cyclic objects per engine job (hook closures, autograd nodes), collected rather than frozen for good
        gc.collect()
        # what outlives a job (modules, caches) is never scanned again: the next job's collections are short
        gc.freeze()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from backend.runtime.entry import exit_now

    exit_now(main(sys.argv[1:]))  # no interpreter teardown after gloo (backend/engine/rank.py says why)
