"""FP8 training (precision fp8): torchao's float8 linears (`convert_to_float8_training`, tensorwise or rowwise
dynamic scaling, Float8LinearConfig.from_recipe_name), bf16 autocast / MixedPrecisionPolicy everywhere else.
torchao 0.18 runs its float8 training on the CPU under torch 2.13 (torch._scaled_mm with float8_e4m3fn operands
runs here), so no hand-written float8 linear is needed. Converted: every block Linear (torchtitan converts every
nn.Linear but its `output` head; the MoE router and experts are left in bf16 here). Under FSDP2 with the tensorwise
recipe the weights are all-gathered in fp8 (enable_fsdp_float8_all_gather) and their scales computed for all of
them at once after each optimizer step (precompute_float8_dynamic_scale_for_fsdp), as torchtitan does.
The single-process reference converts its model the same way (same casts)."""

from __future__ import annotations

from typing import Any

from torch import nn

from backend.spec import ExperimentSpec


def _linear_filter(module: nn.Module, fqn: str) -> bool:
    """Block Linears only: not lm_head, not the MoE router / experts / shared-expert gate."""
    return isinstance(module, nn.Linear) and fqn.startswith("layers.") and ".mlp.router" not in fqn \
        and ".experts." not in fqn and not fqn.endswith("shared_gate")


def config(spec: ExperimentSpec, *, fsdp: bool) -> Any:
    from torchao.float8 import Float8LinearConfig

    cfg = Float8LinearConfig.from_recipe_name(str(spec.train.fp8_recipe))
    if fsdp and spec.train.fp8_gathers:
        from dataclasses import replace

        cfg = replace(cfg, enable_fsdp_float8_all_gather=True)
    return cfg


def convert(spec: ExperimentSpec, module: nn.Module, *, fsdp: bool = False) -> nn.Module:
    """Swap this module's block Linears for torchao Float8Linear (works on meta modules; weights keep their names)."""
    if str(spec.train.precision) != "fp8":
        return module
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(module, config=config(spec, fsdp=fsdp), module_filter_fn=_linear_filter)


def after_step(spec: ExperimentSpec, modules: list[nn.Module], optimizer: Any, *, fsdp: bool) -> None:
    """FSDP2 fp8 all-gather: refresh every float8 weight's scale once per optimizer step (one all-reduce of amaxes)."""
    if not (fsdp and spec.train.fp8_gathers):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(*_: Any) -> None:
        for m in modules:
            precompute_float8_dynamic_scale_for_fsdp(m)

    inner = getattr(optimizer, "optim", optimizer)
    inner.register_step_post_hook(hook)


NOTES = ["FP8: torchao float8 linears (block Linears; lm_head, router and experts stay bf16), dynamic scaling, "
         "bf16 autocast elsewhere; no amax history (dynamic scales are recomputed every step)."]
