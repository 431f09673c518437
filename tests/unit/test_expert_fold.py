"""Issue 35: Megatron-Core's MoE parallel folding on the megatron stack. The experts sit on a grid of their own,
etp x ep x edp over a stage's tp x cp x dp ranks, so ep may span the tp ranks and edp = tp x cp x dp / (etp x ep)
(backend/analytic/expert_layout.py, Megatron-LM parallel_state.py @ core_v0.19.0). Predicted, never run here."""

from __future__ import annotations

import pytest

from backend.analytic.estimate import estimate
from backend.analytic.expert_layout import ExpertLayout
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.spec import ExperimentSpec, validate_spec
from backend.spec.checks import run_blockers

H, FFN, E, LAYERS = 64, 128, 8, 2
MOE = {"vocab_size": 256, "d_model": H, "n_layers": LAYERS, "n_heads": 4, "seq_len": 32, "n_experts": E, "top_k": 2,
       "ffn_hidden": FFN, "mlp": "swiglu", "norm": "rmsnorm", "positions": "rope", "bias": "none"}
ROUTED = LAYERS * E * 3 * H * FFN
"""Every routed expert element of the model: three SwiGLU matrices of h x ffn per expert, no biases."""


def spec(stack: str = "megatron", **parallel) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": MOE, "parallel": {"strategy": "zero1", "sequence_parallel": parallel.get("tp", 1) > 1} | parallel,
        "train": {"global_batch": 16, "micro_batch": 1, "precision": "bf16-mixed", "stack": stack}})


def test_ep_spans_the_tp_ranks_on_megatrons_expert_grid():
    s = spec(world_size=8, tp=4, ep=8)  # dp x cp = 2 ranks: ep 8 takes every tp rank of both
    lay = ExpertLayout.of_spec(s)
    assert (lay.etp, lay.ep, lay.edp, lay.tp_replicas) == (1, 8, 1, 1)
    assert ExpertLayout.of_spec(spec(world_size=16, tp=4, ep=2)).edp == 8  # the tp ranks route distinct tokens
    assert ExpertLayout.of_spec(spec("shardlab", world_size=16, tp=4, ep=2)).edp == 2  # they hold the same experts
    est = estimate(s)
    assert any(n.startswith("ep=8 spans tp: Megatron-Core's MoE parallel folding") and "= 8 / 8 = 1" in n
               for n in est.notes), est.notes
    assert any("ep=8 spans the tp ranks" in w and "etp x ep x edp = 1 x 8 x 1" in w for w in run_blockers(s))
    assert [r.coords["ep"] for r in est.per_rank] == list(range(8))  # Megatron's expert grid: etp, then ep, innermost


def test_the_expert_grid_names_each_rank_as_megatron_does():
    """Megatron's expert ranks run etp fastest, then ep, in the stage's tp-cp-dp order; with etp = tp that is this
    engine's ep block along the dp index."""
    folded = estimate(spec(world_size=16, tp=4, ep=4, etp=2)).per_rank
    assert [(r.coords["etp"], r.coords["ep"]) for r in folded[:8]] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2),
                                                                       (0, 3), (1, 3)]
    same = spec(world_size=16, tp=4, ep=2, etp=4)
    assert [r.coords for r in estimate(same).per_rank] == [same.parallel.coords(i) for i in range(16)]


def test_a_fold_that_does_not_cover_the_stage_is_explained_with_the_arithmetic():
    bad = {"model": MOE, "train": {"stack": "megatron"}, "parallel": {"world_size": 12, "tp": 2, "ep": 8}}
    _, problems = validate_spec(bad, predict_only=True)
    assert any("etp(1) * ep(8) = 8 does not divide tp * cp * dp = 2 * 1 * 6 = 12" in p for p in problems), problems
    _, problems = validate_spec(bad | {"train": {"stack": "shardlab"}}, predict_only=True)
    assert any("ep=8 does not divide dp=6" in p for p in problems), problems
    _, problems = validate_spec({**bad, "parallel": {"world_size": 8, "tp": 4, "ep": 8}} | {
        "train": {"stack": "shardlab"}}, predict_only=True)
    assert any("set stack megatron (and etp < tp) to predict the folded layout" in p for p in problems), problems


@pytest.mark.parametrize(("tp", "ep", "etp"), [(4, 2, 4), (4, 2, 2), (4, 4, 1), (4, 8, 1), (4, 4, 2)])
def test_each_rank_keeps_its_share_of_the_expert_optimizer_state_whatever_the_fold(tp, ep, etp):
    """The distributed optimizer shards the expert buffer over edp: each rank's routed / (etp x ep) elements over
    tp x dp / (etp x ep) ranks leaves it 12 B x routed / (tp x dp) of fp32 master + Adam m, v on every fold; the dense
    state is the same on every fold of one dense layout. Megatron pads each buffer to a multiple of its group."""
    base = estimate(spec(world_size=8, tp=4, ep=2, etp=4)).per_rank[0]
    got = estimate(spec(world_size=8, tp=tp, ep=ep, etp=etp)).per_rank[0]
    expert_elements = ROUTED // (ep * etp)
    assert got.params_count - base.params_count == expert_elements - ROUTED // 8
    assert got.optimizer_bytes == pytest.approx(base.optimizer_bytes, rel=2e-3)


def test_a_folded_layout_has_a_step_time():
    """The step-time model prices the fold: the expert buckets' reduce-scatter on Megatron's expert data-parallel
    group (edp = 8 at tp 4, dp 4, etp 1, ep 2) and an EP group strided by etp over the tp ranks (ep 8 at tp 4, dp 2)."""
    hw = get_hardware("h100-sxm")
    for s in (spec(world_size=16, tp=4, ep=2), spec(world_size=8, tp=4, ep=8)):
        t = step_time(s, hw)
        assert t.summary["step_s"] > 0 and t.per_rank[0].comm_s["ep"] > 0


@pytest.mark.heavy
def test_plan_searches_the_fold_on_the_megatron_stack_and_prices_it_as_estimate_does(capsys):
    """`plan --stack megatron` offers ep over the tp ranks; each such layout's memory is estimate's fullest moment,
    byte for byte (the planner's array path reads the same ExpertLayout). The engine's own stack never offers it."""
    import json
    import random

    from backend.cli import main

    args = ["plan", "--layers", "4", "--hidden", "256", "--heads", "8", "--experts", "8", "--top-k", "2", "--seq",
            "256", "--vocab", "1024", "--gpus", "8", "--gpus-per-node", "8", "--hardware", "h100-sxm",
            "--global-batch", "16", "--include-predicted", "--top", "600", "--json"]

    def folds(stack: str) -> list[dict]:
        assert main([*args, "--stack", stack]) == 0
        configs = json.loads(capsys.readouterr().out)["configs"]
        return [c for c in configs if (lambda p: p["ep"] > 1 and (p["dp"] * p["cp"]) % p["ep"])(c["spec"]["parallel"])]

    assert folds("shardlab") == []
    folded = folds("megatron")
    assert folded and all(not c["runnable"] and "spans the tp ranks" in c["why_not"] for c in folded)
    for c in random.Random(35).sample(folded, min(25, len(folded))):
        est = estimate(ExperimentSpec.for_prediction(c["spec"]))
        assert c["mem_bytes_max"] == max(r.fullest_bytes() for r in est.per_rank), c["spec"]["parallel"]


def test_a_megatron_script_with_ep_over_the_tp_ranks_imports_and_is_predicted(tmp_path):
    """--expert-model-parallel-size 8 over tp 2 x dp 4 with --expert-tensor-parallel-size 1: refused before the fold
    was modelled ("ep=8 does not divide dp=4"); now the megatron stack's layout."""
    from backend.importers import import_config

    script = tmp_path / "train.sh"
    script.write_text(
        "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 8 "
        "--seq-length 256 --max-position-embeddings 256 --ffn-hidden-size 1024 --num-experts 8 --moe-router-topk 2 "
        "--moe-ffn-hidden-size 512 --tensor-model-parallel-size 2 --expert-model-parallel-size 8 "
        "--expert-tensor-parallel-size 1 --sequence-parallel --micro-batch-size 1 --global-batch-size 16 --bf16 "
        "--use-distributed-optimizer\n")
    imported = import_config(script, vocab_size=32000)
    par = imported.spec["parallel"]
    assert (par["tp"], par["dp"], par["ep"], par["etp"], imported.spec["train"]["stack"]) == (2, 4, 8, 1, "megatron")
    s = ExperimentSpec.for_prediction(imported.spec)
    assert ExpertLayout.of_spec(s).edp == 1 and len(estimate(s).per_rank) == 8


def test_an_ep_that_fits_no_expert_grid_is_invalid_not_prediction_only():
    """ep=3 over tp x dp = 2 x 2 ranks fits neither dp nor Megatron's folded grid: the run refusal states the invalid
    arithmetic only, never "prediction-only" with an expert data-parallel degree of 0."""
    moe = MOE | {"n_experts": 6}
    for etp in (1, 2):
        _, problems = validate_spec({"model": moe, "parallel": {"strategy": "ep", "world_size": 4, "tp": 2, "ep": 3,
                                                                 "etp": etp}})
        assert any("ep=3 does not divide dp=2" in p for p in problems), problems
        assert not any("prediction-only" in p or "x 0 over" in p for p in problems), problems


def test_a_fold_whose_ep_divides_dp_is_still_megatrons_grid_not_this_engines():
    """ep=2 over tp x dp = 2 x 2 with etp=1 on stack megatron: ep divides dp, but Megatron's expert grid runs ep over
    the tp ranks (rank 1 holds ep index 1), where this engine's ep block runs along dp (rank 1: ep 0). Runnable stack
    settings must not make the run store that prediction beside the other layout's measurement."""
    eager = {"attention_kernel": "eager", "elementwise": "eager"}
    s = ExperimentSpec.for_prediction({"model": MOE, "parallel": {"strategy": "ep", "world_size": 4, "tp": 2, "ep": 2},
                                       "train": {"global_batch": 16, "stack": "megatron", **eager}})
    assert [r.coords["ep"] for r in estimate(s).per_rank] == [0, 1, 0, 1]
    assert any("ep=2 spans the tp ranks" in w for w in run_blockers(s)), run_blockers(s)
    same = ExperimentSpec.for_prediction({**s.model_dump(mode="json"), "parallel": {
        "strategy": "ep", "world_size": 4, "tp": 2, "ep": 2, "etp": 2}})  # etp = tp: the engine's own layout
    assert not any("spans the tp ranks" in w for w in run_blockers(same)), run_blockers(same)
