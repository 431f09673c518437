"""What a plan fits its layouts in, as a person gives it (`plan --memory-gb / --reserve-gb / --fragmentation`, the
Plan page's fields): the device memory per GPU and the runtime allowance's overrides, checked before anything is
searched and resolved into what analytic/device.fits_device takes. One place, so the CLI and the page compute the
same device size and refuse the same values with the same arithmetic."""

from __future__ import annotations

from dataclasses import replace

from backend.analytic.device import RuntimeOverhead
from backend.analytic.steptime.hardware import Hardware

FLAGS = {"memory": "--memory-gb", "reserve": "--reserve-gb", "fragmentation": "--fragmentation"}
"""How the CLI names the three inputs in its messages; the Plan page passes its own field labels."""


def device_bytes_of(hw: Hardware, memory_bytes: float | None = None) -> float:
    """The device memory per GPU a plan fits its layouts in: memory_bytes (`--memory-gb`, the page's GB field) when
    given, else the profile's."""
    return memory_bytes or hw.memory_bytes


def overhead_of(reserve_bytes: float | None = None, fragmentation: float | None = None) -> RuntimeOverhead:
    """The runtime allowance with the flags' overrides: reserve_bytes replaces the CUDA context + NCCL buffers (a fixed
    amount per GPU), fragmentation the allocator slack (a fraction of the fullest moment)."""
    o = RuntimeOverhead()
    if reserve_bytes is not None:
        o = replace(o, cuda_context_bytes=int(reserve_bytes), nccl_buffsize_bytes=0)
    if fragmentation is not None:
        o = replace(o, fragmentation_frac=float(fragmentation))
    return o


def allowance_problem(memory_gb: float | None, reserve_gb: float | None, fragmentation: float | None,
                      names: dict[str, str] = FLAGS) -> str | None:
    """Why these overrides cannot describe a device (None when they can), before the profile is known: a device of
    no memory, a negative reserve, a slack outside [0, 1] (a negative one would divide by zero in the budget)."""
    if memory_gb is not None and memory_gb <= 0:
        return f"{names['memory']} must be > 0 (got {memory_gb:g})"
    if reserve_gb is not None and reserve_gb < 0:
        return f"{names['reserve']} must be >= 0 GB per GPU (got {reserve_gb:g})"
    if fragmentation is not None and not 0 <= fragmentation <= 1:
        return (f"{names['fragmentation']} must be between 0 and 1, a fraction of the fullest moment (0.13 adds 13%); "
                f"got {fragmentation:g}")
    return None


def reserve_problem(reserve_gb: float | None, device_bytes: float, hardware: str, memory_given: bool,
                    names: dict[str, str] = FLAGS) -> str | None:
    """Why the reserve leaves no room on the device (device_bytes: device_bytes_of; memory_given: the device size was
    given rather than the profile's), or None."""
    if reserve_gb is None or reserve_gb * 1e9 < device_bytes:
        return None
    return (f"{names['reserve']} {reserve_gb:g} GB is not less than the {device_bytes / 1e9:.4g} GB per GPU of "
            f"{hardware}{' (' + names['memory'] + ')' if memory_given else ''}: no layout could fit")
