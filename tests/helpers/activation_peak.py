"""The engine's activation peak of one ddp rank, measured in this process (no process group): what estimate()'s
activations are checked against (tests/unit/test_activation_model.py, test_recompute_policies.py)."""

from __future__ import annotations

import torch

from backend.models.gpt import build_model, loss_fn


def engine_step_activation_peak(spec) -> int:
    """One rank of the engine's microbatch step (backend/strategies/step.py) under pure ddp without the process group:
    microbatches under strategies.base.autocast, `logits` bound in the loop through backward, loss / n; the engine's own
    tracker (backend.bench.memory.CategoryMemTracker) read at its activation peak, as the engine reports it."""
    from backend.bench.memory import CategoryMemTracker, breakdown
    from backend.strategies.base import autocast

    m, t = spec.model, spec.train
    model = build_model(m, seed=0, recompute=t.recompute)
    opt = torch.optim.AdamW(model.parameters())
    mb, n = t.micro_batch, t.microbatches
    x = torch.randint(0, m.vocab_size, (mb * n, m.seq_len))
    y = torch.randint(0, m.vocab_size, (mb * n, m.seq_len))
    tracker = CategoryMemTracker()
    tracker.track_external(model, opt, x, y)
    cpu = torch.device("cpu")
    with tracker:
        for i in range(n):
            with autocast(spec, cpu):
                logits = model(x[i * mb:(i + 1) * mb])  # (mb, T, V)
            loss = loss_fn(logits, y[i * mb:(i + 1) * mb]) / n
            loss.backward()
    return breakdown(tracker, cpu)["categories"]["activations_bytes"]
