"""Shared builders for the store tests: a real SQLite file per test and realistic RunResults."""

from __future__ import annotations

from pathlib import Path

from backend.result import RunResult
from backend.spec import ExperimentSpec
from db.session import open_db

TINY = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16, "vocab_size": 64},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2, "warmup_steps": 1},
        "parallel": {"strategy": "ddp", "world_size": 2}}


def file_db(tmp_path: Path, name: str = "store.db"):
    return open_db(f"sqlite:///{tmp_path / name}")


def spec(name: str = "", **parallel) -> ExperimentSpec:
    data = {**TINY, "name": name, "parallel": {**TINY["parallel"], **parallel}}
    return ExperimentSpec.model_validate(data)


def fake_result(s: ExperimentSpec, status: str = "ok", *, seed: int = 0) -> RunResult:
    """A RunResult shaped like the engine's, with distinct numbers so round trips are checkable."""
    ranks = []
    for r in range(s.parallel.world_size):
        base = 1000 * (seed + 1) + 17 * r
        ranks.append({
            "rank": r, "coords": s.parallel.coords(r),
            "measured": {"params_bytes": base, "grads_bytes": base + 1, "optimizer_bytes": 2 * base,
                         "activations_bytes": 3 * base + 5, "other_bytes": 7, "peak_bytes": 7 * base + 13},
            "predicted": {"params_bytes": base, "grads_bytes": base, "optimizer_bytes": 2 * base,
                          "activations_bytes": 3 * base, "other_bytes": 0, "peak_bytes": 7 * base},
            "error_pct": {"params_bytes": 0.0, "grads_bytes": 100 / base, "optimizer_bytes": 0.0,
                          "activations_bytes": 500 / (3 * base), "peak_bytes": 1300 / (7 * base)},
            "step_s": [0.125 + r / 64, 0.25 + seed / 128, 0.1875],
            "comm": {"all_reduce": {"calls": 2.0, "bytes": 4.0 * base, "wire_bytes": 4.0 * base, "seconds": 0.0123 + r},
                     "broadcast": {"calls": 1.0, "bytes": 64.0, "wire_bytes": 64.0, "seconds": 0.001}},
            "comm_predicted": {"all_reduce": 4.0 * base, "all_gather": 12.5},
            "rss_bytes": 300_000_000 + r,
        })
    return RunResult.model_validate({
        "status": status, "spec": s.model_dump(mode="json"), "per_rank": ranks,
        "error": None if status == "ok" else f"rank 1 raised: boom {seed}",
        "failing_rank": None if status == "ok" else 1, "log_tail": "line 1\nline 2" if status != "ok" else None,
        "env": {"torch": "2.13.0+cpu", "python": "3.11.9", "hostname": "h"},
        "step_s_median": 0.1875 + seed / 1000, "tokens_per_s": 341.3 + seed, "loss": [4.5, 4.25],
        "loss_reference": [4.5, 4.2500001],
        "loss_max_abs_diff": 1e-7, "bubble_measured": -0.015625 if seed % 2 else 0.25, "bubble_predicted": 0.2,
        "timeline": [{"rank": 0, "stage": 0, "microbatch": 0, "pass": "F", "start_s": 0.0, "end_s": 0.01},
                     {"rank": 1, "stage": 1, "microbatch": 0, "pass": "B", "start_s": 0.01, "end_s": 0.03}],
        "wall_s": 12.5,
    })


class SmallFs:
    """A real small file system: a tmpfs of `size` mounted at `path` (root only), filled and freed on demand."""

    def __init__(self, path: Path, size: str = "4m"):
        self.path, self.size = Path(path), size

    def mount(self) -> str | None:
        """Mount it; None, or why it cannot be mounted here (the fault tests are then skipped with that reason)."""
        import os
        import subprocess

        if os.geteuid() != 0:
            return "mounting a small tmpfs needs root"
        self.path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)],
                              capture_output=True, text=True)
        return None if done.returncode == 0 else f"mount -t tmpfs failed: {done.stderr.strip()}"

    def fill(self) -> None:
        """Take every free byte (a file grown until the file system says it is full)."""
        with open(self.path / ".filler", "ab", buffering=0) as f:
            for chunk in (1 << 16, 1 << 12, 1 << 9, 1):
                try:
                    while True:
                        f.write(b"\0" * chunk)
                except OSError:
                    continue

    def free(self) -> None:
        (self.path / ".filler").unlink(missing_ok=True)

    def unmount(self) -> None:
        import subprocess

        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
