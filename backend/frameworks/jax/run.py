"""A JAX/XLA GSPMD run: `python -m backend.frameworks.jax.run --spec S.json --out DIR` (one process).

N = world_size virtual CPU devices (`--xla_force_host_platform_device_count=N`, set before jax is imported).
Writes DIR/ranks.json in the engine's format with one entry per device ("rank" = device index on the
(dp, tp) mesh), plus "framework": "jax" and the XLA facts; on failure DIR/rank-0.error.json.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from backend.atomic_io import write_json_atomic
from backend.engine.rank import PAYLOAD_VERSION
from backend.spec import ExperimentSpec


def set_device_count(n: int) -> None:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def microbatched(spec: ExperimentSpec, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The torch engine's global batch (backend/engine/data.py) as (microbatches, dp * micro_batch, T) int32:
    microbatch i holds every dp rank's i-th microbatch, in dp-rank order (backend.strategies.base.dp_slice)."""
    from backend.engine.data import global_batch

    t, p = spec.train, spec.parallel
    out = []
    for b in global_batch(spec, step):
        a = b.numpy().astype(np.int32).reshape(p.dp, t.microbatches, t.micro_batch, -1)  # (dp, n, mb, T)
        out.append(np.ascontiguousarray(a.transpose(1, 0, 2, 3).reshape(t.microbatches, p.dp * t.micro_batch, -1)))
    return out[0], out[1]


def run(spec: ExperimentSpec, out: Path) -> None:
    from backend.frameworks.jax.trainer import Trainer
    from backend.engine.loop import progress
    from backend.engine.reference import reference_losses

    t = spec.train
    tr = Trainer(spec)
    losses: list[float] = []
    step_s: list[float] = []
    for i in range(t.warmup_steps + t.steps):
        x, y = microbatched(spec, i)
        t0 = time.perf_counter()
        loss = tr.step(x, y)  # blocks until the step's results are ready
        if i >= t.warmup_steps:
            step_s.append(time.perf_counter() - t0)
        losses.append(loss)
        progress(None, i + 1, t.warmup_steps + t.steps, "warmup" if i < t.warmup_steps else "timed")
    ref = reference_losses(spec, on_step=lambda k, n: progress(None, k, n, "reference"))
    facts = tr.facts()
    ranks = [tr.device_payload(d, losses, step_s, facts) for d in range(spec.parallel.world_size)]
    write_json_atomic(out / "ranks.json", {"version": PAYLOAD_VERSION, "world_size": spec.parallel.world_size,
                                           "backend": "xla-cpu", "framework": "jax", "xla": facts,
                                           "ranks": ranks, "loss_reference": ref})


def main(argv: list[str] | None = None) -> int:
    import argparse

    from backend.frameworks.entry import write_error

    ap = argparse.ArgumentParser(prog="python -m backend.frameworks.jax.run")
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        spec = ExperimentSpec.from_json(args.spec.read_text())
        set_device_count(spec.parallel.world_size)
        run(spec, args.out)
    except BaseException as e:  # noqa: BLE001 - the launcher reads the error file
        if isinstance(e, SystemExit) and not e.code:
            raise
        write_error(args.out, 0, e)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
