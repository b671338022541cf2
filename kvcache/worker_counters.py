"""The KV worker's per-interval numbers: what its loader and saver count between two stats reports.

One object for both, under one lock that `KVWorkerSide` creates and hands to each: a report then takes the
loader's and the saver's counts at once, and a step that counted nothing costs one check of this object
(vLLM asks for stats on every step, decode steps included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerCounters:
    """Per-interval numbers `get_kv_connector_stats` reports (reset after each report)."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_errors: int = 0
    load_seconds: list[float] = field(default_factory=list)
    saved_chunks: int = 0
    saved_bytes: int = 0
    dropped_saves: int = 0
    save_seconds: list[float] = field(default_factory=list)
    #: prefill/decode hand-off loads (`vllm_tiercache.kvcache.handoff.wait`): loads, records that were not
    #: there yet and came within the wait, loads that fell back to recompute, records that never came, and
    #: each load's wait
    handoff_loads: int = 0
    handoff_records_waited: int = 0
    handoff_fallbacks: int = 0
    handoff_missing_records: int = 0
    handoff_wait_seconds: list[float] = field(default_factory=list)
    #: far chunks fetched into host memory ahead of their request (`vllm_tiercache.kvcache.load.prefetcher`),
    #: those that did not land there, and each fetch's time
    prefetched_chunks: int = 0
    prefetch_failures: int = 0
    prefetch_seconds: list[float] = field(default_factory=list)

    def take(self) -> dict[str, Any]:
        """The numbers since the last call, then zero; ``{}`` when none moved (most decode steps)."""
        if not any(self.__dict__.values()):
            return {}
        data = dict(self.__dict__)
        self.__init__()  # type: ignore[misc]
        return data
