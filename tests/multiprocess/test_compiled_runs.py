"""Issue 34 part 4: torch.compile of each block on CPU ranks (strategies/compiled.py, torchtitan's apply_compile):
losses and final parameters equal the eager single-process reference at world 2 and 4 (DDP under full recompute,
FSDP x TP with SP, and FSDP2 and 1F1B with the compiled loss too), with Dynamo graphs compiled during the steps; and a
whole engine run of stack torchtitan whose timed steps run the compiled blocks and loss and whose memory-tracked step
runs them eagerly, measuring the same bytes as the eager run of the same spec (Inductor's kernels: C++ / OpenMP here,
Triton on a GPU)."""

from __future__ import annotations

import pytest

from backend.spec import ExperimentSpec
from backend.strategies.compiled import EAGER_MEMORY_NOTE
from tests.helpers.farm import assert_parity, engine_job, params, parity_job, uses
from tests.helpers.specs import tiny

COMPILED = {"elementwise": "compiled"}
# a distinct width per job: no job can reuse another's compiled graphs, so each one's graph count is its own
PARITY = {s.name: parity_job(s) for s in [
    tiny("ddp_full_recompute_compiled", model={"d_model": 48}, strategy="ddp", world_size=2,
         train=COMPILED | {"recompute": "full"}),
    tiny("fsdp_x_tp_sp_compiled", model={"d_model": 64}, strategy="fsdp", world_size=4, tp=2,
         sequence_parallel=True, train=COMPILED),
    # torchtitan's compile of the loss too (components/loss.py): the microbatch loop's and the pipeline schedule's
    tiny("zero3_compiled_loss", model={"d_model": 56}, strategy="zero3", world_size=2,
         train=COMPILED | {"loss_compiled": True}),
    tiny("pp2_1f1b_compiled_loss", model={"d_model": 24}, strategy="pp", world_size=2, pp=2, pp_schedule="1f1b",
         train=COMPILED | {"loss_compiled": True}),
]}


@pytest.mark.slow
@pytest.mark.parametrize("name", params(PARITY))
def test_compiled_blocks_keep_parity_with_the_eager_reference(farm, name):
    r = farm.result(PARITY[name])
    assert_parity(r)
    assert r["dynamo_graphs"] > 0, "the steps ran no compiled graph"
    assert any(n.startswith("torch.compile: ") and "blocks compiled in place" in n for n in r["notes"]), r["notes"]
    assert any("the cross-entropy runs compiled" in n for n in r["notes"]) == ("loss" in name), r["notes"]
    assert any("warmup_steps=0: the first timed step includes the compile" in n for n in r["notes"])  # tiny: 0


LLAMA = {"vocab_size": 256, "d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 128, "norm": "rmsnorm",
         "mlp": "swiglu", "positions": "rope", "bias": "none", "attention": "flash"}


def _run(elementwise: str) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "name": f"torchtitan zero3 {elementwise}", "model": LLAMA,
        "train": {"global_batch": 8, "micro_batch": 2, "steps": 2, "warmup_steps": 1, "precision": "bf16-mixed",
                  "stack": "torchtitan", "elementwise": elementwise},  # torchtitan: compiled blocks and loss
        "parallel": {"strategy": "zero3", "world_size": 2}})


RUNS = {e: engine_job(_run(e)) for e in ("compiled", "eager")}


@pytest.mark.slow
@uses(*RUNS.values())
def test_a_compiled_run_measures_its_memory_with_eager_blocks_against_the_eager_prediction(farm):
    compiled, eager = (farm.result(RUNS[e])["result"] for e in ("compiled", "eager"))
    assert compiled.status == "ok" and eager.status == "ok", (compiled.error, eager.error)
    assert EAGER_MEMORY_NOTE in compiled.notes and EAGER_MEMORY_NOTE not in eager.notes
    assert not any("warmup_steps=0" in n for n in compiled.notes)  # one warm-up step holds the compile
    for c, e in zip(compiled.per_rank, eager.per_rank, strict=True):
        assert c.predicted == e.predicted  # both compared with the eager blocks' prediction
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"):
            assert getattr(c.measured, key) == getattr(e.measured, key), key
        assert abs(c.error_pct["params_bytes"]) < 0.1
    assert compiled.step_s_median > 0 and abs(compiled.loss[-1] - eager.loss[-1]) < 0.05  # bf16-mixed
