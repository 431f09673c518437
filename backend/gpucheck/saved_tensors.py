"""Diagnosis of the activation gap: every tensor autograd saves for backward in ONE block plus the head and the
loss of the check's model, on CUDA and on the CPU (where the analytic activation model was validated), next to
that model's per-block and head terms.

A child process of the GPU check's diag phase (the kit's own process never touches CUDA):

  python -m backend.gpucheck.saved_tensors --device cuda|cpu --shape full,compare|tiny [--threads N] [--modes M,..]

prints a JSON list, one {"device", "shape", "model", "modes": {mode: listing}} per shape. Three modes, the two ways the
engine runs bf16-mixed (backend/strategies/data_parallel.uses_autocast) and the compiled one:
- "autocast": fp32 weights under torch.autocast(bf16), logits held and the loss outside autocast (ddp, zero1);
- "bf16_params": the weights themselves in bf16, no autocast, the loss inside the step (FSDP2's
  MixedPrecisionPolicy: zero2 / zero3);
- "compiled": bf16_params with each block's forward under torch.compile (elementwise=compiled,
  strategies/compiled.py), compiled by one step before the listing; its block term is
  memory/compiled_block.compiled_block_bytes (Inductor on the CPU here, Triton on a GPU: the same partition).
Saved tensors come from torch.autograd.graph.saved_tensors_hooks (the pack hook sees each one as it is saved);
the module whose forward was running names where; the tensor's own grad_fn names the op that produced it;
tensors are deduplicated by storage (a view of an earlier saved tensor, or of a parameter, adds no bytes).
Weights are random (N(0, 0.02)): the listing depends on shapes and dtypes only. Written by hand: torch has no
tool that lists saved tensors by module (its MemTracker sums them by category).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from backend.gpucheck.specs import LLAMA_1B, TINY_LLAMA

SHAPES = {
    "full": dict(LLAMA_1B, n_layers=1),
    "compare": dict(LLAMA_1B, n_layers=1, seq_len=512, vocab_size=8192),
    "tiny": dict(TINY_LLAMA, n_layers=1),
}
"""full: the 1B spec's block and head at seq 4096 (CUDA only: the head alone is ~2e12 FLOPs); compare: the same
block widths at seq 512 and vocabulary 8192, affordable on the host's CPU, listed on both devices."""
MODES = ("autocast", "bf16_params", "compiled")
DEFAULT_MODES = ("autocast", "bf16_params")
"""The compiled mode is its own diag part (its compile takes longer than the other two listings together)."""


def build(shape: dict[str, Any], device: torch.device, mode: str) -> nn.Module:
    from backend.models.gpt import GPT, tie_weights
    from backend.spec import ModelSpec

    spec = ModelSpec.model_validate({k: v for k, v in shape.items() if k != "source"})
    with torch.device("meta"):
        model = GPT(spec)
    model.to_empty(device=device)
    tie_weights(model)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    return model.to(torch.bfloat16) if mode in ("bf16_params", "compiled") else model


def compile_blocks(model: nn.Module, shape: dict[str, Any], device: torch.device) -> None:
    """Each block's forward under torch.compile (its module hooks stay outside, so a saved tensor is named by its
    block), compiled by one forward and backward before anything is listed."""
    from backend.models.gpt import loss_fn

    for block in model.layers.values():
        block.forward = torch.compile(block.forward, fullgraph=True)
    tokens = torch.randint(0, shape["vocab_size"], (1, shape["seq_len"]), device=device)
    loss_fn(model(tokens), tokens).backward()
    model.zero_grad(set_to_none=True)


class SavedLog:
    """Pack hook state: the module stack (forward pre/post hooks) and one record per saved tensor."""

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.records: list[dict[str, Any]] = []
        self.param_keys = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.param_shapes = {tuple(p.shape) for p in model.parameters()}
        self.seen: dict[int, int] = {}
        for name, mod in model.named_modules():
            mod.register_forward_pre_hook(lambda m, a, name=name: self.enter(name))
            mod.register_forward_hook(lambda m, a, o: self.leave())

    def enter(self, name: str) -> None:
        self.stack.append(name)

    def leave(self) -> None:  # a forward hook's return value would replace the module's output
        self.stack.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        producer = type(t.grad_fn).__name__ if t.grad_fn is not None else None
        rec: dict[str, Any] = {"module": self.stack[-1] if self.stack else "(loss)", "producer": producer,
                               "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                               "storage_bytes": t.untyped_storage().nbytes()}
        if key in self.param_keys:
            rec["aliases"] = "parameter"
        elif key in self.seen:
            rec["aliases"] = f"saved #{self.seen[key]}"
        elif producer in ("ToCopyBackward0", "TBackward0") and t.dim() == 2 and (
                tuple(t.shape) in self.param_shapes or tuple(t.shape)[::-1] in self.param_shapes):
            rec["kind"] = "weight_cast"  # autocast's 16-bit copy of a weight (the analytic model counts it apart)
        if key not in self.seen and key not in self.param_keys:
            self.seen[key] = len(self.records)
        self.records.append(rec)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def area(module: str) -> str:
    if module.startswith("layers."):
        return "block"
    return "embedding" if module.startswith("tok_emb") or module.startswith("pos_emb") else "head_and_loss"


def listing(shape: dict[str, Any], device: torch.device, mode: str) -> dict[str, Any]:
    """The saved tensors of one forward + loss of `shape` (1 block) in `mode`, deduplicated, with totals."""
    from backend.models.gpt import loss_fn

    torch.manual_seed(0)
    model = build(shape, device, mode)
    log = SavedLog(model)
    if mode == "compiled":
        compile_blocks(model, shape, device)
    tokens = torch.randint(0, shape["vocab_size"], (1, shape["seq_len"]), device=device)
    targets = torch.randint(0, shape["vocab_size"], (1, shape["seq_len"]), device=device)
    cast = torch.autocast(device.type, dtype=torch.bfloat16) if mode == "autocast" else nullcontext()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(log.pack, log.unpack):
        with cast:
            logits = model(tokens)
            loss = loss_fn(logits, targets) if mode != "autocast" else None
        if loss is None:
            loss = loss_fn(logits, targets)
    out: dict[str, Any] = {"forward_s": time.perf_counter() - t0}
    if cuda:
        torch.cuda.synchronize()
        out["allocated_after_loss_bytes"] = torch.cuda.memory_allocated(device) - before
    totals: dict[str, int] = {}
    for rec in log.records:
        if "aliases" not in rec:
            key = area(rec["module"]) + ("_weight_casts" if rec.get("kind") == "weight_cast" else "")
            totals[key] = totals.get(key, 0) + rec["storage_bytes"]
    out.update(records=log.records, unique_bytes=totals, logits_bytes=logits.numel() * logits.element_size())
    del loss, logits
    return out


def analytic(shape: dict[str, Any], device: str, mode: str) -> dict[str, float]:
    """The analytic model's per-block and head terms for this shape (micro_batch 1, tp 1) in this mode."""
    from backend.analytic.memory.activations import (
        family_kwargs,
        model_embedding_head_activation_bytes,
        model_layer_activation_bytes,
    )
    from backend.spec import ModelSpec

    m = ModelSpec.model_validate({k: v for k, v in shape.items() if k != "source"})
    autocast = mode == "autocast"
    fam = family_kwargs(m)
    block = model_layer_activation_bytes(s=m.seq_len, b=1, h=m.d_model, a=m.n_heads, kv_heads=m.kv_heads, ffn=m.ffn,
                                         dtype_bytes=2, autocast=autocast, device=device, **fam)
    head = model_embedding_head_activation_bytes(s=m.seq_len, b=1, h=m.d_model, vocab=m.vocab_size, dtype_bytes=2,
                                                 logits_held=autocast, autocast=autocast, norm=fam["norm"],
                                                 learned_pos=not fam["rope"], device=device)
    source = "backend/analytic/memory/activations.py model_layer_activation_bytes"
    if mode == "compiled":
        block, source = compiled_block_term(m, device), "backend/analytic/memory/compiled_block.py compiled_block_bytes"
    return {"block_bytes": block, "embedding_head_loss_bytes": head,
            "source": f"{source}, model_embedding_head_activation_bytes"}


def compiled_block_term(m: Any, device: str) -> float | None:
    """memory/compiled_block.compiled_block_bytes of one block (micro-batch 1, bf16 params, no autocast)."""
    from dataclasses import replace

    from backend.analytic.memory.activations import LayerShape
    from backend.analytic.memory.compiled_block import compiled_block_bytes

    shape = LayerShape.prototype(m, dtype_bytes=2, device=device)
    return compiled_block_bytes(replace(shape, micro_batch=1, autocast=False))


def listings(device_type: str, shape_names: list[str], modes: tuple[str, ...] = DEFAULT_MODES) -> list[dict[str, Any]]:
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    out = []
    for name in shape_names:
        shape = SHAPES[name]
        entry: dict[str, Any] = {"device": device_type, "shape": name, "torch": torch.__version__,
                                 "model": {k: v for k, v in shape.items() if k != "source"}, "modes": {}}
        for mode in modes:
            try:
                entry["modes"][mode] = {**listing(shape, device, mode), "analytic": analytic(shape, device_type, mode)}
            except Exception as e:  # noqa: BLE001 - one mode failing is its entry; the others still run
                entry["modes"][mode] = {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.gpucheck.saved_tensors")
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--shape", required=True, help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    args = ap.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - set(MODES):
        ap.error(f"unknown mode(s) in {args.modes!r}; modes are {', '.join(MODES)}")
    names = [n.strip() for n in args.shape.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        ap.error(f"unknown shape(s) {unknown}; shapes are {', '.join(SHAPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    json.dump(listings(args.device, names, modes), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
