"""Short names of the experiment spec's fields (`--world` -> parallel.world_size), shared by the CLI's flags
(backend/cli/spec_flags.py) and sweep grids (backend/sweep.py: `{"world": [2, 4]}`). The parallel dimensions' flags
come from their table (backend/spec/dims.py): value flags here, switches and toggles in `SWITCHES`."""

from __future__ import annotations

from typing import Any

from backend.spec import dims
from backend.spec.choices import (
    AttentionImpl,
    Backend,
    Bias,
    Executor,
    Framework,
    Mlp,
    MoeDispatcher,
    Norm,
    Offload,
    Optimizer,
    Positions,
    Precision,
    Strategy,
)
from backend.spec.stacks import SETTING_INFO, STACK_CHOICES


def dim_flags(dimensions: tuple[dims.Dim, ...]) -> dict[str, tuple[str, str, Any]]:
    """The dimensions' value flags as FLAGS entries (`--cp` -> ("parallel", "cp", int))."""
    return {flag: ("parallel", f.name, dims.flag_choices(f)) for flag, f in dims.cli_flags(dimensions).items()
            if f.flag_kind == "value"}


def dim_switches(dimensions: tuple[dims.Dim, ...]) -> dict[str, dims.SpecField]:
    """The dimensions' boolean flags: switches (`--sequence-parallel`) and toggles (`--[no-]cp-load-balance`)."""
    return {flag: f for flag, f in dims.cli_flags(dimensions).items() if f.flag_kind != "value"}


# flag -> (section, field, type); a flag left unset keeps the --spec file's value or the spec default.
FLAGS: dict[str, tuple[str, str, Any]] = {
    "--name": ("", "name", str),
    "--vocab": ("model", "vocab_size", int),
    "--hidden": ("model", "d_model", int),
    "--layers": ("model", "n_layers", int),
    "--heads": ("model", "n_heads", int),
    "--kv-heads": ("model", "n_kv_heads", int),
    "--ffn": ("model", "ffn_hidden", int),
    "--seq": ("model", "seq_len", int),
    "--experts": ("model", "n_experts", int),
    "--top-k": ("model", "top_k", int),
    "--capacity-factor": ("model", "capacity_factor", float),
    "--moe-aux-loss-coeff": ("model", "moe_aux_loss_coeff", float),
    "--moe-dispatcher": ("model", "moe_dispatcher", [v.value for v in MoeDispatcher]),
    "--moe-imbalance": ("model", "moe_imbalance", float),
    "--global-batch": ("train", "global_batch", int),
    "--micro-batch": ("train", "micro_batch", int),
    "--microbatches": ("train", "microbatches", int),
    "--steps": ("train", "steps", int),
    "--warmup-steps": ("train", "warmup_steps", int),
    "--precision": ("train", "precision", [v.value for v in Precision]),
    "--optimizer": ("train", "optimizer", [v.value for v in Optimizer]),
    "--lr": ("train", "lr", float),
    "--recompute": ("train", "recompute", str),  # none|selective|full|op|layers:K|block:N|uniform:N (spec validation)
    "--seed": ("train", "seed", int),
    "--strategy": ("parallel", "strategy", [v.value for v in Strategy]),
    "--world": ("parallel", "world_size", int),
    **dim_flags(dims.DIMS),
    "--backend": ("runtime", "backend", [v.value for v in Backend]),
    "--nnodes": ("runtime", "nnodes", int),
    "--node-rank": ("runtime", "node_rank", int),
    "--rdzv-endpoint": ("runtime", "rdzv_endpoint", str),
    "--timeout": ("runtime", "timeout_s", float),
    "--framework": ("", "framework", [v.value for v in Framework]),
    "--offload": ("parallel", "offload", [v.value for v in Offload]),
    "--executor": ("runtime", "executor", [v.value for v in Executor]),
    "--nodes": ("runtime", "nnodes", int),
    "--norm": ("model", "norm", [v.value for v in Norm]),
    "--mlp": ("model", "mlp", [v.value for v in Mlp]),
    "--positions": ("model", "positions", [v.value for v in Positions]),
    "--bias": ("model", "bias", [v.value for v in Bias]),
    "--attention": ("model", "attention", [v.value for v in AttentionImpl]),
    "--expert-ffn": ("model", "expert_ffn_hidden", int),
    "--shared-experts": ("model", "n_shared_experts", int),
    "--shared-ffn": ("model", "shared_ffn_hidden", int),
    "--stack": ("train", "stack", list(STACK_CHOICES)),
    **{s.flag: ("train", name, list(s.choices)) for name, s in SETTING_INFO.items() if not s.boolean},
}

SWITCHES = dim_switches(dims.DIMS)

STACK_SWITCHES: dict[str, str] = {s.flag: name for name, s in SETTING_INFO.items() if s.boolean}
"""On / off stack settings (train.<field>; --no-<flag> sets False, neither keeps the stack's default). --async-tp is
--tp-comm-overlap under torchtitan's name, --compile is --elementwise compiled."""
