"""`UsageRefresh`: every tier's usage (records, bytes held), asked on a background thread of its own.

Why: a tier's usage may cost a backend round trip (Redis `INFO`, an object tier's usage record), and
`/metrics` gauges and the per-step stats dump want it on every engine step. So a thread asks every
`USAGE_REFRESH_S` seconds and a step reads its latest snapshot, never the network. The thread starts with
`start` (a connector's worker calls it when it is built: ``Thread.start`` returns only once the new thread
has run, up to half a second on a loaded machine, which a forward must not wait) or else on the first
`snapshot`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from vllm_tiercache.shared.store.api import Tier
from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)

#: Seconds between two background refreshes of the tiers' usage.
USAGE_REFRESH_S = 5.0


def tier_usage(tier: Tier) -> dict[str, Any]:
    """The tier's `Tier.usage`, or what went wrong asking it (stats must not fail for one tier)."""
    try:
        return dict(tier.usage())
    except Exception as exc:
        return {"entries": None, "bytes_used": None, "usage_error": str(exc)}


class UsageRefresh:
    """The latest usage of ``tiers`` ({tier name: {"raw", "bytes_used", "capacity"}}) and the thread that asks."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._tiers = tiers
        self._lock = threading.Lock()
        self._snapshot: dict[str, dict[str, Any]] = {}
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Start the thread (once; never after `close`)."""
        if self.thread is None and not self._stop.is_set():
            with self._lock:
                if self.thread is None and not self._stop.is_set():
                    self.thread = background_thread(self._loop, "tiercache-usage")
                    self.thread.start()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The latest pass's answers ({} before the first); starts the thread if nothing did."""
        self.start()
        with self._lock:
            return self._snapshot

    def refresh(self) -> None:
        """Ask every tier now (the thread's one pass; tests call it directly)."""
        snapshot: dict[str, dict[str, Any]] = {}
        for tier in self._tiers:
            raw = tier_usage(tier)
            used, capacity = raw.get("bytes_used"), raw.get("capacity")
            snapshot[tier.name] = {"raw": raw, "bytes_used": used if isinstance(used, int) else None,
                                   "capacity": capacity if isinstance(capacity, int) else None}
        with self._lock:
            self._snapshot = snapshot

    def close(self) -> None:
        """End the thread after its pass in flight (not waited for)."""
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # a refresh must never end the thread
                log.warning("tiercache: usage refresh failed: %s", exc)
            self._stop.wait(USAGE_REFRESH_S)
