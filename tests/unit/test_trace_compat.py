"""backend/trace/torch_private.py: one test per private torch symbol it touches, and what each stand-in does; the local
stand-in for pipelining's meta exchange on a traced last stage (a farm trace job)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from backend.spec import ExperimentSpec
from backend.trace import torch_private
from tests.helpers.farm import trace_job, uses


def test_private_symbols_exist() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily  # noqa: F401
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    assert callable(torch._C._nn._parse_to)
    assert torch.ops.aten.lift_fresh.default and torch.ops.aten._local_scalar_dense.default


def test_pipeline_meta_exchange_has_one_of_the_two_known_forms() -> None:
    """torch_private._pipeline_patches stands in for torch 2.13's `_recv_meta`/`_send_meta` or torch 2.11's
    `_shape_inference` object lists; a torch with neither is refused by name."""
    from torch.distributed.pipelining import stage

    assert hasattr(stage.PipelineStage, "_recv_meta") or hasattr(stage.PipelineStage, "_shape_inference")
    patched = {name for _, name, _ in torch_private._pipeline_patches(lambda: torch.empty(1, 4, 8))}
    assert patched in ({"_recv_meta", "_send_meta", "_warmup_p2p"}, {"send_object_list", "recv_object_list"})


def test_stage_meta_symbols_torch_2_13() -> None:
    from torch.distributed.pipelining import schedules, stage

    if not hasattr(stage.PipelineStage, "_recv_meta"):
        pytest.skip(f"torch {torch.__version__} exchanges stage metadata by object lists (test below)")
    from torch.distributed.pipelining._utils import (  # noqa: F401
        InferenceMode,
        _StageBackwardMeta,
        _StageForwardMeta,
        extract_tensor_meta,
    )

    for obj, name in ((stage.PipelineStage, "_recv_meta"), (stage.PipelineStage, "_send_meta"),
                      (schedules._PipelineSchedule, "_warmup_p2p"), (InferenceMode, "needs_dynamic")):
        assert callable(getattr(obj, name)), name
    assert hasattr(stage.PipelineStage, "_user_meta") or "_user_meta" in stage.PipelineStage.__init__.__code__.co_names


def test_object_list_shape_inference_torch_2_11() -> None:
    """torch 2.11: `PipelineStage._shape_inference` receives `objects[0]`, a tuple of meta tensors, from
    `dist.recv_object_list` and sends its own with `dist.send_object_list` (both looked up on torch.distributed
    at call time, which is what the stand-in replaces)."""
    from torch.distributed.pipelining import stage

    if hasattr(stage.PipelineStage, "_recv_meta"):
        pytest.skip(f"torch {torch.__version__} exchanges stage metadata with _recv_meta (test above)")
    source = inspect.getsource(stage.PipelineStage._shape_inference)
    assert "dist.recv_object_list(" in source and "dist.send_object_list(" in source
    assert "recv_args = objects[0]" in source
    with torch_private.fake_world(lambda: torch.empty(2, 16, 8, dtype=torch.float32, requires_grad=True)):
        objects: list = [None]
        dist.recv_object_list(objects, src=0)
        dist.send_object_list([objects[0]], dst=1)
    (meta,) = objects[0]
    assert meta.device.type == "meta" and meta.shape == (2, 16, 8) and meta.dtype == torch.float32


def test_fake_mode_float_item_is_nan_and_integer_item_raises() -> None:
    with torch_private.FakeMode():
        x = torch.ones(3)
        assert torch_private.is_fake(x)
        assert math.isnan(float(x.sum()))
        with pytest.raises(torch_private.DataDependentShape, match="integer value"):
            int(torch.ones(3, dtype=torch.int64).sum())


def test_fake_mode_runs_all_real_ops_for_real() -> None:
    real = torch.arange(6, dtype=torch.int32).view(2, 3)
    with torch_private.FakeMode():
        out = real[1]  # a DeviceMesh slices its real rank tensor like this inside the mode
        assert not torch_private.is_fake(out) and out.tolist() == [3, 4, 5]
        assert not torch_private.is_fake(torch.arange(4)) and torch_private.is_fake(torch.arange(4.0))


def test_balanced_routing_spreads_slots_evenly() -> None:
    idx = torch_private.balanced_routing(4, torch.Size([6, 2]))
    assert idx.tolist()[:3] == [[0, 1], [2, 3], [0, 1]]
    assert torch.bincount(idx.flatten(), minlength=4).tolist() == [3, 3, 3, 3]
    with torch_private.FakeMode():
        values, i = torch.topk(torch.rand(6, 4), 2, dim=-1)
        assert torch_private.is_fake(values) and not torch_private.is_fake(i) and i.shape == (6, 2)


def test_module_to_same_device_keeps_fake_parameters() -> None:
    with torch_private.fake_world(lambda: torch.empty(1)):
        m = nn.Linear(2, 2)
        assert m.to(torch.device("cpu")) is m and torch_private.is_fake(m.weight)
    assert nn.Module.to is not None and nn.Linear(2, 2).to("cpu").weight.device.type == "cpu"


def test_ddp_standin_buckets_equal_real_ddp_buckets() -> None:
    """The trace's classic-DDP stand-in allocates the buckets torch's DDP allocates (same sizes, same order), each
    param.grad a view of its bucket; compared with a real DDP on a 1-rank gloo group (dist._compute_bucket_
    assignment_by_size is the private symbol it uses)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from backend.trace.ddp_standin import BucketedDDP

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(384, 384) for _ in range(6)], nn.LayerNorm(384))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        real = DDP(model(), gradient_as_bucket_view=True)
        for _ in range(2):  # DDP rebuilds its buckets in backward order after the first iteration: compare those
            real(torch.ones(2, 384)).sum().backward()
        real_sizes = sorted({p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                             for p in real.module.parameters()}.values())  # grads are bucket views: the buckets
        stand = BucketedDDP(model(), gradient_as_bucket_view=True)
    finally:
        dist.destroy_process_group()
    sizes = sorted(b.numel() * b.element_size() for b in stand._buckets)
    assert sizes == real_sizes and len(sizes) >= 2, (sizes, real_sizes)
    assert sum(sizes) == sum(p.numel() * 4 for p in stand.module.parameters())
    storages = {b.untyped_storage().data_ptr() for b in stand._buckets}
    assert all(p.grad.untyped_storage().data_ptr() in storages for p in stand.module.parameters())


def test_leave_fake_pg_clears_the_dtensor_sharding_caches() -> None:
    """torch_private.leave_fake_pg: the caches whose entries hold a destroyed world's DeviceMesh exist (a later spec's
    mesh of the same shape compares equal and would resolve the destroyed groups' names: seen as 'Could not resolve the
    process group registered under the name 9' on the second spec of a shared-process trace,
    tests/multiprocess/test_fullest_moment.py), and leaving empties them."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    assert callable(propagator.propagate_op_sharding.cache_clear)
    assert callable(propagator._propagate_tensor_meta_cached.cache_clear)
    assert callable(torch._C._clear_DTensor_sharding_propagator_cache)
    torch_private.init_fake_pg(0, 2)
    torch_private.leave_fake_pg()
    assert not dist.is_initialized()
    assert propagator._propagate_tensor_meta_cached.cache_info().currsize == 0


LAST_STAGE = trace_job(ExperimentSpec.model_validate({
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 256},
    "train": {"global_batch": 4, "micro_batch": 1},
    "parallel": {"strategy": "pp", "world_size": 2, "pp": 2, "pp_schedule": "1f1b"}}), ranks=[1])


@uses(LAST_STAGE)
def test_pipeline_last_stage_traces_with_the_local_meta_exchange(farm) -> None:
    """The receiving stage (rank 1 of pp=2) traced end to end through the installed torch's exchange."""
    res = farm.result(LAST_STAGE)
    assert res["status"] == "ok", res
    (row,) = res["per_rank"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert abs(row["error_pct"][key]) <= 1.0, (key, row["traced"], row["predicted"])
    assert abs(row["error_pct"]["activations_bytes"]) <= 10.0, (row["traced"], row["predicted"])
