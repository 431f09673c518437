"""The farm's TP saved-tensors job (tests/helpers/farm.py, `program_job("tp_saved_tensors", world)`): one transformer
block under the Megatron TP plan (parallelize_module), with and without sequence parallel, for MHA and GQA; the bytes
of the tensors the block saves for backward on each rank, parameters excluded.

Value: [{"sp", "kv", "t", "bytes"}] (rank 0's bytes; tests/unit/test_activation_model.py checks them against the layer
formula).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from backend.models.gpt import Block
from backend.spec import ModelSpec


def saved_bytes(mesh, sp: bool, kv: int) -> int:
    rank, t = dist.get_rank(), dist.get_world_size()
    ms = ModelSpec(d_model=64, n_heads=4, n_kv_heads=kv, seq_len=32, vocab_size=128)
    torch.manual_seed(0)
    blk = Block(ms)
    out = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": out, "mlp.fc_in": ColwiseParallel(),
            "mlp.fc_out": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()}
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn": gather, "mlp": gather})
    parallelize_module(blk, mesh, plan)
    x = torch.randn(2, 32, 64)
    x = (x.chunk(t, dim=1)[rank].clone() if sp else x).requires_grad_()
    params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in blk.parameters()}
    seen = {}

    def pack(ten):
        loc = ten._local_tensor if isinstance(ten, DTensor) else ten
        st = loc.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return ten

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda z: z):
        blk(x)
    return sum(seen.values())


def run_job(payload: dict, out: Path) -> list[dict]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return [{"sp": sp, "kv": kv, "t": dist.get_world_size(), "bytes": saved_bytes(mesh, sp, kv)}
            for sp in (False, True) for kv in (4, 2)]
