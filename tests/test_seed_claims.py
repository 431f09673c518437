"""The seed documents' claims, recomputed from the formulas (/work/shared/seeds/*.txt)."""

from __future__ import annotations

import pytest

from backend.analytic.textbook.seeds import Claim, seed_claims, seed_estimate_gpu_memory


def _claims() -> dict[str, Claim]:
    claims = seed_claims()
    ids = [c.id for c in claims]
    assert len(ids) == len(set(ids)), "claim ids must be unique"
    return {c.id: c for c in claims}


def test_seed000_estimate_gpu_memory_70b_defaults():
    """Seed 000's estimate_gpu_memory(70, P) defaults, recomputed by hand: weights 140 GB/P, KV
    2·1·4096·8·128·2·80 B (its head_dim 8192 // 64 = 128), KV not divided by P."""
    for n_gpus in (1, 2, 8):
        out = seed_estimate_gpu_memory(70, n_gpus)
        weights = 70 * 1e9 * 2 / n_gpus
        kv = 2 * 1 * 4096 * 8 * (8192 // 64) * 2 * 80
        assert out["model_GB"] == pytest.approx(weights / 1e9)
        assert out["kv_GB"] == pytest.approx(kv / 1e9)
        assert out["total_GB"] == pytest.approx((weights + kv) / 1e9)
    assert seed_estimate_gpu_memory(70, 8)["kv_GB"] == pytest.approx(1.342, abs=1e-3)


def test_seed000_head_dim_quirk():
    """The seed's head_dim = hidden // (8·n_kv) departs from hidden / n_heads when n_heads != 8·n_kv."""
    # a 32-head, 32-KV-head model (Llama-2-7B): the quirk gives head_dim 4096 // 256 = 16, not 128
    out = seed_estimate_gpu_memory(7, 1, n_layers=32, hidden_dim=4096, n_kv_heads=32)
    assert out["kv_GB"] == pytest.approx(2 * 4096 * 32 * 16 * 2 * 32 / 1e9)


def test_seed004_7b_table_holds_for_fp32_adamw():
    """Seed 004: 7B weights 28 GB, grads 28, optimizer 56, total 122 (with its 10 GB activations)."""
    c = _claims()
    for cid in ("s004-7b-params", "s004-7b-grads", "s004-7b-optimizer", "s004-7b-total", "s004-70b-fp32"):
        assert c[cid].holds, c[cid]
    assert c["s004-7b-optimizer"].formula_value == pytest.approx(56)


def test_seed004_zero_stage_arithmetic():
    """Seed 004: ZeRO-1 '56/8 = 7 GB' and ZeRO-2 '84/8 = 10.5 GB' hold for the sharded part;
    ZeRO-3 '122/8 = 15 GB per GPU' does not: activations are not sharded (14 + 10 = 24 GB)."""
    c = _claims()
    assert c["s004-zero1-opt"].holds and c["s004-zero1-opt"].formula_value == pytest.approx(7)
    assert c["s004-zero2-shard"].holds and c["s004-zero2-shard"].formula_value == pytest.approx(10.5)
    z3 = c["s004-zero3-total"]
    assert not z3.holds and z3.formula_value == pytest.approx(24)


def test_seed004_pipeline_utilisation_75pct_flagged():
    """Seed 004: '4 stages x 4 microbatches ~75% utilisation' vs GPipe m/(m+p-1) = 4/7 = 57%: flagged.
    The naive pipeline's 25% (m = 1) holds."""
    c = _claims()
    claim = c["s004-gpipe-75"]
    assert not claim.holds
    assert claim.formula_value == pytest.approx(4 / 7)
    assert c["s004-naive-pp"].holds and c["s004-naive-pp"].formula_value == pytest.approx(0.25)


def test_seed003_zero_savings_and_20x():
    """Seed 003: ZeRO-1 4x and ZeRO-2 8x hold in the large-N limit (ZeRO Fig. 1), stage 3 = N;
    'total ≈ 20x model size' does not match ZeRO's 16 bytes/param; Llama-70B on one node with TP=8
    does not fit 80 GB for mixed-precision Adam model states."""
    c = _claims()
    assert c["s003-zero1-savings"].holds and c["s003-zero2-savings"].holds and c["s003-zero3-linear"].holds
    assert c["s003-gpt3-fp32"].holds
    assert not c["s003-20x"].holds and c["s003-20x"].formula_value == pytest.approx(16)
    assert not c["s003-70b-one-node"].holds and c["s003-70b-one-node"].formula_value == pytest.approx(140)


def test_seed000_table_and_kv_split():
    """Seed 000: FP16 sizes 14/26/140/810 GB hold; 'KV cache not divided by P in TP' is flagged."""
    c = _claims()
    for name in ("7b", "13b", "70b", "405b"):
        assert c[f"s000-fp16-size-{name}"].holds
    assert c["s000-gpus-70b"].holds and c["s000-gpus-405b"].holds
    assert c["s000-kv-70b"].holds
    split = c["s000-kv-not-split"]
    assert not split.holds and split.formula_value == pytest.approx(split.claimed_value / 8)


def test_claim_fields_complete():
    """Every claim names its source and formula and explains itself; holds agrees with the tolerance."""
    for claim in seed_claims():
        assert claim.source.startswith("seed ") and claim.formula and claim.explanation and claim.unit
        if claim.comparison == "approx":
            within = abs(claim.formula_value - claim.claimed_value) <= claim.tolerance * abs(claim.claimed_value)
            assert claim.holds == within
        assert set(claim.as_dict()) >= {"id", "source", "text", "claimed_value", "unit", "formula_value",
                                        "formula", "holds", "tolerance", "explanation"}
