"""The farm's ring-attention job (tests/helpers/farm.py, `program_job("ring_attention", world)`): ShardLab's CPU ring
attention on every variant (allgather / alltoall K/V rotation, head-tail / contiguous chunks) against one process's
causal SDPA on the whole sequence.

Value: [{"rotate", "load_balance", "dtype", "out", "dq", "dk", "dv"}] with each max |difference| over the ranks (output
and the input grads of this rank's tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from backend.strategies.cp_layout import sequence_chunks
from backend.strategies.ring_attention import RingGroup, ring_attention


def check(rotate: str, load_balance: bool, dtype: torch.dtype) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b, a, s, d = 2, 3, 8 * n, 8
    q, k, v, grad = (torch.randn(b, a, s, d, generator=g).to(dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref.backward(grad)
    mine = torch.cat([torch.arange(x, y) for x, y in sequence_chunks(s, n, rank, load_balance)])
    ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_(True) for t in (q, k, v))
    out = ring_attention(ql, kl, vl, RingGroup(dist.group.WORLD, n, rank, rotate, load_balance))
    out.backward(grad[:, :, mine])
    errs = torch.tensor([float((x.float() - y.float()).abs().max()) for x, y in
                         ((out, ref.detach()[:, :, mine]), (ql.grad, q.grad[:, :, mine]), (kl.grad, k.grad[:, :, mine]),
                          (vl.grad, v.grad[:, :, mine]))], dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    return {"rotate": rotate, "load_balance": load_balance, "dtype": str(dtype).split(".")[-1],
            **dict(zip(("out", "dq", "dk", "dv"), errs.tolist(), strict=False))}


def run_job(payload: dict, out: Path) -> list[dict]:
    return [check(rotate, lb, dtype) for rotate in ("allgather", "alltoall") for lb in (True, False)
            for dtype in (torch.float32, torch.bfloat16)]
