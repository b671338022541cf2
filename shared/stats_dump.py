"""Write a process's connector and store counters to `$TIERCACHE_STATS_DIR/<name>-<pid>.json`.

vLLM's workers live in their own processes; operators (and the test suite) read what each one did
from these files. Writes are throttled, atomic (temp file + rename) and never raise. `write_stats_file`
is the one atomic writer of stats files; the EC connector's legacy ``x_ec_stats_path`` file uses it too.

The throttle is trailing: a call inside the interval is not dropped but written by a timer when the
interval ends, so the file holds a process's last counters within `min_interval_s` of its last step.
A process can't count on its own shutdown hook to write them: vLLM gives a worker a few seconds to exit
before it signals, then kills it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from vllm_tiercache.shared.files import replace_json

log = logging.getLogger(__name__)

ENV_VAR = "TIERCACHE_STATS_DIR"


class _ThrottledWriter:
    """One stats file: the latest payload, when it was last written, and the timer for a pending one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.last_write = -1e9
        self.pending: dict[str, Any] | None = None
        self.timer: threading.Timer | None = None

    def submit(self, directory: str, payload: dict[str, Any], min_interval_s: float, force: bool) -> None:
        with self.lock:
            wait = self.last_write + min_interval_s - time.monotonic()
            if force or wait <= 0:
                self.pending = None
                self.last_write = time.monotonic()
                _write(directory, self.name, payload)
                return
            self.pending = payload
            if self.timer is None:
                self.timer = threading.Timer(wait, self._write_pending, args=(directory,))
                self.timer.daemon = True
                self.timer.start()

    def _write_pending(self, directory: str) -> None:
        with self.lock:
            self.timer = None
            if self.pending is None:
                return
            payload, self.pending = self.pending, None
            self.last_write = time.monotonic()
            _write(directory, self.name, payload)


_writers: dict[str, _ThrottledWriter] = {}
_writers_lock = threading.Lock()


def dump_stats(name: str, payload: dict[str, Any], *, min_interval_s: float = 0.5, force: bool = False) -> None:
    """Record `payload` as this process's `name` stats: now, or when the throttle interval ends."""
    directory = os.environ.get(ENV_VAR)
    if not directory:
        return
    with _writers_lock:
        writer = _writers.setdefault(name, _ThrottledWriter(name))
    writer.submit(directory, payload, min_interval_s, force)


def _write(directory: str, name: str, payload: dict[str, Any]) -> None:
    path = os.path.join(directory, f"{name}-{os.getpid()}.json")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        log.warning("tiercache: cannot write stats to %s: %s", path, exc)
        return
    write_stats_file(path, {"pid": os.getpid(), "time": time.time(), **payload})


def write_stats_file(path: str, payload: dict[str, Any]) -> None:
    """Replace ``path`` with ``payload`` as JSON, atomically (temp file + rename); never raises.

    The one writer of stats files: readers (operators, `tiercache stats`, the tests) see a whole file or
    the previous one, never a half-written one (`vllm_tiercache.shared.files.replace_json`).
    """
    try:
        replace_json(path, payload)
    except OSError as exc:
        log.warning("tiercache: cannot write stats to %s: %s", path, exc)


def read_stats(directory: str, name: str) -> list[dict[str, Any]]:
    """All stats files one kind of process wrote into `directory` (one per process)."""
    out = []
    for entry in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if entry.startswith(f"{name}-") and entry.endswith(".json"):
            with open(os.path.join(directory, entry)) as fh:
                out.append(json.load(fh))
    return out
