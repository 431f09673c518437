"""Every private torch API ShardLab touches, in one module (tests/unit/test_torch_compat.py checks each one), so a
torch upgrade that moves or changes one fails loudly here instead of deep inside a run.

Pinned against torch 2.13.0 (this venv) and torch 2.11.0 (the GPU machine's image): where the two differ the
function here handles both, by capability (hasattr), never by version string. Each name says what we rely on; the
test next to it says how we use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed._functional_collectives as functional_collectives
import torch.distributed._tools.fsdp2_mem_tracker as fsdp2_mem_tracker
import torch.distributed._tools.mem_tracker as mem_tracker
import torch.distributed.pipelining.schedules as pipelining_schedules  # noqa: F401 - re-exported (strategies/timeline)
import torch.distributed.pipelining.stage as pipelining_stage
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel.ddp import _unflatten_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

# FSDP2-style DDP that takes DTensor (TP) parameters and pipelining stages (no public home in 2.13).
replicate = replicate

# Autograd all_to_all with uneven splits, used by the expert-parallel token dispatch (torch has no public one).
all_to_all_single_autograd = functional_collectives.all_to_all_single_autograd

# One flat buffer for the expert grads' single all_reduce (what DDP's reducer does internally).
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors

# The group object behind a functional collective's group-name argument (comm counting).
resolve_process_group = _resolve_process_group

# pipelining: `_PipelineStageBase.{forward_one_chunk, backward_one_chunk, backward_weight_one_chunk,
# perform_reduce_grad}` and `schedules._wait_batch_p2p` are wrapped for the timeline and the memory tracker.
PipelineStageBase = pipelining_stage._PipelineStageBase

# MemTracker / FSDPMemTracker internals the category trackers subclass or call.
MemTracker = mem_tracker.MemTracker
ModMemStats = mem_tracker._ModMemStats
MemRefType = mem_tracker._MemRefType  # GRAD / OPT: the categories `track_as` books a storage under
FSDPMemTracker = fsdp2_mem_tracker.FSDPMemTracker
FSDPModMemStats = fsdp2_mem_tracker._FSDPModMemStats
FSDPRefType = fsdp2_mem_tracker._FSDPRefType
# the tracker's `_fsdp_state`: PRE_FW / PRE_BW = inside FSDP's all-gather hooks
FSDPState = fsdp2_mem_tracker._FSDPState

# A custom tensor-parallel style overrides ParallelStyle._apply (the MoE sequence-parallel gather/scatter).
ParallelStyle = ParallelStyle


@contextlib.contextmanager
def tracked_outputs_walked() -> Iterator[None]:
    """While inside: MemTracker's and FSDPMemTracker's `__torch_dispatch__` hand each op's outputs to a walk that calls
    their `_track` on the same tensors in the same order as the module-level `tree_map_only(torch.Tensor, track, res)`
    they call, without pytree's flatten and unflatten of a tree they throw away (py-spy of the farm's world-2 lane:
    ~12% of the memory-tracked step). Both modules' `tree_map_only` global is swapped back on exit."""
    modules = (mem_tracker, fsdp2_mem_tracker)
    originals = [m.tree_map_only for m in modules]
    for m in modules:
        m.tree_map_only = _visit_tensors
    try:
        yield
    finally:
        for m, original in zip(modules, originals, strict=True):
            m.tree_map_only = original


_PLAIN_LEAVES = (int, float, bool, str, torch.dtype, torch.device)


def _visit_tensors(kind: type, fn: Callable[[torch.Tensor], object], tree: object) -> None:
    """`fn` on every tensor leaf of `tree` (tensors, tuples and lists walked here, any other node by pytree)."""
    if kind is not torch.Tensor:
        pytree.tree_map_only(kind, fn, tree)
    elif isinstance(tree, torch.Tensor):
        fn(tree)
    elif type(tree) in (tuple, list):
        for item in tree:
            if item is not None and type(item) not in _PLAIN_LEAVES:
                _visit_tensors(kind, fn, item)
    elif tree is not None and type(tree) not in _PLAIN_LEAVES:
        pytree.tree_map_only(kind, fn, tree)


def ddp_ignore_params(module: torch.nn.Module, names: list[str]) -> None:
    """Leave these parameters out of DDP's reducer (the experts under expert parallelism)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def completed_work(value: list[torch.Tensor]) -> torch.ScriptObject:
    """A c10d Work that is already complete with `value` (its future's result), boxed as a c10d op returns it
    (backend/bench/settle.py hands it back in place of a settled gloo all-gather's or reduce-scatter's Work)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()


def tensor_use_count(t: torch.Tensor) -> int:
    """Holders of the tensor's TensorImpl, C++ ones included (a c10d Work holds its buffers until it is destroyed)."""
    return t._use_count()


def current_graph_task_id() -> int:
    """-1 outside a backward pass (the memory tracker uses it to tell forward from backward work)."""
    return torch._C._current_graph_task_id()


def auto_dispatch_below_ad_inplace_or_view():
    """Guard a kernel override re-enters torch's own kernel with (comm_hooks)."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def destroy_library(lib: torch.library.Library) -> None:
    """Give torch its own kernels back after our c10d overrides (comm_hooks)."""
    lib._destroy()


def fake_store():
    """The fake process group's store: `init_process_group("fake", store=fake_store(), ...)` (tests, trace)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # testing-only module: imported on use

    return FakeStore()


def unflatten_ddp_tp_param(param: torch.Tensor) -> torch.Tensor:
    """A DDP×TP parameter DDP keeps as a plain local tensor -> its DTensor (test harness)."""
    return _unflatten_tensor(param, param._st_info)



class LocalShardGradScaler(ShardedGradScaler):
    """`ShardedGradScaler` whose inf/NaN check and unscale run on every gradient's LOCAL tensor (a DTensor grad by
    its shard); torch's `unscale_` then all-reduces the found-inf flag over the scaler's process group as before.

    Why: torch's `_unscale_grads_` puts every grad of one device and dtype into one
    `torch._amp_foreach_non_finite_check_and_unscale_` call; DTensor rejects a list that mixes DTensor and plain
    grads ("got mixed torch.Tensor and DTensor"), which TP without SP and FSDP2 with ignored expert params both
    produce, and for an all-DTensor list it reduces the flag only by the FIRST grad's placements. Overrides the
    private `ShardedGradScaler._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)` (torch 2.13)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        by_device: dict = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for q in group["params"]:
                    g = q.grad
                    if g is None:
                        continue
                    if not allow_fp16 and g.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    local = g.to_local() if isinstance(g, DTensor) else g  # under no_grad: the shard itself
                    by_device.setdefault(local.device, {}).setdefault(local.dtype, []).append(local)
            flags = {}
            for device, by_dtype in by_device.items():
                flag = found_inf if found_inf.device == device else torch.zeros_like(found_inf, device=device)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
                flags[device] = flag
        return flags or {found_inf.device: found_inf}  # no local grads: still takes part in the flag's all-reduce


def unflatten_mesh(mesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...],
                   backend_override: dict | None = None):
    """`mesh` with its dim `dim` split into `names` of `sizes` (row-major), sharing the root mesh and its other dims'
    process groups; new groups for the new dims, collective on every rank (the private `DeviceMesh._unflatten`, as
    torchtitan's ParallelDims builds its EP computation mesh). `backend_override` {name: backend} forces fresh groups
    for a dim even where it spans the world (else it reuses the default group). The dim goes by index: torch 2.11's
    name check is inverted (it refuses every name the mesh has)."""
    return mesh._unflatten(mesh.mesh_dim_names.index(dim), sizes, names, backend_override=backend_override)


def host_chunk(full: torch.Tensor, mesh, placements) -> torch.Tensor | None:
    """This rank's piece of `full` under (mesh, placements), cut where `full` lives (`distribute_tensor` first moves
    it to the mesh's device): the private `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`,
    the shape/offset rule DTensor itself shards by. None where a placement is not a plain Shard or Replicate (a
    _StridedShard piece is not one slice)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(type(pl) not in (Shard, Replicate) for pl in placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=False))]


def is_fake_tensor(t: torch.Tensor) -> bool:
    """A FakeTensor (FakeTensorMode: shapes and dtypes, no storage): the full-scale trace's parameters."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def reset_fsdp_sharded_params(module: torch.nn.Module) -> None:
    """What FSDPModule._apply does after nn.Module._apply: every FSDP2 / replicate parameter of `module` re-reads
    its (possibly replaced) sharded Parameter from its owning module and re-pads its local shard."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in fsdp_param_groups(m):
                for fsdp_param in group.fsdp_params:
                    fsdp_param.reset_sharded_param()


def fsdp_param_groups(module: torch.nn.Module) -> list:
    """The FSDPParamGroups of one fully_shard'ed module: torch 2.13's state holds a list `_fsdp_param_groups`,
    torch 2.11's at most one `_fsdp_param_group` (None when the module has no parameters of its own)."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]



def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp (b, a, s) fp32) of the CPU flash kernel SDPA runs on CPU tensors: ring attention needs the
    logsumexp to merge blocks, which F.scaled_dot_product_attention does not return."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def cpu_flash_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block from the merged output and logsumexp (the kernel recomputes P = exp(S - lse))."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal)


def torch_context_parallel_style(mesh, module: torch.nn.Module) -> None:
    """torch's experimental context parallelism applied to one attention-core module: `_ContextParallel(seq_dim=2,
    SDPA)` turns its q, k, v into DTensors sharded on the sequence over `mesh`, so SDPA dispatches to torch's ring
    attention (CUDA flash / efficient / cuDNN kernels only), and its output back to the local shard."""
    from torch.distributed.tensor.experimental import _attention as cp_attention
    from torch.distributed.tensor.parallel import parallelize_module

    style = cp_attention._ContextParallel(seq_dim=2, attention_type=cp_attention._ContextParallel.AttentionType.SDPA)
    parallelize_module(module, mesh, style)


def enable_torch_context_parallel(module: torch.nn.Module, mesh, *, rotate: str, load_balance: bool) -> None:
    """`torch_context_parallel_style` on `module`, then torch's process-wide CP switches: the DTensor SDPA dispatcher
    (`_enable_context_parallel_dispatcher`), the K/V rotation (`set_rotate_method`: "allgather" | "alltoall") and
    `_cp_options.enable_load_balance` (head-tail chunks: the engine shards the batch that way itself)."""
    from torch.distributed.tensor.experimental import _attention as cp_attention

    torch_context_parallel_style(mesh, module)
    cp_attention._enable_context_parallel_dispatcher()
    cp_attention.set_rotate_method(rotate)
    cp_attention._cp_options.enable_load_balance = load_balance
