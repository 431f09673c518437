"""CLI: --preset / --hf-config / --run-here / family flags on estimate (and run/submit through add_spec_flags),
and the microbatch-only batch derivation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.cli import main
from backend.spec import validate_spec

HF = Path(__file__).parents[1] / "fixtures" / "hf"


def _estimate_json(capsys, *args: str) -> dict:
    assert main(["estimate", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_llama_2_70b_per_rank_breakdown(capsys):
    """Issue 12: the per-rank breakdown of the real 69.0B model (HF meta-llama/Llama-2-70b-hf: 68,976,648,192)."""
    d = _estimate_json(capsys, "--preset", "llama-2-70b", "--tp", "8", "--pp", "4", "--world", "64",
                       "--precision", "bf16-mixed", "--micro-batch", "1", "--microbatches", "16")
    assert d["params_total"] == 68_976_648_192
    assert len(d["per_rank"]) == 64
    # every parameter is on exactly one (pp, tp) position: the dp=2 replicas hold the same local elements
    assert all(r["params_bytes"] > 0 for r in d["per_rank"])


def test_hf_config_flag_and_refusal(capsys):
    d = _estimate_json(capsys, "--hf-config", str(HF / "mixtral-8x7b.json"), "--seq", "4096")
    assert d["params_total"] == 46_702_792_704
    assert main(["estimate", "--hf-config", str(HF / "pythia-160m.json")]) != 0
    assert "use_parallel_residual" in capsys.readouterr().err


def test_run_here_scales_down_keeping_family(capsys):
    d = _estimate_json(capsys, "--preset", "qwen1.5-moe-a2.7b", "--run-here", "--strategy", "ep", "--world", "2")
    assert d["params_total"] < 5_000_000


def test_family_flags_override_preset():
    import argparse

    from backend.cli.spec_flags import add_spec_flags, spec_dict_from_args

    p = argparse.ArgumentParser()
    add_spec_flags(p)
    data = spec_dict_from_args(p.parse_args(["--preset", "gpt2", "--no-tie-embeddings", "--attention", "flash"]))
    assert data["model"]["tie_embeddings"] is False and data["model"]["attention"] == "flash"
    assert data["model"]["source"] == {"preset": "gpt2"}


def test_microbatches_alone_derive_global_batch():
    spec, problems = validate_spec({"parallel": {"strategy": "pp", "pp": 4}, "model": {"n_layers": 4},
                                    "train": {"microbatches": 16, "micro_batch": 1}})
    assert problems == [] and spec.train.global_batch == 16
    _, problems = validate_spec({"parallel": {"strategy": "pp", "pp": 4}, "model": {"n_layers": 4},
                                 "train": {"microbatches": 16, "micro_batch": 1, "global_batch": 8}})
    assert problems == ["microbatches=16 != global batch 8 / (micro-batch 1 * dp 1) = 8"]


@pytest.mark.parametrize("model,needle", [
    ({"n_shared_experts": 1}, "n_shared_experts=1 needs a MoE model"),
    ({"positions": "rope", "d_model": 12, "n_heads": 4}, "head_dim = d_model / n_heads = 12 / 4 = 3 must be even"),
    ({"n_experts": 4, "shared_expert_gate": True}, "shared_expert_gate needs n_shared_experts >= 1"),
])
def test_family_checks_show_arithmetic(model, needle):
    _, problems = validate_spec({"model": model})
    assert any(needle in p for p in problems), problems


def test_tp_must_divide_expert_and_shared_hidden():
    _, problems = validate_spec({"model": {"n_experts": 4, "expert_ffn_hidden": 30, "n_shared_experts": 1,
                                           "shared_ffn_hidden": 6},
                                 "parallel": {"strategy": "tp", "tp": 4, "world_size": 4}})
    assert any("expert_ffn_hidden=30 (30 % 4 = 2)" in p for p in problems), problems
    assert any("shared-expert hidden" in p and "6 % 4 = 2" in p for p in problems), problems
