"""The in-rank engine: one rank's set-up, training loop and measurements, and the assembly of their result.

Its public API is below: other rank programs (backend/frameworks), the full-size trace and the launcher use
these names and nothing else of engine/. The names load on first use, so that importing one light module of
the package (e.g. `engine.device_facts` from the dashboard) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "init_distributed": ("backend.engine.mesh", "init"),  # the process group for this rank -> (backend, device)
    "build_mesh": ("backend.engine.mesh", "build_mesh"),
    "global_batch": ("backend.engine.data", "global_batch"),
    "run_loop": ("backend.engine.loop", "run_loop"),
    "timed_steps": ("backend.engine.loop", "timed_steps"),
    "comm_steps": ("backend.engine.loop", "comm_steps"),
    "comm_payload": ("backend.engine.loop", "comm_payload"),
    "has_split_backward": ("backend.engine.loop", "has_split_backward"),
    "progress": ("backend.engine.loop", "progress"),
    "run_isolated": ("backend.engine.reference", "run_isolated"),
    "reference_losses": ("backend.engine.reference", "reference_losses"),
    "assemble_result": ("backend.engine.assemble", "assemble_result"),
    "BOUNDS_PCT": ("backend.engine.accuracy_notes", "BOUNDS_PCT"),
    "host_device": ("backend.engine.device_facts", "host_device"),
    "cuda_available": ("backend.engine.device_facts", "cuda_available"),
}
__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:  # `x as x`: explicit re-exports (ruff cannot read __all__ = sorted(_PUBLIC))
    from backend.engine.accuracy_notes import BOUNDS_PCT as BOUNDS_PCT
    from backend.engine.assemble import assemble_result as assemble_result
    from backend.engine.data import global_batch as global_batch
    from backend.engine.device_facts import cuda_available as cuda_available
    from backend.engine.device_facts import host_device as host_device
    from backend.engine.loop import comm_payload as comm_payload
    from backend.engine.loop import comm_steps as comm_steps
    from backend.engine.loop import has_split_backward as has_split_backward
    from backend.engine.loop import progress as progress
    from backend.engine.loop import run_loop as run_loop
    from backend.engine.loop import timed_steps as timed_steps
    from backend.engine.mesh import build_mesh as build_mesh
    from backend.engine.mesh import init as init_distributed  # noqa: F401 - re-exported under _PUBLIC's name
    from backend.engine.reference import reference_losses as reference_losses
    from backend.engine.reference import run_isolated as run_isolated


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'backend.engine' has no attribute {name!r}")
    module, attr = _PUBLIC[name]
    return getattr(importlib.import_module(module), attr)
