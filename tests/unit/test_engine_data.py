"""The synthetic batch (backend/engine/data.py) follows x[t+1] = (7 x[t] + 3) mod V from a seeded start, computed in
closed form: the same integers as the recurrence, for small and large vocabularies (x0 * 7^t mod V stays in int64)."""

import pytest
import torch

from backend.engine.data import global_batch
from backend.spec import ExperimentSpec


@pytest.mark.parametrize("vocab, seq", [(256, 64), (128256, 1000), (10_000_000, 300), (2, 9)])
def test_closed_form_equals_the_recurrence(vocab, seq):
    spec = ExperimentSpec.model_validate({"model": {"vocab_size": vocab, "seq_len": seq},
                                          "train": {"global_batch": 3, "micro_batch": 1, "seed": 5}})
    inputs, targets = global_batch(spec, 7)
    g = torch.Generator().manual_seed(5 * 1_000_003 + 7)
    x = [torch.randint(0, vocab, (3, 1), generator=g)]
    for _ in range(seq):
        x.append((x[-1] * 7 + 3) % vocab)
    tokens = torch.cat(x, dim=1)
    assert torch.equal(inputs, tokens[:, :-1]) and torch.equal(targets, tokens[:, 1:])
    assert inputs.is_contiguous() and targets.is_contiguous() and inputs.dtype == torch.int64
