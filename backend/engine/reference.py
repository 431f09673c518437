"""The single-process loss reference: same model, seed, data, microbatch loop and optimizer, no parallelism.

It can never break a run: rank 0 runs it after the job's measurements, in a forked process of its own on the
CPU (`run_isolated`; `python -m backend.engine.reference` runs it standalone), so neither the training state
nor a GPU is shared; it is skipped,
with the reason, when the analytic estimate of a one-rank run exceeds the memory budget; and a reference
that fails only leaves a note. Skipping is not a failure: the run simply has no loss-parity check.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from backend.analytic.estimate import estimate
from backend.atomic_io import write_json_atomic
from backend.engine.data import global_batch
from backend.engine.loop import progress
from backend.models.gpt import build_model
from backend.spec import ExperimentSpec
from backend.strategies import float8
from backend.strategies.context import make_optimizer
from backend.strategies.cp_layout import sequence_positions
from backend.strategies.moe_stats import moes
from backend.strategies.scaler import LossScaling
from backend.strategies.step import ExpertUsage, MicrobatchStep, OptimizerTail

BUDGET_ENV = "SHARDLAB_REFERENCE_MAX_BYTES"
"""Overrides the reference's memory budget (bytes); default: half of the host's available memory."""


def reference_losses(spec: ExperimentSpec, *, device: torch.device | str = "cpu",
                     on_step: Callable[[int, int], None] | None = None) -> list[float]:
    """Losses of the warm-up + timed steps (the engine's extra memory-tracked step is excluded on both sides).

    The global batch is split into global_batch / micro_batch chunks of micro_batch rows, each loss scaled
    by 1/chunks before backward (`MicrobatchStep`, the engine's own loop): exactly the average DDP/FSDP
    compute over dp ranks x microbatches.
    """
    device = torch.device(device)
    t = spec.train
    model = float8.convert(spec, build_model(spec.model, seed=t.seed, recompute=t.recompute, device=device,
                                             recompute_ops=t.sac_ops))  # fp8: the same float8 linears and casts
    set_capacity_groups(spec, model)
    opt = make_optimizer(model.parameters(), spec)
    tail = OptimizerTail([model], opt, ExpertUsage([model]), scaling=LossScaling(spec, device, distributed=False))
    step = MicrobatchStep(model, spec, device, tail, use_autocast=True, chunks=t.global_batch // t.micro_batch)
    n_steps = t.warmup_steps + t.steps
    losses: list[float] = []
    for k in range(n_steps):
        x, y = (b.to(device) for b in global_batch(spec, k))
        losses.append(float(step(x, y).loss_sum))
        if on_step:
            on_step(k + 1, n_steps)
    return losses


def set_capacity_groups(spec: ExperimentSpec, model: torch.nn.Module) -> None:
    """The capacity limit applies per rank (models/moe_capacity.py): a reference microbatch is one dp rank's, split
    over cp ranks by sequence position, so each MoE limits each cp rank's positions on their own."""
    p = spec.parallel
    if spec.model.capacity_factor is None or p.cp == 1:
        return
    groups = torch.empty(spec.model.seq_len, dtype=torch.int64, device=next(model.parameters()).device)
    for r in range(p.cp):
        groups[sequence_positions(spec, r)] = r
    for moe in moes([model]):
        moe.capacity_groups = groups


def one_rank_spec(spec: ExperimentSpec) -> ExperimentSpec:
    """The same model and batch on one CPU rank (what the reference runs), for the memory estimate."""
    data = spec.model_dump(mode="json")
    data["parallel"] = {"strategy": "ddp", "world_size": 1}
    data["train"]["microbatches"] = None
    data["runtime"] = {**data["runtime"], "device": "cpu", "backend": "gloo", "nnodes": 1, "node_rank": 0,
                       "rdzv_endpoint": None, "executor": "local"}
    data["framework"] = "torch"  # the reference is single-process torch whatever framework ran the job
    return ExperimentSpec.model_validate(data)


def host_budget_bytes() -> int:
    if os.environ.get(BUDGET_ENV):
        return int(os.environ[BUDGET_ENV])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def skip_reason(spec: ExperimentSpec) -> str | None:
    """Why the reference must not run here (its predicted memory exceeds the budget), or None."""
    est = estimate(one_rank_spec(spec)).per_rank[0]
    need = est.total_bytes + est.optimizer_temp_bytes
    budget = host_budget_bytes()
    if need <= budget:
        return None
    return (f"Loss reference skipped: one CPU process would need about {need / 2**30:.2f} GiB (analytic estimate "
            f"of a 1-rank run) > budget {budget / 2**30:.2f} GiB (half the available host memory, or "
            f"{BUDGET_ENV}); no loss-parity check for this run.")


def run_isolated(spec: ExperimentSpec) -> tuple[list[float], str | None]:
    """(losses, note): the reference in its own CPU process; [] with the reason when skipped or failed.

    The process is forked (it inherits the imported modules: no second interpreter start-up per run) and
    touches neither the process group nor a GPU: it builds its own model on the CPU."""
    reason = skip_reason(spec)
    if reason:
        return [], reason
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec.to_json(), child), daemon=True)
    proc.start()
    child.close()
    out: dict = {}
    if parent.poll(spec.runtime.timeout_s):
        try:
            out = parent.recv()
        except EOFError:
            out = {}
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
    if "losses" not in out:
        return [], (f"Loss reference failed ({out.get('error') or f'exit code {proc.exitcode}'}): no loss-parity "
                    "check for this run. The run itself is unaffected.")
    return out["losses"], None


def _child(spec_json: str, conn) -> None:
    try:
        torch.set_num_threads(1)
        losses = reference_losses(ExperimentSpec.from_json(spec_json), on_step=_progress)
        conn.send({"losses": losses})
    except BaseException as e:  # noqa: BLE001 - reported to the parent as a note, never raised into the run
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def _progress(step: int, of: int) -> None:
    progress(None, step, of, "reference")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.engine.reference")
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = ExperimentSpec.from_json(args.spec.read_text())
    write_json_atomic(args.out, {"losses": reference_losses(spec, on_step=_progress)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
