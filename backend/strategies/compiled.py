"""torch.compile of each transformer block, as torchtitan applies it (torchtitan b5bcd76
torchtitan/distributed/compile.py `apply_compile` 39-72: `transformer_block.compile(backend, fullgraph=True)` per
block, after tensor parallelism and activation checkpointing, before FSDP: models/llama3/parallelize.py 46-56).

`nn.Module.compile` compiles the block's call in place, so parameter names keep no `_orig_mod` prefix: the trackers,
the distributed optimizer's buckets and the parity reference see the eager names. On CPU ranks Inductor writes C++ /
OpenMP kernels, on a GPU Triton ones; the partition (what backward keeps) is the same FX graph on both, the kernels'
speed is not.

The memory-tracked step runs the blocks eagerly (`memory_step_stance`): torch's MemTracker and the comm counter are
TorchDispatchModes, and Dynamo refuses to run a frame under one (torch/_dynamo/convert_frame.py: "non-infra torch
dispatch mode present, this is not supported today in torch.compile"; measured on torch 2.13: the tracked step fails
on every rank with fullgraph=True). What a compiled block keeps for backward is measured in-process with
saved_tensors_hooks instead (tests/unit/test_compiled_block.py), which compile does honour.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from backend.spec import ExperimentSpec
from backend.spec.choices import Elementwise
from backend.spec.stacks import resolve_stack

if TYPE_CHECKING:
    import torch
    from torch import nn

EAGER_MEMORY_NOTE = ("torch.compile: the memory-tracked step ran the blocks and the loss eagerly (torch.compiler."
                     "set_stance 'force_eager'): Dynamo does not run under the memory tracker's TorchDispatchMode, so "
                     "the measured memory is the eager ones' and is compared with the eager prediction; what a "
                     "compiled block saves is measured in-process (tests/unit/test_compiled_block.py)")


def compiles_blocks(spec: Any) -> bool:
    """The spec's element-wise work is compiled (train.elementwise, its own or its stack's default on CPU ranks)."""
    return str(resolve_stack(spec, "cpu").values["elementwise"]) == "compiled"


def compiles_loss(spec: Any) -> bool:
    """The spec's cross-entropy is compiled (train.loss_compiled; stack torchtitan's default under compile)."""
    return bool(resolve_stack(spec, "cpu").values["loss_compiled"])


def compiles(spec: Any) -> bool:
    return compiles_blocks(spec) or compiles_loss(spec)


def loss_function(spec: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss the steps call: models/gpt.loss_fn, under torch.compile where the spec compiles it (torchtitan b5bcd76
    components/loss.py `_maybe_compile` 245-252: `torch.compile(self.fn, backend)`, no fullgraph)."""
    import torch

    from backend.models.gpt import loss_fn

    return torch.compile(loss_fn) if compiles_loss(spec) else loss_fn


def compile_blocks(spec: Any, module: nn.Module) -> int:
    """Compile every transformer block of one (stage) module in place; returns how many."""
    if not compiles_blocks(spec):
        return 0
    blocks = list(module.layers.values())
    for block in blocks:
        block.compile(fullgraph=True)
    return len(blocks)


@contextlib.contextmanager
def memory_step_stance(spec: Any) -> Iterator[None]:
    """Around the memory-tracked step: compiled blocks and loss run eagerly (module docstring), others as they are."""
    if not compiles(spec):
        yield
        return
    import torch

    with torch.compiler.set_stance("force_eager"):
        yield


def eager_twin(spec: ExperimentSpec) -> ExperimentSpec:
    """The spec with its blocks and loss eager: what the memory-tracked step ran, which its measured memory is compared
    with."""
    if not compiles(spec):
        return spec
    eager = {"elementwise": Elementwise.EAGER, "loss_compiled": False}
    return spec.model_copy(update={"train": spec.train.model_copy(update=eager)})


def notes(spec: Any, n_blocks: int) -> list[str]:
    out = [f"torch.compile: {n_blocks} transformer blocks compiled in place (nn.Module.compile, fullgraph=True) "
           "after TP and activation checkpointing, before FSDP, as torchtitan's apply_compile; the timed and "
           "comm-timing steps run them compiled"] if n_blocks else []
    if compiles_loss(spec):
        out.append("torch.compile: the cross-entropy runs compiled (torch.compile(loss_fn), as torchtitan's "
                   "build_cross_entropy_loss under compile)")
    if out and not spec.train.warmup_steps:
        out.append("torch.compile with warmup_steps=0: the first timed step includes the compile (seconds on CPU "
                   "ranks), which the median of the timed steps only partly hides; set warmup_steps >= 1")
    return out + ([EAGER_MEMORY_NOTE] if out else [])
