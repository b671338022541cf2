"""How the disk tier's parts report a problem while serving: counted, and logged once per kind of problem.

Why: a full filesystem or a failing index would otherwise log on every read and write; the counters
(`errors`, on `/metrics`) say how often, one log line says what. Shared by the tier's reads, writes,
bookkeeping and admin operations, so the once-only rule holds across all of them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vllm_tiercache.shared.store.counters import TierCounters


class ProblemReporter:
    """Counts and logs the problems of one tier (``kind`` and ``root`` name it in each line)."""

    def __init__(self, kind: str, root: Path, counters: TierCounters, log: logging.Logger) -> None:
        self.kind = kind
        self.root = root
        self.counters = counters
        self.log = log
        self._warned: set[str] = set()

    def warn_once(self, what: str, message: str) -> None:
        """Log ``message`` the first time a problem named ``what`` happens, never again."""
        if what not in self._warned:
            self._warned.add(what)
            self.log.warning(message)

    def error(self, what: str, exc: BaseException) -> None:
        """Count an error and log it once per ``what``."""
        self.counters.add(errors=1)
        self.warn_once(what, f"tiercache {self.kind} tier {self.root}: {what}: {exc}")
