"""The single-process reference: same model, seed, data, microbatch accumulation and optimizer, no parallelism."""

from __future__ import annotations

from typing import Callable

import torch

from backend.engine.data import global_batch
from backend.launch.faults import maybe_inject
from backend.models.gpt import build_model, loss_fn
from backend.spec import ExperimentSpec
from backend.strategies.base import autocast, make_optimizer


def reference_losses(spec: ExperimentSpec, *, device: torch.device | str = "cpu", rank: int = 0,
                     on_step: Callable[[int, int], None] | None = None) -> list[float]:
    """Losses of the warm-up + timed steps (the engine's extra memory-tracked step is excluded on both sides).

    The global batch is split into global_batch / micro_batch chunks of micro_batch rows, each loss scaled
    by 1/chunks before backward: exactly the average DDP/FSDP compute over dp ranks x microbatches.
    """
    device = torch.device(device)
    t = spec.train
    model = build_model(spec.model, seed=t.seed, recompute=t.recompute, device=device)
    opt = make_optimizer(model.parameters(), spec)
    chunks, mb = t.global_batch // t.micro_batch, t.micro_batch
    n_steps = t.warmup_steps + t.steps
    losses: list[float] = []
    for step in range(n_steps):
        maybe_inject(rank, step)
        x, y = (b.to(device) for b in global_batch(spec, step))
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for i in range(chunks):
            with autocast(spec, device):
                logits = model(x[i * mb:(i + 1) * mb])  # (mb, T, V)
            loss = loss_fn(logits, y[i * mb:(i + 1) * mb]) / chunks
            loss.backward()
            total += loss.detach()
        opt.step()
        losses.append(float(total.item()))
        if on_step:
            on_step(step + 1, n_steps)
    return losses
