"""Issue 34 item 1: a stack in the spec. One registry entry per stack gives every setting's default with its source;
each setting can be set on its own; `estimate --json` prints the resolved stack; what this engine cannot run is
prediction-only with the reason (run_rules); the CLI flags reach the spec."""

from __future__ import annotations

import json

import pytest

from backend.cli import main
from backend.spec import ExperimentSpec, validate_spec
from backend.spec.checks import run_blockers
from backend.spec.choices import Stack
from backend.spec.stacks import SETTING_INFO, SETTINGS, SPEC_DEFAULT, SPEC_SET, STACKS, resolve_stack

LLAMA = {"vocab_size": 1000, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "norm": "rmsnorm",
         "mlp": "swiglu", "positions": "rope", "bias": "none", "attention": "flash"}


def _spec(train: dict | None = None, parallel: dict | None = None) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({"model": LLAMA, "train": {"global_batch": 8, "micro_batch": 2,
                                                                   "precision": "bf16-mixed", **(train or {})},
                                          "parallel": {"strategy": "zero1", "world_size": 4, "tp": 2,
                                                       "sequence_parallel": True, **(parallel or {})}})


def test_every_stack_gives_every_setting_a_default_with_its_source():
    assert set(STACKS) == set(Stack)
    for stack, entry in STACKS.items():
        assert set(entry.defaults) == set(SETTINGS), stack
        for name, d in entry.defaults.items():
            assert len(d.source) > 20, (stack, name)
    assert ExperimentSpec().train.stack == "shardlab"


def test_megatron_attention_follows_transformer_engine_by_device():
    """TE picks cuDNN fused attention on Hopper (get_attention_backend, cc >= 9.0), flash-attn on Ampere."""
    s = _spec({"stack": "megatron"})
    assert resolve_stack(s, "sm90").values["attention_kernel"] == "cudnn"
    assert resolve_stack(s, "sm80").values["attention_kernel"] == "flash2"
    assert resolve_stack(s, "cpu").values["attention_kernel"] == "eager"
    r = resolve_stack(s, "sm90")
    assert (r.values["elementwise"] == "fused" and r.values["param_dtype"] == "bf16"
            and r.values["master_dtype"] == "fp32")
    assert r.values["grad_reduce_overlap"] is False and r.set_by["grad_reduce_overlap"] == SPEC_DEFAULT
    assert "arguments.py 3121" in r.sources["grad_reduce_overlap"]


def test_a_setting_set_in_the_spec_wins_and_says_so():
    r = resolve_stack(_spec({"stack": "megatron", "attention_kernel": "flash3", "grad_reduce_overlap": True,
                             "grad_reduce_dtype": "bf16"}), "sm90")
    assert r.values["attention_kernel"] == "flash3" and r.set_by["attention_kernel"] == SPEC_SET
    assert r.values["grad_reduce_overlap"] is True and r.values["grad_reduce_dtype"] == "bf16"
    assert r.set_by["elementwise"] == SPEC_DEFAULT


def test_torchtitan_dtypes_and_loss_parallel():
    r = resolve_stack(_spec({"stack": "torchtitan"}, {"strategy": "zero3"}), "sm90")
    assert (r.values["param_dtype"], r.values["grad_reduce_dtype"],
            r.values["master_dtype"]) == ("fp32", "fp32", "none")
    assert r.values["loss_parallel"] is True and r.values["param_gather_overlap"] is True


def test_shardlab_resolves_to_what_the_engine_keeps():
    """The distributed optimizer (zero1 x tp) keeps 16-bit params with fp32 masters; dp-only zero1 keeps fp32."""
    assert resolve_stack(_spec(), "sm90").values["param_dtype"] == "bf16"
    assert resolve_stack(_spec(parallel={"tp": 1, "sequence_parallel": False}), "sm90").values["param_dtype"] == "fp32"
    assert resolve_stack(_spec(), "cpu").values["attention_kernel"] == "eager"
    assert resolve_stack(_spec(), "sm90").is_default


def test_contradictions_are_refused_with_the_values():
    _, problems = validate_spec({"model": LLAMA, "train": {"precision": "fp32", "param_dtype": "bf16"}},
                                predict_only=True)
    assert any("param_dtype=bf16 with precision=fp32" in p for p in problems), problems
    _, problems = validate_spec({"model": LLAMA, "parallel": {"world_size": 2, "tp": 2},
                                 "train": {"global_batch": 2, "tp_overlap": True}}, predict_only=True)
    assert any("tp_overlap with tp=2 needs sequence_parallel" in p for p in problems), problems
    _, problems = validate_spec({"model": LLAMA, "train": {"stack": "nemo"}}, predict_only=True)
    assert problems and "train.stack" in problems[0]


def test_what_this_engine_cannot_run_is_prediction_only_with_the_reason():
    blockers = run_blockers(_spec({"stack": "megatron"}))
    assert any(b.startswith("attention_kernel=cudnn") for b in blockers), blockers
    assert any(b.startswith("elementwise=fused") for b in blockers)
    assert not any("loss_parallel" in b for b in blockers), "the engine runs the vocab-parallel loss (strategies/tp.py)"
    pipelined = run_blockers(_spec({"loss_parallel": True, "microbatches": 2}, {"pp": 2, "world_size": 8}))
    assert any(b.startswith("loss_parallel=on with pp=2") for b in pipelined), pipelined
    assert any(b.startswith("stack megatron keeps grad_reduce_dtype=bf16") for b in _blockers_dp_only()), \
        _blockers_dp_only()
    _, problems = validate_spec(_spec({"stack": "megatron"}).model_dump(mode="json"))
    assert problems, "run/submit must refuse a stack this engine does not run"
    assert run_blockers(_spec()) == []
    assert run_blockers(_spec({"elementwise": "compiled"})) == []  # strategies/compiled.py (tests/multiprocess)
    assert run_blockers(_spec({"elementwise": "fused"})) == [
        "elementwise=fused (set in the spec, stack shardlab): this engine runs eager / compiled only: fused means "
        "Transformer Engine's or Apex's CUDA kernels, which it does not call (compiled runs: torch.compile of each "
        "block, strategies/compiled.py)"]
    for name, setting in SETTING_INFO.items():  # every refusal of a setting's value says why, not only what runs
        refused = set(setting.choices or (False, True)) - set(setting.engine_runs or setting.choices or (False, True))
        assert not refused or setting.engine_why, name
    assert blockers[-1].endswith("(stack megatron: set stack shardlab to run this layout on this engine)")
    assert not run_blockers(_spec({"stack": "torchtitan", "loss_parallel": False}, {"strategy": "zero3", "tp": 1,
                                                                                    "sequence_parallel": False}))


def _estimate(capsys, *argv):
    assert main(["estimate", "--vocab", "1000", "--hidden", "64", "--layers", "2", "--heads", "4", "--world", "4",
                 "--tp", "2", "--sequence-parallel", "--strategy", "zero1", "--global-batch", "4", "--micro-batch", "2",
                 "--precision", "bf16-mixed", "--attention", "flash", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_json_gives_the_resolved_stack(capsys):
    d = _estimate(capsys, "--stack", "megatron", "--hardware", "h100-sxm")
    stack = d["stack"]
    assert stack["name"] == "megatron" and stack["device"] == "sm90" and set(stack["settings"]) == set(SETTINGS)
    assert stack["settings"]["attention_kernel"] == {
        "value": "cudnn", "set_by": SPEC_DEFAULT, "source": STACKS[Stack.MEGATRON].defaults["attention_kernel"].source}
    assert d["runnable"] is False and "elementwise=fused" in d["why_not"]
    assert "stack=megatron" in " ".join(d["step_time_detail"]["notes"])
    d = _estimate(capsys)
    assert d["stack"]["name"] == "shardlab" and d["runnable"] is True and d["stack"]["device"] in ("cpu", "gpu")


def test_cli_switches_reach_the_spec(capsys):
    d = _estimate(capsys, "--stack", "torchtitan", "--compile", "--async-tp", "--no-loss-parallel",
                  "--overlap-grad-reduce", "--attention-kernel", "flash3", "--grad-reduce-dtype", "bf16")
    got = {k: (v["value"], v["set_by"]) for k, v in d["stack"]["settings"].items()}
    assert got["elementwise"] == ("compiled", SPEC_SET) and got["tp_overlap"] == (True, SPEC_SET)
    assert got["loss_parallel"] == (False, SPEC_SET) and got["grad_reduce_overlap"] == (True, SPEC_SET)
    assert got["attention_kernel"] == ("flash3", SPEC_SET) and got["grad_reduce_dtype"] == ("bf16", SPEC_SET)
    assert got["pp_overlap"] == (False, SPEC_DEFAULT)
    assert main(["estimate", "--compile", "--elementwise", "fused", "--json"]) == 2
    assert "--compile means --elementwise compiled" in capsys.readouterr().err


@pytest.mark.parametrize("name", SETTINGS)
def test_every_registry_setting_reaches_the_spec_the_cli_and_the_form(name):
    """One entry in stacks.SETTING_INFO (and its default per stack) is the whole setting: a train field, a CLI flag
    (an on / off switch or a choice) that sets it, and a widget of the Stack settings form."""
    from backend.cli import build_parser
    from backend.cli.spec_flags import spec_dict_from_args
    from backend.spec.stacks import SETTING_INFO
    from backend.spec.train_spec import TrainSpec
    from dashboard.stack_form import CHOICES, LABELS, to_spec

    info = SETTING_INFO[name]
    assert name in TrainSpec.model_fields
    value = True if info.boolean else info.choices[-1]
    argv = ["estimate", info.flag] + ([] if info.boolean else [value])
    assert spec_dict_from_args(build_parser("estimate").parse_args(argv))["train"][name] == value
    assert LABELS[name] == info.label
    widget = "on" if info.boolean else value
    assert widget in CHOICES[name] and to_spec({"stack": "megatron", name: widget})[name] == value


# the dtypes are compared with the engine's own (test above); ep_overlap needs a MoE layout on stack megatron
# (tests/unit/test_ep_overlap.py checks its prediction-only reason)
@pytest.mark.parametrize("name", [n for n in SETTINGS if n not in ("param_dtype", "grad_reduce_dtype", "master_dtype",
                                                                   "ep_overlap")])
def test_a_settings_registry_entry_says_which_values_this_engine_runs(name):
    """stacks.Setting.engine_runs is the one list stack_blockers reads: a value outside it is prediction-only with the
    setting's name and the values that run; every value inside it runs (tp 2, so tp-only settings count)."""
    from backend.spec.stacks import SETTING_INFO

    info = SETTING_INFO[name]
    values = (False, True) if info.boolean else info.choices
    for value in values:
        spec = _spec({name: value, "stack": "shardlab"})
        mine = [b for b in run_blockers(spec) if b.startswith(f"{name}=")]
        runs = info.engine_runs is None or value in info.engine_runs
        assert (mine == []) == runs, (value, mine)
        if not runs:
            assert "this engine runs" in mine[0]


@pytest.mark.parametrize("stack", [s.value for s in Stack])
def test_every_stack_predicts(stack):
    from backend.analytic.steptime.hardware import get_hardware
    from backend.analytic.steptime.model import step_time

    st = step_time(_spec({"stack": stack}), get_hardware("h100-sxm"))
    assert st.summary["step_s"] > 0


def _blockers_dp_only() -> list[str]:
    """Megatron's bf16 grad reduction under dp-only zero1, where this engine's distributed optimizer keeps an fp32
    main-grad buffer. (Its bf16 params and fp32 master are what the engine's distributed optimizer keeps: the megatron
    stack's zero1 runs on it whatever the degrees, test_megatron_zero1_runs_as_the_distributed_optimizer.)"""
    return run_blockers(_spec({"stack": "megatron", "grad_reduce_dtype": "bf16"},
                              {"tp": 1, "sequence_parallel": False}))


def test_megatron_zero1_runs_as_the_distributed_optimizer():
    """Issue 34 part 4: the megatron stack's dp-only zero1 keeps Megatron's memory layout in this engine too."""
    from backend.strategies.data_parallel import uses_distributed_optimizer

    spec = _spec({"stack": "megatron", "attention_kernel": "flash2", "elementwise": "eager"},
                 {"tp": 1, "sequence_parallel": False})
    assert run_blockers(spec) == [] and uses_distributed_optimizer(spec)
    assert not uses_distributed_optimizer(_spec({}, {"tp": 1, "sequence_parallel": False}))


def test_loss_parallel_plans_vocab_sharded_logits():
    from torch.distributed.tensor import Replicate, Shard

    from backend.models.gpt import build_model
    from backend.strategies.tp import tp_plan, vocab_parallel_loss

    spec = _spec({"loss_parallel": True})
    assert vocab_parallel_loss(spec) and not vocab_parallel_loss(_spec())
    model = build_model(spec.model, seed=0, device="meta")
    head = tp_plan(model, sp=True, sharded_logits=True)["lm_head"]
    assert head.output_layouts == (Shard(-1),) and head.use_local_output is False
    assert tp_plan(model, sp=True)["lm_head"].output_layouts == (Replicate(),)


def test_the_stack_setting_recipe_names_files_that_exist_and_the_registry_first():
    """docs/ARCHITECTURE.md's recipe for a stack setting: the registry entry first, every file it names exists, and
    the files it says derive from the entry read SETTING_INFO (or SETTINGS) indeed."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "ARCHITECTURE.md").read_text()
    recipe = text[text.index("**A stack setting**"):text.index("**A model family feature**")]
    assert "`backend/spec/stacks.py`" in recipe.split("\n- ")[1]
    named = set(re.findall(r"`((?:backend|db|dashboard|tests)/[\w/]+\.py)", recipe))
    assert named and [p for p in sorted(named) if not (root / p).exists()] == []
    derived = recipe[recipe.index("Derived from the entry"):]
    for path in re.findall(r"`((?:backend|dashboard)/[\w/]+\.py)", derived):
        assert re.search(r"\bSETTING_INFO\b|\bSETTINGS\b", (root / path).read_text()), path
