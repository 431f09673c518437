"""Issue 32: two terms of a pipelined backward's fullest moment, read tensor by tensor off the traced peak of the 7B
zero3 x tp8 x pp4 1F1B layout (benchmarks/fullest_moment.py, "3d"), pinned here on a small spec of the same kind.

- layers:K: the middle stages peaked in their second block (layers:2's lowest checkpoint), re-run while the plain block
  below it still held its saved tensors; the model's candidate was the stage's first block, 2.8% / 3.3% short.
- 1F1B: every later backward of a stage that sends gradients still holds the previous backward's stage-input gradient
  (the schedule's `bwd_sends` / `send_work`): one fp32 (b, s, h), missing for every policy on ranks 16 and 32 and in
  the last stage's last loss backward.
"""

from __future__ import annotations

import pytest

from backend.analytic.layout import Layout, RankPosition
from backend.analytic.memory import backward_moment, rank_memory
from backend.analytic.memory.rank_activations import rank_activation_moments
from backend.spec import ExperimentSpec

MODEL = {"n_layers": 12, "d_model": 256, "n_heads": 4, "seq_len": 256, "vocab_size": 2048}


def spec(recompute: str, schedule: str = "1f1b") -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "name": "pinned", "model": MODEL,
        "train": {"micro_batch": 1, "global_batch": 8, "microbatches": 4, "precision": "bf16-mixed",
                  "recompute": recompute},
        "parallel": {"strategy": "zero3", "world_size": 12, "tp": 2, "pp": 3, "pp_schedule": schedule}})


def rank_of_stage(s: ExperimentSpec, stage: int) -> int:
    return next(r for r in range(s.parallel.world_size) if RankPosition.of_rank(s, r).pp_rank == stage)


def memory(s: ExperimentSpec, stage: int) -> rank_memory.RankMemory:
    return rank_memory.rank_memory(s.model, Layout.of(s), RankPosition.of_rank(s, rank_of_stage(s, stage)))


def test_previous_backwards_input_gradient_is_held_by_later_1f1b_backwards():
    s = spec("full")
    grad = 1 * 256 * 256 * 4  # micro-batch x seq x hidden, fp32 under autocast (tp without SP: the whole sequence)
    layout = Layout.of(s)
    held = {stage: backward_moment.sent_grad_bytes(s.model, layout, memory(s, stage).parts) for stage in range(3)}
    assert held == {0: 0, 1: grad, 2: grad}  # the first stage sends no gradient
    gpipe = spec("full", schedule="gpipe")
    assert backward_moment.sent_grad_bytes(gpipe.model, Layout.of(gpipe), memory(gpipe, 1).parts) == 0


@pytest.mark.parametrize("stage", [1, 2])
def test_later_backwards_and_the_last_loss_backward_count_it(monkeypatch, stage):
    s = spec("full")
    with_grad = memory(s, stage)
    grad = backward_moment.sent_grad_bytes(s.model, Layout.of(s), with_grad.parts)
    monkeypatch.setattr(backward_moment, "sent_grad_bytes", lambda *a: 0)
    monkeypatch.setattr(rank_memory, "sent_grad_bytes", lambda *a: 0)
    without = memory(s, stage)
    if stage == 2:  # the last stage: its last loss backward follows the previous microbatch's backward
        assert with_grad.loss_backward_bytes - without.loss_backward_bytes == grad
    assert with_grad.backward_bytes - without.backward_bytes == grad  # every later candidate holds it


def test_layers_policy_peaks_at_its_lowest_checkpoint_in_a_pipelined_backward(monkeypatch):
    """The middle stage (4 blocks, layers:2: blocks 0 and 2 plain, 1 and 3 checkpointed) in a later 1F1B backward:
    at the stage's first block the model held every block's unsharded parameters and gradients and the 16-bit weight
    grads of the 3 blocks above; at the second block, the first block's saved tensors are still alive and one block's
    weight grads fewer have been made. Same gathered units (zero3: the working block up, and the prefetched one)."""
    s = spec("layers:2")
    fixed = memory(s, 1)
    acts = rank_activation_moments(s.model, Layout.of(s), 1, fixed.parts)
    monkeypatch.setattr(backward_moment, "lowest_checkpoint", lambda *a: 0)
    bottom = memory(s, 1)
    assert fixed.backward_bytes - bottom.backward_bytes == acts.plain - acts.one_block_casts > 0
    assert fixed.fullest_bytes == fixed.backward_bytes
    # the other policies have no such block: unchanged
    for other in ("none", "full", "block:2", "uniform:2"):
        monkeypatch.undo()
        before = memory(spec(other), 1).backward_bytes
        monkeypatch.setattr(backward_moment, "lowest_checkpoint", lambda *a: 0)
        assert memory(spec(other), 1).backward_bytes == before, other
