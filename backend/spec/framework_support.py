"""What each framework runs, checked before launch: anything else is refused with the reason.

Pure Python (imported by spec validation): no torch, deepspeed or jax here.
"""

from __future__ import annotations

from backend.spec import dims
from backend.spec.parallel_spec import ParallelSpec
from backend.spec.spec_parts import SpecParts

DEEPSPEED_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
"""ShardLab strategy -> DeepSpeed `zero_optimization.stage` (ddp is stage 0: plain data parallelism)."""
JAX_STRATEGIES = {"ddp": "dp", "zero3": "fsdp", "fsdp": "fsdp", "tp": "tp"}
"""ShardLab strategy -> the GSPMD layout it is written as (backend/frameworks/jax/named_shardings.py)."""
JAX_DIMS = ("dp", "tp")
"""The parallel dimensions the JAX layouts shard over; any other above 1 is refused."""
_BEYOND_DP = tuple(d.name for d in dims.DIMS if not d.remainder)
_QUIET_AT_1 = tuple(d.name for d in dims.DIMS if not (d.always_named or d.in_world))
"""Carved dimensions named only above 1 (etp), as in a rank's coords: a message lists them only when set."""


def _degrees_text(p: ParallelSpec, names: tuple[str, ...]) -> str:
    return ", ".join(f"{d}={getattr(p, d)}" for d in names if d not in _QUIET_AT_1 or getattr(p, d) > 1)
"""Every degree but dp: DeepSpeed and torch's offload run pure data parallelism here."""
JAX_GPT_FAMILY = {"norm": "layernorm", "mlp": "gelu", "positions": "learned", "bias": "all", "tie_embeddings": False,
                  "norm_eps": 1e-5}
"""The one model family the JAX twin writes (backend/frameworks/jax/gpt.py: LayerNorm with bias, eps 1e-5, GELU MLP,
learned positions, biases everywhere, its own lm_head)."""
JAX_MAX_DEVICES = 64
"""Virtual CPU devices in one process (`--xla_force_host_platform_device_count`): more only measures overhead."""


def check_framework(s: SpecParts) -> list[str]:
    return {"torch": _torch, "deepspeed": _deepspeed, "jax": _jax}[str(s.framework)](s)


def _torch(s: SpecParts) -> list[str]:
    p = s.parallel
    if p.offload == "none":
        return []
    out = []
    if str(p.strategy) not in ("zero2", "zero3", "fsdp"):
        out.append(f"offload={p.offload} on torch is FSDP2's CPUOffloadPolicy: it needs strategy zero2, zero3 or fsdp "
                   f"(got {p.strategy})")
    if p.offload == "optimizer":
        out.append("torch FSDP2's CPUOffloadPolicy moves the sharded parameters, their gradients and the optimizer "
                   "step to the host together: use offload=params (offload=optimizer alone is DeepSpeed's, --framework "
                   "deepspeed)")
    if any(getattr(p, d) > 1 for d in _BEYOND_DP):
        out.append("offload on torch runs pure data parallelism here (got " + _degrees_text(p, _BEYOND_DP) + ")")
    return out


def _deepspeed(s: SpecParts) -> list[str]:
    p, t, m = s.parallel, s.train, s.model
    out = []
    st = str(p.strategy)
    if st not in DEEPSPEED_STAGE:
        hint = " (DeepSpeed's ZeRO-3 is --strategy zero3)" if st == "fsdp" else ""
        out.append(f"framework deepspeed runs ZeRO stages 0-3 (strategy ddp, zero1, zero2, zero3); got {st}{hint}")
    mp = {k: getattr(p, k) for k in _BEYOND_DP if getattr(p, k) > 1}
    if mp:
        out.append("framework deepspeed runs ZeRO data parallelism only here (its TP/PP/MoE/sequence engines are not "
                   "wired): "
                   + ", ".join(f"{k}={v}" for k, v in mp.items()) + " must be 1")
    if m.is_moe:
        out.append(f"framework deepspeed runs dense models only here (got n_experts={m.n_experts})")
    if str(t.recompute) != "none":
        out.append(f"framework deepspeed: recompute={t.recompute} is not wired (DeepSpeed has its own activation "
                   "checkpointing API); use recompute=none")
    stage = DEEPSPEED_STAGE.get(st, 0)
    if p.offload != "none" and stage == 0:
        out.append(f"offload={p.offload} needs ZeRO stage >= 1 (DeepSpeed offloads ZeRO partitions; got {st} = "
                   "stage 0)")
    if p.offload == "params" and stage != 3:
        out.append(f"offload=params is DeepSpeed's offload_param, which only ZeRO stage 3 has (got {st} = stage "
                   f"{stage})")
    if str(t.precision) == "fp8":
        out.append("framework deepspeed: precision fp8 is torchao's float8 training, wired for framework torch only")
    if str(s.runtime.device) != "cuda" and str(t.precision) == "fp16-mixed":
        out.append(f"framework deepspeed with device={s.runtime.device}: DeepSpeed's CPU accelerator does not support "
                   "fp16 (is_fp16_supported() is not True); use bf16-mixed or fp32, or device=cuda")
    return out


def _jax(s: SpecParts) -> list[str]:
    p, t, m, r = s.parallel, s.train, s.model, s.runtime
    out = []
    st = str(p.strategy)
    if st not in JAX_STRATEGIES:
        why = (": GSPMD shards parameters and optimizer state together, so ZeRO-1/2 have no layout of their own"
               if st in ("zero1", "zero2") else "")
        out.append("framework jax runs dp (ddp), fsdp (zero3/fsdp) and tp layouts and their dp x tp mix; "
                   f"got {st}{why}")
    unwritten = [d for d in _BEYOND_DP if d not in JAX_DIMS]
    if any(getattr(p, d) > 1 for d in unwritten):
        out.append("framework jax: pipeline and expert parallelism (and context parallelism) are not written in JAX "
                   "here (" + _degrees_text(p, tuple(unwritten)) + ")")
    if st in ("zero3", "fsdp") and p.tp > 1:
        out.append(f"framework jax: fsdp x tp is not wired (got tp={p.tp}); run fsdp with tp=1 or tp with ddp")
    if m.is_moe:
        out.append(f"framework jax runs dense models only (got n_experts={m.n_experts})")
    other = {k: getattr(m, k) for k, gpt in JAX_GPT_FAMILY.items() if getattr(m, k) != gpt}
    if other:
        out.append("framework jax runs the GPT family only (layernorm, gelu, learned positions, bias=all, untied "
                   "embeddings, norm_eps=1e-05); got " + ", ".join(f"{k}={v}" for k, v in other.items()))
    if str(t.precision) != "fp32":
        out.append(f"framework jax runs fp32 only here (got {t.precision})")
    if str(t.recompute) != "none":
        out.append(f"framework jax: recompute={t.recompute} is not wired (jax.checkpoint); use recompute=none")
    if p.offload != "none":
        out.append(f"framework jax: offload={p.offload} is not wired (XLA host offload needs an accelerator)")
    if r.nnodes > 1 or str(r.device) == "cuda" or str(r.backend) == "nccl":
        out.append(f"framework jax runs on N virtual CPU devices in one process (got nnodes={r.nnodes}, "
                   f"device={r.device}, backend={r.backend})")
    if p.world_size and p.world_size > JAX_MAX_DEVICES:
        out.append(f"framework jax: world_size={p.world_size} > {JAX_MAX_DEVICES} virtual devices")
    return out
