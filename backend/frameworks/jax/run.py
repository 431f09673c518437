"""A JAX/XLA GSPMD run: `python -m backend.frameworks.jax.run --spec S.json --out DIR` (one process).

N = world_size virtual CPU devices (`--xla_force_host_platform_device_count=N`, set before jax is imported).
Writes DIR/ranks.json in the engine's format (backend/runtime/protocol.py) with one entry per device ("rank" =
device index on the (dp, tp) mesh), plus "framework": "jax" and the XLA facts; on failure DIR/rank-0.error.json.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from backend.runtime.entry import exit_now, rank_main
from backend.runtime.protocol import PAYLOAD_VERSION, RankPayload, RanksFile, write_ranks
from backend.spec import ExperimentSpec


def set_device_count(n: int) -> None:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def microbatched(spec: ExperimentSpec, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The torch engine's global batch (backend/engine/data.py) as (microbatches, dp * micro_batch, T) int32:
    microbatch i holds every dp rank's i-th microbatch, in dp-rank order (backend.strategies.base.dp_slice)."""
    from backend.engine import global_batch

    t, p = spec.train, spec.parallel
    out = []
    for b in global_batch(spec, step):
        a = b.numpy().astype(np.int32).reshape(p.dp, t.microbatches, t.micro_batch, -1)  # (dp, n, mb, T)
        out.append(np.ascontiguousarray(a.transpose(1, 0, 2, 3).reshape(t.microbatches, p.dp * t.micro_batch, -1)))
    return out[0], out[1]


def run(spec: ExperimentSpec, out: Path) -> None:
    from backend.engine import progress, reference_losses
    from backend.frameworks.jax.trainer import Trainer

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
    ranks = [RankPayload(**tr.device_payload(d, losses, step_s, facts)) for d in range(spec.parallel.world_size)]
    write_ranks(out, RanksFile(version=PAYLOAD_VERSION, world_size=spec.parallel.world_size, backend="xla-cpu",
                               framework="jax", xla=facts, ranks=ranks, loss_reference=ref))


def run_rank(spec: ExperimentSpec, rank: int, world: int, local_rank: int, out: Path) -> None:
    """The whole world in this one process: N virtual devices, set before jax is first imported."""
    set_device_count(spec.parallel.world_size)
    run(spec, out)


def main(argv: list[str] | None = None) -> int:
    return rank_main(run_rank, "python -m backend.frameworks.jax.run", argv, one_process=True)


if __name__ == "__main__":
    exit_now(main())
