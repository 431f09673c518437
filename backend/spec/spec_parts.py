"""What the cross-field checks read of a whole spec (checks.py, run_rules.py, framework_support.py): its four sections
and its framework, as a Protocol, so the checks can run on an ExperimentSpec while it validates."""

from __future__ import annotations

from typing import Protocol

from backend.spec.choices import Framework
from backend.spec.model_spec import ModelSpec
from backend.spec.parallel_spec import ParallelSpec
from backend.spec.runtime_spec import RuntimeSpec
from backend.spec.train_spec import TrainSpec


class SpecParts(Protocol):
    """What the cross-field checks read of a spec (an ExperimentSpec while it validates)."""

    model: ModelSpec
    train: TrainSpec
    parallel: ParallelSpec
    runtime: RuntimeSpec
    framework: Framework
