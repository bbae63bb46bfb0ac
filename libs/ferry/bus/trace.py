"""Per-request hop timestamps across processes, for finding where latency goes (off by default).

With `FERRY_TRACE_FILE=<path>` in the environment (inherited by every `ferry up` child), each
`hop(request_id, name)` appends one JSON line `{"t": <unix s>, "rid": ..., "hop": ..., "pid": ...}`
to that file; all services write the same file, so one request's path reads in time order
(`ops/bench/system/trace.py` starts the system with it and prints the gaps). Unset, `hop` is one
`if` and costs nothing measurable. A wall clock, not a monotonic one: the processes share a box.
"""

from __future__ import annotations

import json
import os
import time

_PATH = os.environ.get("FERRY_TRACE_FILE", "")


def enabled() -> bool:
    return bool(_PATH)


def hop(request_id: str, name: str, **info: int | float | str) -> None:
    """Record that `request_id` reached `name` now (with `info`, e.g. a step's sizes, in the same line);
    a no-op unless FERRY_TRACE_FILE is set."""
    if not _PATH:
        return
    line = json.dumps({"t": time.time(), "rid": request_id, "hop": name, "pid": os.getpid(), **info}) + "\n"
    # One small O_APPEND write per line: lines from several processes do not interleave.
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
