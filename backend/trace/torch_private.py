"""Every private torch API the full-scale trace touches, in one place (tests/unit/test_trace_compat.py and
tests/multiprocess/test_trace_compat.py check each symbol), so a torch upgrade fails loudly here and nowhere else.

A traced rank runs the engine's own set-up and train step on fake tensors (`FakeTensorMode`: shapes,
dtypes and storage sizes, no data) over the fake process group (`init_process_group("fake")`:
collectives return at once, nothing is sent). A few spots of torch cannot run that way; each stand-in
below is what the real program would compute, for memory purposes, and is installed only inside
`fake_world()` in the trace's own process:

- `FakeMode`: ops whose tensor inputs are all real (the DeviceMesh's int32 rank tensor) run for real,
  so mesh slicing works inside the mode; a float `.item()` (the reported loss) returns NaN: the step's
  loss is data, not memory. An integer `.item()` still raises: shapes that depend on data (MoE routing
  counts) cannot be traced, and the trace reports `unsupported` naming it.
- `nn.Module.to(device)` when every parameter and buffer is already there: returns the module (what
  torch does for real tensors); torch's swap path rejects fake parameters held by the fake mode's memo.
- classic DDP (pure ddp, zero1's DDP, ddp with ep): torch's C++ Reducer reads parameter storage, which fake
  tensors lack; the trace puts `ddp_standin.BucketedDDP` in its place (`ddp_standin.standing_in()`, entered
  beside `fake_world()`), built on `ddp_bucket_assignment` below.
- MoE routing (which expert each token goes to) is data. `topk` on a fake tensor returns the fake
  values and, as indices, the balanced assignment the analytic model assumes (uniform routing): slot j
  of token i goes to expert (i·k + j) mod E, as a real tensor. Every count derived from it (bincount,
  argsort, splits) is then real and computed for real; the expert-parallel count exchange
  (`dist.all_to_all_single` of real int tensors) returns what every peer sends under that routing
  (all ranks route alike): my experts' counts from each peer. Integer `arange` is real too (its values
  come from its arguments), so index arithmetic on it stays real.
- pipelining: stages on other ranks would send their output/grad metadata (torch 2.13: `_send_meta`, and a
  vote on the inference mode, `.item()` of a received int; torch 2.11: `send_object_list` of meta tensors);
  the traced rank computes both locally: a GPT stage boundary is always the residual stream `hidden_meta`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


class DataDependentShape(RuntimeError):
    """An integer read from a fake tensor: the program's shapes or control flow depend on data values."""


class FakeMode(FakeTensorMode):
    """FakeTensorMode where all-real ops run for real and float `.item()` is NaN (see module docstring)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = _tensor_args(args, kwargs)
        if func not in _LIFTS and tensors and not any(isinstance(x, FakeTensor) for x in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func.overloadpacket is torch.ops.aten.arange and not _float_dtype(kwargs.get("dtype"), args):
            with unset_fake_temporarily():  # integer ranges are known from their arguments: index math stays real
                return func(*args, **kwargs)
        if func is torch.ops.aten.topk.default and isinstance(args[0], FakeTensor):
            values, _ = super().__torch_dispatch__(func, types, args, kwargs)
            return values, balanced_routing(args[0].shape[-1], values.shape)
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            if args[0].dtype.is_floating_point:
                return math.nan
            raise DataDependentShape(
                f"torch FakeTensorMode cannot read an integer value of a fake tensor "
                f"({args[0].dtype}, shape {tuple(args[0].shape)}): the program's shapes depend on data")
        return super().__torch_dispatch__(func, types, args, kwargs)


def _tensor_args(args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments: top-level, or in a list / tuple argument (aten schemas nest no deeper:
    Tensor, Tensor?, Tensor[], Tensor?[]); pytree's generic flatten cost ~7% of a trace."""
    out: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out.extend(x for x in value if isinstance(x, torch.Tensor))
    return out


def _float_dtype(dtype: torch.dtype | None, args: Any) -> bool:
    if dtype is not None:
        return dtype.is_floating_point
    return any(isinstance(a, float) for a in args)


def balanced_routing(n_experts: int, shape: torch.Size) -> torch.Tensor:
    """(..., k) int64 expert ids: slot j of row i -> (i·k + j) mod n_experts (a real tensor)."""
    with unset_fake_temporarily():
        return (torch.arange(math.prod(shape), dtype=torch.int64) % n_experts).view(shape)


def _all_to_all_single(orig: Callable[..., Any]) -> Callable[..., Any]:
    def all_to_all_single(output: torch.Tensor, input: torch.Tensor, *args: Any, group: Any = None,
                          **kwargs: Any) -> Any:
        if isinstance(output, FakeTensor) or isinstance(input, FakeTensor) or args or kwargs.get("async_op"):
            return orig(output, input, *args, group=group, **kwargs)
        n, me = dist.get_world_size(group), dist.get_rank(group)
        with unset_fake_temporarily():
            mine = input.view(n, -1)[me]
            output.view(n, -1).copy_(mine.expand(n, -1))  # every peer routes alike: each sends me this block
        return None

    return all_to_all_single


def ddp_bucket_assignment(params: list[torch.Tensor], limits_bytes: list[int]) -> list[list[int]]:
    """DDP's own bucketing (dist._compute_bucket_assignment_by_size, C++): index lists, one per bucket."""
    groups, _ = dist._compute_bucket_assignment_by_size(params, limits_bytes, [False] * len(params))
    return groups


def init_fake_pg(rank: int, world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def leave_fake_pg() -> None:
    """End a traced rank's fake world so the next spec can be traced in the same process: destroy the fake process
    group and clear DTensor's sharding-propagation caches, whose entries hold the old DeviceMesh (a new mesh of the
    same shape compares equal and would resolve the destroyed groups' names:
    torch/distributed/tensor/_sharding_prop.py `propagate_op_sharding` (a LocalLRUCache),
    `_propagate_tensor_meta_cached`, and the C++ fast path's cache,
    `torch._C._clear_DTensor_sharding_propagator_cache`)."""
    from torch.distributed.tensor import DTensor

    if dist.is_initialized():
        dist.destroy_process_group()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's copy of the same


def to_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    return mode.from_tensor(t)


def is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


def _module_to(orig: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, fmt = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if dtype is None and fmt is None and device is not None and all(t.device == device for t in tensors):
            return self
        return orig(self, *args, **kwargs)

    return to


def _pipeline_patches(hidden_meta: Callable[[], torch.Tensor]) -> list[tuple[Any, str, Any]]:
    """The stage-metadata exchange, computed locally: torch 2.13 sends it with `PipelineStage._send_meta` /
    `_recv_meta` and votes on `InferenceMode` in `_PipelineSchedule._warmup_p2p`; torch 2.11 has neither and
    sends a tuple of meta tensors with `dist.send_object_list` / `recv_object_list` inside
    `PipelineStage._shape_inference`. Chosen by what the installed torch has."""
    from torch.distributed.pipelining import stage

    if hasattr(stage.PipelineStage, "_recv_meta"):
        return _stage_meta_patches(hidden_meta)
    if hasattr(stage.PipelineStage, "_shape_inference"):
        return _object_list_patches(hidden_meta)
    raise NotImplementedError("this torch's PipelineStage has neither _recv_meta (2.13) nor _shape_inference (2.11): "
                              "backend/trace/torch_private.py cannot stand in for its stage-metadata exchange")


def _stage_meta_patches(hidden_meta: Callable[[], torch.Tensor]) -> list[tuple[Any, str, Any]]:
    from torch.distributed.pipelining import schedules, stage
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _StageBackwardMeta,
        _StageForwardMeta,
        extract_tensor_meta,
    )

    def recv_meta(self: Any, src_stage: int) -> Any:
        meta = extract_tensor_meta(hidden_meta())
        return _StageForwardMeta(forward_metas=(meta,)) if src_stage < self.stage_index else \
            _StageBackwardMeta(backward_metas=(meta,))

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        return None

    def warmup_p2p(self: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        # Every rank's stages are built by the same code with the same (absent) user metadata: the vote is local.
        dynamic = any(InferenceMode.needs_dynamic(s._user_meta, has_backward) for s in stages)
        for s in stages:
            s._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    return [(stage.PipelineStage, "_recv_meta", recv_meta), (stage.PipelineStage, "_send_meta", send_meta),
            (schedules._PipelineSchedule, "_warmup_p2p", warmup_p2p)]


def _object_list_patches(hidden_meta: Callable[[], torch.Tensor]) -> list[tuple[Any, str, Any]]:
    """torch 2.11: the only object lists a traced rank exchanges are the stages' output metadata (the engine's
    own object collectives run outside the trace): a send goes nowhere, a receive gets the boundary's meta."""

    def send_object_list(object_list: list, *args: Any, **kwargs: Any) -> None:
        return None

    def recv_object_list(object_list: list, *args: Any, **kwargs: Any) -> int:
        object_list[0] = (hidden_meta().detach().to("meta"),)  # what the sender's `x.to("meta")` of its output gives
        return 0

    return [(dist, "send_object_list", send_object_list), (dist, "recv_object_list", recv_object_list)]


@contextmanager
def fake_world(hidden_meta: Callable[[], torch.Tensor]) -> Iterator[FakeMode]:
    """The patches of the module docstring, then the fake mode; everything restored on exit."""
    patches = [(nn.Module, "to", _module_to(nn.Module.to)),
               (dist, "all_to_all_single", _all_to_all_single(dist.all_to_all_single)),
               *_pipeline_patches(hidden_meta)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        with FakeMode() as mode:
            yield mode
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
