"""What one eager block keeps for backward, read with saved_tensors_hooks (tests/unit/test_extra_norm_bytes.py,
test_mla_block_bytes.py, test_moe_block_bytes.py): block 0 of the spec's model at seed 0, in one of the three ways this
engine runs a block on the CPU."""

from __future__ import annotations

import contextlib

import torch

from backend.models.gpt import build_model
from backend.spec import ExperimentSpec

MODES = {  # (precision, strategy): FSDP2's bf16 block, autocast over fp32 weights, fp32
    "bf16_params": ("bf16-mixed", "zero3"), "autocast": ("bf16-mixed", "ddp"), "fp32": ("fp32", "ddp")}


def block_saved_bytes(spec: ExperimentSpec, mode: str, selective: bool = False) -> int:
    """Distinct storages the block's forward saves, parameters, 0-dim scalars and autocast's 16-bit weight casts left
    out (every 2-D weight is cast once under autocast: the caller's experts must all receive rows)."""
    m = spec.model
    dtype = torch.bfloat16 if mode == "bf16_params" else torch.float32
    block = build_model(m, seed=0).to(dtype).layers["0"]
    block.attn.selective_recompute = selective
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    # a fixed input: an MoE block's routing (which experts run, what a capacity limit drops) follows it
    x = torch.randn(spec.train.micro_batch, m.seq_len, m.d_model, generator=torch.Generator().manual_seed(0),
                    dtype=dtype, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params and t.dim() > 0:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    region = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    with region, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    casts = 2 * sum(p.numel() for p in block.parameters() if p.dim() == 2) if mode == "autocast" else 0
    return sum(saved.values()) - casts
