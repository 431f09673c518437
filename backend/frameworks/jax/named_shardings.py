"""NamedShardings over a ("dp", "tp") Mesh of virtual CPU devices, from the layout in
backend/analytic/frameworks/gspmd.py."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from backend.analytic.frameworks.gspmd import layout


def make_mesh(spec: Any) -> Mesh:
    import jax

    p = spec.parallel
    devices = np.array(jax.devices()[: p.world_size]).reshape(p.dp, p.tp)  # row-major: ParallelSpec.coords
    return Mesh(devices, ("dp", "tp"))


def param_shardings(spec: Any, mesh: Mesh, shapes: dict[str, tuple[int, ...]]) -> dict[str, NamedSharding]:
    lay = layout(spec)
    out = {}
    for name, shape in shapes.items():
        dim, axis = lay[name]
        parts = [axis if d == dim else None for d in range(len(shape))]
        out[name] = NamedSharding(mesh, P(*parts))
    return out


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """(microbatches, dp * micro_batch, T): rows split over "dp", replicated over "tp"."""
    return NamedSharding(mesh, P(None, "dp", None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
