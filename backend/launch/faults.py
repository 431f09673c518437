"""Test-only fault injection, read from SHARDLAB_FAULT="kind:rank=R:step=S" (kind: raise | kill | hang | oom).

The engine calls `maybe_inject(rank, step)` at the start of every step; it does nothing unless the
variable is set, so production runs never pay for it. Used by the launcher's failure tests.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "SHARDLAB_FAULT"


def parse(text: str) -> tuple[str, int, int]:
    kind, *kv = text.split(":")
    fields = dict(item.split("=", 1) for item in kv)
    return kind, int(fields.get("rank", 0)), int(fields.get("step", 0))


def maybe_inject(rank: int, step: int) -> None:
    text = os.environ.get(ENV)
    if not text:
        return
    kind, at_rank, at_step = parse(text)
    if rank != at_rank or step != at_step:
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind == "oom":
        raise MemoryError(f"injected out-of-memory on rank {rank} at step {step}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(1)
