"""Issue 35: expert tensor parallelism (`parallel.etp`, `--etp`): the expert layout etp x ep x edp over a stage's
tp x cp x dp ranks (backend/analytic/expert_layout.py), checked with the arithmetic, predicted (expert weights, grads
and optimizer state over etp x ep x edp, the experts' all-reduces over etp); the engine runs etp = tp, and an etp
below tp is prediction-only."""

from __future__ import annotations

import pytest

from backend.analytic.estimate import estimate
from backend.analytic.expert_layout import ExpertLayout
from backend.cli import main
from backend.spec import ExperimentSpec, validate_spec
from backend.spec.checks import run_blockers

H, FFN, E, LAYERS = 64, 128, 4, 2
MOE = {"vocab_size": 256, "d_model": H, "n_layers": LAYERS, "n_heads": 4, "seq_len": 32, "n_experts": E, "top_k": 2,
       "ffn_hidden": FFN, "mlp": "swiglu", "norm": "rmsnorm", "positions": "rope", "bias": "none"}


def spec(**parallel) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({"model": MOE, "parallel": {"strategy": "zero1"} | parallel,
                                          "train": {"global_batch": 16, "micro_batch": 1, "precision": "bf16-mixed"}})


@pytest.mark.parametrize(("parallel", "needle"), [
    ({"world_size": 8, "tp": 4, "ep": 2, "etp": 3},
     "etp=3 does not divide tp=4 (4 % 3 = 1): each expert is split over etp ranks of the tp group, so the expert "
     "layout etp x ep x edp = 3 x 2 x edp must fold into tp x cp x dp = 4 x 1 x 2 with etp | tp"),
    ({"world_size": 8, "tp": 4, "ep": 1, "etp": 2},
     "etp=2 with ep=1: without expert parallelism the routed experts are split over tp like the dense MLP "
     "(etp = tp = 4, Megatron's default)"),
    ({"world_size": 8, "tp": 4, "ep": 8},
     "ep=8 does not divide dp=2 (expert-parallel ranks are carved out of the data-parallel ranks); Megatron-Core's MoE "
     "parallel folding would lay the experts out as etp(1) x ep(8) x edp(1) over the tp(4) x cp(1) x dp(2) = 8 ranks"),
])
def test_an_impossible_fold_is_explained_with_the_arithmetic(parallel, needle):
    s, problems = validate_spec({"model": MOE, "parallel": parallel})
    assert s is None and any(needle in p for p in problems), problems


def test_etp_needs_a_moe_model_and_an_expert_ffn_it_divides():
    _, problems = validate_spec({"model": {"n_heads": 4}, "parallel": {"world_size": 4, "tp": 2, "etp": 2}})
    assert "etp=2 needs a MoE model (n_experts > 0, got n_experts=0)" in problems
    _, problems = validate_spec({"model": MOE | {"expert_ffn_hidden": 126}, "parallel": {"world_size": 8, "tp": 4,
                                                                                          "ep": 2, "etp": 4}})
    assert any("etp=4 does not divide expert_ffn_hidden=126 (126 % 4 = 2)" in p for p in problems), problems


def test_the_expert_layout_and_the_rank_coords():
    lay = ExpertLayout.of(tp=4, dp_cp=4, ep=2, etp=2)
    assert (lay.etp, lay.ep, lay.edp, lay.tp_replicas) == (2, 2, 2, 2)
    assert ExpertLayout.of(tp=4, dp_cp=4, ep=1, etp=1).etp == 4  # ep 1: the experts split over tp
    s = spec(world_size=16, tp=4, ep=2, etp=2)
    assert [s.parallel.coords(r)["etp"] for r in range(4)] == [0, 1, 0, 1]  # tp index mod etp
    assert "etp" not in spec(world_size=16, tp=4, ep=2).parallel.coords(0)  # named only above 1


def test_expert_state_splits_over_etp_and_shards_over_edp():
    """Each rank holds routed / (etp x ep) expert elements (Megatron's theoretical_memory_usage, moe.md Sec 2.4):
    three SwiGLU matrices of h x ffn per expert, E / ep experts per rank, no biases."""
    routed_per_ep_rank = LAYERS * (E // 2) * 3 * H * FFN
    got = {etp: estimate(spec(world_size=16, tp=4, ep=2, etp=etp)).per_rank[0] for etp in (1, 2, 4)}
    assert got[1].params_count - got[2].params_count == routed_per_ep_rank // 2
    assert got[2].params_count - got[4].params_count == routed_per_ep_rank // 4
    # the distributed optimizer: 12 B of fp32 master + Adam m, v per expert element, sharded over edp = 4 / 2 = 2
    opt = {etp: got[etp].optimizer_bytes for etp in got}
    assert opt[1] - opt[2] == pytest.approx(12 * (routed_per_ep_rank // 2) / 2, rel=1e-3)


def test_the_experts_all_reduce_over_etp():
    base = estimate(spec(world_size=16, tp=4, ep=2)).per_rank[0].comm_bytes
    split = estimate(spec(world_size=16, tp=4, ep=2, etp=2))
    assert split.per_rank[0].comm_bytes["all_to_all"] == base["all_to_all"]  # the MoE input is whole on every tp rank
    assert split.per_rank[0].comm_bytes["all_reduce"] > base["all_reduce"]
    assert any(n.startswith("etp=2:") for n in split.notes)


def test_etp_below_tp_with_ep_is_prediction_only_with_the_reason():
    """etp = tp runs (each expert colwise / rowwise over the tp mesh dim: tests/multiprocess/test_moe_layouts.py
    etp2_x_ep2_ddp); an expert-tp group smaller than tp does not."""
    why = run_blockers(spec(world_size=16, tp=4, ep=2, etp=2))
    assert any("etp=2 with ep=2 is prediction-only at tp=4" in w for w in why), why
    assert not any("etp" in w for w in run_blockers(spec(world_size=16, tp=4, ep=2, etp=4)))
    assert not any("etp" in w for w in run_blockers(spec(world_size=16, tp=4, ep=2)))
    assert not any("etp" in w for w in run_blockers(spec(world_size=8, tp=4, etp=4)))  # ep 1: etp = tp as before


def test_the_cli_refuses_an_impossible_fold_with_exit_2(capsys):
    code = main(["estimate", "--layers", "2", "--hidden", "64", "--heads", "4", "--experts", "4", "--world", "8",
                 "--tp", "4", "--ep", "2", "--etp", "3"])
    assert code == 2 and "etp=3 does not divide tp=4 (4 % 3 = 1)" in capsys.readouterr().err
