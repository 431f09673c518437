"""Issue 32: what one block's backward holds beyond its saved tensors (memory/block_backward.py), read off the engine's
own backward with MemTracker on the CPU: GPT and Llama-style blocks, math and flash attention, under the three ways
weight gradients come (FSDP2's pure 16-bit parameters: fresh and held; autocast over fp32 parameters, held (the FSDP2
mixes) or added into persistent grads (ddp); fp32), on three shapes where different ops are the fullest (the attention
scores' backward at long sequences, the MLP's weight gradients at wide ones)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from backend.analytic.memory.activations import LayerShape
from backend.analytic.memory.backward_moment import block_extra
from backend.models.gpt import build_model, loss_fn
from backend.spec import ModelSpec

FAMILIES = {"gpt": {}, "gpt-flash": {"attention": "flash"},
            "llama": {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none"},
            "llama-flash-gqa": {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none",
                                "attention": "flash", "n_kv_heads": 2}}
SHAPES = {"long": dict(d_model=128, n_heads=4, seq_len=512), "wide": dict(d_model=512, n_heads=8, seq_len=64)}
MODES = {  # (model dtype, autocast, warm step first: the grads exist and are added into, held by the ledger)
    "bf16-held": (torch.bfloat16, False, False), "autocast-held": (torch.float32, True, False),
    "autocast-added": (torch.float32, True, True), "fp32-added": (torch.float32, False, True)}


def measured_extra(ms: ModelSpec, mode: str) -> int:
    """MemTracker's largest total inside block 0's backward minus its entry: everything but the transient tensors
    at the block's first op, plus the gradient of its output (a (b, s, h) tensor in the residual dtype)."""
    dtype, autocast, warm = MODES[mode]
    torch.manual_seed(0)
    model = build_model(ms, seed=0).to(dtype)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    x, y = torch.randint(0, ms.vocab_size, (1, ms.seq_len)), torch.randint(0, ms.vocab_size, (1, ms.seq_len))
    if warm:
        with ctx():
            logits = model(x)
        loss_fn(logits, y).backward()
        del logits
    events = []

    class Tracker(MemTracker):
        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():
                events.append((snap.get("Total", 0), snap.get(_MemRefType.TEMP, 0), self._mod_tracker.is_bw,
                               set(self._mod_tracker.parents)))

    tracker = Tracker()
    tracker.track_external(model, x, y)
    with tracker:
        with ctx():
            logits = model(x)
        loss = loss_fn(logits, y)
        del logits
        loss.backward()
    inside = [e for e in events if e[2] and any(p == "GPT.layers.0" or p.startswith("GPT.layers.0.") for p in e[3])]
    total, temp = inside[0][0], inside[0][1]
    grad_out = ms.seq_len * ms.d_model * (4 if autocast or dtype == torch.float32 else 2)
    return max(e[0] for e in inside) - (total - temp + grad_out)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.heavy
def test_block_backward_extra_is_the_engines(family: str, shape: str, mode: str) -> None:
    ms = ModelSpec(vocab_size=256, n_layers=2, **SHAPES[shape], **FAMILIES[family])
    dtype, autocast, warm = MODES[mode]
    cb = 4 if dtype == torch.float32 and not autocast else 2
    ls = LayerShape.of(ms, micro_batch=1, tp=1, sequence_parallel=False, dtype_bytes=cb, autocast=autocast, ep=1,
                       device="cpu")
    predicted, _ = block_extra(ls, held=not warm)
    measured = measured_extra(ms, mode)
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)
