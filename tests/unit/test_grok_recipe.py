"""Issue 35: NVIDIA's Grok-1 314B recipe (NVIDIA/dgxc-benchmarking v25.04.01 grok1/cfg/grok1_314b.yaml, research
moe.md Sec 7.1: 8 experts top-2, tp 4, ep 8, cp 2, pp 8 x 8 virtual stages, distributed optimizer, sequence
parallel, capacity factor 1.0 padded, alltoall dispatcher, 512 H100s) is predicted by `estimate`, not refused; its
etp is Megatron's default tp = 4 (the recipe sets none), and the v26.05 table's ETP 1 is predicted too."""

from __future__ import annotations

import math

import pytest

from backend.analytic.estimate import estimate
from backend.analytic.expert_layout import ExpertLayout
from backend.cli import main
from backend.spec import ExperimentSpec
from backend.spec.checks import run_blockers

GROK = {"vocab_size": 128256, "d_model": 6144, "n_layers": 64, "n_heads": 48, "n_kv_heads": 8, "ffn_hidden": 32768,
        "n_experts": 8, "top_k": 2, "mlp": "geglu", "norm": "rmsnorm", "positions": "rope", "bias": "none",
        "tie_embeddings": False, "seq_len": 8192, "attention": "flash", "capacity_factor": 1.0,
        "moe_pad_to_capacity": True, "moe_dispatcher": "alltoall", "moe_aux_loss_coeff": 0.01}
PARALLEL = {"strategy": "zero1", "world_size": 512, "tp": 4, "pp": 8, "cp": 2, "ep": 8, "virtual_stages": 8,
            "pp_schedule": "interleaved_1f1b", "sequence_parallel": True}
TRAIN = {"micro_batch": 1, "global_batch": 1024, "precision": "bf16-mixed"}


@pytest.mark.parametrize("etp", [4, 1])
def test_grok1_recipe_is_predicted_not_refused(etp):
    spec = ExperimentSpec.for_prediction({"model": GROK, "parallel": PARALLEL | {"etp": etp}, "train": TRAIN})
    assert (spec.parallel.dp, spec.train.microbatches) == (8, 128)  # the recipe's GA 128: dp is 8
    # Megatron's expert grid at etp = tp: edp = world / (etp x ep x pp) = 512 / (4 x 8 x 8) = 2 (moe.md Sec 2.3); at
    # etp 1 ShardLab keeps ep over dp x cp (edp = 16 / 8 = 2) with 4 tp replicas, not Megatron's ep over tp (edp 8)
    lay = ExpertLayout.of_spec(spec)
    assert (lay.edp, lay.tp_replicas) == (2, 4 // etp)
    est = estimate(spec)
    assert len(est.per_rank) == 512 and all(math.isfinite(r.total_bytes) and r.total_bytes > 0
                                            for r in est.per_rank[:8])
    blockers = run_blockers(spec)  # the engine cannot run it here (a prediction, with the reasons), but it is valid
    assert not any("etp=" in b for b in blockers)  # etp = tp (4) and etp 1 are both wired in the engine


def test_grok1_recipe_on_the_cli(capsys):
    code = main(["estimate", "--layers", "64", "--hidden", "6144", "--heads", "48", "--kv-heads", "8", "--ffn", "32768",
                 "--vocab", "128256", "--experts", "8", "--top-k", "2", "--mlp", "geglu", "--norm", "rmsnorm",
                 "--positions", "rope", "--no-tie-embeddings", "--seq", "8192", "--attention", "flash", "--world",
                 "512", "--tp", "4", "--pp", "8", "--cp", "2", "--ep", "8", "--etp", "4", "--virtual-stages", "8",
                 "--schedule", "interleaved_1f1b", "--strategy", "zero1", "--sequence-parallel", "--capacity-factor",
                 "1.0", "--moe-pad-to-capacity", "--moe-dispatcher", "alltoall", "--moe-aux-loss-coeff", "0.01",
                 "--micro-batch", "1", "--global-batch", "1024", "--precision", "bf16-mixed", "--hardware", "h100-sxm"])
    out = capsys.readouterr().out
    assert code == 0 and "step time on h100-sxm:" in out
    assert "prediction only" not in out  # etp = tp runs in the engine (strategies/tp.py splits each expert over tp)
