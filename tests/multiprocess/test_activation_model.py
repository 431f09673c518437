"""The TP + SP layer formula against the tensors the ranks of a real gloo run save for backward."""

from __future__ import annotations

import pytest

from backend.analytic.memory.activations import model_layer_activation_bytes

TOL = 0.05  # the formula is derived op by op; the brief's bound is 15%


_TP_SCRIPT = r'''
import json, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from backend.models.gpt import Block
from backend.spec import ModelSpec

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, t = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (t,))
for sp in (False, True):
    for kv in (4, 2):
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
        if rank == 0:
            print("RESULT " + json.dumps({"sp": sp, "kv": kv, "t": t, "bytes": sum(seen.values())}), flush=True)
dist.destroy_process_group()
import os; os._exit(0)  # no interpreter teardown after gloo (see tests/helpers/mp_harness.py)
'''


@pytest.mark.slow
def test_tp_sp_layer_formula_matches_saved_tensors(tmp_path):
    """TP=2 (Megatron plan via parallelize_module), with and without SP: per-rank saved bytes of one block."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "tp_probe.py"
    script.write_text(_TP_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={port}", str(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    assert len(rows) == 4
    for row in rows:
        pred = model_layer_activation_bytes(s=32, b=2, h=64, a=4, kv_heads=row["kv"], ffn=256, dtype_bytes=4,
                                            t=row["t"], sp=row["sp"])
        assert pred == pytest.approx(row["bytes"], rel=TOL), row
