"""Formulas' "Checked on measured runs": a ZeRO run is checked against a DDP run of the same framework only, and a
run without per-category measurements (imported: its log gives allocator peaks) is neither checked nor a baseline."""

from __future__ import annotations

from backend.result import ImportFacts
from backend.spec import ExperimentSpec
from dashboard import formulas_view as fv
from tests.helpers.store_helpers import TINY, fake_result


def _with(framework: str, strategy: str, seed: int):
    s = ExperimentSpec.model_validate({**TINY, "framework": framework,
                                       "parallel": {**TINY["parallel"], "strategy": strategy}})
    return fake_result(s, seed=seed)


def _zero_rows(runs) -> list:
    df = fv.measured_checks(runs)
    return df[df["check"].str.contains("saves model-state")]["run"].tolist()


def test_zero_check_pairs_runs_of_one_framework() -> None:
    ddp, zero3, ds_zero3 = _with("torch", "ddp", 0), _with("torch", "zero3", 1), _with("deepspeed", "zero3", 2)
    assert _zero_rows([(1, ddp), (2, zero3), (3, ds_zero3)]) == [2]  # DeepSpeed's zero3 has no DeepSpeed DDP here


def test_an_imported_run_is_neither_baseline_nor_checked() -> None:
    ddp, zero3 = _with("torch", "ddp", 0), _with("torch", "zero3", 1)
    facts = ImportFacts.model_validate({"framework": "torchtitan", "gpus": 2, "source_file": "x.toml",
                                        "log_file": "x.log"})
    imported_ddp = ddp.model_copy(update={"imported": facts})
    imported_zero3 = zero3.model_copy(update={"imported": facts})
    assert _zero_rows([(1, imported_ddp), (2, zero3)]) == []  # 0 B baseline would read "0.00x"
    assert _zero_rows([(1, ddp), (2, imported_zero3)]) == []
