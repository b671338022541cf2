"""One JSON line per step's load, for finding where a hit's time goes on a given machine.

Set ``TIERCACHE_LOAD_TRACE=/path/loads.jsonl`` in the environment vLLM starts with (its worker processes
inherit it) and every worker appends one line per step that loads KV:

    {"pid": 123, "rank": 0, "device": "cpu", "before_forward": true, "chunks": 32, "failed": 0,
     "bytes": 8388608, "load_s": 0.00105, "fetch_s": 0.00021, "copy_s": 0.00061}

- ``load_s``: the whole load, from the job's start to its last layer, on the thread that ran it
  (``before_forward``: the forward's own thread, before the forward; otherwise the loader thread, while
  the forward runs);
- ``fetch_s``: the store's reads, checks included (on a CPU a disk read lands in the KV cache itself, so
  its copy out of the page cache is here too);
- ``copy_s``: the copies into the KV cache of what the store returned (CUDA: issuing them, plus the host
  copy into a pinned staging buffer, and any wait for one, of records that are not pinned);
- the rest of ``load_s`` is the loader's own work: the disk tier's read-ahead advice, planning, keys,
  checks of each record's layout, the per-layer events.

Why: a hit costs more than vLLM's resident hit of the same prompt, and only part of that is the load.
`tiercache bench kv` reads these lines to split the difference into the store's reads, the copies, the
loader's other work and what happens outside the loader (vLLM's own work for an external hit, the
connector's plumbing). Before this, each such split needed a throw-away patch (docs/benchmarks-kv.md).

Off unless the variable is set. A line is one ``O_APPEND`` write (a few microseconds on a descriptor kept
open), so several workers may share a file. A trace that cannot be written is turned off with one warning:
it never fails a load.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

LOAD_TRACE_ENV = "TIERCACHE_LOAD_TRACE"


class LoadTrace:
    """Appends one JSON line per load to a file (`from_env`: None unless ``TIERCACHE_LOAD_TRACE`` is set)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = -1
        #: a write failed: tracing is off for this process (set once, under the lock; read without it,
        #: since a stale False only costs one more attempt that finds it set)
        self.broken = False

    @classmethod
    def from_env(cls) -> LoadTrace | None:
        """The trace ``$TIERCACHE_LOAD_TRACE`` names, or None when it is unset or empty."""
        path = os.environ.get(LOAD_TRACE_ENV)
        return cls(path) if path else None

    def record(self, **fields: Any) -> None:
        """Append one line with ``fields`` and this process's pid. Never raises: the caller is a load, which
        a diagnostic must not fail; the first error turns the trace off with a warning."""
        if self.broken:
            return
        with self._lock:
            try:
                line = (json.dumps({"pid": os.getpid(), **fields}) + "\n").encode()
                if self._fd < 0:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
                os.write(self._fd, line)
            except Exception as exc:  # any failure only ends the tracing
                self.broken = True
                log.warning("tiercache: %s=%s cannot be written (%s); load tracing is off",
                            LOAD_TRACE_ENV, self.path, exc)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_load_trace(path: str, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The complete lines of a trace file from byte ``offset`` on, and the offset after them (a reader
    polling a file that workers still append to; a half-written last line waits for the next call).
    A line that does not parse (a torn write of a process that died) is skipped."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    lines = []
    for raw in data[:end].splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            lines.append(line)
    return lines, offset + end
