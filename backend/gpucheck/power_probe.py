"""The power phase's child (backend/gpucheck/power.py): what each class of kernel draws at the GPU's own power limit,
and the SM clock it holds there. Prints one JSON object.

    python -m backend.gpucheck.power_probe --device cuda [--seconds 4]

Why: the 500 W H100 profile (Meta's Grand Teton, torchtitan's benchmarks) caps GEMMs at what FBGEMM measured on a
500 W H100 (hardware.json `sustained_flops`), but nothing says how far the same limit slows the attention kernels or
the memory-bound ones, which draw less than a dense GEMM. On an unlimited GPU each kernel's draw at full clock is
measurable; with the GEMM's pair (its rate here, its rate at 500 W) it prices the cap per kernel class. The power
limit itself is left as it is (the device machine's rule): only its draw is read.

For each workload (a bf16 GEMM, FlashAttention-2 and cuDNN attention forward + backward through SDPA, a device copy):
one second of warm-up, then `--seconds` of back-to-back calls while `nvidia-smi --loop-ms=100` samples power.draw and
clocks.sm; the mean of the samples inside the timed window (its first 0.5 s left out: the clock settles) next to the
rate the calls achieved (FLOP/s, bytes/s for the copy). The idle draw is sampled first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SMI_FIELDS = ("power.draw", "clocks.sm", "power.limit", "temperature.gpu")
SETTLE_S = 0.5
"""Samples this long after a workload starts are left out: the clock and the draw ramp up first."""


def parse_smi_line(line: str) -> dict[str, float] | None:
    """One `nvidia-smi --format=csv,noheader,nounits` line of SMI_FIELDS, None where a field is not a number
    ('[N/A]', a header, a blank line)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(SMI_FIELDS):
        return None
    try:
        return dict(zip(SMI_FIELDS, (float(p) for p in parts), strict=True))
    except ValueError:
        return None


@dataclass
class Samples:
    """nvidia-smi's samples, each stamped with time.monotonic() when read."""

    rows: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Mean power (W) and SM clock (MHz) of the samples in [t0 + SETTLE_S, t1], and how many there were."""
        inside = [r for t, r in self.rows if t0 + SETTLE_S <= t <= t1]
        if not inside:
            return {"samples": 0, "power_w": None, "sm_mhz": None}
        return {"samples": len(inside), "power_w": sum(r["power.draw"] for r in inside) / len(inside),
                "sm_mhz": sum(r["clocks.sm"] for r in inside) / len(inside),
                "power_limit_w": inside[-1]["power.limit"], "temperature_c": max(r["temperature.gpu"] for r in inside)}


class Sampler:
    """`nvidia-smi --loop-ms` in the background, its lines parsed into Samples by a reader thread."""

    def __init__(self, exe: str, interval_ms: int = 100):
        self.samples = Samples()
        self.proc = subprocess.Popen([exe, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits",
                                      f"--loop-ms={interval_ms}", "--id=0"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout or []:
            row = parse_smi_line(line)
            if row is not None:
                self.samples.rows.append((time.monotonic(), row))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@dataclass(frozen=True)
class Workload:
    name: str
    call: Callable[[], Any]
    work: float
    """FLOPs (bytes for a memory-bound workload) of one call."""
    unit: str


def workloads(torch: Any) -> list[Workload]:
    """The kernel classes of a training step, each at a size that keeps the GPU busy for milliseconds per call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    n = 8192
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    batch, heads, seq, dim = 2, 32, 8192, 128
    q, k, v = (torch.randn(batch, heads, seq, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)
    attn_flops = 3.5 * 4.0 * batch * heads * seq * seq * dim * 0.5  # causal forward + backward (2.5x forward)
    src = torch.empty(2**30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def attention(backend: Any) -> Callable[[], None]:
        def call() -> None:
            with sdpa_kernel([backend]):
                q.grad = k.grad = v.grad = None
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        return call

    return [Workload("gemm_bf16", lambda: torch.mm(a, b), 2.0 * n**3, "flop/s"),
            Workload("attention_flash", attention(SDPBackend.FLASH_ATTENTION), attn_flops, "flop/s"),
            Workload("attention_cudnn", attention(SDPBackend.CUDNN_ATTENTION), attn_flops, "flop/s"),
            Workload("copy", lambda: dst.copy_(src), 2.0 * src.numel(), "bytes/s")]


def measure(torch: Any, sampler: Sampler, w: Workload, seconds: float) -> dict[str, Any]:
    """One workload: warm-up, then calls for `seconds`, the rate they achieved and the draw sampled meanwhile."""
    try:
        warm_end = time.monotonic() + 1.0
        while time.monotonic() < warm_end:
            w.call()
            torch.cuda.synchronize()
        t0, calls = time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            for _ in range(4):
                w.call()
            calls += 4
            torch.cuda.synchronize()
        t1 = time.monotonic()
    except Exception as e:  # noqa: BLE001 - a kernel this GPU lacks (cuDNN attention) is a row, the rest go on
        return {"name": w.name, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"name": w.name, "status": "ok", "calls": calls, "seconds": t1 - t0, "unit": w.unit,
            "achieved_per_s": calls * w.work / (t1 - t0), **sampler.samples.window(t0, t1)}


def probe(seconds: float) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device: power draw is a GPU's"}
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {"status": "skipped", "reason": "nvidia-smi not found: nothing reads the draw"}
    sampler = Sampler(exe)
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        time.sleep(1.0 + SETTLE_S)
        idle = sampler.samples.window(t0, time.monotonic())
        rows = [measure(torch, sampler, w, seconds) for w in workloads(torch)]
    finally:
        sampler.stop()
    return {"status": "ok", "device_name": torch.cuda.get_device_name(0), "idle": idle, "kernels": rows,
            "seconds_per_kernel": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args(argv)
    if args.device != "cuda":
        row = {"status": "skipped", "reason": f"device {args.device}: power draw is measured on CUDA only"}
    else:
        row = probe(args.seconds)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
