"""Tiny specs the tests share: `tiny(name, ...)` for the model-parallel layouts, `tiny_spec(...)` for the launcher's
own tests (a 2-rank DDP job); `stored_spec(name)`, a spec as an older commit stored it (tests/fixtures/stored_specs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backend.spec import ExperimentSpec


def tiny(name: str, *, model: dict | None = None, train: dict | None = None, **parallel: Any) -> ExperimentSpec:
    m = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16} | (model or {})
    t = {"global_batch": 8, "micro_batch": 2, "steps": 2, "warmup_steps": 0} | (train or {})
    return ExperimentSpec.model_validate({"name": name, "model": m, "train": t, "parallel": parallel})


def tiny_spec(**runtime: Any) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2, "warmup_steps": 1},
        "parallel": {"strategy": "ddp", "world_size": 2},
        "runtime": {"device": "cpu", "timeout_s": 120, **runtime},
    })


def stored_spec(name: str) -> str:
    """The spec JSON an older commit stored (tests/fixtures/stored_specs/README.md says which and how)."""
    return (Path(__file__).resolve().parents[1] / "fixtures" / "stored_specs" / f"{name}.json").read_text().strip()
