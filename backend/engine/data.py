"""Synthetic, learnable token data: identical on every rank and in the single-process reference."""

from __future__ import annotations

import torch

from backend.spec import ExperimentSpec


def global_batch(spec: ExperimentSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (global_batch, seq_len) int64, a function of (seed, step) only.

    Sequences follow x[t+1] = (7 * x[t] + 3) mod V from a random start, so the loss really falls; computed in closed
    form, x[t] = (a[t] * x[0] + b[t]) mod V with a[t] = 7^t and b[t] = 7 b[t-1] + 3 (mod V), one tensor op instead
    of one per position (a 128k context took seconds), the same integers (start * a < V^2 fits int64).
    """
    m, t = spec.model, spec.train
    g = torch.Generator().manual_seed(t.seed * 1_000_003 + step)
    start = torch.randint(0, m.vocab_size, (t.global_batch, 1), generator=g, device="cpu")  # moved by the engine
    tokens = (start * _powers(m.seq_len, m.vocab_size) + _offsets(m.seq_len, m.vocab_size)) % m.vocab_size  # (B, T+1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _powers(seq_len: int, vocab: int) -> torch.Tensor:
    out, a = [], 1
    for _ in range(seq_len + 1):
        out.append(a)
        a = a * 7 % vocab
    return torch.tensor(out, dtype=torch.int64, device="cpu")  # as `start`: moved by the engine


def _offsets(seq_len: int, vocab: int) -> torch.Tensor:
    out, b = [], 0
    for _ in range(seq_len + 1):
        out.append(b)
        b = (7 * b + 3) % vocab
    return torch.tensor(out, dtype=torch.int64, device="cpu")  # as `start`: moved by the engine
