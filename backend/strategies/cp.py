"""Context parallelism: every sequence split over the cp ranks, attention across the shards.

Applied after tensor parallelism and before activation checkpointing and FSDP (torchtitan's order: its apply_cp
wraps each attention module after TP). The cp ranks hold the same parameters: they are part of the data-parallel
group (the engine mesh's dp dim is dp x cp, so FSDP2 / DDP / ZeRO-1 shard and average over them, torchtitan's
dp_shard_cp); the loss of each rank is the mean over its own tokens, and equal shares make the mean of those the
global mean.

What each rank holds: its share of every sequence (strategies/cp_layout.py: head-tail chunks r and 2cp-1-r of 2cp,
or contiguous chunks without load balancing), copied by the engine's `local_batch`; the positions of those tokens
(learned position embeddings and RoPE tables are looked up at the global positions); and the ring attention:
- on CUDA, torch's own: each attention core is a module wrapped with `_ContextParallel` (its q, k, v become DTensors
  sharded on the sequence over the cp mesh, so SDPA dispatches to torch's ring flash / efficient / cuDNN attention),
  `set_rotate_method(cp_rotate)`, load balancing per cp_load_balance;
- on CPU ranks (gloo), strategies/ring_attention.py: the same algorithm written by hand over the CPU flash kernel,
  which torch 2.13's context_parallel does not dispatch.

Per layer and microbatch the K/V traffic over the cp group is (kv = b * s/cp * a/t * d_head * 2 bytes of K and V
in the compute dtype, fp32 for the dK/dV accumulators):
  allgather: forward 1 all_gather (output cp x kv), backward 1 all_gather + cp all_to_all of 2 x kv fp32;
  alltoall:  forward cp-1 all_to_all of kv, backward cp-1 all_to_all of kv + cp all_to_all of 2 x kv fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from backend.models.gpt import GPT, Attention
from backend.strategies.context import RankContext
from backend.strategies.cp_layout import sequence_positions
from backend.strategies.ring_attention import RingGroup, ring_attention
from backend.torch_compat import enable_torch_context_parallel


class _SdpaCore(nn.Module):
    """The attention core as a module, so torch's `_ContextParallel` style can wrap its inputs and output."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class ContextShard:
    """What a model's GPT and Attention modules ask under context parallelism (gpt.token_positions, the core)."""

    def __init__(self, ctx: RankContext):
        self.spec, self.cp_index = ctx.spec, ctx.cp_rank()
        p = ctx.spec.parallel
        mesh = ctx.cp_mesh()["cp"]
        if ctx.device.type == "cuda":
            self.core: nn.Module | None = _SdpaCore()
            enable_torch_context_parallel(self.core, mesh, rotate=str(p.cp_rotate), load_balance=p.cp_load_balance)
            self.ring = None
        else:
            self.core = None
            self.ring = RingGroup(mesh.get_group(), p.cp, self.cp_index, str(p.cp_rotate), p.cp_load_balance)

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        """This rank's global positions: made afresh on each call, as arange(T) is without cp."""
        out = sequence_positions(self.spec, self.cp_index, device)
        if out.numel() != T:
            raise ValueError(f"context parallelism: this rank holds {out.numel()} tokens of each sequence, the model "
                             f"got {T}")
        return out

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.core is not None:
            return self.core(q, k, v)
        return ring_attention(q, k, v, self.ring)

    def measured(self, step: Callable, extra: dict) -> Callable:
        """`step` that records, per call, the seconds this rank waited on the ring's transfers (CPU ranks: the ring's
        exposed communication; torch's CUDA ring hides its waits in the stream, so nothing is recorded there) into
        extra["cp_ring"]["wait_s"], one entry per train_step call (warm-up, timed, memory, comm steps in order)."""
        if self.ring is None:
            return step
        record = extra.setdefault("cp_ring", {"wait_s": [], "waits": []})
        waits = self.ring.waits

        def run(x: torch.Tensor, y: torch.Tensor):
            waits.reset()
            out = step(x, y)
            record["wait_s"].append(waits.seconds)
            record["waits"].append(waits.waits)
            return out

        return run


def apply_cp(ctx: RankContext, module: nn.Module, shard: ContextShard | None) -> None:
    """Point the model part's GPT and Attention modules at this rank's `ContextShard` (nothing when cp = 1)."""
    if shard is None:
        return
    for sub in module.modules():
        if isinstance(sub, (GPT, Attention)):
            sub.context_parallel = shard


def context_shard(ctx: RankContext) -> ContextShard | None:
    """This rank's ContextShard (creates the cp process groups: every rank calls it, in the same order)."""
    return ContextShard(ctx) if ctx.spec.parallel.cp > 1 else None


def notes(ctx: RankContext) -> list[str]:
    p = ctx.spec.parallel
    if p.cp == 1:
        return []
    how = ("head-tail chunks (rank r holds chunks r and 2cp-1-r of 2cp)" if p.cp_load_balance
           else "contiguous chunks, no load balancing (the last cp rank does the most attention work)")
    impl = ("torch's context_parallel (_ContextParallel over SDPA)" if ctx.device.type == "cuda"
            else "ShardLab's ring attention over the CPU flash kernel (strategies/ring_attention.py)")
    return [f"CP: each sequence split over cp={p.cp} ranks as {how}; K/V rotated by {p.cp_rotate}; attention by "
            f"{impl}; gradients averaged and FSDP/ZeRO state sharded over dp x cp = {p.dp_cp} ranks."]
