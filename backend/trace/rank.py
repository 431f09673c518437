"""Trace one rank at full size: `python -m backend.trace.rank --spec S.json --rank R --out R.json`.

The rank joins the fake process group as rank R of the spec's world, builds the model on fake tensors,
runs the engine's own set-up (`setup` = `strategies.base.prepare` = `parallelize`) and two train steps: the first
creates the optimizer state (AdamW allocates it lazily in step), the second runs inside the same
tracker and is read with the same breakdown as the engine's memory-tracked step (engine/loop.py
`_memory_step`, bench/memory.py). Nothing is allocated: the bytes are the tracker's account of the fake
tensors' storages. One process per rank keeps RSS bounded and the fake PG's rank fixed.

Output JSON: {"rank", "status": "ok"|"failed"|"unsupported", "error", "traceback", "coords",
"traced": {params_bytes, grads_bytes, optimizer_bytes, activations_bytes, other_bytes, peak_bytes},
"memory": bench/memory.breakdown(...), "seconds": {"setup", "step0", "step1", "total"},
"max_rss_bytes", "notes": [...]}.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backend.atomic_io import write_json_atomic
from backend.spec import ExperimentSpec

TRACED_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes")


def setup(ctx: Any, model: nn.Module) -> Any:
    """The engine's own set-up (strategies.base.prepare, i.e. strategies/parallelize.parallelize), the trace's only call
    into the strategies."""
    from backend.strategies.base import prepare

    return prepare(ctx, model)


def hidden_meta_fn(spec: ExperimentSpec):
    """A pipeline stage boundary: the fp32 residual stream (micro_batch, T, C): T = this cp rank's seq_len / cp,
    over tp under sequence parallel."""
    m, p = spec.model, spec.parallel
    seq = m.seq_len // p.cp
    seq = seq // p.tp if p.sequence_parallel and p.tp > 1 else seq
    return lambda: torch.empty(spec.train.micro_batch, seq, m.d_model, dtype=torch.float32, requires_grad=True)


def unsupported_reason(e: BaseException) -> str | None:
    """The torch limitation behind an exception, or None when it is an ordinary failure."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    from backend.trace.torch_private import DataDependentShape

    if isinstance(e, DataDependentShape):
        return str(e)
    if isinstance(e, DynamicOutputShapeException):
        return f"torch FakeTensorMode cannot run {e.func}: its output shape depends on data values"
    if isinstance(e, DataDependentOutputException):
        return f"torch FakeTensorMode cannot run {e.func}: its output depends on data values"
    if "Couldn't swap" in str(e) and "weakref" in str(e.__cause__ or ""):
        return (f"torch nn.Module._apply swaps fake-tensor parameters with torch.utils.swap_tensors, which refuses "
                f"a parameter that has a weakref attached ({e}: {e.__cause__}); on fake tensors the meta-device "
                "materialize step cannot run for this layout")
    if "its data is not allocated yet" in str(e):
        return (f"torch C++ code read a fake tensor's storage, which fake tensors do not have "
                f"({_torch_frame(e)}); e.g. DistributedDataParallel's C++ Reducer")
    return None


def _torch_frame(e: BaseException) -> str:
    """The innermost Python frame of the traceback (where the C++ call was made)."""
    tb = traceback.extract_tb(e.__traceback__)
    return f"{Path(tb[-1].filename).name}:{tb[-1].lineno} {tb[-1].name}" if tb else "unknown frame"


def trace_rank(spec: ExperimentSpec, rank: int, device_type: str = "cpu") -> dict[str, Any]:
    """Trace `rank` on fake tensors of `device_type` ("cuda": fake CUDA tensors, which needs a CUDA build of torch;
    the tracker then rounds storages as on a GPU)."""
    from backend.bench import memory
    from backend.engine import build_mesh, global_batch, has_split_backward
    from backend.models.gpt import build_model
    from backend.strategies.base import RankContext
    from backend.strategies.context import local_batch
    from backend.trace import ddp_standin, torch_private

    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    world = spec.parallel.world_size
    torch.set_num_threads(1)
    torch_private.init_fake_pg(rank, world)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    # The mesh's rank tensor is real: build it outside the fake mode (torchtitan's estimator does the same).
    ctx = RankContext(spec=spec, rank=rank, world_size=world, local_rank=0, device=device,
                      mesh=build_mesh(spec, device))
    real = [local_batch(ctx, *global_batch(spec, i)) for i in range(2)]  # this dp rank's (B/dp, T) int64 rows
    with ddp_standin.standing_in(), torch_private.fake_world(hidden_meta_fn(spec)) as mode:
        model = build_model(spec.model, seed=spec.train.seed, recompute=spec.train.recompute, device="meta")
        prep = setup(ctx, model)
        seconds["setup"] = time.perf_counter() - t0
        batches = [tuple(torch_private.to_fake(mode, x) for x in b) for b in real]
        t = time.perf_counter()
        prep.train_step(*batches[0])
        seconds["step0"] = time.perf_counter() - t
        t = time.perf_counter()
        tracker = memory.make_tracker(prep.modules, prep.optimizer, fsdp=prep.fsdp, hookless=has_split_backward(ctx))
        memory.track_inputs(tracker, batches[1])
        memory.track_resident(tracker, prep.resident())
        with memory.tracking(tracker, prep.modules):
            prep.train_step(*batches[1])
        mem = memory.breakdown(tracker, device, ctx.placement.states)
        seconds["step1"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    seconds["cpu"] = ru.ru_utime + ru.ru_stime  # single-threaded: the wall time on an idle core
    traced = {k: int(mem["categories"][k]) for k in TRACED_KEYS} | {"peak_bytes": int(mem["peak_bytes"])}
    return {"rank": rank, "status": "ok", "error": None, "coords": ctx.coords(), "traced": traced,
            "memory": _jsonable(mem), "seconds": seconds,
            "strategy_module": spec.parallel.strategy_module, "notes": list(prep.notes) + _standin_notes(prep.modules)}


def _standin_notes(modules: list[nn.Module]) -> list[str]:
    from backend.trace import ddp_standin

    return [ddp_standin.NOTE] if any(isinstance(m, ddp_standin.BucketedDDP) for m in modules) else []


def _jsonable(mem: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(mem, default=str))


def max_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.trace.rank")
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--rank", required=True, type=int)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device of the fake tensors")
    args = ap.parse_args(argv)
    spec = ExperimentSpec.from_json(args.spec.read_text())
    try:
        out = trace_rank(spec, args.rank, args.device)
    except Exception as e:  # noqa: BLE001 - every failure is reported with its rank, kind and traceback
        reason = unsupported_reason(e)
        out = {"rank": args.rank, "status": "unsupported" if reason else "failed",
               "error": reason or f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    out["max_rss_bytes"] = max_rss_bytes()
    write_json_atomic(args.out, out)
    return 0 if out["status"] == "ok" else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    import os

    os._exit(code)  # the fake PG and fake tensors need no teardown
