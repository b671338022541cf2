"""`LoadJob`: one step's layerwise load, the state the loader thread, the forward pass and a hand-off's wait share.

Why a module of its own: the loader runs jobs and the hand-off wait (`vllm_tiercache.kvcache.handoff.wait`)
holds them until their records arrive; both name the job, and neither should import the other for it.
"""

from __future__ import annotations

import threading

from vllm_tiercache.kvcache.plan import ChunkLoad


class LoadJob:
    """One step's layerwise load, shared by the loader thread and the forward pass."""

    def __init__(self, layer_names: tuple[str, ...], loads: list[ChunkLoad],
                 owners: list[str] | None = None, whole_requests: set[str] | None = None, *,
                 near_only: bool = False) -> None:
        self.loads = loads
        #: read only the near tiers (`TieredKVMetadata.near_loads`): a record not there is a failed load
        self.near_only = near_only
        #: the request of every load, and the requests whose loads are whole-request loads
        self.owners = owners or [""] * len(loads)
        self.whole_requests = whole_requests or set()
        self.ready = {name: threading.Event() for name in layer_names}
        self.handles: dict[str, object | None] = {}
        self.failed: set[int] = set()  # indices into `loads`
        self.done = threading.Event()
        #: where the load's time went (`LoadTrace`): the store's reads and the copies into the KV cache
        self.fetch_seconds = 0.0
        self.copy_seconds = 0.0
        self.loaded_bytes = 0
