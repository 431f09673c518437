"""Issue 34: `plan` searches within one stack and says which. The held training settings (planner/held.py) carry the
stack and its settings into every planned spec, so each layout is timed as that stack runs it."""

from __future__ import annotations

import json

from backend.analytic.steptime.hardware import get_hardware
from backend.cli import main
from backend.planner.held import HeldTraining
from backend.planner.search import plan
from backend.spec import ModelSpec

MODEL = ModelSpec(vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_hidden=2816, seq_len=2048,
                  norm="rmsnorm", mlp="swiglu", positions="rope", bias="none", attention="flash")


def _plan(held: HeldTraining):
    return plan(MODEL, gpus=16, gpus_per_node=8, hw=get_hardware("h100-sxm"), global_batch=32, top=3, held=held)


def test_plan_holds_the_stack_and_says_which():
    mega = _plan(HeldTraining(stack="megatron"))
    own = _plan(HeldTraining())
    assert all(c["spec"]["train"]["stack"] == "megatron" for c in mega.configs)
    assert all(not c["runnable"] and "stack megatron" in c["why_not"] for c in mega.configs)
    assert any("stack megatron" in n for n in mega.notes) and any(n.endswith("stack shardlab") for n in own.notes)
    assert all(c["runnable"] for c in own.configs) and "stack" not in own.configs[0]["spec"]["train"]
    assert mega.configs[0]["step_time"]["step_s"] != own.configs[0]["step_time"]["step_s"]


def test_held_settings_from_a_spec_and_on_their_own():
    held = HeldTraining.of_train({"precision": "bf16-mixed", "stack": "torchtitan", "elementwise": "compiled"})
    assert held.stack == "torchtitan" and dict(held.stack_settings) == {"elementwise": "compiled"}
    held = held.with_stack("megatron", {"attention_kernel": "flash3"})
    assert held.spec_train("none") == {"stack": "megatron", "attention_kernel": "flash3", "elementwise": "compiled"}
    assert "stack megatron (attention_kernel flash3, elementwise compiled)" in held.words()


def test_plan_cli_stack(capsys):
    assert main(["plan", "--vocab", "32000", "--hidden", "1024", "--layers", "8", "--heads", "16", "--gpus", "16",
                 "--global-batch", "32", "--seq", "2048", "--hardware", "h100-sxm", "--top", "2", "--stack",
                 "torchtitan", "--compile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(c["spec"]["train"]["stack"] == "torchtitan" and c["spec"]["train"]["elementwise"] == "compiled"
               for c in out["configs"])
    assert any("stack torchtitan (elementwise compiled)" in n for n in out["notes"])


def _titan_spec(model: dict, parallel: dict):
    from backend.spec import ExperimentSpec

    base = {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 128}
    return ExperimentSpec.for_prediction({"model": base | model, "train": {"global_batch": 8, "stack": "torchtitan"},
                                          "parallel": parallel, "runtime": {"device": "cpu"}})


def test_torchtitan_runs_plain_data_parallel_only_alone():
    """torchtitan raises 'DDP has not supported > 1D parallelism' beside tp / pp / cp in its dense models and carves
    ep out of its FSDP mesh: such a spec is predicted with a note, refused to run, and never planned."""
    from backend.analytic.estimate_notes import estimate_notes
    from backend.spec.run_rules import blocking_reasons
    from backend.spec.stack_rules import ddp_runs_alone

    moe = {"n_experts": 4, "top_k": 2}
    ddp_tp = _titan_spec({}, {"strategy": "ddp", "tp": 2, "world_size": 4})
    assert ddp_runs_alone(ddp_tp)
    assert any("runs plain data parallel (ddp, dp 2) only alone, not beside tp 2" in n for n in estimate_notes(ddp_tp))
    assert any("plain data parallel (ddp, dp 2) beside tp 2: stack torchtitan does not run it" in r
               for r in blocking_reasons(ddp_tp))
    assert ddp_runs_alone(_titan_spec(moe, {"strategy": "ep", "ep": 2, "world_size": 2}))
    for fine in (_titan_spec({}, {"strategy": "zero3", "tp": 2, "world_size": 4}),
                 _titan_spec({}, {"strategy": "ddp", "world_size": 4}),
                 _titan_spec({}, {"strategy": "ddp", "tp": 4, "world_size": 4}),
                 _titan_spec(moe, {"strategy": "ddp", "tp": 2, "world_size": 4})):  # deepseek_v3: DDP over dp_replicate
        assert not ddp_runs_alone(fine), fine.parallel
    own = ddp_tp.model_copy(update={"train": ddp_tp.train.model_copy(update={"stack": "shardlab"})})
    assert not ddp_runs_alone(own)


def test_plan_under_torchtitan_leaves_out_ddp_beside_model_parallelism():
    """The planner's grid (planner/space.py) drops DDP over dp > 1 beside tp / pp / cp under torchtitan's repertoire."""
    import numpy as np

    from backend.analytic.layout import ZeroStage
    from backend.planner.space import enumerate_layouts
    from backend.spec.choices import Stack
    from backend.spec.stacks import STACKS

    def ddp_beside(repertoire) -> int:
        lay = enumerate_layouts(MODEL, gpus=16, gpus_per_node=8, global_batch=32, repertoire=repertoire)
        beside = (lay.tp > 1) | (lay.pp > 1) | (lay.cp > 1)
        return int(np.sum((lay.zero_stage == ZeroStage.DDP) & (lay.dp > 1) & beside))

    assert ddp_beside(STACKS[Stack.SHARDLAB].layouts) > 0
    assert ddp_beside(STACKS[Stack.TORCHTITAN].layouts) == 0


def test_held_settings_that_contradict_are_refused_with_the_reason(tmp_path):
    """`plan --recompute-modules mlp` without --stack megatron, or a --spec's param_dtype bf16 under --precision fp32,
    ended in a pydantic traceback once a planned spec carried them (mark_runnable re-validates each)."""
    from tests.helpers.launch import cli

    small = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--ffn", "2816", "--vocab", "32000"]
    common = ["plan", "--hardware", "h100-sxm", "--gpus", "8", "--global-batch", "32", "--seq", "2048", "--top", "3"]
    p = cli(*common, *small, "--recompute-modules", "mlp")
    assert p.code == 2 and "Traceback" not in p.err and "ValidationError" not in p.err
    assert ("recompute_modules=mlp is Megatron-Core's --recompute-modules: set stack megatron (stack is shardlab)"
            in p.err)
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"model": MODEL.model_dump(mode="json"),
                                "train": {"stack": "torchtitan", "param_dtype": "bf16", "precision": "bf16-mixed"}}))
    p = cli(*common, "--spec", str(spec), "--precision", "fp32")
    assert p.code == 2 and "Traceback" not in p.err and "ValidationError" not in p.err
    assert "param_dtype=bf16 with precision=fp32" in p.err
    try:
        _plan(HeldTraining(recompute_modules=("mlp",)))
    except ValueError as e:  # the planner itself (the Plan page calls it) refuses them before searching
        assert "set stack megatron" in str(e)
    else:
        raise AssertionError("plan() searched with contradicting held settings")
