"""Synthetic, learnable token data: identical on every rank and in the single-process reference."""

from __future__ import annotations

import torch

from backend.spec import ExperimentSpec


def global_batch(spec: ExperimentSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (global_batch, seq_len) int64, a function of (seed, step) only.

    Sequences follow x[t+1] = (7 * x[t] + 3) mod V from a random start, so the loss really falls.
    """
    m, t = spec.model, spec.train
    g = torch.Generator().manual_seed(t.seed * 1_000_003 + step)
    start = torch.randint(0, m.vocab_size, (t.global_batch, 1), generator=g, device="cpu")  # moved by the engine
    seq = [start]
    for _ in range(m.seq_len):
        seq.append((seq[-1] * 7 + 3) % m.vocab_size)
    tokens = torch.cat(seq, dim=1)  # (B, T+1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
