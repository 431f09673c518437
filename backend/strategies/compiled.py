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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from backend.spec import ExperimentSpec
from backend.spec.choices import Elementwise
from backend.spec.stacks import resolve_stack

if TYPE_CHECKING:
    from torch import nn

EAGER_MEMORY_NOTE = ("torch.compile: the memory-tracked step ran the blocks eagerly (torch.compiler.set_stance "
                     "'force_eager'): Dynamo does not run under the memory tracker's TorchDispatchMode, so the "
                     "measured memory is the eager blocks' and is compared with the eager prediction; what a compiled "
                     "block saves is measured in-process (tests/unit/test_compiled_block.py)")


def compiles_blocks(spec: Any) -> bool:
    """The spec's element-wise work is compiled (train.elementwise, its own or its stack's default on CPU ranks)."""
    return str(resolve_stack(spec, "cpu").values["elementwise"]) == "compiled"


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
    """Around the memory-tracked step: compiled blocks run eagerly (module docstring), others as they are."""
    if not compiles_blocks(spec):
        yield
        return
    import torch

    with torch.compiler.set_stance("force_eager"):
        yield


def eager_twin(spec: ExperimentSpec) -> ExperimentSpec:
    """The spec with its blocks eager: what the memory-tracked step ran, which its measured memory is compared with."""
    if not compiles_blocks(spec):
        return spec
    return spec.model_copy(update={"train": spec.train.model_copy(update={"elementwise": Elementwise.EAGER})})


def notes(spec: Any, n_blocks: int) -> list[str]:
    if not n_blocks:
        return []
    return [f"torch.compile: {n_blocks} transformer blocks compiled in place (nn.Module.compile, fullgraph=True) "
            "after TP and activation checkpointing, before FSDP, as torchtitan's apply_compile; the timed and "
            "comm-timing steps run them compiled", EAGER_MEMORY_NOTE]
