"""Ring attention over the cp group, written by hand for gloo / CPU ranks.

torch 2.13's `context_parallel` (torch/distributed/tensor/experimental/_context_parallel/_attention.py) dispatches
only the CUDA SDPA kernels (flash, memory-efficient, cuDNN); the CPU flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`) is not among them. So on CPU ranks this module does what torch's
`_templated_ring_attention` / `_templated_ring_attention_backward` do, step for step, with the CPU flash kernel per
block (the ring structure follows picotron's context_parallel/context_parallel.py; the block schedule, merge and
rotation follow torch's, so CPU and CUDA runs have the same comm and compute breakdown):

- each cp rank holds its queries; K/V of every rank reach it in cp steps: `allgather` gathers them all once (one
  all_gather of K and V per call), `alltoall` passes them to the next rank each step (cp - 1 all-to-all
  permutations, K and V in one buffer), the next block's K/V in flight while this block computes;
- causal skip: with head-tail chunks (rank r holds chunks r and 2cp-1-r of 2cp) step 0 is the local causal block,
  then each step computes exactly half a block: all queries against the earlier sender's first chunk, or the
  second query chunk against a later sender's K/V (torch's Note "Context parallelism load balance algorithm for
  causal masking"); with contiguous chunks a later sender's block is skipped;
- blocks are merged by their logsumexp in fp32 (online softmax: out -= sigmoid(lse_b - lse) (out - out_b),
  lse -= logsigmoid(lse - lse_b), ring-flash-attention's stable form, as torch's _SDPAMerger, written as
  lse += softplus(lse_b - lse));
- backward re-sends K/V the same way and passes the dK/dV accumulators (fp32) round the ring (cp all-to-alls), each
  block's grads from the flash backward with the merged output and logsumexp; the accumulators come home after a
  full turn.
Saved for backward: q, k, v, the output and the (b, a, s/cp) fp32 logsumexp, exactly what the flash kernel saves,
and the output is laid out (b, s, a, d) so that the o projection's input is the same storage, as SDPA's is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.functional import softplus

from backend.torch_compat import cpu_flash_attention, cpu_flash_attention_backward

SKIP, FULL, FIRST_K, SECOND_Q = "skip", "full", "first_k", "second_q"


@dataclass
class RingWaits:
    """Seconds this rank spent blocked on the ring's transfers (waiting for a K/V or dK/dV buffer): the communication
    the attention blocks did not hide. Accumulated until `reset`."""
    seconds: float = 0.0
    waits: int = 0

    def reset(self) -> None:
        self.seconds, self.waits = 0.0, 0


@dataclass(frozen=True)
class RingGroup:
    """The cp group a ring attention runs over."""
    group: dist.ProcessGroup
    size: int
    rank: int
    """This rank's index in the cp group (its cp coordinate)."""
    rotate: str = "allgather"
    """K/V in forward: "allgather" (one all-gather) or "alltoall" (passed round the ring); dK/dV always ring."""
    load_balance: bool = True
    """Head-tail chunks (rank r holds chunks r and 2cp-1-r)."""
    waits: RingWaits = field(default_factory=RingWaits, compare=False)


def block_kind(ring: RingGroup, step: int) -> str:
    """Which part of step `step`'s block this rank computes: the K/V it holds came from rank (r - step) mod cp."""
    if step == 0:
        return FULL  # the local block, causal
    source = (ring.rank - step) % ring.size
    if ring.load_balance:
        return FIRST_K if source < ring.rank else SECOND_Q
    return FULL if source < ring.rank else SKIP


class _Rotater:
    """K/V of rank (r - i) at step i: `allgather` all at once, `alltoall` one hop per step; asynchronous, so the next
    block's buffer is in flight while this block computes."""

    def __init__(self, ring: RingGroup, method: str):
        self.ring, self.method = ring, method
        self.work = self.buffer = self.sending = None
        self.sent = 0

    def send(self, flat: torch.Tensor) -> None:
        g, n, r = self.ring.group, self.ring.size, self.ring.rank
        self.sent += 1
        if self.method == "allgather":
            if self.buffer is None:
                self.buffer = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
                self.work = dist.all_gather_single(self.buffer, flat, group=g, async_op=True)
            return
        self.sending, self.buffer = flat, torch.empty_like(flat)
        out_splits = [flat.numel() if j == (r - 1) % n else 0 for j in range(n)]
        in_splits = [flat.numel() if j == (r + 1) % n else 0 for j in range(n)]
        self.work = dist.all_to_all_single(self.buffer, flat, out_splits, in_splits, group=g, async_op=True)

    def next(self) -> torch.Tensor:
        if self.work is not None:
            t0 = time.perf_counter()
            self.work.wait()
            self.ring.waits.seconds += time.perf_counter() - t0
            self.ring.waits.waits += 1
            self.work = self.sending = None
        if self.method == "allgather":
            n = self.buffer.numel() // self.ring.size
            return self.buffer.narrow(0, ((self.ring.rank - self.sent) % self.ring.size) * n, n)
        return self.buffer


def _split(flat: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = like.numel()
    return flat[:n].view(like.shape), flat[n:2 * n].view(like.shape)


def _first(x: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """The first of two equal chunks along `dim` (one view: `narrow`, not `chunk`, which makes both)."""
    return x.narrow(dim, 0, x.shape[dim] // 2)


def _second(x: torch.Tensor, dim: int = -2) -> torch.Tensor:
    half = x.shape[dim] // 2
    return x.narrow(dim, half, x.shape[dim] - half)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block into the running fp32 (out, lse (.., s, 1)), in place (ring-flash-attention's stable update:
    lse - logsigmoid(lse - lse_b) = lse + softplus(lse_b - lse))."""
    gap = block_lse.unsqueeze(-1) - lse
    out.sub_(torch.sigmoid(gap) * (out - block_out.float()))
    lse.add_(softplus(gap))


def _forward_block(kind: str, q, k_i, v_i, out, lse, causal: bool) -> None:
    if kind == FIRST_K:
        b_out, b_lse = cpu_flash_attention(q, _first(k_i), _first(v_i), causal=False)
        _merge(out, lse, b_out, b_lse)
    elif kind == SECOND_Q:
        b_out, b_lse = cpu_flash_attention(_second(q), k_i, v_i, causal=False)
        _merge(_second(out), _second(lse), b_out, b_lse)
    elif kind == FULL:
        b_out, b_lse = cpu_flash_attention(q, k_i, v_i, causal=causal)
        _merge(out, lse, b_out, b_lse)


def _backward_block(kind: str, grad_out, q, k_i, v_i, out, lse, dq, dkv, causal: bool, lse_second=None) -> None:
    """Add this block's dq to `dq` and its dk, dv to the travelling accumulator `dkv` (2, *k.shape); `lse_second`:
    the second query chunk's logsumexp, contiguous (the kernel needs it so)."""
    if kind == SKIP:
        return
    if kind == SECOND_Q:
        gq, gk, gv = cpu_flash_attention_backward(_second(grad_out), _second(q), k_i, v_i, _second(out), lse_second,
                                                  causal=False)
        _second(dq).add_(gq)
        dkv[0].add_(gk)
        dkv[1].add_(gv)
        return
    if kind == FIRST_K:
        k_i, v_i = _first(k_i), _first(v_i)
    gq, gk, gv = cpu_flash_attention_backward(grad_out, q, k_i, v_i, out, lse, causal=causal)
    dq.add_(gq)
    target_k, target_v = (dkv[0], dkv[1]) if kind == FULL else (_first(dkv[0]), _first(dkv[1]))
    target_k.add_(gk)
    target_v.add_(gv)


class RingAttention(torch.autograd.Function):
    """softmax(q kᵀ / sqrt(d), causal over global positions) v for this rank's q (b, a, s/cp, d) against every cp
    rank's k, v; q, k, v as the model hands them to SDPA."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingGroup) -> torch.Tensor:
        k, v = k.contiguous(), v.contiguous()
        b, a, s, d = q.shape
        rot = _Rotater(ring, ring.rotate)
        held = torch.cat([k.flatten(), v.flatten()]) if ring.size > 1 else None
        if held is not None:
            rot.send(held)
        out, lse = cpu_flash_attention(q, k, v, causal=True)  # step 0: the local block (every row sees itself)
        out, lse = out.float(), lse.float().unsqueeze(-1)
        for step in range(1, ring.size):
            held = rot.next()
            k_i, v_i = _split(held, k)
            if step < ring.size - 1:
                rot.send(held)
            _forward_block(block_kind(ring, step), q, k_i, v_i, out, lse, causal=False)
            del k_i, v_i
        del held, rot
        result = torch.empty((b, s, a, d), dtype=q.dtype, device=q.device).transpose(1, 2)  # SDPA's layout
        result.copy_(out)
        del out
        lse = lse.squeeze(-1).contiguous()
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring = ring
        return result

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring: RingGroup = ctx.ring
        kv_rot, dkv_rot = _Rotater(ring, ring.rotate), _Rotater(ring, "alltoall")
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_second = _second(lse, -1).contiguous() if ring.load_balance and ring.size > 1 else None
        held = torch.cat([k.flatten(), v.flatten()]) if ring.size > 1 else None
        k_i, v_i = k, v
        for step in range(ring.size):
            if step > 0:
                held = kv_rot.next()
                k_i, v_i = _split(held, k)
            if step < ring.size - 1:
                kv_rot.send(held)
            if step == 0:
                dkv = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=k.device)
            else:
                dkv = dkv_rot.next().view((2,) + tuple(k.shape))
            _backward_block(block_kind(ring, step), grad_out, q, k_i, v_i, out, lse, dq, dkv, causal=step == 0,
                            lse_second=lse_second)
            if ring.size > 1:
                dkv_rot.send(dkv.flatten())
        if ring.size > 1:
            dkv = dkv_rot.next().view((2,) + tuple(k.shape))
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingGroup) -> torch.Tensor:
    return RingAttention.apply(q, k, v, ring)
