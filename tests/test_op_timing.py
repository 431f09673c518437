"""The probe's device timing (backend/bench/op_timing.py) with torch.cuda's events replaced by a model of a GPU queue
(CPU test of the CUDA path): a kernel starts when the host has launched it and the GPU is free, so a single call
timed between two events on an idle GPU holds the host's launch; a burst of back-to-back calls shares one."""

from __future__ import annotations

import pytest
import torch

from backend.bench import op_timing

LAUNCH_S, KERNEL_S = 20e-6, 50e-6


class _Gpu:
    """Host clock and GPU clock: launch() costs the host LAUNCH_S and queues a KERNEL_S kernel."""

    def __init__(self):
        self.host = 0.0
        self.gpu = 0.0

    def launch(self) -> None:
        self.host += LAUNCH_S
        self.gpu = max(self.gpu, self.host) + KERNEL_S


def test_burst_timing_keeps_the_host_launch_out_of_the_span(monkeypatch):
    gpu = _Gpu()

    class Event:
        def __init__(self, enable_timing: bool = False):
            self.t = 0.0

        def record(self):
            gpu.gpu = max(gpu.gpu, gpu.host)  # the event runs as soon as the queue reaches it
            self.t = gpu.gpu

        def synchronize(self):
            gpu.host = max(gpu.host, self.t)

        def elapsed_time(self, other) -> float:
            return (other.t - self.t) * 1e3  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(op_timing, "synchronize", lambda device: None)
    # a 50 us kernel behind a 20 us launch: one call per event pair measures 70 us; in a burst the launches run
    # ahead of the kernels and only the first one's 20 us is inside the span, shared by ~14 calls
    per_call = op_timing.median_s([gpu.launch], torch.device("cuda"), warmup=1, repeats=3)
    assert per_call == pytest.approx(KERNEL_S, rel=0.05), per_call
