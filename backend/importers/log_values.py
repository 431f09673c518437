"""The numbers of a log line: a garbled one skips the line, an impossible one refuses the log.

- Garbled: the text is not a number ("1.2.3", "abc s", "," or nothing): `Garbled` is raised and the parser counts the
  line (`Collector.garbled`) and goes on. Torn and interleaved writes are a fact of log files that several ranks
  share; the import says how many lines it could not understand and where the first one is.
- Impossible: a number no training run logs (a negative or zero step time or rate, a negative memory peak, NaN / inf
  or a 400-digit figure, a step number or a memory peak past any machine): the log is refused with the line number
  (LogImportError) and nothing is stored. Such a log is wrong about more than one line (a broken timer, a different
  unit, a file that is not what it says), so no number from it is kept.
Losses are read with `loss`: NaN and inf are a diverged run, a result worth keeping, and pass through as floats.
Memory may be zero (DeepSpeed's see_memory_usage before the first allocation, a Max_CA rounded to whole GiB).
"""

from __future__ import annotations

import math

from backend.importers.import_result import LogImportError

MAX_STEP = 10 ** 12
"""A step number past a trillion is no training run (a step per millisecond for 30 years)."""
MIN_STEP_S = 1e-6
MAX_STEP_S = 7 * 86_400.0
"""A step takes more than a microsecond and less than a week."""
MAX_DEVICE_BYTES = float(1 << 50)
"""No accelerator holds a PiB."""


class Garbled(ValueError):
    """The text is not a number: the line is skipped and counted."""


def number(text: str, *, commas: bool = False) -> float:
    """The float the text spells (thousands separators removed where the format prints them); Garbled otherwise."""
    raw = text.replace(",", "") if commas else text
    try:
        return float(raw)
    except ValueError:
        raise Garbled(text) from None


def integer(text: str, what: str, line: int, *, hi: int = MAX_STEP) -> int:
    """A step or rank number in 0..hi; Garbled if not a whole number, refused if out of range."""
    if not text.strip().isdigit():
        raise Garbled(text)
    value = int(text) if len(text) <= 30 else hi + 1
    if value > hi:
        raise _refuse(line, what, text, f"over {hi:,}: out of range")
    return value


def step_seconds(seconds: float, what: str, text: str, line: int) -> float:
    """A step time in seconds (computed from `text`, as the log printed it): refused unless finite and in range."""
    if not math.isfinite(seconds):
        raise _refuse(line, what, text, "not a finite number: a step time is")
    if seconds < 0:
        raise _refuse(line, what, text, "negative: a step takes time")
    if seconds < MIN_STEP_S:
        raise _refuse(line, what, text, f"a step of {seconds:.3g} s: a step takes more than {MIN_STEP_S:g} s")
    if seconds > MAX_STEP_S:
        raise _refuse(line, what, text, f"a step of {seconds:,.0f} s: over a week, out of range")
    return seconds


def positive(text: str, what: str, line: int, *, commas: bool = False) -> float:
    """A rate or a time the log prints (tokens/s, samples/s, ms): finite and > 0, else refused; Garbled if no number."""
    value = number(text, commas=commas)
    if not math.isfinite(value):
        raise _refuse(line, what, text, "not a finite number")
    if value <= 0:
        raise _refuse(line, what, text, f"{'negative' if value < 0 else 'zero'}, where a run logs a number > 0")
    return value


def non_negative(text: str, what: str, line: int, *, commas: bool = False) -> float:
    """A reported figure (a timer part, TFLOP/s, MFU %): finite and >= 0, else refused; Garbled if no number."""
    value = number(text, commas=commas)
    if not math.isfinite(value):
        raise _refuse(line, what, text, "not a finite number")
    if value < 0:
        raise _refuse(line, what, text, "negative, where a run logs a number >= 0")
    return value


def memory_bytes(text: str, unit_bytes: float, what: str, line: int) -> float:
    """A memory figure in `unit_bytes` units (MiB, GiB), as bytes: finite, >= 0 and under a PiB, else refused."""
    value = non_negative(text, what, line) * unit_bytes
    if value > MAX_DEVICE_BYTES:
        raise _refuse(line, what, text, "over a PiB: out of range for one device")
    return value


def loss(text: str) -> float:
    """A loss as the log prints it: any float, NaN and inf included (a diverged run); Garbled if no number."""
    return number(text)


def _refuse(line: int, what: str, text: str, why: str) -> LogImportError:
    shown = text.strip()
    shown = shown if len(shown) <= 40 else f"{shown[:24]}… ({len(shown):,} characters)"
    return LogImportError([f"line {line}: {what} is {shown!r}, {why}; a log with an impossible value is refused "
                           "(nothing stored): check that this is the run's own log, uncut and unedited"])
