"""Host-side DTensor dispatch a rank pays on top of its kernels (pure Python).

On a GPU the host enqueues kernels ahead of the device, so dispatch hides behind them (Tunables.dtensor_op_s = 0).
A CPU rank runs each kernel on the thread that dispatched it, so host cost adds to the step. The part that differs
between layouts is DTensor's: every operator on a DTensor passes Python `__torch_dispatch__` and sharding
propagation (torch/distributed/tensor/_dispatch.py OpDispatcher.dispatch), far more than a plain op.

Dispatch counts, from torch.profiler "PythonSubclass" events of one step of this repo's GPT (torch 2.13, CPU,
gloo, fp32, world 2; counts do not depend on machine load):
- TP: 108 per layer and microbatch (forward + backward) with the 6 TP linears q, k, v, o, fc_in, fc_out, i.e.
  18 per TP linear (input redistribute, linear, output to_local, and their backward); sequence parallel adds 10
  per layer (its 2 LayerNorms on DTensors). Same per layer with dp2 x tp2 ZeRO-2 (868 over 8 layer-microbatches).
- optimizer step + zero_grad: 9 per DTensor parameter for AdamW (torch/optim/adamw.py _single_tensor_adamw:
  mul_, lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_; zero_grad's zero_): 621 for FSDP2's 69 parameters.
  SGD with momentum: 4 (mul_, add_, add_, zero_).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from backend.analytic.sharding import LocalParam, derived

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

DISPATCH_PER_TP_LINEAR = 18
DISPATCH_PER_SP_LAYER = 10
DISPATCH_PER_PARAM = {"adamw": 9, "sgd": 4}
FSDP2_FLAVOURS = ("zero2", "zero3", "fsdp")


def _norm(name: str) -> bool:
    return ".ln" in name or name.startswith(("norm.", "ln_f.")) or ".norm" in name


def _router(name: str) -> bool:
    return ".router" in name or ".shared_gate" in name


def fsdp2_wrapped(spec: ExperimentSpec) -> bool:
    """Parameters are FSDP2 DTensors: fully_shard (zero2/zero3) or, in a tp/pp mix with dp > 1, `replicate`
    (backend/strategies/data_parallel.py uses_fsdp2)."""
    p = spec.parallel
    pure = p.tp == 1 and p.pp == 1 and p.ep == 1
    flavour = str(p.dp_flavour)
    if flavour in FSDP2_FLAVOURS:
        return p.dp_cp > 1 or pure
    return p.dp_cp > 1 and flavour == "ddp" and p.ep == 1 and not pure


def dtensor_params(spec: ExperimentSpec, params: Sequence[LocalParam]) -> int:
    """Parameters of this rank that are DTensors: all under FSDP2; under TP all but the plain LayerNorms (plain
    unless sequence parallel) and the replicated MoE router (backend/strategies/tp.py plan table)."""
    p = spec.parallel
    if fsdp2_wrapped(spec):
        return len(params)
    if p.tp == 1:
        return 0
    return sum(1 for q in params if not _router(q.name) and (p.sequence_parallel or not _norm(q.name)))


def tp_dispatch_per_layer(spec: ExperimentSpec, params: list[LocalParam], layer: int) -> int:
    """DTensor dispatches of one layer and microbatch, forward + backward (module docstring)."""
    p = spec.parallel
    if p.tp == 1:
        return 0
    prefix = f"layers.{layer}."
    linears = sum(1 for q in params if q.name.startswith(prefix) and len(q.shape) == 2 and q.local_shape != q.shape)
    return DISPATCH_PER_TP_LINEAR * linears + (DISPATCH_PER_SP_LAYER if p.sequence_parallel else 0)


def optimizer_dispatch(spec: ExperimentSpec, params: list[LocalParam]) -> int:
    """DTensor dispatches of optimizer.step + zero_grad on this rank."""
    p = spec.parallel
    n = derived(params, ("dtensor_params", fsdp2_wrapped(spec), p.tp, bool(p.sequence_parallel)),
                lambda ps: dtensor_params(spec, ps))  # memoised on every input dtensor_params reads
    return DISPATCH_PER_PARAM.get(str(spec.train.optimizer), DISPATCH_PER_PARAM["adamw"]) * n


def tp_dispatch_layers(spec: ExperimentSpec, params: Sequence[LocalParam], layers: Sequence[int]) -> int:
    """sum(tp_dispatch_per_layer(spec, params, i) for i in layers), from one pass over the parameters (memoised
    per shared params tuple, sharding.derived)."""
    p = spec.parallel
    if p.tp == 1:
        return 0
    per_layer = derived(params, "tp_linears_per_layer", _tp_linears_per_layer)
    linears = sum(per_layer.get(i, 0) for i in layers)
    return DISPATCH_PER_TP_LINEAR * linears + (DISPATCH_PER_SP_LAYER * len(layers) if p.sequence_parallel else 0)


def _tp_linears_per_layer(params: Sequence[LocalParam]) -> dict[int, int]:
    """TP-sharded linear weights per layer index (tp_dispatch_per_layer's count)."""
    out: dict[int, int] = {}
    for q in params:
        if q.name.startswith("layers.") and len(q.shape) == 2 and q.local_shape != q.shape:
            i = int(q.name.split(".", 2)[1])
            out[i] = out.get(i, 0) + 1
    return out
