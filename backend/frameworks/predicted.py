"""What a DeepSpeed / JAX run predicts per rank for its own layout, in place of the torch engine's model states:
the numbers the run's assembler (backend/frameworks/assemblers.py) puts beside the measured ones, and `estimate`
prints for the same spec, so the two never disagree."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec


@dataclass(frozen=True)
class FrameworkLayout:
    """One rank's predicted categories for the framework's layout (every rank alike); activations are not in it:
    DeepSpeed's run keeps the torch engine's activation formula, XLA reports activations only as a temp buffer."""

    framework: str
    params_bytes: int
    grads_bytes: int
    """DeepSpeed: the preallocated reduce bucket (ZeRO-3); JAX: 0 (XLA's temp buffer holds the gradients)."""
    optimizer_bytes: int
    """Optimizer state, plus DeepSpeed's fp32 master partition."""
    other_bytes: int
    """JAX: the batch on each device; DeepSpeed: 0."""
    backward_bucket_bytes: int = 0
    """DeepSpeed ZeRO-1/2: the reduce bucket allocated at backward, in the peak but in no category."""
    offload: str = "none"
    """The spec's offload: on a GPU, what it names sits in host memory (on this CPU host, the same memory)."""

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)


def framework_layout(spec: ExperimentSpec) -> FrameworkLayout | None:
    """The framework's own per-rank layout, or None for the torch engine (whose prediction is the estimate's)."""
    framework = str(spec.framework)
    if framework == "deepspeed":
        from backend.analytic.frameworks.deepspeed_layout import deepspeed_rank
        from backend.frameworks.deepspeed.ds_config import BUCKET_ELEMENTS, PERSISTENCE_THRESHOLD

        lay = deepspeed_rank(spec, bucket_elements=BUCKET_ELEMENTS, persistence_threshold=PERSISTENCE_THRESHOLD)
        return FrameworkLayout(framework, params_bytes=lay.params_bytes, grads_bytes=lay.grad_bucket_bytes,
                               optimizer_bytes=lay.master_bytes + lay.optimizer_state_bytes, other_bytes=0,
                               backward_bucket_bytes=lay.backward_bucket_bytes, offload=str(spec.parallel.offload))
    if framework == "jax":
        from backend.analytic.frameworks.gspmd import predicted_bytes

        pb = predicted_bytes(spec)
        return FrameworkLayout(framework, params_bytes=pb["params_bytes"], grads_bytes=0,
                               optimizer_bytes=pb["optimizer_bytes"], other_bytes=pb["data_bytes"])
    return None


def layout_line(d: dict[str, int | str]) -> str:
    """`estimate`'s line for a FrameworkLayout.to_dict(): what the run will predict beside its measurement."""
    mib = 1024 ** 2
    total = sum(int(d[k]) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "other_bytes"))
    grads = "reduce bucket" if d["framework"] == "deepspeed" else "in XLA's temp buffer"
    return (f"framework {d['framework']}: its run predicts per rank params {int(d['params_bytes']) / mib:.2f} MiB + "
            f"grads ({grads}) {int(d['grads_bytes']) / mib:.2f} MiB + optimizer {int(d['optimizer_bytes']) / mib:.2f}"
            f" MiB + other {int(d['other_bytes']) / mib:.2f} MiB = {total / mib:.2f} MiB before activations, for its "
            "own layout (the table is the estimate's layout model of the same spec)"
            + (f"; its peak adds the {int(d['backward_bucket_bytes']) / mib:.2f} MiB reduce bucket of the backward"
               if int(d.get("backward_bucket_bytes", 0)) else "")
            + (f"; offload {d['offload']}: on a GPU those states sit in host memory" if d.get("offload", "none")
               != "none" else ""))
