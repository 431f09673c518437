"""Per-device parameter layout of ShardLab's JAX/XLA GSPMD runs (backend/frameworks/jax), pure Python.

Mesh ("dp", "tp") of shape (dp, tp), row-major (device d has coords dp = d // tp, tp = d % tp, as
ParallelSpec.coords). One rule per parameter, shared by the runner (which builds the NamedShardings from it)
and the prediction, so "argument bytes per device = params + optimizer state + data" is checked against the
layout the run actually used:
- dp: every parameter replicated (GSPMD data parallelism; Xu et al. 2021, "GSPMD", §3.3 data parallelism).
- fsdp: each parameter split along its first dimension divisible by dp, over "dp" (ZeRO-3 / FSDP: Rajbhandari
  et al. 2020 §5.3 P_os+g+p; GSPMD §3.3 "sharding weights along the batch axis"); replicated if none divides.
- tp: Megatron-style (Shoeybi et al. 2019 §3): the same per-module plan as ShardLab's torch TP
  (backend/analytic/sharding.tp_style: column-parallel rows, row-parallel columns, vocab-parallel embeddings
  and lm_head), over "tp"; replicated over "dp". A dimension tp does not divide stays replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.params import ParamInfo, param_list
from backend.analytic.sharding import tp_style
from backend.analytic.tp_placement import REPLICATE, ROWWISE

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

FP32_BYTES = 4
TOKEN_BYTES = 4  # int32 token ids (JAX's default integer without x64)
OPT_STATES = {"adamw": 2, "sgd": 1}  # Adam m and v (Kingma & Ba 2015 Alg. 1); SGD momentum buffer


def layout(spec: ExperimentSpec) -> dict[str, tuple[int | None, str | None]]:
    """name -> (sharded dimension or None, mesh axis or None)."""
    p = spec.parallel
    fsdp = str(p.strategy) in ("zero3", "fsdp")
    return {q.name: _rule(q, fsdp, p.dp, p.tp) for q in param_list(spec.model)}


def mode(spec: ExperimentSpec) -> str:
    """dp, fsdp, tp or dp x tp, as the run page names the layout."""
    p = spec.parallel
    if str(p.strategy) in ("zero3", "fsdp"):
        return "fsdp"
    if p.tp > 1:
        return "dp x tp" if p.dp > 1 else "tp"
    return "dp"


def _rule(q: ParamInfo, fsdp: bool, dp: int, tp: int) -> tuple[int | None, str | None]:
    if fsdp and dp > 1:
        return next(((d, "dp") for d, n in enumerate(q.shape) if n % dp == 0), (None, None))
    if tp == 1:
        return None, None
    style = tp_style(q.name)
    if style == REPLICATE or (style == ROWWISE and q.name.endswith(".bias")):
        return None, None
    d = 1 if style == ROWWISE else 0  # Linear colwise and (vocab) embedding rowwise split rows
    return (d, "tp") if q.shape[d] % tp == 0 else (None, None)


def axis_size(spec: ExperimentSpec, axis: str | None) -> int:
    return {"dp": spec.parallel.dp, "tp": spec.parallel.tp}.get(axis or "", 1)


def param_numel_per_device(spec: ExperimentSpec) -> int:
    lay = layout(spec)
    return sum(q.numel // axis_size(spec, lay[q.name][1]) for q in param_list(spec.model))


def predicted_bytes(spec: ExperimentSpec) -> dict[str, int]:
    """Per device: params, optimizer state, the step's input data, and their sum (XLA's argument bytes)."""
    n = param_numel_per_device(spec)
    params = n * FP32_BYTES
    optimizer = OPT_STATES[str(spec.train.optimizer)] * n * FP32_BYTES
    rows = spec.train.global_batch // spec.parallel.dp  # the batch is split over "dp", replicated over "tp"
    data = 2 * rows * spec.model.seq_len * TOKEN_BYTES  # inputs and targets
    scalars = FP32_BYTES  # the step counter
    return {"params_bytes": params, "optimizer_bytes": optimizer, "data_bytes": data,
            "argument_bytes": params + optimizer + data + scalars}
