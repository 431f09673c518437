"""What a spec's stack (spec/stacks.py, resolved on a profile's device class) sets in the step-time model (pure Python):
the attention kernel and element-wise implementation it times, whose fp8 GEMMs, how the loss splits the vocabulary,
and which collectives overlap compute. The shardlab stack with nothing set gives exactly the model's knobs from
before stacks (FlashAttention-2 on GPUs, eager on CPU; eager PyTorch element-wise on GPUs; no TP / PP overlap; DDP
and the distributed optimizer's grad reduction behind backward, its param gathers after the step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend.analytic.steptime.compute import default_implementation
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.ops import FP8_ROWWISE
from backend.analytic.steptime.stack_kernels import TORCHAO_ROWWISE
from backend.analytic.steptime.torchao_rowwise import TORCHAO_ROWWISE_LINEAR
from backend.spec.stacks import SPEC_DEFAULT, ResolvedStack, resolve_stack

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

KERNEL = {"eager": "eager", "flash2": "flash", "flash3": "flash3", "cudnn": "cudnn", "efficient": "efficient",
          "flash1": "flash1", "flash-triton": "flash-triton"}
"""The spec's attention kernels -> the step-time model's names (compute.ATTENTION; FlashAttention-2 is "flash")."""
HOPPER = ("sm90", "sm100")


@dataclass(frozen=True)
class StackKnobs:
    attention: str
    implementation: str
    fp8_gemms: str
    vocab_shards: int | None
    """The loss's logits split: tp under loss parallel, 1 over gathered logits, None = the legacy tp (shardlab)."""
    tp_overlap: bool
    grad_overlap: bool | None
    """None: the model's behaviour before stacks (dp_sync.dp_exposed defaults)."""
    gather_overlap: bool | None
    pp_overlap: bool
    resolved: ResolvedStack
    cp_ring_overlap: bool = True
    """False: torch's CP ring runs inside torch.compile's graph and hides no transfer (cp_ring.py): stack torchtitan
    with compile on (torchtitan 9dec370 torchtitan/parallelisms/parallelize_llama.py apply_compile: each
    TransformerBlock, its attention included, under torch.compile(fullgraph=True))."""
    echo: str | None = None
    """The stack's settings as resolved, in words; None for the shardlab stack with nothing set."""
    caveats: list[str] = field(default_factory=list)
    """What the model times in place of what the spec asks for on this profile (a kernel the GPU lacks, an overlap that
    cannot apply): said wherever the step time is shown (StepTime.caveats)."""

    @property
    def notes(self) -> list[str]:
        return ([self.echo] if self.echo else []) + self.caveats


def stack_knobs(spec: ExperimentSpec, hw: Hardware) -> StackKnobs:
    """The step-time knobs of a spec's stack on `hw` (module docstring)."""
    r = resolve_stack(spec, hw.device_class)
    p = spec.parallel
    v = r.values
    implementation = {"eager": default_implementation(hw), "compiled": "compiled", "fused": "fused"}[v["elementwise"]]
    caveats: list[str] = []
    echo = None if r.is_default else f"stack={r.stack}: " + ", ".join(f"{k}={_word(v[k])}" for k in v)
    attention = KERNEL[v["attention_kernel"]]
    if attention == "flash3" and hw.device_class not in HOPPER:
        caveats.append(f"FlashAttention-3 runs on Hopper; {hw.key} ({hw.device_class}) times it as FlashAttention-2")
        attention = "flash"
    tp_overlap = bool(v["tp_overlap"]) and p.tp > 1 and bool(p.sequence_parallel)
    if v["tp_overlap"] and p.tp > 1 and not p.sequence_parallel:
        caveats.append("tp_overlap needs sequence parallelism: TP collectives predicted exposed")
    legacy_loss = r.stack == "shardlab" and r.set_by["loss_parallel"] == SPEC_DEFAULT
    vocab_shards = None if legacy_loss else (p.tp if v["loss_parallel"] else 1)
    default_dp = r.stack == "shardlab"
    multi_stage = p.virtual_stages > 1
    if v["pp_overlap"] and p.pp > 1 and not multi_stage and r.stack == "megatron":
        caveats.append("overlap_p2p_comm applies to Megatron's interleaved schedules only: the 1F1B hops stay exposed")
    pp_overlap = bool(v["pp_overlap"]) and p.pp > 1 and (multi_stage or r.stack != "megatron")
    fp8_gemms = _fp8_gemms(spec, hw, r, implementation == "compiled", caveats)
    return StackKnobs(attention=attention, implementation=implementation, fp8_gemms=fp8_gemms,
                      vocab_shards=vocab_shards, tp_overlap=tp_overlap,
                      grad_overlap=None if default_dp and r.set_by["grad_reduce_overlap"] == SPEC_DEFAULT
                      else bool(v["grad_reduce_overlap"]),
                      gather_overlap=None if default_dp and r.set_by["param_gather_overlap"] == SPEC_DEFAULT
                      else bool(v["param_gather_overlap"]),
                      pp_overlap=pp_overlap, resolved=r, echo=echo, caveats=caveats,
                      cp_ring_overlap=not (r.stack == "torchtitan" and implementation == "compiled"))


def _fp8_gemms(spec: ExperimentSpec, hw: Hardware, r: ResolvedStack, compiled: bool, caveats: list[str]) -> str:
    """Whose float8 GEMMs, torchao's rowwise recipe apart: its GEMMs scale each row (stack_kernels.TORCHAO_ROWWISE),
    timed by the profile's own rowwise GEMM table where it has one; otherwise, compiled on Hopper, each rowwise linear
    is timed whole from torchao's microbenchmark of it (torchao_rowwise.TORCHAO_ROWWISE_LINEAR)."""
    t = spec.train
    if r.fp8_gemms != "torchao" or str(t.precision) != "fp8" or str(t.fp8_recipe) != "rowwise":
        return r.fp8_gemms
    measured = hw.tables.gemm_table(FP8_ROWWISE) is not None
    if not measured and compiled and hw.device_class == "sm90" and hw.peak_flops.get("fp8"):
        caveats.append(f"fp8_recipe rowwise: each float8 linear (its GEMMs and casts) is timed as {hw.key}'s bf16 "
                       "GEMMs over torchao's measured rowwise speedup of a compiled LayerNorm -> Linear -> Sigmoid at "
                       "its shape (torchao_rowwise.py; H100, torch 2.8.0a0)")
        return TORCHAO_ROWWISE_LINEAR
    if not measured and hw.peak_flops.get("fp8"):
        caveats.append(f"fp8_recipe rowwise: {hw.key} has no measured rowwise-scaled fp8 GEMM table, so its GEMMs "
                       "are timed as tensorwise ones (the GPU check's probe measures one: gemm_fp8_rowwise); its casts "
                       "are the rowwise recipe's (float8_casts.py)")
    return TORCHAO_ROWWISE


def _word(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)
