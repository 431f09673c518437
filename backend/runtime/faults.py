"""Test-only fault injection: the rank named by SHARDLAB_FAULT="kind:rank=R:step=S" (protocol.Fault) injects
it at the start of step S (kind: raise | kill | hang | stop | oom).

Every rank program calls `maybe_inject(rank, step)` at the start of every step; it does nothing unless the
variable is set, so production runs never pay for it. Used by the launcher's failure tests.
"""

from __future__ import annotations

import os
import signal
import time

from backend.runtime.protocol import read_fault


def maybe_inject(rank: int, step: int) -> None:
    fault = read_fault()
    if fault is None or rank != fault.rank or step != fault.step:
        return
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if fault.kind == "oom":
        raise MemoryError(f"injected out-of-memory on rank {rank} at step {step}")
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        while True:
            time.sleep(1)
    if fault.kind == "stop":  # frozen as by SIGSTOP (a debugger, a swapped-out or preempted host): no stack dump
        os.kill(os.getpid(), signal.SIGSTOP)
