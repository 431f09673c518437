"""The jitted GSPMD training step: weights from the seeded torch model by name, NamedShardings from the layout,
XLA inserts the collectives. Measures: losses, per-step time (whole process), `compiled.memory_analysis()`,
the compiled HLO's collectives, and each device's resident shard bytes."""

from __future__ import annotations

import platform
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from backend.analytic.frameworks.gspmd import mode
from backend.frameworks.jax import hlo, model, optim, sharding

MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
                 "generated_code_size_in_bytes")


class Trainer:
    def __init__(self, spec: Any):
        self.spec = spec
        t = spec.train
        self.mesh = sharding.make_mesh(spec)
        host = model.torch_params(spec)
        shapes = {k: v.shape for k, v in host.items()}
        self.p_sh = sharding.param_shardings(spec, self.mesh, shapes)
        self.params = {k: jax.device_put(v, self.p_sh[k]) for k, v in host.items()}
        s_sh = {"m": self.p_sh, "v": self.p_sh} if str(t.optimizer) == "adamw" else {"buf": self.p_sh}
        self.state = jax.jit(lambda p: optim.init_state(p, str(t.optimizer)), out_shardings=s_sh)(self.params)
        rep, x_sh = sharding.replicated(self.mesh), sharding.batch_sharding(self.mesh)
        self.x_sh = x_sh
        self.count = jax.device_put(jnp.ones((), jnp.float32), rep)
        step = _make_step(spec)
        self.jitted = jax.jit(step, in_shardings=(self.p_sh, s_sh, rep, x_sh, x_sh),
                              out_shardings=(self.p_sh, s_sh, rep, rep), donate_argnums=(0, 1))
        self.compiled = None

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        xd, yd = jax.device_put(x, self.x_sh), jax.device_put(y, self.x_sh)
        if self.compiled is None:
            self.compiled = self.jitted.lower(self.params, self.state, self.count, xd, yd).compile()
            self.data_bytes = {d: _bytes_on(d, xd) + _bytes_on(d, yd) for d in range(len(self.mesh.devices.flat))}
        self.params, self.state, self.count, loss = self.compiled(self.params, self.state, self.count, xd, yd)
        return float(jax.block_until_ready(loss))

    def facts(self) -> dict[str, Any]:
        mem = self.compiled.memory_analysis()
        text = self.compiled.as_text()
        return {"jax": jax.__version__, "mode": mode(self.spec), "mesh": dict(self.mesh.shape),
                "memory_analysis": {k: int(getattr(mem, k, 0) or 0) for k in MEMORY_FIELDS},
                "collectives": hlo.collectives(text), "hlo_chars": len(text)}

    def device_payload(self, d: int, losses: list[float], step_s: list[float], facts: dict[str, Any]) -> dict[str, Any]:
        """One device's entry in ranks.json: the engine's payload keys, memory from XLA and the live shards."""
        p = self.spec.parallel
        params = sum(_bytes_on(d, a) for a in self.params.values())
        opt = sum(_bytes_on(d, a) for a in jax.tree_util.tree_leaves(self.state))
        ma = facts["memory_analysis"]
        cats = {"params_bytes": params, "grads_bytes": 0, "optimizer_bytes": opt,
                "activations_bytes": ma["temp_size_in_bytes"], "other_bytes": self.data_bytes[d]}
        comm = {k: {"calls": v["calls"], "bytes": v["bytes"], "wire_bytes": _wire(k, v), "seconds": None,
                    "seconds_note": "not measured: XLA times collectives only under its profiler"}
                for k, v in facts["collectives"].items()}
        return {"rank": d, "coords": {"pp": 0, "dp": d // p.tp, "tp": d % p.tp, "ep": 0}, "losses": losses,
                "step_s": step_s, "comm": comm, "comm_excluded": {}, "comm_kernel": {},
                "comm_group_sizes": {k: v["group_sizes"] for k, v in facts["collectives"].items()},
                "memory": {"categories": cats, "moment": "xla_memory_analysis",
                           "peak_bytes": ma["argument_size_in_bytes"] + ma["output_size_in_bytes"]
                           + ma["temp_size_in_bytes"] - ma["alias_size_in_bytes"],
                           "at_peak": cats, "high_water": cats, "xla": ma, "rss_bytes": None},
                "env": {"python": platform.python_version(), "jax": jax.__version__, "backend": "xla-cpu",
                        "device_type": "cpu", "virtual_devices": p.world_size,
                        "platform": platform.platform()},
                "notes": [], "timeline": [], "strategy_module": f"jax:{mode(self.spec)}", "extra": {}}


def _make_step(spec: Any):
    t, m = spec.train, spec.model
    n = t.microbatches
    grad_fn = jax.value_and_grad(model.loss_fn)

    def step(params, state, count, x, y):  # x, y (n, dp * mb, T)
        total, grads = 0.0, None
        for i in range(n):  # unrolled: every collective in the HLO runs once per step
            loss, g = grad_fn(params, x[i], y[i], m)
            total = total + loss / n
            grads = {k: v / n for k, v in g.items()} if grads is None else {k: grads[k] + g[k] / n for k in grads}
        params, state = optim.update(params, grads, state, count, t.lr, str(t.optimizer))
        return params, state, count + 1, total

    return step


def _bytes_on(d: int, a: jax.Array) -> int:
    return sum(s.data.nbytes for s in a.addressable_shards if s.device.id == d)


def _wire(key: str, v: dict[str, Any]) -> float:
    from backend.analytic.textbook.comm import ring_wire_bytes

    n = max(v["group_sizes"] or [1])
    return float(ring_wire_bytes(key, v["bytes"], n))
