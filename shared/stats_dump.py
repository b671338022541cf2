"""Write a process's connector and store counters to `$TIERCACHE_STATS_DIR/<name>-<pid>.json`.

vLLM's workers live in their own processes; operators (and the test suite) read what each one did
from these files. Writes are throttled, atomic (temp file + rename) and never raise.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

ENV_VAR = "TIERCACHE_STATS_DIR"
_last_write: dict[str, float] = {}


def dump_stats(name: str, payload: dict[str, Any], *, min_interval_s: float = 0.5, force: bool = False) -> None:
    directory = os.environ.get(ENV_VAR)
    if not directory:
        return
    now = time.monotonic()
    if not force and now - _last_write.get(name, -1e9) < min_interval_s:
        return
    _last_write[name] = now
    path = os.path.join(directory, f"{name}-{os.getpid()}.json")
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"pid": os.getpid(), "time": time.time(), **payload}, fh, default=str)
        os.replace(tmp, path)
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
