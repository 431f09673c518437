"""The specs the GPU check runs: a Llama-family model of about 1B parameters on CUDA, a tiny one on the CPU.

The CUDA model has Llama 3.2 1B's shape (meta-llama/Llama-3.2-1B config.json: hidden 2048, 16 layers, 32 heads,
8 KV heads, intermediate 8192, vocabulary 128256, tied embeddings, RMSNorm, SwiGLU, RoPE, no biases:
1,235,814,400 parameters), at seq 4096 with flash attention and bf16-mixed. Two microbatches of one sequence
per data-parallel rank: 8,192 tokens per rank per step, about 7e13 FLOPs (well under a second on an H100).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.spec import ExperimentSpec, validate_spec

LLAMA_1B = dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                seq_len=4096, norm="rmsnorm", mlp="swiglu", positions="rope", tie_embeddings=True, bias="none",
                attention="flash", norm_eps=1e-5,
                source={"shape_of": "meta-llama/Llama-3.2-1B config.json", "file": "backend/gpucheck/specs.py"})
TINY_LLAMA = dict(LLAMA_1B, vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                  seq_len=64,
                  source={"shape_of": "Llama-3.2-1B family, scaled for the CPU", "file": "backend/gpucheck/specs.py"})
STEPS, WARMUP_STEPS = 6, 1
"""Six timed steps: run 1 (three) saw 0.272 / 0.289 / 0.359 s for zero3, too few for a stable median."""


@dataclass(frozen=True)
class KitRun:
    """One real run of the check: a name (file- and tag-safe) and what differs from the base spec."""

    name: str
    strategy: str
    recompute: str = "none"
    offload: str = "none"
    tp: int = 1
    pp: int = 1
    min_world: int = 1
    """Mixes need this many GPUs (tp·pp ranks, at least one data-parallel pair)."""
    steps: int = STEPS
    late: bool = False
    """Run in the late_runs phase, after diag, trace and tests (what is slow and least needed)."""
    elementwise: str = "eager"
    """train.elementwise: compiled runs each block under torch.compile (strategies/compiled.py; Triton on a GPU)."""


RUNS: tuple[KitRun, ...] = (
    KitRun("zero3", "zero3"),
    KitRun("ddp", "ddp"),
    KitRun("zero2", "zero2"),
    KitRun("zero3-selective", "zero3", recompute="selective"),
    KitRun("zero3-full", "zero3", recompute="full"),
    KitRun("zero3-compiled", "zero3", elementwise="compiled"),
    KitRun("zero3-offload", "zero3", offload="params", steps=1, late=True),
    KitRun("zero3-tp2", "zero3", tp=2, min_world=4),
    KitRun("ddp-pp2", "pp", pp=2, min_world=4),
)
"""In priority order: the budget may end the list early. zero3-compiled: the step time of compiled element-wise work
(steptime/elementwise.py's compiled passes) measured against its prediction, not yet run on a GPU. The offload run
is slow on the host (FSDP2's CPU AdamW over 1.24B parameters on the rank's one thread): one timed step, so 4 steps
in all with warm-up, memory and comm."""


def runs_for(nproc: int, names: list[str] | None = None, late: bool | None = None) -> list[KitRun]:
    """The runs for `nproc` ranks (mixes only where the world holds them), optionally only `names`, only the late
    (True) or the early (False) ones."""
    unknown = sorted(set(names or []) - {r.name for r in RUNS})
    if unknown:
        raise ValueError(f"unknown run(s) {unknown}; known: {', '.join(r.name for r in RUNS)}")
    return [r for r in RUNS if nproc >= r.min_world and nproc % (r.tp * r.pp) == 0 and (not names or r.name in names)
            and (late is None or r.late == late)]


def spec_for(run: KitRun, *, device: str, nproc: int, timeout_s: float, device_name: str = "") -> ExperimentSpec:
    """The validated spec of one run on `nproc` ranks; ValueError with every problem when it cannot run."""
    cuda = device == "cuda"
    dp = nproc // (run.tp * run.pp)
    data: dict[str, Any] = {
        "name": f"gpu-check {run.name}" + (f" on {device_name}" if device_name else ""),
        "model": dict(LLAMA_1B if cuda else TINY_LLAMA),
        "train": {"global_batch": 2 * dp * max(1, run.pp), "micro_batch": 1, "steps": run.steps,
                  "warmup_steps": WARMUP_STEPS, "precision": "bf16-mixed", "optimizer": "adamw",
                  "recompute": run.recompute, "seed": 0,
                  **({"elementwise": run.elementwise} if run.elementwise != "eager" else {})},
        "parallel": {"strategy": run.strategy, "world_size": nproc, "tp": run.tp, "pp": run.pp,
                     "sequence_parallel": run.tp > 1, "offload": run.offload},
        "runtime": {"device": device, "backend": "nccl" if cuda else "gloo", "timeout_s": max(1.0, timeout_s)},
    }
    spec, problems = validate_spec(data)
    if spec is None:
        raise ValueError(f"gpu-check run {run.name}: invalid spec: " + "; ".join(problems))
    return spec
