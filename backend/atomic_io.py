"""Atomic file writes: readers see the old file or the complete new one, never half a file."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def write_atomic(path: Path, text: str) -> None:
    """Write text to a temp file beside `path` (unique per process and thread), fsync, then os.replace."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave an empty temp file behind per attempt
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1, default=str))
