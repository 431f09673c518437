"""One test per private torch symbol backend/torch_compat.py exposes: a torch upgrade that moves or changes one
fails here, by name, instead of deep inside a run."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

from backend import torch_compat as tc


def test_replicate_takes_a_mesh_and_ignored_params():
    assert {"mesh", "ignored_params"} <= set(inspect.signature(tc.replicate).parameters)


def test_all_to_all_single_autograd_signature():
    assert list(inspect.signature(tc.all_to_all_single_autograd).parameters)[:4] == [
        "self", "output_split_sizes", "input_split_sizes", "group"]


def test_flatten_unflatten_round_trip():
    ts = [torch.arange(3.0, device="cpu"), torch.ones(2, 2, device="cpu")]
    flat = tc.flatten_dense_tensors(ts)
    assert flat.shape == (7,)
    for a, b in zip(tc.unflatten_dense_tensors(flat, ts), ts, strict=False):
        torch.testing.assert_close(a, b)


def test_resolve_process_group_maps_a_group_name():
    dist.init_process_group("fake", store=tc.fake_store(), rank=0, world_size=2)
    try:
        pg = dist.group.WORLD
        assert tc.resolve_process_group(pg.group_name).size() == 2
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("meth", ["forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
                                  "perform_reduce_grad"])
def test_pipeline_stage_methods_we_wrap(meth):
    fn = getattr(tc.PipelineStageBase, meth)
    assert callable(fn)
    if meth != "perform_reduce_grad":  # timeline.py reads the chunk id as the first argument
        assert list(inspect.signature(fn).parameters)[1].endswith("_chunk_id")


def test_wait_batch_p2p_and_stage_modules():
    assert callable(tc.pipelining_schedules._wait_batch_p2p)
    assert tc.pipelining_stage._PipelineStageBase is tc.PipelineStageBase


def test_mem_tracker_internals():
    t = tc.MemTracker()
    for attr in ("track_external", "get_tracker_snapshot", "_update_peak_stats", "_pre_fw_hook", "reset_mod_stats"):
        assert callable(getattr(t, attr)), attr
    assert hasattr(t, "_mod_tracker") and hasattr(t, "_curr_mem_snap") and hasattr(t, "memory_tracking")
    assert t._peak_mem == {} and t._peak_mem_snap == {}  # bench/memory.py's _update_peak_stats keeps the peak in these
    assert "_peak_mem_snap" in inspect.getsource(tc.MemTracker.get_tracker_snapshot)
    assert callable(t._mod_tracker.get_known_fqn)
    assert inspect.isclass(tc.ModMemStats)


def test_tracked_outputs_walked_tracks_what_tree_map_only_tracks():
    """Both trackers call their module's `tree_map_only(torch.Tensor, partial(self._track, reftype), res)` on every op
    and drop its value; inside `tracked_outputs_walked` the walk visits the same tensors in the same order, and the
    snapshots of a step with nested, None and non-tensor outputs (max.dim's named tuple, split's list) are equal."""
    from torch.distributed._tools import fsdp2_mem_tracker, mem_tracker

    for module in (mem_tracker, fsdp2_mem_tracker):
        assert "tree_map_only(torch.Tensor, partial(self._track" in inspect.getsource(module)
        assert module.tree_map_only is torch.utils._pytree.tree_map_only
    a, b = torch.ones(2), torch.zeros(3)
    tree = (a, [None, 3, (b, "x", torch.float32)], torch.return_types.max((a, b)), {"k": b})
    seen: list[torch.Tensor] = []
    torch.utils._pytree.tree_map_only(torch.Tensor, seen.append, tree)
    walked: list[torch.Tensor] = []
    with tc.tracked_outputs_walked():
        assert mem_tracker.tree_map_only is fsdp2_mem_tracker.tree_map_only is not torch.utils._pytree.tree_map_only
        mem_tracker.tree_map_only(torch.Tensor, walked.append, tree)
    assert mem_tracker.tree_map_only is fsdp2_mem_tracker.tree_map_only is torch.utils._pytree.tree_map_only
    assert [id(t) for t in walked] == [id(t) for t in seen] and len(seen) == 5

    def step_snapshots(walk: bool) -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters())
        tracker = tc.MemTracker()
        tracker.track_external(model, opt)
        with tracker, (tc.tracked_outputs_walked() if walk else contextlib.nullcontext()):
            x = torch.randn(5, 8)
            top, idx = model(x).max(dim=1)
            parts = torch.split(x, 2)
            (top.sum() + sum(p.sum() for p in parts) + idx.float().sum()).backward()
            opt.step()
        return tracker.get_tracker_snapshot("peak"), tracker.get_tracker_snapshot()

    walked_step = step_snapshots(walk=True)
    assert walked_step == step_snapshots(walk=False) and walked_step[0]


def test_mem_ref_type_books_grads_and_optimizer_state():
    """bench/memory.py CategoryMemTracker.track_as books the distributed optimizer's buffers under these."""
    assert {"GRAD", "OPT"} <= set(tc.MemRefType.__members__)
    assert callable(tc.MemTracker._update_and_maybe_create_winfos)


def test_fsdp_mem_tracker_internals():
    for attr in ("_instrument_fsdp_module", "_update_and_maybe_create_winfos", "_fsdp_state_pre_forward",
                 "_deregister_module_and_optimizer_hooks", "track_inputs"):
        assert callable(getattr(tc.FSDPMemTracker, attr)), attr
    assert {"SHARDED_PARAM", "SHARDED_GRAD"} <= set(tc.FSDPRefType.__members__)
    assert {"PRE_FW", "PRE_BW"} <= set(tc.FSDPState.__members__)
    assert "_fsdp_state" in inspect.getsource(tc.FSDPMemTracker.__init__)
    assert inspect.isclass(tc.FSDPModMemStats)


def test_parallel_style_apply_is_the_override_point():
    assert "_apply" in tc.ParallelStyle.__dict__


def test_ddp_ignore_params_marks_the_module():
    m = nn.Linear(2, 2)
    tc.ddp_ignore_params(m, ["bias"])
    assert set(m._ddp_params_and_buffers_to_ignore) == {"bias"}


def test_completed_work_is_a_boxed_done_work_with_its_value():
    value = [torch.ones(3)]
    work = dist.distributed_c10d.Work.unbox(tc.completed_work(value))
    assert work.is_completed() and work.wait()
    assert work.get_future().value()[0] is value[0]


def test_tensor_use_count_sees_a_cpp_holder():
    t = torch.ones(2, requires_grad=True)
    before = tc.tensor_use_count(t)
    also = [t, t]  # more Python references to the same tensor are not more holders of its TensorImpl
    assert tc.tensor_use_count(also[0]) == before
    y = (t * t).sum()  # autograd's saved variables hold it in C++, as a c10d Work holds its buffers
    assert tc.tensor_use_count(t) > before
    del y
    assert tc.tensor_use_count(t) == before


def test_current_graph_task_id_tells_backward_from_forward():
    seen = []
    x = torch.ones(2, requires_grad=True, device="cpu")
    x.register_hook(lambda g: seen.append(tc.current_graph_task_id()))
    assert tc.current_graph_task_id() == -1
    (x * 2).sum().backward()
    assert seen and seen[0] != -1


def test_auto_dispatch_guard_and_library_destroy():
    with tc.auto_dispatch_below_ad_inplace_or_view():
        torch.ones(1, device="cpu")
    lib = torch.library.Library("c10d", "IMPL")
    tc.destroy_library(lib)


def test_unflatten_ddp_tp_param_source():
    assert callable(tc._unflatten_tensor)


def test_local_shard_grad_scaler_overrides_unscale_grads():
    """ShardedGradScaler.unscale_ calls `_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)` and
    all-reduces what it returns; our override checks a DTensor grad by its shard next to a plain grad (torch's
    own raises "mixed torch.Tensor and DTensor")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor, Shard

    assert list(inspect.signature(ShardedGradScaler._unscale_grads_).parameters) == [
        "self", "optimizer", "inv_scale", "found_inf", "allow_fp16"]
    dist.init_process_group("fake", store=tc.fake_store(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        # from_local, not distribute_tensor: torch 2.11's scatter over the fake group leaves the shard uninitialised
        a = nn.Parameter(DTensor.from_local(torch.ones(4, device="cpu"), mesh, [Shard(0)]))
        b = nn.Parameter(torch.ones(2, device="cpu"))
        a.grad = DTensor.from_local(torch.full((4,), 8.0, device="cpu"), mesh, [Shard(0)])
        b.grad = torch.tensor([8.0, float("inf")], device="cpu")
        opt = torch.optim.SGD([a, b], lr=1.0)
        scaler = tc.LocalShardGradScaler(device="cpu", init_scale=4.0)
        scaler.scale(torch.ones((), device="cpu"))  # lazily creates the scale
        scaler.unscale_(opt)
        torch.testing.assert_close(a.grad.to_local(), torch.full((4,), 2.0, device="cpu"))
        assert sum(float(f) for f in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()) == 1.0
    finally:
        dist.destroy_process_group()


def test_unflatten_mesh_splits_a_named_dim_and_forces_fresh_groups():
    """DeviceMesh._unflatten(dim, sizes, names, backend_override=...): a dim spanning the world reuses the default
    group unless a backend is named for it."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=tc.fake_store(), rank=5, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        em = tc.unflatten_mesh(mesh, "dp", (1, 2), ("a", "b"))
        assert em.mesh_dim_names == ("pp", "a", "b", "tp") and em["b"].mesh.tolist() == [5, 7]
        flat = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
        assert tc.unflatten_mesh(flat, "dp", (1, 8), ("a", "b"))["b"].get_group() is dist.group.WORLD
        fresh = tc.unflatten_mesh(flat, "dp", (1, 8), ("a", "b"), backend_override={"b": dist.get_backend()})
        assert fresh["b"].get_group() is not dist.group.WORLD and fresh["b"].get_group().size() == 8
    finally:
        dist.destroy_process_group()


def test_is_fake_tensor_and_fsdp_reset_after_parameter_replacement():
    """materialize.to_empty_by_assignment replaces Parameters (fake tensors cannot be swapped) and relies on
    FSDPModule._get_fsdp_state()._fsdp_param_groups[..] (2.11: ._fsdp_param_group).fsdp_params[..].reset_sharded_param()
    to re-read them."""
    from torch.distributed.fsdp import fully_shard

    from backend.strategies.materialize import to_empty_by_assignment
    from backend.trace.torch_private import FakeMode

    dist.init_process_group("fake", store=tc.fake_store(), rank=0, world_size=2)
    try:
        with FakeMode():
            m = nn.Sequential(nn.Linear(4, 6, device="meta"), nn.Linear(6, 2, device="meta"))
            fully_shard(m[0])
            ignored = m[1].weight
            fully_shard(m, ignored_params={ignored})
            assert tc.is_fake_tensor(m[1].weight) and m[1].weight.is_meta
            to_empty_by_assignment(m, torch.device("cpu"))
            (p0,) = [fp for g in tc.fsdp_param_groups(m[0]) for fp in g.fsdp_params][:1]
            assert p0.sharded_param is m[0].weight and m[0].weight.to_local().device.type == "cpu"
            assert m[1].weight is not ignored and m[1].weight.device.type == "cpu" and tc.is_fake_tensor(m[1].weight)
    finally:
        dist.destroy_process_group()
    assert not tc.is_fake_tensor(torch.ones(1))


def test_cpu_flash_attention_returns_the_logsumexp_and_its_backward_the_grads():
    """aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout, causal) -> (out, lse (b, a, s) fp32) and
    its _backward(grad_out, q, k, v, out, lse, dropout, causal) -> (dq, dk, dv): ring attention's block kernel."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, requires_grad=True) for _ in range(3))
    out, lse = tc.cpu_flash_attention(q.detach(), k.detach(), v.detach(), causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref.detach())
    scores = (q @ k.transpose(-2, -1) / 2.0).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).detach())
    grad = torch.randn(1, 2, 6, 4, generator=g)
    ref.backward(grad)
    got = tc.cpu_flash_attention_backward(grad, q.detach(), k.detach(), v.detach(), out, lse, causal=True)
    for mine, theirs in zip(got, (q.grad, k.grad, v.grad), strict=False):
        torch.testing.assert_close(mine, theirs)


def test_torch_context_parallel_switches():
    """torch.distributed.tensor.experimental._attention: `_ContextParallel(seq_dim, attention_type=AttentionType.SDPA)`
    (a ParallelStyle), `_enable_context_parallel_dispatcher`, `set_rotate_method("allgather" | "alltoall")` and
    `_cp_options.enable_load_balance`: the CUDA path of strategies/cp.py (enable_torch_context_parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import _attention as cp_attention

    assert issubclass(cp_attention._ContextParallel, tc.ParallelStyle)
    assert cp_attention._ContextParallel.AttentionType.SDPA.value == "scaled_dot_product_attention"
    assert callable(cp_attention._enable_context_parallel_dispatcher)
    assert callable(cp_attention._disable_context_parallel_dispatcher)
    saved = (cp_attention._cp_options.rotate_method, cp_attention._cp_options.enable_load_balance)
    dist.init_process_group("fake", store=tc.fake_store(), rank=0, world_size=2)
    try:
        core = nn.Identity()
        tc.enable_torch_context_parallel(core, init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)),
                                         rotate="alltoall", load_balance=False)
        assert core._forward_pre_hooks and core._forward_hooks  # sdpa_input_fn / sdpa_output_fn
        assert cp_attention._cp_options.rotate_method == cp_attention._RotateMethod.ALL_TO_ALL
        assert cp_attention._cp_options.enable_load_balance is False
    finally:
        cp_attention._disable_context_parallel_dispatcher()
        cp_attention._cp_options.rotate_method, cp_attention._cp_options.enable_load_balance = saved
        dist.destroy_process_group()


def test_host_chunk_cuts_what_distribute_tensor_gives_each_rank():
    """torch.distributed.tensor._utils.compute_local_shape_and_global_offset: materialize cuts a host-held FSDP2 shard
    (CPUOffloadPolicy on CUDA) with it, where distribute_tensor would first send the full tensor to the device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    for rank in range(4):  # 7 rows over 4 ranks: 2, 2, 2, 1 (torch.chunk), and a (4, 1) mesh
        dist.init_process_group("fake", store=tc.fake_store(), rank=rank, world_size=4)
        try:
            mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
            for placements in ([Shard(0), Replicate()], [Shard(0), Shard(1)], [Replicate(), Replicate()]):
                want = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
                torch.testing.assert_close(tc.host_chunk(full, mesh, placements), want)
            assert tc.host_chunk(full, mesh, [_StridedShard(0, split_factor=2), Replicate()]) is None
        finally:
            dist.destroy_process_group()
