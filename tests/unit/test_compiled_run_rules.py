"""Issue 34 part 4: where this engine runs compiled blocks (strategies/compiled.py) and where it refuses them before
launch, each refusal with what Dynamo or AOTAutograd raised on torch 2.13 (tests/multiprocess/test_compiled_runs.py
runs the layouts that compile); the trace runs a compiled spec's blocks eagerly, as the engine's memory-tracked step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.spec import ExperimentSpec
from backend.spec.checks import run_blockers
from backend.strategies.compiled import EAGER_MEMORY_NOTE, compiles_blocks, compiles_loss, eager_twin
from backend.trace.trace_spec import TRACED_EAGER_NOTE, trace_spec

pytestmark = pytest.mark.unit

MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "seq_len": 16, "attention": "flash"}


def _spec(model: dict | None = None, train: dict | None = None, **parallel) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": MODEL | (model or {}), "train": {"global_batch": 8, "micro_batch": 2, "elementwise": "compiled"}
        | (train or {}), "parallel": {"strategy": "zero3", "world_size": 2} | parallel})


def _compile_blockers(spec: ExperimentSpec) -> list[str]:
    return [b for b in run_blockers(spec) if b.startswith("elementwise=compiled")]


@pytest.mark.parametrize("parallel", [{}, {"strategy": "ddp"}, {"strategy": "zero1", "tp": 2, "world_size": 4},
                                      {"strategy": "fsdp", "tp": 2, "world_size": 4, "sequence_parallel": True},
                                      {"strategy": "pp", "pp": 2, "pp_schedule": "1f1b"},
                                      {"strategy": "pp", "pp": 2, "pp_schedule": "interleaved_1f1b",
                                       "virtual_stages": 2}])
def test_dense_layouts_run_compiled(parallel):
    spec = _spec(**parallel)
    assert compiles_blocks(spec)
    assert run_blockers(spec) == []


@pytest.mark.parametrize(("spec", "says"), [
    (_spec({"n_experts": 4, "top_k": 2}), "with n_experts=4: the MoE dispatch branches on each expert's token count"),
    (_spec(cp=2), "with cp=2: the ring attention's transfers are async collectives"),
    (_spec(strategy="pp", pp=2, pp_schedule="zero_bubble", virtual_stages=2),
     "with pp_schedule=zero_bubble: the schedule splits backward into input and weight passes with "
     "retain_graph=True"),
], ids=["moe", "cp", "zero_bubble"])
def test_what_does_not_compile_is_refused_before_launch_with_the_reason(spec, says):
    assert [b for b in _compile_blockers(spec) if says in b], run_blockers(spec)


def test_a_compiled_block_outside_the_torch_engine_is_refused():
    spec = ExperimentSpec.for_prediction({
        "model": MODEL, "framework": "deepspeed", "train": {"global_batch": 8, "micro_batch": 2,
                                                             "elementwise": "compiled", "precision": "bf16-mixed"},
        "parallel": {"strategy": "zero2", "world_size": 2}})
    assert any("deepspeed runs its model's blocks eagerly here" in b for b in _compile_blockers(spec)), \
        run_blockers(spec)


def test_torchtitan_compiles_its_loss_too_and_this_engine_runs_it_except_under_loss_parallel():
    assert compiles_loss(_spec(train={"stack": "torchtitan"}))
    assert run_blockers(_spec(train={"stack": "torchtitan"})) == []
    tp = _spec(train={"stack": "torchtitan"}, strategy="tp", tp=2)
    assert run_blockers(tp) == [
        "loss_compiled=on with loss_parallel and tp=2: torch.compile of the cross-entropy over vocab-sharded DTensor "
        "logits under loss_parallel() gave a wrong loss in 4 of 5 launches (5.008 against eager's 4.526 on the same "
        "logits, gradients "
        "off by 0.03) and a DTensor that DTensor's dispatch refuses to detach; run it eager (--no-compile-loss) or "
        "without loss parallel (stack torchtitan: set stack shardlab to run this layout on this engine)"]
    assert run_blockers(_spec(train={"stack": "torchtitan", "loss_compiled": False}, strategy="tp", tp=2)) == []
    assert run_blockers(_spec(train={"stack": "torchtitan", "loss_parallel": False}, strategy="tp", tp=2)) == []
    ds = ExperimentSpec.for_prediction({
        "model": MODEL, "framework": "deepspeed", "train": {"global_batch": 8, "micro_batch": 2, "loss_compiled": True,
                                                             "precision": "bf16-mixed"},
        "parallel": {"strategy": "zero2", "world_size": 2}})
    assert any(b.startswith("loss_compiled=on: deepspeed runs its model's own loss eagerly") for b in run_blockers(ds))


def test_the_eager_twin_is_the_same_spec_with_eager_blocks():
    spec = _spec(train={"stack": "torchtitan"})  # compiled blocks and loss
    twin = eager_twin(spec)
    assert str(twin.train.elementwise) == "eager" and not compiles_blocks(twin) and not compiles_loss(twin)
    eager_keys = {"train": {"elementwise", "loss_compiled"}}
    assert twin.model_dump(exclude=eager_keys) == spec.model_dump(exclude=eager_keys)
    eager = eager_twin(twin)
    assert eager is twin
    assert "memory-tracked step ran the blocks and the loss eagerly" in EAGER_MEMORY_NOTE


def test_the_trace_of_a_compiled_spec_traces_its_eager_twin(tmp_path):
    seen: list[dict] = []

    def runner(spec_path: Path, rank: int, out: Path, timeout_s: float, device: str) -> dict:
        seen.append(json.loads(spec_path.read_text()))
        return {"rank": rank, "status": "failed", "error": "not traced here"}

    out = trace_spec(_spec(), ranks=[0], rank_runner=runner)
    assert seen[0]["train"]["elementwise"] == "eager"
    assert TRACED_EAGER_NOTE in out["notes"]
    assert out["spec"]["train"]["elementwise"] == "compiled"
    trace_spec(eager_twin(_spec()), ranks=[0], rank_runner=runner)
    assert len(seen) == 2 and TRACED_EAGER_NOTE not in trace_spec(eager_twin(_spec()), ranks=[0],
                                                                   rank_runner=runner)["notes"]
