"""`estimate --stack deepspeed --loss-parallel --tp 2` was accepted and predicted a vocab-parallel loss (logits / tp)
that DeepSpeed cannot run: its AutoTP shards lm_head by rows and all-reduces full logits (DeepSpeed @ edaa7221
module_inject/auto_tp.py 454-456 -> layers.py 1232-1264 LmHeadLinearAllreduce, "is it necessary to re-implement the
vocab parallel module?" a TODO), and the model's own loss runs on them. The spec refuses it (stack_rules), so the CLI,
the dashboard and the planner all get the reason."""

from __future__ import annotations

import pytest

from backend.cli import main
from backend.planner.held import HeldTraining
from backend.spec import ExperimentSpec

LLAMA = {"vocab_size": 1000, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "norm": "rmsnorm",
         "mlp": "swiglu", "positions": "rope", "bias": "none", "attention": "flash"}
SAID = "loss_parallel=on with stack deepspeed"


def _spec(train: dict) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({"model": LLAMA, "train": {"global_batch": 8, "micro_batch": 2,
                                                                   "precision": "bf16-mixed", **train},
                                          "parallel": {"strategy": "zero1", "world_size": 4, "tp": 2}})


def test_the_spec_refuses_loss_parallel_on_the_deepspeed_stack():
    with pytest.raises(ValueError, match=SAID):
        _spec({"stack": "deepspeed", "loss_parallel": True})
    assert _spec({"stack": "deepspeed"}).train.stack == "deepspeed"  # its default (off) stands
    assert _spec({"stack": "deepspeed", "loss_parallel": False}).train.loss_parallel is False


def test_the_cli_says_why(capsys):
    code = main(["estimate", "--stack", "deepspeed", "--loss-parallel", "--tp", "2", "--dp", "2", "--world", "4"])
    assert code == 2 and SAID in capsys.readouterr().err


def test_the_planner_refuses_it_as_a_held_setting():
    problems = HeldTraining(stack="deepspeed", stack_settings=(("loss_parallel", True),)).problems()
    assert any(SAID in p for p in problems), problems
