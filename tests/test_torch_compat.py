"""One test per private torch symbol backend/torch_compat.py exposes: a torch upgrade that moves or changes one
fails here, by name, instead of deep inside a run."""

from __future__ import annotations

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
    for a, b in zip(tc.unflatten_dense_tensors(flat, ts), ts):
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
    assert callable(t._mod_tracker.get_known_fqn)
    assert inspect.isclass(tc.ModMemStats)


def test_fsdp_mem_tracker_internals():
    for attr in ("_instrument_fsdp_module", "_update_and_maybe_create_winfos",
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
