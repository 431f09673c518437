"""The rank ⇄ launcher protocol: every file, line and variable a rank program and its launcher exchange, typed,
with one writer and one reader each. Nothing else in ShardLab names these files or parses them.

In the run folder DIR (the rank program's `--out`):
  ranks.json           `RanksFile`   global rank 0, once, on success   `write_ranks`         `read_ranks`
  rank-<r>.error.json  `RankError`   a rank that failed                `write_rank_error`    `read_rank_errors`
  rank-<r>.stack.txt   `RankStack`   faulthandler, on STACK_SIGNAL     `enable_stack_dump`   `read_stacks`
  rank-<r>.progress    `RankProgress` every rank, after each step       `mark_progress`       `read_progress_marks`
On stderr (rank 0):
  SHARDLAB_PROGRESS {"step", "of", "phase"}   `Progress`       `emit_progress`   `progress_reader`
In the environment (tests only):
  SHARDLAB_FAULT=kind:rank=R:step=S           `Fault`          `Fault.env_value` `read_fault`

JSON is written atomically (temp file + os.replace) with the keys and layout of earlier versions, so a run
folder from before still reads. A file that does not match its type is a `ProtocolError` naming the file and
each offending field. Readers keep keys they do not know (`extra="allow"`), so a newer writer's additions pass
through to the assembler untouched.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from backend.atomic_io import write_json_atomic

PAYLOAD_VERSION = 1
RANKS_FILE = "ranks.json"
ERROR_GLOB = "rank-*.error.json"
STACK_GLOB = "rank-*.stack.txt"
PROGRESS_GLOB = "rank-*.progress"
PROGRESS_TAG = "SHARDLAB_PROGRESS"
FAULT_ENV = "SHARDLAB_FAULT"
STACK_SIGNAL = signal.SIGUSR1


class ProtocolError(ValueError):
    """A protocol file or line that does not match its type; the message names the file and each bad field."""


def _problems(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or '(top level)'}: {err['msg']}" for err in e.errors())


def _validated(model: type[BaseModel], data: Any, where: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ProtocolError(f"{where} is not a valid {model.__name__}: {_problems(e)}") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ProtocolError(f"{path} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ProtocolError(f"{path} is not JSON: {e}") from None


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- ranks.json ----------------------------------------------------------------------------------------------

class RankPayload(_Record):
    """One rank's measurements (for JAX: one device's). Keys and units: docs/ARCHITECTURE.md, engine/assemble.py."""

    rank: int
    coords: dict[str, int] = {}
    strategy_module: str | None = None
    losses: list[float]
    """Global mean loss of every warm-up and timed step, in order."""
    step_s: list[float]
    """Seconds of each timed step."""
    comm: dict[str, dict[str, Any]] = {}
    """Per collective, per timed step: calls, bytes, wire_bytes, seconds (bench/comm.py)."""
    comm_kernel: dict[str, dict[str, Any]] = {}
    comm_excluded: dict[str, Any] = {}
    comm_group_sizes: dict[str, list[int]] = {}
    memory: dict[str, Any] = {}
    """bench/memory.py breakdown: categories, peak_bytes, at_peak, high_water, tracker snapshots, cuda/rss peaks."""
    env: dict[str, Any] = {}
    notes: list[str] = []
    timeline: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    """What the strategy measured (`Prepared.extra`), e.g. ep's moe_routing, fp16's loss_scaling."""


class RanksFile(_Record):
    """DIR/ranks.json: every rank's payload, gathered by global rank 0 after the run."""

    version: Literal[1]
    world_size: int
    backend: str
    """The process group's backend (gloo, nccl) or the framework's ("xla-cpu")."""
    framework: str | None = None
    ds_config: dict[str, Any] | None = None
    framework_estimate: dict[str, Any] | None = None
    xla: dict[str, Any] | None = None
    ranks: list[RankPayload]
    loss_reference: list[float] = []
    """The single-process reference's losses of the same steps; [] when it was skipped (a note says why)."""

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON: the framework fields only where the writer (or the file read) gave them."""
        unset = {"framework", "ds_config", "framework_estimate", "xla"} - self.model_fields_set
        return self.model_dump(mode="python", exclude=unset)


def write_ranks(out_dir: Path, ranks_file: RanksFile) -> None:
    write_json_atomic(Path(out_dir) / RANKS_FILE, ranks_file.to_dict())


def ranks_path(out_dir: Path) -> Path:
    return Path(out_dir) / RANKS_FILE


def read_ranks(out_dir: Path) -> RanksFile:
    path = ranks_path(out_dir)
    return _validated(RanksFile, _read_json(path), str(path))


# ---- rank-<r>.error.json -------------------------------------------------------------------------------------

class RankError(_Record):
    """DIR/rank-<r>.error.json: why rank r failed."""

    rank: int
    error: str
    """`Type: message` of the exception."""
    traceback: str | None = None
    kind: Literal["error", "oom"] = "error"
    time_unix: float | None = None
    _file_mtime_s: float | None = PrivateAttr(default=None)

    @classmethod
    def from_exception(cls, rank: int, e: BaseException, *, oom: bool) -> RankError:
        """Call inside the `except` block: the traceback is the one being handled."""
        return cls(rank=rank, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                   kind="oom" if oom else "error", time_unix=time.time())

    @property
    def failed_at_unix(self) -> float:
        """When the rank failed: its own clock, else the file's modification time."""
        return self.time_unix if self.time_unix else (self._file_mtime_s or 0.0)


def error_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"rank-{rank}.error.json"


def write_rank_error(out_dir: Path, record: RankError) -> None:
    write_json_atomic(error_path(out_dir, record.rank), record.model_dump(mode="python"))


def read_rank_error(path: Path) -> RankError:
    record = _validated(RankError, _read_json(path), str(path))
    record._file_mtime_s = Path(path).stat().st_mtime_ns / 1e9
    return record


def read_rank_errors(out_dir: Path) -> list[RankError]:
    """Every readable error record in DIR; a file that is not one is skipped (the launcher then falls back on
    torchrun's failure summary)."""
    records = []
    for path in Path(out_dir).glob(ERROR_GLOB):
        try:
            records.append(read_rank_error(path))
        except (ProtocolError, OSError):
            continue
    return records


def any_rank_error(out_dir: Path) -> bool:
    return any(Path(out_dir).glob(ERROR_GLOB))


def clear_rank_outputs(out_dir: Path) -> None:
    """A reused run folder must not let a previous run's files speak for this one."""
    for pattern in (RANKS_FILE, ERROR_GLOB, STACK_GLOB, PROGRESS_GLOB):
        for path in Path(out_dir).glob(pattern):
            path.unlink(missing_ok=True)


# ---- SHARDLAB_PROGRESS lines ---------------------------------------------------------------------------------

class Progress(BaseModel):
    """Step `step` (1-based) of `of` in `phase` (warmup, timed, memory, comm, reference) has finished."""

    step: int
    of: int
    phase: str


_PROGRESS_LINE = re.compile(rf"{PROGRESS_TAG}\s+(\{{.*\}})\s*$")


def emit_progress(event: Progress) -> None:
    print(f"{PROGRESS_TAG} {json.dumps(event.model_dump())}", file=sys.stderr, flush=True)


def parse_progress(line: str) -> Progress | None:
    """The event on a log line, or None for any other line (or a progress line that does not parse)."""
    m = _PROGRESS_LINE.search(line)
    if not m:
        return None
    try:
        return Progress.model_validate(json.loads(m.group(1)))
    except (json.JSONDecodeError, ValidationError):
        return None


def progress_reader(on_progress: Callable[[dict], None]) -> Callable[[str], None]:
    """A log-line callback that hands each progress event to on_progress as {"step", "of", "phase"}."""
    def on_line(line: str) -> None:
        event = parse_progress(line)
        if event is not None:
            on_progress(event.model_dump())

    return on_line


# ---- rank-<r>.progress ---------------------------------------------------------------------------------------

MARK_BYTES = 64
_MARK: list[int] = []  # [fd, steps done] of this process's progress file, once enabled


@dataclass
class RankProgress:
    """How far rank `rank` got: steps finished (every phase counted, in order), the last one ("timed 3/10"), and
    whether the rank program finished. A hung job's rank that stopped making progress is the one behind."""

    rank: int
    steps_done: int
    last: str = ""
    finished: bool = False


def progress_mark_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"rank-{rank}.progress"


def enable_progress_marks(out_dir: Path, rank: int) -> None:
    """Open rank-<r>.progress; every later mark_progress rewrites its one line in place (one pwrite, no fsync:
    the launcher reads it while the process is alive or hung, so the page cache is enough)."""
    fd = os.open(progress_mark_path(out_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if _MARK:
        os.close(_MARK[0])  # a second rank_main in one process (tests)
    _MARK[:] = [fd, 0]
    _write_mark("started")


def mark_progress(phase: str, step: int, of: int) -> None:
    """This rank finished step `step` of `of` in `phase` (no-op unless enabled, e.g. in a one-process program)."""
    if _MARK:
        _MARK[1] += 1
        _write_mark(f"{phase} {step}/{of}")


def mark_finished() -> None:
    if _MARK:
        _write_mark("finished")


def _write_mark(last: str) -> None:
    line = f"{_MARK[1]} {last}".encode("utf-8", "replace")[:MARK_BYTES - 1].ljust(MARK_BYTES - 1) + b"\n"
    try:
        os.pwrite(_MARK[0], line, 0)
    except OSError:
        pass  # a full disk must not fail the step; the hang report then just lacks this rank's count


def read_progress_marks(out_dir: Path) -> dict[int, RankProgress]:
    """Every rank's progress file in DIR that parses, by rank."""
    out = {}
    for path in Path(out_dir).glob(PROGRESS_GLOB):
        try:
            rank = int(path.name.split("-")[1].split(".")[0])
            done, _, last = path.read_text(encoding="utf-8", errors="replace").strip().partition(" ")
            out[rank] = RankProgress(rank, int(done), last.strip(), last.strip() == "finished")
        except (OSError, ValueError, IndexError):
            continue
    return out


# ---- SHARDLAB_FAULT ------------------------------------------------------------------------------------------

FaultKind = Literal["raise", "kill", "hang", "stop", "oom"]


class Fault(BaseModel):
    """A fault the rank `rank` injects into itself at the start of step `step` (tests of the failure paths)."""

    model_config = ConfigDict(frozen=True)
    kind: FaultKind
    rank: int = 0
    step: int = 0

    def env_value(self) -> str:
        return f"{self.kind}:rank={self.rank}:step={self.step}"


def read_fault(environ: dict[str, str] | None = None) -> Fault | None:
    text = (os.environ if environ is None else environ).get(FAULT_ENV)
    if not text:
        return None
    kind, *pairs = text.split(":")
    fields: dict[str, Any] = {"kind": kind}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in ("rank", "step"):
            raise ProtocolError(f"{FAULT_ENV}={text!r}: {pair!r} is not rank=R or step=S "
                                "(expected kind:rank=R:step=S, kind one of raise|kill|hang|stop|oom)")
        fields[key] = value
    return _validated(Fault, fields, f"{FAULT_ENV}={text!r}")


# ---- rank-<r>.stack.txt --------------------------------------------------------------------------------------

class StackFrame(NamedTuple):
    file: str
    line: int
    function: str


@dataclass
class RankStack:
    """Where rank `rank` was when it got STACK_SIGNAL: the frames of the thread running our code."""

    rank: int
    frames: list[StackFrame] = field(default_factory=list)
    """Innermost first."""


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_KEEP: list = []  # the dump files stay open for the process lifetime (faulthandler writes to the fd)


def stack_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"rank-{rank}.stack.txt"


def enable_stack_dump(out_dir: Path, rank: int) -> None:
    """Dump every thread's Python stack to rank-<r>.stack.txt when this process gets STACK_SIGNAL."""
    fh = open(stack_path(out_dir, rank), "w", encoding="utf-8")  # noqa: SIM115 - must outlive this call
    _KEEP.append(fh)
    faulthandler.register(STACK_SIGNAL, file=fh, all_threads=True, chain=False)


def parse_dump(text: str) -> list[list[StackFrame]]:
    """Frames of each thread in a faulthandler dump (innermost first)."""
    threads: list[list[StackFrame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append(StackFrame(m["file"], int(m["line"]), m["func"]))
    return threads


def _is_ours(frame: StackFrame) -> bool:
    return "/backend/" in frame.file or "/tests/" in frame.file


def stack_dump_ranks(out_dir: Path) -> list[int]:
    """The ranks that registered a stack dump (their file exists, empty until they answer STACK_SIGNAL)."""
    return sorted(int(p.name.split("-")[1].split(".")[0]) for p in Path(out_dir).glob(STACK_GLOB))


def read_stacks(out_dir: Path) -> list[RankStack]:
    """Every non-empty dump in DIR, by rank; the rank's thread is the one whose frames include our code."""
    out = []
    for path in sorted(Path(out_dir).glob(STACK_GLOB)):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        rank = int(path.name.split("-")[1].split(".")[0])
        threads = parse_dump(text)
        main = next((t for t in threads if any(_is_ours(f) for f in t)), None)
        out.append(RankStack(rank, main or (threads[-1] if threads else [])))
    return sorted(out, key=lambda s: s.rank)
