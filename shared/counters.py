"""Named, thread-safe, monotonically increasing counters: the one shape every part of the product counts in.

Why one class: the tiers (per-tier events), the EC connector (process totals) and whatever reports them
(stats files, `/metrics`, `tiercache stats`) then agree on what a snapshot looks like: a dict of every
declared name, ints for counts and floats for seconds, taken under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class Counters:
    """Counters with a fixed set of declared names (all present in a snapshot, 0 until they move)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(names, 0)
        #: Bumped by every `add` (lets a stats file be rewritten only when something changed).
        self.version = 0

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] = self._values.get(name, 0) + delta
            self.version += 1

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self._values.items()}
