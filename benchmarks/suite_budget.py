"""Where a pytest run's time goes: `python benchmarks/suite_budget.py [--out F] -- <pytest arguments>`.

Runs `python -m pytest <arguments>` with benchmarks/suite_timeline.py loaded and samples /proc every `--every-s`
seconds beside it (Linux only): the host's busy CPU seconds (/proc/stat), and each process's CPU seconds by what it
runs (`CATEGORIES`, matched on its command line; a process alive when sampling starts counts from there). It prints,
and writes as JSON:
- the run's wall time, busy CPU seconds and busy fraction, and the floor: busy CPU seconds over the cores, the wall
  time of the same work packed perfectly;
- the busy fraction per 30 s window (where the CPUs idled);
- CPU seconds per category; what no sample saw (processes shorter than a sampling period) is `unsampled`;
- the longest tests and the ones that spent the most CPU in their own process.

`make test`'s target (issue 33: 10 minutes of pytest on 2 cores) needs the floor under 600 s: this says how far the
suite's work is from it, and what that work is. Written by hand: pytest's `--durations` gives wall time only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.suite_timeline import TIMELINE_ENV  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
WINDOW_S = 30.0
TOP = 25
MAKE_TEST_ARGS = ("-q", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder")
"""`make test`'s pytest arguments (tests/unit/test_suite_budget.py checks them against the Makefile)."""

CATEGORIES = (
    ("farm ranks", "tests.helpers.farm_rank"),
    ("torchrun launchers", "torch.distributed.run"),
    ("engine ranks (tests' own launches)", "backend.engine.rank"),
    ("DeepSpeed ranks", "backend.frameworks.deepspeed.rank"),
    ("trace processes", "backend.trace."),
    ("pytest-xdist workers", "exec(eval(sys.stdin"),
    ("pytest", "-m pytest"),
    ("workers (python -m backend worker)", "-m backend worker"),
    ("other backend processes", "-m backend"),
    ("dashboards (streamlit)", "streamlit"),
    ("chromium", "chrom"),
    ("playwright driver", "playwright"),
    ("PostgreSQL", "postgres"),
    ("SLURM", "slurm"),
    ("benchmarks", "benchmarks/"),
)
"""(category, a substring of the command line): the first that matches names a process."""


@dataclass
class Sample:
    t: float
    busy_ticks: int
    total_ticks: int
    cpu_s: dict[int, float] = field(default_factory=dict)
    """Each live process's user + system CPU seconds so far."""


@dataclass
class Span:
    """One test (a suite_timeline line)."""

    id: str
    worker: str
    start: float
    end: float
    self_cpu_s: float
    children_cpu_s: float


def category_of(cmdline: str) -> str:
    if not cmdline:
        return "kernel threads and unnamed"
    return next((name for name, needle in CATEGORIES if needle in cmdline), "other")


def read_sample(names: dict[int, str]) -> Sample:
    """The host's CPU ticks and every process's CPU seconds now; `names` gains the command line of each new pid."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]
    sample = Sample(time.time(), sum(ticks) - idle, sum(ticks))
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            sample.cpu_s[pid] = (int(fields[11]) + int(fields[12])) * TICK_S
            if pid not in names:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    names[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # the process ended between listing and reading
            continue
    return sample


def busy_windows(samples: list[Sample]) -> list[dict]:
    """The busy fraction of the cores in each WINDOW_S window from the first sample."""
    t0, sums = samples[0].t, {}  # window -> (busy ticks, all ticks)
    for a, b in zip(samples, samples[1:], strict=False):
        w = int((a.t - t0) // WINDOW_S)  # the interval from a to b, by where it starts
        busy, total = sums.get(w, (0, 0))
        sums[w] = (busy + b.busy_ticks - a.busy_ticks, total + b.total_ticks - a.total_ticks)
    return [{"from_s": w * WINDOW_S, "busy_fraction": round(busy / total, 3) if total else None}
            for w, (busy, total) in sorted(sums.items())]


def cpu_by_category(samples: list[Sample], names: dict[int, str]) -> dict[str, float]:
    """CPU seconds each category spent between the first and the last sample (a pid's last sighting counts)."""
    baseline, last = dict(samples[0].cpu_s), {}
    for s in samples:
        last.update(s.cpu_s)
    out: dict[str, float] = {}
    for pid, cpu_s in last.items():
        cat = category_of(names.get(pid, ""))
        out[cat] = out.get(cat, 0.0) + cpu_s - baseline.get(pid, 0.0)
    return dict(sorted(((k, round(v, 1)) for k, v in out.items()), key=lambda kv: -kv[1]))


def budget(samples: list[Sample], names: dict[int, str], spans: list[Span], cores: int) -> dict:
    """The run's budget (see the module docstring) from its samples and test spans."""
    first, last = samples[0], samples[-1]
    busy_cpu_s = (last.busy_ticks - first.busy_ticks) * TICK_S
    wall_s = last.t - first.t
    by_category = cpu_by_category(samples, names)

    def row(s: Span) -> dict:
        return {"id": s.id, "worker": s.worker, "wall_s": round(s.end - s.start, 2),
                "self_cpu_s": round(s.self_cpu_s, 2), "children_cpu_s": round(s.children_cpu_s, 2)}

    return {"wall_s": round(wall_s, 1), "cores": cores, "busy_cpu_s": round(busy_cpu_s, 1),
            "busy_fraction": round(busy_cpu_s / (wall_s * cores), 3) if wall_s else None,
            "floor_s": round(busy_cpu_s / cores, 1), "tests": len(spans),
            "tests_self_cpu_s": round(sum(s.self_cpu_s for s in spans), 1),
            "by_category": by_category,
            "unsampled_cpu_s": round(busy_cpu_s - sum(by_category.values()), 1),
            "windows": busy_windows(samples),
            "longest_tests": [row(s) for s in sorted(spans, key=lambda s: s.start - s.end)[:TOP]],
            "cpu_heaviest_tests": [row(s) for s in sorted(spans, key=lambda s: -s.self_cpu_s)[:TOP]]}


class Sampler(threading.Thread):
    def __init__(self, every_s: float) -> None:
        super().__init__(daemon=True)
        self.every_s, self.samples, self.names = every_s, [], {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while True:
            self.samples.append(read_sample(self.names))
            if self.stopped.wait(self.every_s):
                self.samples.append(read_sample(self.names))
                return


def read_spans(path: Path) -> list[Span]:
    if not path.exists():
        return []
    return [Span(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def summary_lines(b: dict) -> list[str]:
    lines = [f"{b['tests']} tests in {b['wall_s']:.0f} s on {b['cores']} cores: {b['busy_cpu_s']:.0f} busy CPU-s "
             f"({b['busy_fraction']:.0%} busy); packed perfectly, the same work takes {b['floor_s']:.0f} s",
             "CPU seconds by what ran:"]
    lines += [f"  {v:8.1f}  {k}" for k, v in b["by_category"].items()]
    lines.append(f"  {b['unsampled_cpu_s']:8.1f}  unsampled (processes shorter than a sampling period)")
    idle = [w for w in b["windows"] if w["busy_fraction"] is not None and w["busy_fraction"] < 0.9]
    lines.append("windows under 90% busy: " + (", ".join(f"{w['from_s']:.0f} s: {w['busy_fraction']:.0%}"
                                                          for w in idle) or "none"))
    lines.append("longest tests (wall s, own CPU s + reaped children's):")
    lines += [f"  {r['wall_s']:7.1f}  {r['self_cpu_s']:6.1f} + {r['children_cpu_s']:6.1f}  {r['id']}"
              for r in b["longest_tests"][:10]]
    return lines


def checkout() -> str:
    """The measured commit, and "+ changes" when the work tree differs from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + (" + changes" if git("status", "--porcelain") else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/suite_budget.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "suite_budget.json")
    ap.add_argument("--every-s", type=float, default=2.0, help="sampling period (default 2 s)")
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: make test's run)")
    args = ap.parse_args(argv)
    pytest_args = args.pytest_args or list(MAKE_TEST_ARGS)
    commit = checkout()  # what is measured: the work tree as the run starts
    with tempfile.TemporaryDirectory(prefix="suite-budget-") as tmp:
        timeline = Path(tmp) / "timeline.jsonl"
        env = dict(os.environ, **{TIMELINE_ENV: str(timeline)})
        sampler = Sampler(args.every_s)
        sampler.start()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "benchmarks.suite_timeline", *pytest_args],
                             cwd=ROOT, env=env)
        sampler.stopped.set()
        sampler.join()
        b = budget(sampler.samples, sampler.names, read_spans(timeline), os.cpu_count() or 1)
    b |= {"pytest_args": pytest_args, "pytest_exit_code": rc, "every_s": args.every_s, "commit": commit,
          "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(sampler.samples[0].t))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(b, indent=1) + "\n")
    print("\n".join(summary_lines(b)))
    print(f"written: {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
