"""The experiment spec: one typed object (pydantic) that flows UI -> store -> launcher -> ranks -> result -> plots.

`choices` holds the closed value sets, `sections` the parts (model, train, parallel, runtime) with their bounds,
`checks` the cross-field checks with their arithmetic, `framework_support` what DeepSpeed and JAX run, `experiment` the
whole spec and `validate_spec`; `fields` names the fields for CLI flags and sweeps, `user_text` bounds what people type.
The names below are the spec's public API: `from backend.spec import ExperimentSpec, validate_spec`.
"""

from backend.spec.choices import (
                                  DP_FLAVOURS,
                                  GATED_MLPS,
                                  MULTI_STAGE_SCHEDULES,
                                  ZERO_STAGE,
                                  AttentionImpl,
                                  Backend,
                                  Bias,
                                  CpRotate,
                                  Device,
                                  Executor,
                                  Fp8Recipe,
                                  Framework,
                                  Mlp,
                                  MoeDispatcher,
                                  Norm,
                                  Offload,
                                  Optimizer,
                                  Positions,
                                  Precision,
                                  Recompute,
                                  RouterScore,
                                  Schedule,
                                  Strategy,
                                  WindowKind,
)
from backend.spec.dims import MAX_WORLD
from backend.spec.experiment import ExperimentSpec, SpecError, validate_spec
from backend.spec.model_spec import ModelSpec
from backend.spec.parallel_spec import ParallelSpec
from backend.spec.runtime_spec import RuntimeSpec
from backend.spec.section_base import MAX_BATCH, MAX_DIM, MAX_LAYERS, MAX_SEQ, MAX_STEPS, MAX_VOCAB, READ_BACK
from backend.spec.train_spec import TrainSpec

__all__ = [
    "DP_FLAVOURS", "GATED_MLPS", "MULTI_STAGE_SCHEDULES", "ZERO_STAGE", "AttentionImpl", "Backend", "Bias", "CpRotate",
    "Device", "Executor", "Fp8Recipe", "Framework", "Mlp", "MoeDispatcher", "Norm", "Offload", "Optimizer", "Positions",
    "Precision", "Recompute", "RouterScore", "Schedule", "Strategy", "WindowKind",
    "ExperimentSpec", "SpecError", "validate_spec", "READ_BACK", "MAX_BATCH", "MAX_DIM", "MAX_LAYERS", "MAX_SEQ",
    "MAX_STEPS", "MAX_VOCAB", "MAX_WORLD", "ModelSpec", "ParallelSpec", "RuntimeSpec", "TrainSpec",
]
